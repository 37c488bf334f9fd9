//! Quantized operators onnx-ir does not type, rewritten before it parses a model into the
//! `QuantizeLinear` / `DequantizeLinear` form it does: the QOperator format's `QLinearConv`
//! and `QLinearMatMul`, and dynamic quantization's `ConvInteger`, `MatMulInteger` and
//! `DynamicQuantizeLinear` (what ONNX Runtime's `quantize_static(quant_format=QOperator)`
//! and `quantize_dynamic` write).
//!
//! Each becomes the operator's definition in ONNX's own terms: `QLinearConv(x, w) =
//! Q(Conv(DQ(x), DQ(w), DQ(bias)))` with the bias's scale `x_scale · w_scale`,
//! `ConvInteger(x, w) = Cast(Conv(x − x_zero, w − w_zero), int32)` and likewise for the
//! matrix products, `DynamicQuantizeLinear` the scale and zero point its specification
//! computes from the input's range. The integer arithmetic ONNX Runtime does is exact and the
//! float form here rounds once per product sum, so results agree to within one quantization
//! step (where a sum lands on a rounding boundary). The rewritten graph is then the QDQ
//! graph Kiln's static int8 pass (`passes/static_int8.rs`) puts on its integer kernels.
//!
//! Why rewrite instead of running them: onnx-ir keeps these nodes as untyped placeholders
//! (their outputs carry only what the file declares, usually nothing), so the front end
//! could not type what follows them.

use onnx_ir::{AttributeProto, AttributeType, GraphProto, ModelProto, NodeProto, TensorProto};

/// ONNX `TensorProto.DataType` codes used here.
const FLOAT: i32 = 1;
const INT32: i32 = 6;

/// Rewrites every quantized operator onnx-ir cannot type; returns how many it rewrote.
pub fn lower_quantized_ops(model: &mut ModelProto) -> usize {
    let Some(graph) = model.graph.as_mut() else {
        return 0;
    };
    let mut lowering = Lowering {
        nodes: Vec::with_capacity(graph.node.len()),
        initializers: Vec::new(),
        fresh: 0,
        rewritten: 0,
    };
    for node in std::mem::take(&mut graph.node) {
        if node.domain.is_empty() || node.domain == "ai.onnx" {
            match node.op_type.as_str() {
                "QLinearConv" if node.input.len() >= 8 => {
                    lowering.qlinear(&node, "Conv");
                    continue;
                }
                "QLinearMatMul" if node.input.len() == 8 => {
                    lowering.qlinear(&node, "MatMul");
                    continue;
                }
                "ConvInteger" if node.input.len() >= 2 => {
                    lowering.integer(&node, "Conv", graph);
                    continue;
                }
                "MatMulInteger" if node.input.len() >= 2 => {
                    lowering.integer(&node, "MatMul", graph);
                    continue;
                }
                "DynamicQuantizeLinear" if node.input.len() == 1 && node.output.len() == 3 => {
                    lowering.dynamic_quantize(&node);
                    continue;
                }
                _ => {}
            }
        }
        lowering.nodes.push(node);
    }
    graph.node = lowering.nodes;
    graph.initializer.extend(lowering.initializers);
    lowering.rewritten
}

/// The rewritten node list being built.
struct Lowering {
    nodes: Vec<NodeProto>,
    initializers: Vec<TensorProto>,
    fresh: usize,
    rewritten: usize,
}

impl Lowering {
    /// A value name no file uses (the prefix is Kiln's; the counter makes it unique).
    fn name(&mut self, base: &str, what: &str) -> String {
        self.fresh += 1;
        format!("kiln_lowered_{}_{what}_{base}", self.fresh)
    }

    fn emit(
        &mut self,
        op: &str,
        inputs: &[&str],
        outputs: &[&str],
        attributes: Vec<AttributeProto>,
    ) {
        let mut n = NodeProto::new();
        n.op_type = op.into();
        n.name = format!("{}_{}", outputs.first().copied().unwrap_or(op), op);
        n.input = inputs.iter().map(|s| s.to_string()).collect();
        n.output = outputs.iter().map(|s| s.to_string()).collect();
        n.attribute = attributes;
        self.nodes.push(n);
    }

    /// A float constant of `dims` (scalar when empty) filled with `value`.
    fn constant(&mut self, base: &str, value: f32, dims: &[i64]) -> String {
        let name = self.name(base, "const");
        let mut t = TensorProto::new();
        t.name = name.clone();
        t.data_type = FLOAT;
        t.dims = dims.to_vec();
        let n: i64 = dims.iter().product();
        t.float_data = vec![value; n.max(1) as usize];
        self.initializers.push(t);
        name
    }

    /// `DequantizeLinear(x, scale, zero)` along `axis` into a new value.
    fn dequantize(&mut self, x: &str, scale: &str, zero: Option<&str>, axis: i64) -> String {
        let out = self.name(x, "dq");
        let mut inputs = vec![x, scale];
        if let Some(z) = zero.filter(|z| !z.is_empty()) {
            inputs.push(z);
        }
        self.emit(
            "DequantizeLinear",
            &inputs,
            &[&out],
            vec![int_attr("axis", axis)],
        );
        out
    }

    /// `QLinearConv` / `QLinearMatMul` (`op`): dequantize both operands (and a conv's int32
    /// bias with scale `x_scale · w_scale`), the float operator, quantize the result.
    fn qlinear(&mut self, node: &NodeProto, op: &str) {
        let i = &node.input;
        let (x, w) = (i[0].as_str(), i[3].as_str());
        let xf = self.dequantize(x, &i[1], Some(&i[2]), 1);
        // A convolution's weight is quantized per output channel (axis 0); a matrix
        // product's right operand per column (axis 1, ONNX's default).
        let w_axis = if op == "Conv" { 0 } else { 1 };
        let wf = self.dequantize(w, &i[4], Some(&i[5]), w_axis);
        let mut operands = vec![xf, wf];
        if op == "Conv" && i.len() > 8 && !i[8].is_empty() {
            let scale = self.name(&i[8], "bias_scale");
            self.emit("Mul", &[&i[1], &i[4]], &[&scale], vec![]);
            operands.push(self.dequantize(&i[8], &scale, None, 0));
        }
        let yf = self.name(&node.output[0], "float");
        let refs: Vec<&str> = operands.iter().map(String::as_str).collect();
        self.emit(op, &refs, &[&yf], float_op_attributes(node));
        self.emit(
            "QuantizeLinear",
            &[&yf, &i[6], &i[7]],
            &[&node.output[0]],
            vec![int_attr("axis", 1)],
        );
        self.rewritten += 1;
    }

    /// `ConvInteger` / `MatMulInteger` (`op`): both operands less their zero points as
    /// floats (a dequantization with scale 1), the float operator, the result as int32.
    fn integer(&mut self, node: &NodeProto, op: &str, graph: &GraphProto) {
        let i = &node.input;
        let zero = |k: usize| i.get(k).map(String::as_str).filter(|s| !s.is_empty());
        let (a_zero, b_zero) = (zero(2), zero(3));
        // The unit scale matches its zero point's shape (per-tensor or per channel).
        let unit = |me: &mut Self, z: Option<&str>, base: &str| {
            let dims = z
                .and_then(|z| initializer_dims(graph, z))
                .unwrap_or_default();
            me.constant(base, 1.0, &dims)
        };
        let a_scale = unit(self, a_zero, &i[0]);
        let af = self.dequantize(&i[0], &a_scale, a_zero, 1);
        let b_scale = unit(self, b_zero, &i[1]);
        let b_axis = if op == "Conv" { 0 } else { 1 };
        let bf = self.dequantize(&i[1], &b_scale, b_zero, b_axis);
        let yf = self.name(&node.output[0], "float");
        self.emit(op, &[&af, &bf], &[&yf], float_op_attributes(node));
        self.emit(
            "Cast",
            &[&yf],
            &[&node.output[0]],
            vec![int_attr("to", INT32 as i64)],
        );
        self.rewritten += 1;
    }

    /// `DynamicQuantizeLinear(x) → (y, scale, zero)` as its specification defines it: the
    /// range of `x` widened to hold 0, 256 levels over it, uint8.
    fn dynamic_quantize(&mut self, node: &NodeProto) {
        let x = node.input[0].as_str();
        let (y, scale, zero) = (&node.output[0], &node.output[1], &node.output[2]);
        let keep = || vec![int_attr("keepdims", 0)];
        let (mn, mx) = (self.name(x, "min"), self.name(x, "max"));
        self.emit("ReduceMin", &[x], &[&mn], keep());
        self.emit("ReduceMax", &[x], &[&mx], keep());
        let zero_f = self.constant(x, 0.0, &[]);
        let levels = self.constant(x, 255.0, &[]);
        let (lo, hi) = (self.name(x, "lo"), self.name(x, "hi"));
        self.emit("Min", &[&mn, &zero_f], &[&lo], vec![]);
        self.emit("Max", &[&mx, &zero_f], &[&hi], vec![]);
        let span = self.name(x, "span");
        self.emit("Sub", &[&hi, &lo], &[&span], vec![]);
        self.emit("Div", &[&span, &levels], &[scale], vec![]);
        let (ratio, neg, rounded) = (
            self.name(x, "ratio"),
            self.name(x, "neg"),
            self.name(x, "round"),
        );
        self.emit("Div", &[&lo, scale], &[&ratio], vec![]);
        self.emit("Neg", &[&ratio], &[&neg], vec![]);
        self.emit("Round", &[&neg], &[&rounded], vec![]);
        // uint8 = TensorProto.UINT8.
        self.emit("Cast", &[&rounded], &[zero], vec![int_attr("to", 2)]);
        self.emit("QuantizeLinear", &[x, scale, zero], &[y], vec![]);
        self.rewritten += 1;
    }
}

/// The attributes of a quantized Conv / MatMul that its float operator takes (a
/// convolution's geometry; a matrix product has none).
fn float_op_attributes(node: &NodeProto) -> Vec<AttributeProto> {
    const CONV: [&str; 6] = [
        "auto_pad",
        "dilations",
        "group",
        "kernel_shape",
        "pads",
        "strides",
    ];
    node.attribute
        .iter()
        .filter(|a| CONV.contains(&a.name.as_str()))
        .cloned()
        .collect()
}

/// The dimensions of initializer `name`, when it is one.
fn initializer_dims(graph: &GraphProto, name: &str) -> Option<Vec<i64>> {
    graph
        .initializer
        .iter()
        .find(|t| t.name == name)
        .map(|t| t.dims.clone())
}

fn int_attr(name: &str, value: i64) -> AttributeProto {
    let mut a = AttributeProto::new();
    a.name = name.into();
    a.type_ = AttributeType::INT.into();
    a.i = value;
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
        let mut n = NodeProto::new();
        n.op_type = op.into();
        n.input = inputs.iter().map(|s| s.to_string()).collect();
        n.output = outputs.iter().map(|s| s.to_string()).collect();
        n
    }

    #[test]
    fn quantized_operators_become_quantize_dequantize_and_float_operators() {
        let mut model = ModelProto::new();
        let graph = model.graph.mut_or_insert_default();
        let mut conv = node(
            "QLinearConv",
            &["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
            &["y"],
        );
        conv.attribute.push(int_attr("group", 1));
        graph.node.push(conv);
        graph
            .node
            .push(node("DynamicQuantizeLinear", &["y"], &["q", "qs", "qz"]));
        graph
            .node
            .push(node("MatMulInteger", &["q", "m", "qz"], &["mi"]));
        graph.node.push(node("Relu", &["mi"], &["out"]));
        assert_eq!(lower_quantized_ops(&mut model), 3);
        let graph = model.graph.as_ref().unwrap();
        let ops: Vec<&str> = graph.node.iter().map(|n| n.op_type.as_str()).collect();
        assert!(!ops.iter().any(|o| o.starts_with("QLinear")
            || o.ends_with("Integer")
            || *o == "DynamicQuantizeLinear"));
        // The conv keeps its attributes, and its output name survives on the Q node.
        let c = graph.node.iter().find(|n| n.op_type == "Conv").unwrap();
        assert_eq!(c.input.len(), 3);
        assert!(c.attribute.iter().any(|a| a.name == "group"));
        let q = graph
            .node
            .iter()
            .find(|n| n.output == ["y".to_string()])
            .unwrap();
        assert_eq!(q.op_type, "QuantizeLinear");
        // The dynamic quantizer's three outputs are produced, the last op untouched.
        for name in ["q", "qs", "qz", "mi"] {
            assert!(
                graph
                    .node
                    .iter()
                    .any(|n| n.output.iter().any(|o| o == name))
            );
        }
        assert_eq!(ops.last(), Some(&"Relu"));
    }
}
