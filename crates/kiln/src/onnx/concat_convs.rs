//! Fuses a channel `Concat` whose every input is a convolution's output (read by nothing
//! else) with those convolutions: on the host each writes its channels of the concatenated
//! image in place ([`kiln_kernels::implicit::conv2d_nhwc_into_channels`]), so the
//! concatenation is no copy of its own (SqueezeNet's fire modules, Inception's branches).
//!
//! The step keeps the layers as they were: passes take it apart first and fuse again after,
//! and a run that cannot use the in-place path runs the convolutions and the Concat in turn.

use onnx_ir::Node;

use super::{OnnxModel, Step, StepOp};

impl OnnxModel {
    /// Fuses each such Concat (channel axis) with its convolutions (dense, constant weights,
    /// nothing fused after them but an activation) into one step at the Concat's place.
    /// Returns how many.
    pub(super) fn fuse_concat_convs(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let Some(convs) = self.convs_into(at) else {
                at += 1;
                continue;
            };
            let concat = self.steps.remove(at);
            // Remove from the last so the earlier indices hold.
            let mut order: Vec<usize> = convs.clone();
            order.sort_unstable_by(|a, b| b.cmp(a));
            let mut removed: Vec<(usize, Step)> =
                order.iter().map(|&c| (c, self.steps.remove(c))).collect();
            // Back in the Concat's input order.
            let layers: Vec<Step> = convs
                .iter()
                .map(|c| {
                    let i = removed.iter().position(|(at, _)| at == c).unwrap_or(0);
                    removed.swap_remove(i).1
                })
                .collect();
            for layer in &layers {
                // The Concat no longer reads the convolutions' outputs from slots.
                let out = layer.outputs[0];
                self.uses[out] = self.uses[out].saturating_sub(1);
            }
            let inputs = layers
                .iter()
                .flat_map(|l| l.inputs.iter().copied())
                .collect();
            let make = Step::fused(format!("{}+Concat", layers[0].op_name), inputs, &concat);
            let step = make(StepOp::ConcatConvs(Box::new(ConcatConvs {
                layers,
                concat,
            })));
            // Where the Concat ran, less the convolutions removed before it.
            let place = at - convs.len();
            self.steps.insert(place, step);
            fused += 1;
            at = place + 1;
        }
        fused
    }

    /// Takes every fused Concat apart again: its convolutions, then the Concat, where it was.
    pub(super) fn unfuse_concat_convs(&mut self) {
        let mut at = 0;
        while at < self.steps.len() {
            if !matches!(self.steps[at].op, StepOp::ConcatConvs(_)) {
                at += 1;
                continue;
            }
            let step = self.steps.remove(at);
            let StepOp::ConcatConvs(fused) = step.op else {
                continue;
            };
            let ConcatConvs { layers, concat } = *fused;
            let count = layers.len();
            for layer in layers.into_iter().rev() {
                self.uses[layer.outputs[0]] += 1;
                self.steps.insert(at, layer);
            }
            self.steps.insert(at + count, concat);
            at += count + 1;
        }
    }

    /// The convolutions (step indices, in the Concat's input order) Concat step `at` can
    /// take in, if it is such a Concat.
    fn convs_into(&self, at: usize) -> Option<Vec<usize>> {
        let concat = &self.steps[at];
        let Some(Node::Concat(n)) = concat.op.node() else {
            return None;
        };
        if n.config.axis != 1 || concat.outputs.len() != 1 || concat.inputs.len() < 2 {
            return None;
        }
        concat
            .inputs
            .iter()
            .map(|slot| {
                let conv = self.sole_producer((*slot)?)?;
                let c = &self.steps[conv];
                let Some(Node::Conv2d(node)) = c.op.node() else {
                    return None;
                };
                let fits = node.config.groups == 1
                    && c.residual.is_none()
                    && !c.pool
                    && c.outputs.len() == 1
                    && self.weights_constant(c);
                fits.then_some(conv)
            })
            .collect()
    }
}

/// The layers of a fused Concat, as they were.
#[derive(Debug)]
pub(super) struct ConcatConvs {
    /// The convolutions, in the Concat's input order; the step's inputs are theirs in turn.
    pub layers: Vec<Step>,
    /// The Concat, reading the convolutions' outputs.
    pub concat: Step,
}
