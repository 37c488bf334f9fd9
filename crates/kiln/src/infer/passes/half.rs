//! Half-precision weights for GPU inference: convolution and linear weights rounded to f16 or
//! bf16 (half the bytes on disk and in device memory) and the graph marked to compute those
//! layers — and attention's two products — in that precision.

use crate::error::{KilnError, Result};
use crate::infer::graph::{Graph, Op, Weight};
use crate::precision::Precision;

/// Rounds every Conv and Linear weight and bias to `precision` and sets the graph's compute
/// precision. Normalization, softmax, pooling and residual adds stay f32 when the graph runs
/// (the executor casts around the half-precision ops), as in mixed-precision training. Int8
/// layers are left as they are.
pub fn to_half_precision(graph: &mut Graph, precision: Precision) -> Result<Vec<String>> {
    if precision == Precision::F32 {
        return Ok(Vec::new());
    }
    if graph.precision != Precision::F32 && graph.precision != precision {
        return Err(KilnError::InvalidValue {
            key: "passes".into(),
            value: precision.name().into(),
            expected: format!(
                "one half precision per graph (this one is already {})",
                graph.precision.name()
            ),
        });
    }
    let mut changes = Vec::new();
    for node in &mut graph.nodes {
        let (weight, bias) = match &mut node.op {
            Op::Conv2d { weight, bias, .. } | Op::Linear { weight, bias } => (weight, bias),
            _ => continue,
        };
        if weight.precision == precision {
            continue;
        }
        let before = weight.bytes() + bias.as_ref().map_or(0, Weight::bytes);
        *weight = weight.rounded_to(precision);
        if let Some(b) = bias.as_mut() {
            *b = b.rounded_to(precision);
        }
        let after = weight.bytes() + bias.as_ref().map_or(0, Weight::bytes);
        changes.push(format!(
            "{}: {} weights f32 → {} ({before} → {after} bytes)",
            node.name,
            node.op.kind(),
            precision.name()
        ));
    }
    graph.precision = precision;
    Ok(changes)
}
