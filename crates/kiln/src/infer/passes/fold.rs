//! Folds inference BatchNorm into the convolution or linear layer that feeds it.
//!
//! BN at inference is `y = x·s + t` per channel with `s = γ / sqrt(var + ε)` and
//! `t = β − mean·s`. For `x = W·in + b` that is `(W·s)·in + (b·s + t)`: the same layer with
//! each output channel's weights scaled and a new bias. One node and one pass over the
//! activations less, and the result is exact up to f32 rounding.

use crate::infer::graph::{Graph, Op, Weight, batch_norm_affine};

/// Folds every BatchNorm whose input is a Conv2d or Linear used only by that BatchNorm.
pub fn fold_batch_norm(graph: &mut Graph) -> Vec<String> {
    let mut changes = Vec::new();
    let mut i = 0;
    while i < graph.nodes.len() {
        let Op::BatchNorm {
            gamma,
            beta,
            mean,
            var,
            eps,
        } = &graph.nodes[i].op
        else {
            i += 1;
            continue;
        };
        let input = graph.nodes[i].inputs[0];
        let producer = graph.nodes.iter().position(|n| n.output == input);
        let Some(p) = producer.filter(|_| graph.uses(input) == 1) else {
            i += 1;
            continue;
        };
        let (scale, shift) = batch_norm_affine(gamma, beta, mean, var, *eps);
        let channels = scale.len();
        let folded = match &mut graph.nodes[p].op {
            Op::Conv2d { weight, bias, .. } if weight.shape[0] == channels => {
                // [Co, Ci/g, kh, kw]: output channel is the outer axis.
                let per = weight.len() / channels;
                for (c, chunk) in weight.values.chunks_exact_mut(per).enumerate() {
                    chunk.iter_mut().for_each(|w| *w *= scale[c]);
                }
                *bias = Some(new_bias(bias.take(), &scale, &shift));
                true
            }
            Op::Linear { weight, bias } if weight.shape[1] == channels => {
                // [in, out]: output channel is the inner axis.
                for row in weight.values.chunks_exact_mut(channels) {
                    row.iter_mut().zip(&scale).for_each(|(w, s)| *w *= s);
                }
                *bias = Some(new_bias(bias.take(), &scale, &shift));
                true
            }
            _ => false,
        };
        if !folded {
            i += 1;
            continue;
        }
        let bn = graph.nodes.remove(i);
        graph.rename_uses(bn.output, input);
        changes.push(format!(
            "folded {} into {} ({channels} channels)",
            bn.name, graph.nodes[p].name
        ));
    }
    changes
}

fn new_bias(bias: Option<Weight>, scale: &[f32], shift: &[f32]) -> Weight {
    let old = bias.map_or_else(|| vec![0.0; scale.len()], |b| b.values);
    let values = old
        .iter()
        .zip(scale)
        .zip(shift)
        .map(|((b, s), t)| b * s + t)
        .collect();
    Weight::new(vec![scale.len()], values)
}
