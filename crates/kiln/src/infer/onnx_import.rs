//! ONNX import: an ONNX file whose operators Kiln's inference graph has (Conv, Gemm, MatMul by
//! a constant, BatchNormalization, LayerNormalization, Relu, MaxPool, GlobalAveragePool,
//! Flatten, Reshape, ReduceMean over tokens, Add, Dropout, Identity, and Kiln's own
//! `ai.kiln.MultiHeadAttention` function) becomes
//! a [`Graph`], so `kiln serve` can run ONNX models and the passes (fold, int8) apply to them.
//! Anything else is refused with the node and operator named — never approximated.

use std::collections::HashMap;

use onnx_protobuf::tensor_proto::DataType;
use onnx_protobuf::tensor_shape_proto::dimension;
use onnx_protobuf::{AttributeProto, NodeProto, TensorProto, type_proto};

use super::graph::{ConvGeometry, Graph, Op, ValueId, Weight};
use super::onnx::{KILN_DOMAIN, parse};
use crate::error::{KilnError, Result};

fn unsupported(node: &NodeProto, why: impl Into<String>) -> KilnError {
    KilnError::Unsupported {
        pass: "onnx import".into(),
        layer: format!("{} ({})", node.name, node.op_type),
        fix: why.into(),
    }
}

fn bad(message: impl Into<String>) -> KilnError {
    KilnError::Inference(format!("ONNX import: {}", message.into()))
}

/// Reads an ONNX model (one `[N, C, H, W]` float input, one output) into an inference graph.
pub fn import(bytes: &[u8], name: &str) -> Result<Graph> {
    let model = parse(bytes)?;
    let g = model
        .graph
        .as_ref()
        .ok_or_else(|| bad("the model has no graph"))?;
    let weights: HashMap<&str, &TensorProto> =
        g.initializer.iter().map(|t| (t.name.as_str(), t)).collect();
    let inputs: Vec<_> = g
        .input
        .iter()
        .filter(|i| !weights.contains_key(i.name.as_str()))
        .collect();
    let [input] = inputs.as_slice() else {
        return Err(bad(format!(
            "Kiln serves models with one input; this one has {}",
            inputs.len()
        )));
    };
    let dims: Vec<Option<i64>> = match input.type_.value.as_ref() {
        Some(type_proto::Value::TensorType(t)) => {
            if t.elem_type != DataType::FLOAT as i32 {
                return Err(bad(format!("input `{}` is not FP32", input.name)));
            }
            t.shape
                .dim
                .iter()
                .map(|d| match d.value {
                    Some(dimension::Value::DimValue(v)) => Some(v),
                    _ => None,
                })
                .collect()
        }
        _ => return Err(bad(format!("input `{}` is not a tensor", input.name))),
    };
    let shape = match dims.as_slice() {
        [_, Some(c), Some(h), Some(w)] if *c > 0 && *h > 0 && *w > 0 => {
            [*c as usize, *h as usize, *w as usize]
        }
        _ => {
            return Err(bad(format!(
                "input `{}` has shape {dims:?}; Kiln needs [N, C, H, W] with fixed C, H, W",
                input.name
            )));
        }
    };
    let [output] = g.output.as_slice() else {
        return Err(bad(format!(
            "Kiln serves models with one output; this one has {}",
            g.output.len()
        )));
    };

    let mut graph = Graph::new(name, shape);
    let mut values: HashMap<String, ValueId> = HashMap::new();
    values.insert(input.name.clone(), Graph::INPUT);
    for node in &g.node {
        let value = |i: usize| -> Result<ValueId> {
            let n = node
                .input
                .get(i)
                .ok_or_else(|| unsupported(node, format!("input {i} is missing")))?;
            values
                .get(n)
                .copied()
                .ok_or_else(|| unsupported(node, format!("input `{n}` is not computed before it")))
        };
        // The constant initializer feeding input `i`.
        let initializer = |i: usize| -> Result<&TensorProto> {
            let n = node
                .input
                .get(i)
                .ok_or_else(|| unsupported(node, format!("input {i} is missing")))?;
            weights
                .get(n.as_str())
                .copied()
                .ok_or_else(|| unsupported(node, format!("`{n}` must be a constant initializer")))
        };
        let weight = |i: usize| -> Result<Weight> {
            tensor(initializer(i)?).map_err(|e| unsupported(node, e))
        };
        let optional_weight = |i: usize| -> Result<Option<Weight>> {
            match node.input.get(i) {
                Some(n) if !n.is_empty() => weight(i).map(Some),
                _ => Ok(None),
            }
        };
        let integers = |i: usize| -> Result<Vec<i64>> {
            int64s(initializer(i)?).map_err(|e| unsupported(node, e))
        };
        let attrs = Attributes(&node.attribute);
        let kiln_function = node.domain == KILN_DOMAIN;
        if !(node.domain.is_empty() || node.domain == "ai.onnx" || kiln_function) {
            return Err(unsupported(
                node,
                format!(
                    "operators of domain `{}` have no Kiln equivalent",
                    node.domain
                ),
            ));
        }
        let op_type = if kiln_function {
            format!("{KILN_DOMAIN}.{}", node.op_type)
        } else {
            node.op_type.clone()
        };
        let (op, inputs) = match op_type.as_str() {
            "Conv" => {
                let w = weight(1)?;
                let [_, _, kh, kw] = w.shape[..] else {
                    return Err(unsupported(node, "only 2-D convolutions are supported"));
                };
                let pair = |key: &str| -> Result<[usize; 2]> {
                    match attrs.ints(key).as_deref() {
                        None => Ok([1, 1]),
                        Some([a, b]) => Ok([*a as usize, *b as usize]),
                        Some(other) => Err(unsupported(node, format!("{key} = {other:?}"))),
                    }
                };
                let pads = match attrs.ints("pads").as_deref() {
                    None => [0; 4],
                    Some([a, b, c, d]) => [*a as usize, *b as usize, *c as usize, *d as usize],
                    Some(other) => return Err(unsupported(node, format!("pads = {other:?}"))),
                };
                if attrs.string("auto_pad").is_some_and(|p| p != "NOTSET") {
                    return Err(unsupported(node, "auto_pad; export with explicit pads"));
                }
                let geometry = ConvGeometry {
                    stride: pair("strides")?,
                    pads,
                    dilation: pair("dilations")?,
                    groups: attrs.int("group").unwrap_or(1) as usize,
                    kernel: [kh, kw],
                };
                let op = Op::Conv2d {
                    weight: w,
                    bias: optional_weight(2)?,
                    geometry,
                };
                (op, vec![value(0)?])
            }
            "Gemm" => {
                if attrs.int("transA").unwrap_or(0) != 0
                    || attrs.float("alpha").unwrap_or(1.0) != 1.0
                    || attrs.float("beta").unwrap_or(1.0) != 1.0
                {
                    return Err(unsupported(
                        node,
                        "Gemm with transA, alpha or beta ≠ defaults",
                    ));
                }
                let mut w = weight(1)?;
                if w.shape.len() != 2 {
                    return Err(unsupported(node, "Gemm weight must be 2-D"));
                }
                // Kiln keeps Burn's [in, out]; transB = 1 stores [out, in].
                if attrs.int("transB").unwrap_or(0) != 0 {
                    let (out, inn) = (w.shape[0], w.shape[1]);
                    let mut t = vec![0f32; w.values.len()];
                    for o in 0..out {
                        for i in 0..inn {
                            t[i * out + o] = w.values[o * inn + i];
                        }
                    }
                    w = Weight::new(vec![inn, out], t);
                }
                let op = Op::Linear {
                    weight: w,
                    bias: optional_weight(2)?,
                };
                (op, vec![value(0)?])
            }
            "BatchNormalization" => {
                let op = Op::BatchNorm {
                    gamma: weight(1)?.values,
                    beta: weight(2)?.values,
                    mean: weight(3)?.values,
                    var: weight(4)?.values,
                    eps: attrs.float("epsilon").unwrap_or(1e-5) as f64,
                };
                (op, vec![value(0)?])
            }
            "Relu" => (Op::Relu, vec![value(0)?]),
            "MaxPool" => {
                let pair = |key: &str| -> Result<[usize; 2]> {
                    match attrs.ints(key).as_deref() {
                        Some([a, b]) => Ok([*a as usize, *b as usize]),
                        None if key == "strides" => Ok([1, 1]),
                        other => Err(unsupported(node, format!("{key} = {other:?}"))),
                    }
                };
                if attrs
                    .ints("pads")
                    .is_some_and(|p| p.iter().any(|&x| x != 0))
                    || attrs.int("ceil_mode").unwrap_or(0) != 0
                {
                    return Err(unsupported(node, "MaxPool with padding or ceil_mode"));
                }
                let op = Op::MaxPool2d {
                    kernel: pair("kernel_shape")?,
                    stride: pair("strides")?,
                };
                (op, vec![value(0)?])
            }
            "GlobalAveragePool" => (Op::GlobalAvgPool, vec![value(0)?]),
            "Flatten" => {
                if attrs.int("axis").unwrap_or(1) != 1 {
                    return Err(unsupported(node, "Flatten with axis ≠ 1"));
                }
                (Op::Flatten, vec![value(0)?])
            }
            "MatMul" => {
                let w = weight(1)?;
                if w.shape.len() != 2 {
                    return Err(unsupported(
                        node,
                        "MatMul by a 2-D constant weight only (a linear layer)",
                    ));
                }
                let op = Op::Linear {
                    weight: w,
                    bias: None,
                };
                (op, vec![value(0)?])
            }
            // A constant operand (a bias, a position embedding) is an AddConstant, folded
            // into the matmul before it below when it is that matmul's bias.
            "Add" => match (
                weights.get(node.input.first().map_or("", String::as_str)),
                weights.get(node.input.get(1).map_or("", String::as_str)),
            ) {
                (None, None) => (Op::Add, vec![value(0)?, value(1)?]),
                (None, Some(_)) => (Op::AddConstant { value: weight(1)? }, vec![value(0)?]),
                (Some(_), None) => (Op::AddConstant { value: weight(0)? }, vec![value(1)?]),
                (Some(_), Some(_)) => return Err(unsupported(node, "Add of two constants")),
            },
            "Reshape" => {
                let dims = integers(1)?;
                let per_sample: Option<Vec<usize>> = match dims.split_first() {
                    Some((0 | -1, rest)) if !rest.is_empty() && rest.iter().all(|&d| d > 0) => {
                        Some(rest.iter().map(|&d| d as usize).collect())
                    }
                    _ => None,
                };
                let Some(shape) = per_sample else {
                    return Err(unsupported(
                        node,
                        format!(
                            "Reshape to {dims:?}: Kiln keeps the batch dimension (0 or -1 \
                             first) and fixes the others"
                        ),
                    ));
                };
                (Op::Reshape { shape }, vec![value(0)?])
            }
            "LayerNormalization" => {
                if attrs.int("axis").unwrap_or(-1) != -1 {
                    return Err(unsupported(node, "LayerNormalization over an axis ≠ -1"));
                }
                let op = Op::LayerNorm {
                    gamma: weight(1)?.values,
                    beta: optional_weight(2)?.map(|b| b.values),
                    eps: attrs.float("epsilon").unwrap_or(1e-5) as f64,
                };
                (op, vec![value(0)?])
            }
            "ReduceMean" => {
                // Opset 17 has `axes` as an attribute, 18+ as an input.
                let axes = match attrs.ints("axes") {
                    Some(axes) => axes,
                    None if node.input.len() > 1 => integers(1)?,
                    None => Vec::new(),
                };
                if axes != [1] || attrs.int("keepdims").unwrap_or(1) != 0 {
                    return Err(unsupported(
                        node,
                        "ReduceMean over the tokens only (axes = [1], keepdims = 0)",
                    ));
                }
                (Op::TokenMean, vec![value(0)?])
            }
            "ai.kiln.MultiHeadAttention" => {
                let split = integers(3)?;
                let scale = weight(4)?;
                let [0, 0, heads, head_dim] = split[..] else {
                    return Err(unsupported(node, format!("head shape {split:?}")));
                };
                let expected = (head_dim.max(0) as f32).sqrt();
                if heads <= 0
                    || head_dim <= 0
                    || scale.values.len() != 1
                    || (scale.values[0] - expected).abs() > expected * 1e-6
                {
                    return Err(unsupported(
                        node,
                        format!(
                            "attention with {heads} heads of {head_dim} scaled by {:?} (Kiln \
                             scales by sqrt(head size))",
                            scale.values
                        ),
                    ));
                }
                let op = Op::Attention {
                    heads: heads as usize,
                    head_dim: head_dim as usize,
                };
                (op, vec![value(0)?, value(1)?, value(2)?])
            }
            "Dropout" => (Op::Dropout { prob: 0.0 }, vec![value(0)?]),
            "Identity" => {
                let v = value(0)?;
                for out in &node.output {
                    values.insert(out.clone(), v);
                }
                continue;
            }
            other => {
                return Err(unsupported(
                    node,
                    format!(
                        "operator {other} has no Kiln equivalent; Kiln imports Conv, Gemm, MatMul (by a constant), BatchNormalization, LayerNormalization, Relu, MaxPool, GlobalAveragePool, Flatten, Reshape, ReduceMean (tokens), Add, Dropout, Identity and its own ai.kiln.MultiHeadAttention"
                    ),
                ));
            }
        };
        let out = node
            .output
            .first()
            .ok_or_else(|| unsupported(node, "no output"))?;
        let label = if node.name.is_empty() {
            out.clone()
        } else {
            node.name.clone()
        };
        let v = graph.push(label, op, inputs);
        values.insert(out.clone(), v);
    }
    graph.output = *values
        .get(&output.name)
        .ok_or_else(|| bad(format!("output `{}` is never computed", output.name)))?;
    fold_matmul_bias(&mut graph);
    Ok(graph)
}

/// `MatMul` + `Add(bias)` (how a linear layer over a sequence is written, Gemm being 2-D only)
/// back into one linear layer with its bias, when nothing else reads the product.
fn fold_matmul_bias(graph: &mut Graph) {
    let mut i = 0;
    while i < graph.nodes.len() {
        let producer = match (&graph.nodes[i].op, graph.nodes[i].inputs.first()) {
            (Op::AddConstant { value }, Some(&input)) => graph
                .nodes
                .iter()
                .position(|n| n.output == input)
                .filter(|&p| {
                    let out = match &graph.nodes[p].op {
                        Op::Linear { weight, bias: None } => weight.shape[1],
                        _ => return false,
                    };
                    graph.uses(input) == 1 && value.len() == out && value.shape.last() == Some(&out)
                }),
            _ => None,
        };
        let Some(p) = producer else {
            i += 1;
            continue;
        };
        let node = graph.nodes.remove(i);
        if let (Op::AddConstant { value }, Op::Linear { bias, .. }) =
            (node.op, &mut graph.nodes[p].op)
        {
            *bias = Some(Weight::new(vec![value.len()], value.values));
        }
        graph.rename_uses(node.output, graph.nodes[p].output);
    }
}

/// An INT64 initializer (raw little-endian bytes or `int64_data`).
fn int64s(t: &TensorProto) -> std::result::Result<Vec<i64>, String> {
    if t.data_type != DataType::INT64 as i32 {
        return Err(format!("initializer `{}` is not INT64", t.name));
    }
    if t.raw_data.is_empty() {
        return Ok(t.int64_data.clone());
    }
    if !t.raw_data.len().is_multiple_of(8) {
        return Err(format!("initializer `{}` is not whole INT64s", t.name));
    }
    Ok(t.raw_data
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect())
}

/// A float initializer (raw little-endian bytes or `float_data`).
fn tensor(t: &TensorProto) -> std::result::Result<Weight, String> {
    if t.data_type != DataType::FLOAT as i32 {
        return Err(format!("initializer `{}` is not FP32", t.name));
    }
    let shape: Vec<usize> = t.dims.iter().map(|&d| d.max(0) as usize).collect();
    let count: usize = shape.iter().product();
    let values: Vec<f32> = if !t.raw_data.is_empty() {
        t.raw_data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    } else {
        t.float_data.clone()
    };
    if values.len() != count {
        return Err(format!(
            "initializer `{}` holds {} values for shape {shape:?}",
            t.name,
            values.len()
        ));
    }
    Ok(Weight::new(shape, values))
}

/// Attribute lookup by name (absent → `None`, so each op applies ONNX's default).
struct Attributes<'a>(&'a [AttributeProto]);

impl Attributes<'_> {
    fn get(&self, name: &str) -> Option<&AttributeProto> {
        self.0.iter().find(|a| a.name == name)
    }
    fn ints(&self, name: &str) -> Option<Vec<i64>> {
        self.get(name).map(|a| a.ints.clone())
    }
    fn int(&self, name: &str) -> Option<i64> {
        self.get(name).map(|a| a.i)
    }
    fn float(&self, name: &str) -> Option<f32> {
        self.get(name).map(|a| a.f)
    }
    fn string(&self, name: &str) -> Option<String> {
        self.get(name)
            .map(|a| String::from_utf8_lossy(&a.s).into_owned())
    }
}
