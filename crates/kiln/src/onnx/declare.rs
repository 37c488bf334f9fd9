//! Fills a typing gap of onnx-ir before it parses a model: the rank of a `Reshape` whose
//! target shape is computed.
//!
//! PyTorch's TorchScript exporter writes many reshapes (every `nn.MultiheadAttention`, so
//! every `nn.TransformerEncoder`) with a target built as `Concat(Unsqueeze(scalar), …)` of
//! shape arithmetic. ONNX's own shape inference gives such a Concat a length, onnx-ir's
//! does not, and it refuses the model because the Reshape's output rank is unknown. The
//! length follows from the graph's structure alone: a Concat of pieces whose lengths are
//! known, each a constant, an `Unsqueeze` of a scalar, a `Gather` of one element, ... This
//! module works those lengths out on the protobuf and declares each such Reshape's output
//! rank as a `value_info` entry (dimensions left symbolic), the form onnx-ir reads a
//! declared rank from. Nothing is declared where the length cannot be proven.

use std::collections::HashMap;

use onnx_ir::{
    AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, TensorShapeProto, TypeProto,
    ValueInfoProto,
};

/// Adds a declared rank for every `Reshape` output whose target length is provable and
/// that the model leaves undeclared; returns how many it declared.
pub fn declare_reshape_ranks(model: &mut ModelProto) -> usize {
    let Some(graph) = model.graph.as_mut() else {
        return 0;
    };
    let declared: Vec<(String, Vec<Option<i64>>, i32)> = {
        let facts = Facts::new(graph);
        graph
            .node
            .iter()
            .filter(|n| n.op_type == "Reshape" && n.input.len() >= 2 && !n.output.is_empty())
            .filter(|n| !facts.declared.contains_key(n.output[0].as_str()))
            .filter_map(|n| {
                let len = facts.length(&n.input[1], 0)?;
                let elem = facts.elem_type(&n.input[0], 0).unwrap_or(0);
                Some((
                    n.output[0].clone(),
                    facts.target_dims(&n.input[1], len),
                    elem,
                ))
            })
            .collect()
    };
    for (name, dims, elem) in &declared {
        let mut t = TypeProto::new();
        let tensor = t.mut_tensor_type();
        tensor.elem_type = *elem;
        let mut shape = TensorShapeProto::new();
        for (i, dim) in dims.iter().enumerate() {
            shape.dim.push(Default::default());
            if let Some(d) = shape.dim.last_mut() {
                match dim {
                    Some(v) => d.set_dim_value(*v),
                    None => d.set_dim_param(format!("{name}_{i}")),
                }
            }
        }
        tensor.shape = Some(shape).into();
        let mut v = ValueInfoProto::new();
        v.name = name.clone();
        v.type_ = Some(t).into();
        graph.value_info.push(v);
    }
    declared.len()
}

/// Deepest chain of producers followed (shape arithmetic is shallow; this bounds a
/// malformed cyclic graph).
const MAX_DEPTH: usize = 64;

/// What the graph states about its values.
struct Facts<'a> {
    producers: HashMap<&'a str, &'a NodeProto>,
    initializers: HashMap<&'a str, &'a TensorProto>,
    /// Declared ranks and element types (graph inputs, outputs, value_info).
    declared: HashMap<&'a str, (usize, i32)>,
}

impl<'a> Facts<'a> {
    fn new(graph: &'a GraphProto) -> Self {
        let producers = graph
            .node
            .iter()
            .flat_map(|n| n.output.iter().map(move |o| (o.as_str(), n)))
            .collect();
        let initializers = graph
            .initializer
            .iter()
            .map(|t| (t.name.as_str(), t))
            .collect();
        let declared = graph
            .input
            .iter()
            .chain(&graph.output)
            .chain(&graph.value_info)
            .filter_map(|v| {
                let t = v.type_.as_ref()?.tensor_type();
                let shape = t.shape.as_ref()?;
                Some((v.name.as_str(), (shape.dim.len(), t.elem_type)))
            })
            .collect();
        Facts {
            producers,
            initializers,
            declared,
        }
    }

    fn constant(&self, name: &str) -> Option<&'a TensorProto> {
        if let Some(t) = self.initializers.get(name) {
            return Some(t);
        }
        let n = self.producers.get(name)?;
        if n.op_type != "Constant" {
            return None;
        }
        attr(n, "value").and_then(|a| a.t.as_ref())
    }

    /// The integers of a constant (an initializer or a Constant node), or of integer
    /// arithmetic on constants (the exporter leaves `Mod(Constant, Constant)` unfolded).
    fn ints(&self, name: &str) -> Option<Vec<i64>> {
        self.ints_at(name, 0)
    }

    fn ints_at(&self, name: &str, depth: usize) -> Option<Vec<i64>> {
        if depth > MAX_DEPTH {
            return None;
        }
        if let Some(t) = self.constant(name) {
            return tensor_ints(t);
        }
        let n = self.producers.get(name)?;
        let arg = |i: usize| self.ints_at(n.input.get(i)?, depth + 1);
        match n.op_type.as_str() {
            "Constant" => attr(n, "value_ints")
                .map(|a| a.ints.clone())
                .or_else(|| attr(n, "value_int").map(|a| vec![a.i])),
            "Identity" | "Cast" | "Reshape" | "Unsqueeze" | "Squeeze" => arg(0),
            "Neg" => Some(arg(0)?.iter().map(|v| v.wrapping_neg()).collect()),
            "Concat" => (0..n.input.len())
                .map(arg)
                .collect::<Option<Vec<_>>>()
                .map(|parts| parts.concat()),
            "Add" | "Sub" | "Mul" | "Div" | "Mod" => {
                let (a, b) = (arg(0)?, arg(1)?);
                let len = a.len().max(b.len());
                if !(a.len() == len || a.len() == 1) || !(b.len() == len || b.len() == 1) {
                    return None;
                }
                let fmod = attr(n, "fmod").is_some_and(|a| a.i != 0);
                (0..len)
                    .map(|i| {
                        let (x, y) = (a[i % a.len()], b[i % b.len()]);
                        match n.op_type.as_str() {
                            "Add" => Some(x.wrapping_add(y)),
                            "Sub" => Some(x.wrapping_sub(y)),
                            "Mul" => Some(x.wrapping_mul(y)),
                            "Div" => x.checked_div(y),
                            // Mod without fmod takes the divisor's sign (Python's %).
                            _ if fmod => x.checked_rem(y),
                            _ => x.checked_rem(y).map(|r| {
                                if r != 0 && (r < 0) != (y < 0) {
                                    r + y
                                } else {
                                    r
                                }
                            }),
                        }
                    })
                    .collect()
            }
            _ => None,
        }
    }

    fn elem_type(&self, name: &str, depth: usize) -> Option<i32> {
        if depth > MAX_DEPTH {
            return None;
        }
        if let Some((_, e)) = self.declared.get(name) {
            return Some(*e);
        }
        if let Some(t) = self.constant(name) {
            return Some(t.data_type);
        }
        let n = self.producers.get(name)?;
        match n.op_type.as_str() {
            "Cast" => attr(n, "to").map(|a| a.i as i32),
            "Shape" | "Size" => Some(7), // INT64
            _ => self.elem_type(n.input.first()?, depth + 1),
        }
    }

    /// The rank of `name`, when provable.
    fn rank(&self, name: &str, depth: usize) -> Option<usize> {
        if depth > MAX_DEPTH {
            return None;
        }
        if let Some((r, _)) = self.declared.get(name) {
            return Some(*r);
        }
        if let Some(t) = self.constant(name) {
            return Some(t.dims.len());
        }
        let n = self.producers.get(name)?;
        let input = |i: usize| n.input.get(i).map(String::as_str).filter(|s| !s.is_empty());
        let rank_of = |i: usize| self.rank(input(i)?, depth + 1);
        match n.op_type.as_str() {
            "Constant" => self.ints(name).map(|_| 1),
            "Shape" => Some(1),
            "Size" => Some(0),
            "Gather" => Some(rank_of(0)? + rank_of(1)? - 1),
            "Unsqueeze" => Some(rank_of(0)? + self.axes(n)?.len()),
            "Squeeze" => rank_of(0)?.checked_sub(self.axes(n)?.len()),
            "Cast" | "Identity" | "Neg" | "Floor" | "Ceil" | "Sqrt" | "Abs" | "Concat"
            | "Slice" | "Relu" | "Transpose" | "Sigmoid" | "Tanh" | "Erf" | "Exp" | "Log"
            | "Softmax" | "LayerNormalization" | "Dropout" | "Conv" | "BatchNormalization"
            | "Gelu" | "Clip" | "Reciprocal" | "Not" => rank_of(0),
            "Gemm" => Some(2),
            "MatMul" => Some(rank_of(0)?.max(rank_of(1)?)),
            "Reshape" => self.length(input(1)?, depth + 1),
            "Expand" => Some(rank_of(0)?.max(self.length(input(1)?, depth + 1)?)),
            "Add" | "Sub" | "Mul" | "Div" | "Mod" | "Min" | "Max" | "Pow" | "Equal" | "Less"
            | "Greater" => Some(rank_of(0)?.max(rank_of(1)?)),
            "Where" => Some(rank_of(0)?.max(rank_of(1)?).max(rank_of(2)?)),
            _ => None,
        }
    }

    /// Unsqueeze/Squeeze axes (an attribute before opset 13, an input from 13 on).
    fn axes(&self, n: &NodeProto) -> Option<Vec<i64>> {
        if let Some(a) = attr(n, "axes") {
            return Some(a.ints.clone());
        }
        self.ints(n.input.get(1)?)
    }

    /// The length of the 1-D value `name`, when provable.
    /// The dimensions a Reshape target `name` of `len` entries sets, where a piece of it is
    /// a constant (positive: a `0` copies the input's dimension, a `-1` is inferred): the
    /// output's static shape then says them. Declaring every dimension unknown would give
    /// onnx-ir an output shape equal to an input's that is unknown too, and it removes such
    /// a Reshape as a no-op (timm's TNT, MobileViT, CoaT and EfficientViT lost their
    /// reshapes that way).
    fn target_dims(&self, name: &str, len: usize) -> Vec<Option<i64>> {
        let known = |v: Vec<i64>| -> Vec<Option<i64>> {
            v.into_iter().map(|d| (d > 0).then_some(d)).collect()
        };
        if let Some(v) = self.ints(name).filter(|v| v.len() == len) {
            return known(v);
        }
        let pieces = self
            .producers
            .get(name)
            .filter(|n| n.op_type == "Concat")
            .map(|n| {
                n.input
                    .iter()
                    .map(|i| {
                        let l = self.length(i, 1)?;
                        Some(match self.ints(i).filter(|v| v.len() == l) {
                            Some(v) => known(v),
                            None => vec![None; l],
                        })
                    })
                    .collect::<Option<Vec<_>>>()
            });
        match pieces.flatten().map(|p| p.concat()) {
            Some(dims) if dims.len() == len => dims,
            _ => vec![None; len],
        }
    }

    fn length(&self, name: &str, depth: usize) -> Option<usize> {
        if depth > MAX_DEPTH {
            return None;
        }
        if let Some(t) = self.constant(name) {
            return match t.dims.as_slice() {
                [len] => Some(*len as usize),
                [] => Some(1),
                _ => None,
            };
        }
        if let Some(v) = self.ints(name) {
            return Some(v.len());
        }
        let n = self.producers.get(name)?;
        let input = |i: usize| n.input.get(i).map(String::as_str).filter(|s| !s.is_empty());
        let len_of = |i: usize| self.length(input(i)?, depth + 1);
        let rank_of = |i: usize| self.rank(input(i)?, depth + 1);
        match n.op_type.as_str() {
            "Concat" => n
                .input
                .iter()
                .map(|i| self.length(i, depth + 1))
                .sum::<Option<usize>>(),
            "Unsqueeze" if rank_of(0)? == 0 && self.axes(n)?.len() == 1 => Some(1),
            "Cast" | "Identity" | "Neg" | "Floor" | "Ceil" | "Abs" | "Relu" => len_of(0),
            "Shape" => {
                let rank = rank_of(0)? as i64;
                let clamp = |v: i64| {
                    if v < 0 {
                        (v + rank).max(0)
                    } else {
                        v.min(rank)
                    }
                };
                let start = attr(n, "start").map_or(0, |a| clamp(a.i));
                let end = attr(n, "end").map_or(rank, |a| clamp(a.i));
                Some((end - start).max(0) as usize)
            }
            "Gather" => {
                if rank_of(0)? != 1 {
                    return None;
                }
                match rank_of(1)? {
                    0 => None, // a scalar, not 1-D
                    1 => len_of(1),
                    _ => None,
                }
            }
            "Add" | "Sub" | "Mul" | "Div" | "Mod" | "Min" | "Max" | "Where" => {
                let lens: Vec<usize> = (0..n.input.len())
                    .map(|i| match rank_of(i)? {
                        0 => Some(1),
                        1 => len_of(i),
                        _ => None,
                    })
                    .collect::<Option<_>>()?;
                let longest = lens.iter().copied().max()?;
                lens.iter()
                    .all(|&l| l == 1 || l == longest)
                    .then_some(longest)
            }
            "Slice" => {
                let len = len_of(0)? as i64;
                let starts = self.ints(input(1)?)?;
                let ends = self.ints(input(2)?)?;
                if let Some(axes) = input(3)
                    && self.ints(axes)? != [0]
                {
                    return None;
                }
                let step = match input(4) {
                    Some(s) => *self.ints(s)?.first()?,
                    None => 1,
                };
                slice_len(len, *starts.first()?, *ends.first()?, step)
            }
            _ => None,
        }
    }
}

/// Elements a Slice of `step` keeps of `len` (ONNX's clamping of start and end).
fn slice_len(len: i64, start: i64, end: i64, step: i64) -> Option<usize> {
    if step == 0 {
        return None;
    }
    let norm = |v: i64, lo: i64, hi: i64| {
        let v = if v < 0 { v + len } else { v };
        v.clamp(lo, hi)
    };
    let n = if step > 0 {
        let (s, e) = (norm(start, 0, len), norm(end, 0, len));
        (e - s + step - 1).div_euclid(step)
    } else {
        let (s, e) = (norm(start, -1, len - 1), norm(end, -1, len - 1));
        (s - e - step - 1).div_euclid(-step)
    };
    Some(n.max(0) as usize)
}

fn attr<'n>(n: &'n NodeProto, name: &str) -> Option<&'n AttributeProto> {
    n.attribute.iter().find(|a| a.name == name)
}

/// The integers of an INT64/INT32 tensor (typed fields or raw little-endian bytes).
fn tensor_ints(t: &TensorProto) -> Option<Vec<i64>> {
    const INT32: i32 = 6;
    const INT64: i32 = 7;
    match t.data_type {
        INT64 if !t.int64_data.is_empty() => Some(t.int64_data.clone()),
        INT32 if !t.int32_data.is_empty() => Some(t.int32_data.iter().map(|&v| v as i64).collect()),
        INT64 => Some(
            t.raw_data
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
        ),
        INT32 => Some(
            t.raw_data
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as i64)
                .collect(),
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_lengths_follow_onnx_clamping() {
        assert_eq!(slice_len(4, 0, 2, 1), Some(2));
        assert_eq!(slice_len(4, -2, i64::MAX, 1), Some(2));
        assert_eq!(slice_len(4, 1, 100, 2), Some(2));
        assert_eq!(slice_len(4, -1, i64::MIN, -1), Some(4));
        assert_eq!(slice_len(4, 3, 3, 1), Some(0));
        assert_eq!(slice_len(4, 0, 1, 0), None);
    }

    /// A Reshape to `Concat(Unsqueeze(Gather(Shape(x), 0)), [196], [384])` (TNT's) is
    /// declared `[?, 196, 384]`: known pieces as values, so onnx-ir does not see an output
    /// shape of unknowns equal to its input's and drop the Reshape as a no-op.
    #[test]
    fn constant_pieces_of_a_reshape_target_are_declared_as_values() {
        fn node(op: &str, inputs: &[&str], output: &str) -> NodeProto {
            let mut n = NodeProto::new();
            n.op_type = op.into();
            n.input = inputs.iter().map(|s| s.to_string()).collect();
            n.output = vec![output.into()];
            n
        }
        fn ints(name: &str, v: &[i64]) -> TensorProto {
            let mut t = TensorProto::new();
            t.name = name.into();
            t.data_type = 7;
            t.dims = vec![v.len() as i64];
            t.int64_data = v.to_vec();
            t
        }
        let mut model = ModelProto::new();
        let g = model.graph.mut_or_insert_default();
        let mut scalar = ints("zero", &[0]);
        scalar.dims.clear();
        g.initializer.extend([
            scalar,
            ints("axes", &[0]),
            ints("a", &[196]),
            ints("b", &[384]),
        ]);
        g.node.push(node("Shape", &["x"], "shape"));
        let mut gather = node("Gather", &["shape", "zero"], "batch");
        let mut axis = AttributeProto::new();
        axis.name = "axis".into();
        gather.attribute.push(axis);
        g.node.push(gather);
        g.node.push(node("Unsqueeze", &["batch", "axes"], "b1"));
        let mut concat = node("Concat", &["b1", "a", "b"], "target");
        let mut axis = AttributeProto::new();
        axis.name = "axis".into();
        concat.attribute.push(axis);
        g.node.push(concat);
        g.node.push(node("Reshape", &["y", "target"], "out"));
        assert_eq!(declare_reshape_ranks(&mut model), 1);
        let v = &model.graph.as_ref().unwrap().value_info[0];
        let dims: Vec<Option<i64>> = v
            .type_
            .tensor_type()
            .shape
            .dim
            .iter()
            .map(|d| d.has_dim_value().then(|| d.dim_value()))
            .collect();
        assert_eq!(dims, vec![None, Some(196), Some(384)]);
    }
}
