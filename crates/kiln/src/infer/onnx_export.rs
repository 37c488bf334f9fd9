//! ONNX export of an inference [`Graph`] (opset 17), written with the ONNX message types
//! `onnx-ir` generates (the crate Kiln's importer parses with, so one protobuf runtime serves
//! both directions). The batch dimension is symbolic (`batch`), so one file serves b1 and b64.
//! Attention is written out as the standard ops it computes (Reshape, Transpose, MatMul, Div,
//! Softmax), which any runtime and Kiln's importer read.

use std::path::Path;

use onnx_ir::{
    AttributeProto, AttributeType, GraphProto, Message, ModelProto, NodeProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto,
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
                let shape = format!("{}.head_shape", node.name);
                let split = [0, 0, *heads as i64, *head_dim as i64];
                int_inits.push(int64_tensor(&shape, &split));
                let scale = init("scale", &[], &[(*head_dim as f32).sqrt()]);
                let inputs: Vec<String> = node.inputs.iter().map(|&v| value_name(v)).collect();
                let [q, k, v] = [0, 1, 2].map(|i| inputs.get(i).cloned().unwrap_or_default());
                g.initializer.extend(int_inits);
                g.node.extend(attention_nodes(
                    &node.name,
                    [&q, &k, &v],
                    &shape,
                    &scale,
                    &value_name(node.output),
                ));
                continue;
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
    // onnx-ir re-exports the outer messages only; the opset entry is reached through the
    // field that holds it.
    model.opset_import.push(Default::default());
    model.opset_import[0].version = OPSET;
    model.graph = Some(g).into();
    model
        .write_to_bytes()
        .map_err(|e| KilnError::Inference(format!("encoding ONNX: {e}")))
}

/// The nodes of one attention op: `q`, `k`, `v` `[B, T, D]` split by `head_shape`
/// (`[0, 0, heads, D / heads]`) into heads, `softmax(q·kᵀ / scale) · v` per head, heads joined
/// back to `q`'s shape; the executor's op sequence, in standard ONNX ops.
fn attention_nodes(
    prefix: &str,
    [q, k, v]: [&str; 3],
    head_shape: &str,
    scale: &str,
    output: &str,
) -> Vec<NodeProto> {
    let name = |s: &str| format!("{prefix}.{s}");
    let node = |op: &str, inputs: &[&str], out: &str, attrs: Vec<AttributeProto>| {
        let mut n = NodeProto::new();
        n.name = name(out);
        n.op_type = op.into();
        n.input = inputs.iter().map(|s| s.to_string()).collect();
        n.output = vec![if out == "context" {
            output.to_string()
        } else {
            name(out)
        }];
        n.attribute = attrs;
        n
    };
    let heads_first = || vec![ints("perm", &[0, 2, 1, 3])];
    let (qs, qh, ks, kt, vs, vh) = (
        name("q_split"),
        name("q_heads"),
        name("k_split"),
        name("k_heads_t"),
        name("v_split"),
        name("v_heads"),
    );
    let (scores, scaled, weights, ctx_heads, ctx_split, q_shape) = (
        name("scores"),
        name("scaled"),
        name("weights"),
        name("context_heads"),
        name("context_split"),
        name("q_shape"),
    );
    vec![
        node("Reshape", &[q, head_shape], "q_split", vec![]),
        node("Transpose", &[&qs], "q_heads", heads_first()),
        node("Reshape", &[k, head_shape], "k_split", vec![]),
        // Keys go straight to [B, heads, dk, T]: kᵀ for the product.
        node(
            "Transpose",
            &[&ks],
            "k_heads_t",
            vec![ints("perm", &[0, 2, 3, 1])],
        ),
        node("Reshape", &[v, head_shape], "v_split", vec![]),
        node("Transpose", &[&vs], "v_heads", heads_first()),
        node("MatMul", &[&qh, &kt], "scores", vec![]),
        node("Div", &[&scores, scale], "scaled", vec![]),
        node("Softmax", &[&scaled], "weights", vec![int("axis", -1)]),
        node("MatMul", &[&weights, &vh], "context_heads", vec![]),
        node("Transpose", &[&ctx_heads], "context_split", heads_first()),
        node("Shape", &[q], "q_shape", vec![]),
        node("Reshape", &[&ctx_split, &q_shape], "context", vec![]),
    ]
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

/// ONNX `TensorProto.DataType` codes.
const FLOAT: i32 = 1;
const INT64: i32 = 7;

fn value_info(name: &str, dims: &[Dim]) -> ValueInfoProto {
    let mut shape = TensorShapeProto::new();
    for d in dims {
        shape.dim.push(Default::default());
        let dim = shape.dim.last_mut().expect("just pushed");
        match d {
            Dim::Batch => dim.set_dim_param("batch".into()),
            Dim::Fixed(n) => dim.set_dim_value(*n as i64),
            Dim::Unknown => {}
        }
    }
    let mut ty = TypeProto::new();
    let tensor = ty.mut_tensor_type();
    tensor.elem_type = FLOAT;
    tensor.shape = Some(shape).into();
    let mut info = ValueInfoProto::new();
    info.name = name.into();
    info.type_ = Some(ty).into();
    info
}

fn float_tensor(name: &str, shape: &[usize], values: &[f32]) -> TensorProto {
    let mut t = TensorProto::new();
    t.name = name.into();
    t.data_type = FLOAT;
    t.dims = shape.iter().map(|&d| d as i64).collect();
    // raw_data is little-endian by the ONNX spec, whatever the host.
    t.raw_data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    t
}

fn int64_tensor(name: &str, values: &[i64]) -> TensorProto {
    let mut t = TensorProto::new();
    t.name = name.into();
    t.data_type = INT64;
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
