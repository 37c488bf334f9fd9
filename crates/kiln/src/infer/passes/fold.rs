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
        // The layer's weights scaled per output channel; its bias, replaced below.
        let bias = match &mut graph.nodes[p].op {
            Op::Conv2d { weight, bias, .. } if weight.shape[0] == channels => {
                // [Co, Ci/g, kh, kw]: output channel is the outer axis.
                scale_outer_channels(&mut weight.values, &scale);
                bias
            }
            Op::Linear { weight, bias } if weight.shape[1] == channels => {
                // [in, out]: output channel is the inner axis.
                for row in weight.values.chunks_exact_mut(channels) {
                    row.iter_mut().zip(&scale).for_each(|(w, s)| *w *= s);
                }
                bias
            }
            _ => {
                i += 1;
                continue;
            }
        };
        let old = bias.take().map(|b| b.values);
        *bias = Some(Weight::new(
            vec![channels],
            folded_bias(old.as_deref(), &scale, &shift),
        ));
        let bn = graph.nodes.remove(i);
        graph.rename_uses(bn.output, input);
        changes.push(format!(
            "folded {} into {} ({channels} channels)",
            bn.name, graph.nodes[p].name
        ));
    }
    changes
}

/// A BatchNorm folded into the layer before it, whose weight has the output channel on its
/// outer axis (a convolution's `[co, ci/g, kh, kw]`): each channel's weights scaled in place,
/// the folded bias returned. The one fold arithmetic of both inference roads — this graph's
/// pass and the ONNX importer's — so a model folds to the same weights either way.
pub fn fold_into_outer_channels(
    weight: &mut [f32],
    bias: Option<&[f32]>,
    [gamma, beta, mean, var]: [&[f32]; 4],
    eps: f64,
) -> Vec<f32> {
    let (scale, shift) = batch_norm_affine(gamma, beta, mean, var, eps);
    scale_outer_channels(weight, &scale);
    folded_bias(bias, &scale, &shift)
}

/// Each output channel's weights (the outer axis) times its scale.
fn scale_outer_channels(weight: &mut [f32], scale: &[f32]) {
    let per = weight.len() / scale.len().max(1);
    if per > 0 {
        for (c, chunk) in weight.chunks_exact_mut(per).enumerate() {
            chunk.iter_mut().for_each(|w| *w *= scale[c]);
        }
    }
}

/// The bias after the fold: `b·s + t` per channel (`b` = 0 without a bias).
fn folded_bias(bias: Option<&[f32]>, scale: &[f32], shift: &[f32]) -> Vec<f32> {
    scale
        .iter()
        .zip(shift)
        .enumerate()
        .map(|(c, (s, t))| bias.map_or(0.0, |b| b[c]) * s + t)
        .collect()
}
