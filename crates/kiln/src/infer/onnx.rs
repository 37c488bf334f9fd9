//! ONNX export of an inference [`Graph`] (opset 17), written with the `onnx-protobuf` message
//! types. The batch dimension is symbolic (`batch`), so one file serves b1 and b64.

use std::path::Path;

use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::tensor_proto::DataType;
use onnx_protobuf::tensor_shape_proto::{Dimension, dimension};
use onnx_protobuf::type_proto::{self, Tensor as TensorType};
use onnx_protobuf::{
    AttributeProto, GraphProto, Message, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto,
};

use super::graph::{Graph, Op, ValueId, Weight};
use crate::error::{KilnError, Result};

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
    for node in &graph.nodes {
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
            Op::Linear { weight, bias } => {
                // Gemm: Y = A·B + C with B = Burn's [in, out] weight as is.
                n.input.push(init("weight", &weight.shape, &weight.values));
                if let Some(Weight { shape, values }) = bias {
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
        g.node.push(n);
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
    model.graph = Some(g).into();
    model
        .write_to_bytes()
        .map_err(|e| KilnError::Inference(format!("encoding ONNX: {e}")))
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
