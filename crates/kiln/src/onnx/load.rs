//! Turns an ONNX file into an [`OnnxModel`]: onnx-ir parses and types it, Kiln checks every
//! node can run, numbers the values into slots, uploads the constants once and works out
//! when each value can be freed.

use std::collections::{BTreeMap, HashMap};
use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::tensor::{DType, Device};
use onnx_ir::{ArgType, Argument, Message, ModelProto, Node, OnnxGraphBuilder};

use super::ops;
use super::value::{Value, kind_of};
use super::{OnnxError, OnnxModel, Port, Step, panic_text};

/// Largest model file Kiln reads (protobuf's own limit is 2 GiB).
const MAX_MODEL_BYTES: usize = 2 << 30;

pub fn load(bytes: &[u8], name: &str, device: &Device) -> Result<OnnxModel, OnnxError> {
    if bytes.len() >= MAX_MODEL_BYTES {
        return Err(OnnxError::Parse(format!(
            "{} bytes is past protobuf's 2 GiB limit; models that large keep weights in \
             external data files",
            bytes.len()
        )));
    }
    // onnx-ir renames values; the ports keep the names written in the file.
    let mut proto = ModelProto::parse_from_bytes(bytes)
        .map_err(|e| OnnxError::Parse(format!("{e}; is the file complete and an ONNX model?")))?;
    let graph_proto = proto
        .graph
        .as_ref()
        .ok_or_else(|| OnnxError::Parse("the file holds no graph".into()))?;
    let initializers: std::collections::HashSet<&str> = graph_proto
        .initializer
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    let input_names: Vec<String> = graph_proto
        .input
        .iter()
        .filter(|i| !initializers.contains(i.name.as_str()))
        .map(|i| i.name.clone())
        .collect();
    let batch_axes = batch_axes(graph_proto, &initializers);
    let output_names: Vec<String> = graph_proto.output.iter().map(|o| o.name.clone()).collect();
    // Reshape ranks onnx-ir cannot infer, declared from the graph's structure.
    // Quantized operators onnx-ir cannot type, in the QDQ form it can.
    let lowered = super::lower_quant::lower_quantized_ops(&mut proto)
        + super::ceil_pool::rewrite_ceil_average_pools(&mut proto);
    let patched;
    let bytes = if super::declare::declare_reshape_ranks(&mut proto) + lowered > 0 {
        patched = proto
            .write_to_bytes()
            .map_err(|e| OnnxError::Parse(format!("re-encoding the model: {e}")))?;
        patched.as_slice()
    } else {
        bytes
    };

    let graph = catch_unwind(AssertUnwindSafe(|| {
        OnnxGraphBuilder::new().parse_bytes(bytes)
    }))
    .map_err(|p| OnnxError::Parse(format!("the parser panicked: {}", panic_text(&p))))?
    .map_err(|e| OnnxError::Parse(e.to_string()))?;

    let mut unsupported: BTreeMap<String, usize> = BTreeMap::new();
    for node in &graph.nodes {
        if let Some(why) = ops::unsupported(node) {
            *unsupported.entry(why).or_default() += 1;
        }
    }
    if !unsupported.is_empty() {
        return Err(OnnxError::UnsupportedOps(unsupported.into_iter().collect()));
    }

    let mut slots: HashMap<String, usize> = HashMap::new();
    let mut constants: Vec<Option<Value>> = Vec::new();
    let new_slot = |constants: &mut Vec<Option<Value>>, value: Option<Value>| {
        constants.push(value);
        constants.len() - 1
    };

    let mut inputs = Vec::new();
    let mut input_slots = Vec::new();
    for (i, arg) in graph.inputs.iter().enumerate() {
        let slot = new_slot(&mut constants, None);
        slots.insert(arg.name.clone(), slot);
        input_slots.push(slot);
        let name = input_names
            .get(i)
            .cloned()
            .unwrap_or_else(|| arg.name.clone());
        let mut port = port(name, &arg.ty)?;
        port.batch_axis = batch_axes.get(i).copied().flatten();
        inputs.push(port);
    }

    let mut steps = Vec::new();
    for node in graph.nodes {
        let mut step_inputs = Vec::with_capacity(node.inputs().len());
        for arg in node.inputs() {
            step_inputs.push(input_slot(arg, &node, &mut slots, &mut constants, device)?);
        }
        let outputs: Vec<usize> = node
            .outputs()
            .iter()
            .map(|o| {
                let s = new_slot(&mut constants, None);
                slots.insert(o.name.clone(), s);
                s
            })
            .collect();
        // A Constant's value is known now: it becomes a constant slot and never runs.
        if let Node::Constant(_) = &node
            && let (Some(Some(src)), Some(&out)) = (step_inputs.first(), outputs.first())
            && let Some(value) = constants[*src].clone()
        {
            let scalar = ops::declares_scalar(&node.outputs()[0].ty);
            constants[out] = Some(value.with_scalar(scalar));
            continue;
        }
        let scalar = node
            .outputs()
            .iter()
            .map(|o| ops::declares_scalar(&o.ty))
            .collect();
        let kind = node
            .outputs()
            .iter()
            .map(|o| ops::declared_kind(&o.ty))
            .collect();
        let names = (node.name().to_string(), node.node_type().to_string());
        steps.push(Step::plain(
            super::StepOp::Onnx(Box::new(node)),
            names,
            step_inputs,
            (outputs, scalar, kind),
        ));
    }

    let mut outputs = Vec::new();
    let mut output_slots = Vec::new();
    for (i, arg) in graph.outputs.iter().enumerate() {
        let slot = *slots.get(&arg.name).ok_or_else(|| {
            OnnxError::Graph(format!("output `{}` is produced by no node", arg.name))
        })?;
        output_slots.push(slot);
        let name = output_names
            .get(i)
            .cloned()
            .unwrap_or_else(|| arg.name.clone());
        outputs.push(port(name, &arg.ty)?);
    }

    let mut uses = vec![0usize; constants.len()];
    for &s in steps.iter().flat_map(|s| s.inputs.iter().flatten()) {
        uses[s] += 1;
    }
    for &s in &output_slots {
        uses[s] += 1;
    }
    let mut model = OnnxModel {
        name: name.to_string(),
        inputs,
        outputs,
        input_slots,
        output_slots,
        constants,
        steps,
        uses,
        device: device.clone(),
        kiln_kernels: true,
        shape_cache: Default::default(),
        placement: Default::default(),
    };
    // A quantized model's layers onto the integer kernels with its own scales (nothing
    // changes in a float model).
    for change in model.lower_qdq()? {
        tracing::debug!(model = name, "{change}");
    }
    // SiLU and GELU first: their exported nodes become one step that a convolution or a
    // linear layer then takes.
    model.fuse_silus();
    model.fuse_gelus();
    model.fuse_scaled_softmaxes();
    model.fuse_activations();
    model.fuse_relu_pools();
    model.fuse_residuals();
    model.fuse_channel_shuffles();
    // Last: these take the layers with their activations fused into them.
    model.fuse_concat_convs();
    model.fuse_expand_depthwises();
    Ok(model)
}

/// The slot a node input reads: a constant uploaded now, or the slot of the value that
/// produces it; `None` for an optional input left out.
fn input_slot(
    arg: &Argument,
    node: &Node,
    slots: &mut HashMap<String, usize>,
    constants: &mut Vec<Option<Value>>,
    device: &Device,
) -> Result<Option<usize>, OnnxError> {
    if arg.is_optional() || arg.name.is_empty() && !arg.is_static() {
        return Ok(None);
    }
    if let Some(data) = arg.value() {
        let value = Value::from_data(data, device)?;
        let scalar = ops::declares_scalar(&arg.ty);
        constants.push(Some(value.with_scalar(scalar)));
        return Ok(Some(constants.len() - 1));
    }
    if let Some(&slot) = slots.get(&arg.name) {
        return Ok(Some(slot));
    }
    Err(OnnxError::Graph(format!(
        "node `{}` ({}) reads `{}`, which no node, input or initializer provides",
        node.name(),
        node.node_type(),
        arg.name
    )))
}

fn port(name: String, ty: &ArgType) -> Result<Port, OnnxError> {
    let (dtype, dims) = match ty {
        ArgType::Tensor(t) => (
            t.dtype,
            t.static_shape.clone().unwrap_or_else(|| vec![None; t.rank]),
        ),
        ArgType::ScalarNative(d) | ArgType::ScalarTensor(d) => (*d, Vec::new()),
        ArgType::Shape(n) => (DType::I64, vec![Some(*n)]),
    };
    Ok(Port {
        name,
        kind: kind_of(dtype)?,
        dtype: dtype_name(dtype).to_string(),
        dims,
        batch_axis: None,
    })
}

/// Per graph input (initializers left out): the axis named like the first input's first
/// named dynamic axis — the batch, by the exporters' naming (`batch`, `batch_size`, `s0`),
/// wherever it sits (`[seq, batch, features]`); an input without that name has none (a
/// static state or scale). A model without named axes has its batch first in every input.
fn batch_axes(
    graph: &onnx_ir::GraphProto,
    initializers: &std::collections::HashSet<&str>,
) -> Vec<Option<usize>> {
    let inputs: Vec<Vec<Option<&str>>> = graph
        .input
        .iter()
        .filter(|i| !initializers.contains(i.name.as_str()))
        .map(|i| {
            let dims = i
                .type_
                .as_ref()
                .and_then(|t| t.tensor_type().shape.as_ref())
                .map(|s| s.dim.as_slice())
                .unwrap_or_default();
            dims.iter()
                .map(|d| {
                    let name = d.dim_param().trim();
                    (!d.has_dim_value() && !name.is_empty()).then_some(name)
                })
                .collect()
        })
        .collect();
    let batch = inputs
        .first()
        .and_then(|dims| dims.iter().find_map(|&name| name));
    inputs
        .iter()
        .map(|dims| match batch {
            Some(b) => dims.iter().position(|&name| name == Some(b)),
            None => (!dims.is_empty()).then_some(0),
        })
        .collect()
}

/// ONNX's name for an element type.
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F64 => "float64",
        DType::F32 | DType::Flex32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::I16 => "int16",
        DType::I8 => "int8",
        DType::U64 => "uint64",
        DType::U32 => "uint32",
        DType::U16 => "uint16",
        DType::U8 => "uint8",
        DType::Bool(_) => "bool",
        _ => "other",
    }
}
