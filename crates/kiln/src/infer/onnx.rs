//! ONNX export of an inference [`Graph`] (opset 17), written with the `onnx-protobuf` message
//! types. The batch dimension is symbolic (`batch`), so one file serves b1 and b64. Attention
//! is a call of a model-local function (`ai.kiln.MultiHeadAttention`, standard ops inside),
//! which runtimes inline and Kiln's importer reads back as one op.

use std::path::Path;

use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::tensor_proto::DataType;
use onnx_protobuf::tensor_shape_proto::{Dimension, dimension};
use onnx_protobuf::type_proto::{self, Tensor as TensorType};
use onnx_protobuf::{
    AttributeProto, FunctionProto, GraphProto, Message, ModelProto, NodeProto, OperatorSetIdProto,
    TensorProto, TensorShapeProto, TypeProto, ValueInfoProto,
};

use super::graph::{Graph, Op, ValueId, Weight};
use crate::error::{KilnError, Result};
use crate::precision::Precision;

/// The opset the exporter targets.
pub const OPSET: i64 = 17;
/// IR version matching opset 17 (ONNX 1.12+).
const IR_VERSION: i64 = 8;
/// Name of the graph input.
pub const INPUT_NAME: &str = "images";
/// Name of the graph output.
pub const OUTPUT_NAME: &str = "logits";

/// Serializes `graph` as an ONNX model.
pub fn to_bytes(graph: &Graph) -> Result<Vec<u8>> {
    if graph.precision != Precision::F32 {
        return Err(KilnError::Unsupported {
            pass: "onnx export".into(),
            layer: format!("{} (weights in {})", graph.model, graph.precision.name()),
            fix: "export the f32 graph (leave f16/bf16 out of --passes) and convert it with \
                  your runtime's float16 tool; Kiln writes float32 ONNX only"
                .into(),
        });
    }
    let mut g = GraphProto::new();
    g.name = graph.model.clone();
    let value_name = |v: ValueId| {
        if v == Graph::INPUT {
            INPUT_NAME.to_string()
        } else if v == graph.output {
            OUTPUT_NAME.to_string()
        } else {
            format!("v{v}")
        }
    };
    let ranks = graph.ranks();
    let mut uses_attention = false;
    for node in &graph.nodes {
        // A second node when one Kiln op is two ONNX ops (MatMul + Add).
        let mut bias_add: Option<NodeProto> = None;
        // Integer initializers (shapes), added after the float ones of `init`.
        let mut int_inits: Vec<TensorProto> = Vec::new();
        let mut n = NodeProto::new();
        n.name = node.name.clone();
        n.op_type = node.op.kind().to_string();
        n.input = node.inputs.iter().map(|&v| value_name(v)).collect();
        n.output = vec![value_name(node.output)];
        let mut init = |suffix: &str, shape: &[usize], values: &[f32]| {
            let name = format!("{}.{suffix}", node.name);
            g.initializer.push(float_tensor(&name, shape, values));
            name
        };
        match &node.op {
            Op::Conv2d {
                weight,
                bias,
                geometry,
            } => {
                n.input.push(init("weight", &weight.shape, &weight.values));
                if let Some(b) = bias {
                    n.input.push(init("bias", &b.shape, &b.values));
                }
                n.attribute = vec![
                    ints("kernel_shape", &geometry.kernel),
                    ints("strides", &geometry.stride),
                    ints("pads", &geometry.pads),
                    ints("dilations", &geometry.dilation),
                    int("group", geometry.groups as i64),
                ];
            }
            Op::Linear { weight, bias }
                if node.inputs.first().and_then(|&v| ranks.get(v)) == Some(&3) =>
            {
                // Gemm is 2-D only: a sequence takes MatMul (which broadcasts over the
                // batch), then Add for the bias.
                n.op_type = "MatMul".into();
                n.input.push(init("weight", &weight.shape, &weight.values));
                if let Some(Weight { shape, values, .. }) = bias {
                    let mut add = NodeProto::new();
                    add.name = format!("{}.bias", node.name);
                    add.op_type = "Add".into();
                    let product = format!("{}.matmul", value_name(node.output));
                    add.input = vec![product.clone(), init("bias", shape, values)];
                    add.output = std::mem::replace(&mut n.output, vec![product]);
                    bias_add = Some(add);
                }
            }
            Op::Linear { weight, bias } => {
                // Gemm: Y = A·B + C with B = Burn's [in, out] weight as is.
                n.input.push(init("weight", &weight.shape, &weight.values));
                if let Some(Weight { shape, values, .. }) = bias {
                    n.input.push(init("bias", shape, values));
                }
            }
            Op::BatchNorm {
                gamma,
                beta,
                mean,
                var,
                eps,
            } => {
                let c = [gamma.len()];
                n.input.push(init("scale", &c, gamma));
                n.input.push(init("bias", &c, beta));
                n.input.push(init("mean", &c, mean));
                n.input.push(init("var", &c, var));
                n.attribute = vec![float("epsilon", *eps as f32)];
            }
            Op::MaxPool2d { kernel, stride } => {
                n.attribute = vec![ints("kernel_shape", kernel), ints("strides", stride)];
            }
            Op::Flatten => n.attribute = vec![int("axis", 1)],
            Op::Reshape { shape } => {
                // 0 copies the batch dimension (allowzero = 0), so the file stays batch-free.
                let dims: Vec<i64> = std::iter::once(0)
                    .chain(shape.iter().map(|&d| d as i64))
                    .collect();
                let name = format!("{}.shape", node.name);
                int_inits.push(int64_tensor(&name, &dims));
                n.input.push(name);
            }
            Op::AddConstant { value } => {
                n.input.push(init("value", &value.shape, &value.values));
            }
            Op::LayerNorm { gamma, beta, eps } => {
                n.input.push(init("scale", &[gamma.len()], gamma));
                if let Some(beta) = beta {
                    n.input.push(init("bias", &[beta.len()], beta));
                }
                n.attribute = vec![int("axis", -1), float("epsilon", *eps as f32)];
            }
            Op::TokenMean => {
                n.attribute = vec![ints("axes", &[1]), int("keepdims", 0)];
            }
            Op::Attention { heads, head_dim } => {
                // A call of Kiln's model-local function (its body is standard ops), so any
                // ONNX runtime runs it and Kiln's importer reads it back as one op.
                uses_attention = true;
                n.domain = KILN_DOMAIN.into();
                let shape = format!("{}.head_shape", node.name);
                let split = [0, 0, *heads as i64, *head_dim as i64];
                int_inits.push(int64_tensor(&shape, &split));
                n.input.push(shape);
                n.input
                    .push(init("scale", &[], &[(*head_dim as f32).sqrt()]));
            }
            Op::Dropout { .. } | Op::Relu | Op::GlobalAvgPool | Op::Add => {}
            Op::QLinear { .. } | Op::QConv2d { .. } => {
                return Err(KilnError::Unsupported {
                    pass: "onnx export".into(),
                    layer: format!("{} ({})", node.name, node.op.kind()),
                    fix: "export the f32 or folded graph (--passes fold) and quantize with \
                          ONNX Runtime's quantize_dynamic; Kiln's int8 scheme has no exact \
                          ONNX equivalent yet"
                        .into(),
                });
            }
        }
        g.initializer.extend(int_inits);
        g.node.push(n);
        g.node.extend(bias_add);
    }
    let [c, h, w] = graph.input_shape;
    g.input.push(value_info(
        INPUT_NAME,
        &[Dim::Batch, Dim::Fixed(c), Dim::Fixed(h), Dim::Fixed(w)],
    ));
    g.output
        .push(value_info(OUTPUT_NAME, &[Dim::Batch, Dim::Unknown]));

    let mut model = ModelProto::new();
    model.ir_version = IR_VERSION;
    model.producer_name = "kiln".into();
    model.producer_version = env!("CARGO_PKG_VERSION").into();
    let mut opset = OperatorSetIdProto::new();
    opset.domain = String::new();
    opset.version = OPSET;
    model.opset_import.push(opset);
    if uses_attention {
        let mut kiln = OperatorSetIdProto::new();
        kiln.domain = KILN_DOMAIN.into();
        kiln.version = 1;
        model.opset_import.push(kiln);
        model.functions.push(attention_function());
    }
    model.graph = Some(g).into();
    model
        .write_to_bytes()
        .map_err(|e| KilnError::Inference(format!("encoding ONNX: {e}")))
}

/// The domain of Kiln's model-local ONNX functions.
pub const KILN_DOMAIN: &str = "ai.kiln";
/// The name of the attention function ([`Op::Attention`]).
pub const ATTENTION_FUNCTION: &str = "MultiHeadAttention";

/// `MultiHeadAttention(q, k, v, head_shape, scale)`: `q`, `k`, `v` `[B, T, D]` split by
/// `head_shape` (`[0, 0, heads, D / heads]`) into heads, `softmax(q·kᵀ / scale) · v` per head,
/// heads joined back to `q`'s shape. The executor's op sequence, in standard ONNX ops.
fn attention_function() -> FunctionProto {
    let node = |op: &str, inputs: &[&str], output: &str, attrs: Vec<AttributeProto>| {
        let mut n = NodeProto::new();
        n.op_type = op.into();
        n.input = inputs.iter().map(|s| s.to_string()).collect();
        n.output = vec![output.into()];
        n.attribute = attrs;
        n
    };
    let heads_first = || vec![ints("perm", &[0, 2, 1, 3])];
    let mut f = FunctionProto::new();
    f.name = ATTENTION_FUNCTION.into();
    f.domain = KILN_DOMAIN.into();
    f.input = ["q", "k", "v", "head_shape", "scale"]
        .map(String::from)
        .to_vec();
    f.output = vec!["context".into()];
    f.node = vec![
        node("Reshape", &["q", "head_shape"], "q_split", vec![]),
        node("Transpose", &["q_split"], "q_heads", heads_first()),
        node("Reshape", &["k", "head_shape"], "k_split", vec![]),
        // Keys go straight to [B, heads, dk, T]: kᵀ for the product.
        node(
            "Transpose",
            &["k_split"],
            "k_heads_t",
            vec![ints("perm", &[0, 2, 3, 1])],
        ),
        node("Reshape", &["v", "head_shape"], "v_split", vec![]),
        node("Transpose", &["v_split"], "v_heads", heads_first()),
        node("MatMul", &["q_heads", "k_heads_t"], "scores", vec![]),
        node("Div", &["scores", "scale"], "scaled", vec![]),
        node("Softmax", &["scaled"], "weights", vec![int("axis", -1)]),
        node("MatMul", &["weights", "v_heads"], "context_heads", vec![]),
        node(
            "Transpose",
            &["context_heads"],
            "context_split",
            heads_first(),
        ),
        node("Shape", &["q"], "q_shape", vec![]),
        node("Reshape", &["context_split", "q_shape"], "context", vec![]),
    ];
    let mut opset = OperatorSetIdProto::new();
    opset.version = OPSET;
    f.opset_import.push(opset);
    f
}

/// Writes `graph` to `path` atomically (temp file + rename).
pub fn export(graph: &Graph, path: &Path) -> Result<()> {
    let bytes = to_bytes(graph)?;
    crate::fsutil::write_atomic(path, &bytes)
}

/// Parses an ONNX file back (for inspection and tests).
pub fn parse(bytes: &[u8]) -> Result<ModelProto> {
    ModelProto::parse_from_bytes(bytes)
        .map_err(|e| KilnError::Inference(format!("not an ONNX model: {e}")))
}

enum Dim {
    Batch,
    Fixed(usize),
    Unknown,
}

fn value_info(name: &str, dims: &[Dim]) -> ValueInfoProto {
    let mut shape = TensorShapeProto::new();
    for d in dims {
        let mut dim = Dimension::new();
        dim.value = match d {
            Dim::Batch => Some(dimension::Value::DimParam("batch".into())),
            Dim::Fixed(n) => Some(dimension::Value::DimValue(*n as i64)),
            Dim::Unknown => None,
        };
        shape.dim.push(dim);
    }
    let mut tensor = TensorType::new();
    tensor.elem_type = DataType::FLOAT as i32;
    tensor.shape = Some(shape).into();
    let mut ty = TypeProto::new();
    ty.value = Some(type_proto::Value::TensorType(tensor));
    let mut info = ValueInfoProto::new();
    info.name = name.into();
    info.type_ = Some(ty).into();
    info
}

fn float_tensor(name: &str, shape: &[usize], values: &[f32]) -> TensorProto {
    let mut t = TensorProto::new();
    t.name = name.into();
    t.data_type = DataType::FLOAT as i32;
    t.dims = shape.iter().map(|&d| d as i64).collect();
    // raw_data is little-endian by the ONNX spec, whatever the host.
    t.raw_data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    t
}

fn int64_tensor(name: &str, values: &[i64]) -> TensorProto {
    let mut t = TensorProto::new();
    t.name = name.into();
    t.data_type = DataType::INT64 as i32;
    t.dims = vec![values.len() as i64];
    t.raw_data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    t
}

fn ints(name: &str, values: &[usize]) -> AttributeProto {
    let mut a = AttributeProto::new();
    a.name = name.into();
    a.type_ = AttributeType::INTS.into();
    a.ints = values.iter().map(|&v| v as i64).collect();
    a
}

fn int(name: &str, value: i64) -> AttributeProto {
    let mut a = AttributeProto::new();
    a.name = name.into();
    a.type_ = AttributeType::INT.into();
    a.i = value;
    a
}

fn float(name: &str, value: f32) -> AttributeProto {
    let mut a = AttributeProto::new();
    a.name = name.into();
    a.type_ = AttributeType::FLOAT.into();
    a.f = value;
    a
}
