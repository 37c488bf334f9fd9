//! Fuses a 1×1 convolution with the depthwise convolution that alone reads its output (an
//! inverted-residual block's expand and depthwise layers: MobileNet v2/v3, EfficientNet,
//! ShuffleNet's branches) into one step, which the host runs band by band
//! ([`kiln_kernels::expand_depthwise`]) so the expanded image is never written out.
//!
//! The step keeps both layers as they were: passes that rewrite layers (the BatchNorm fold,
//! int8) take the pair apart first and fuse again after, and a run that cannot use the
//! fused kernel (another device, a layer the host does not take) runs the two in turn.

use onnx_ir::Node;
use onnx_ir::node::padding::{AutoPad, PaddingConfig2d};

use super::{OnnxModel, Step, StepOp};

impl OnnxModel {
    /// Fuses each 1×1, stride-1, unpadded, ungrouped convolution with constant weights (an
    /// activation fused into it or not) into the depthwise convolution (constant weights,
    /// one filter per channel) that is the only reader of its output. Returns how many.
    pub(super) fn fuse_expand_depthwises(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let Some(pw) = self.expand_before(at) else {
                at += 1;
                continue;
            };
            // `pw` comes before `at`: remove the later first.
            let dw = self.steps.remove(at);
            let pw_step = self.steps.remove(pw);
            // The depthwise layer no longer reads the 1×1's output from a slot.
            let expanded = pw_step.outputs[0];
            self.uses[expanded] = self.uses[expanded].saturating_sub(1);
            let inputs = pw_step
                .inputs
                .iter()
                .chain(&dw.inputs[1..])
                .copied()
                .collect();
            let make = Step::fused(format!("{}+{}", pw_step.op_name, dw.op_name), inputs, &dw);
            let step = make(StepOp::ExpandDepthwise(Box::new([pw_step, dw])));
            // Where the 1×1 ran: the depthwise layer's other inputs are constants.
            self.steps.insert(pw, step);
            fused += 1;
            at = pw + 1;
        }
        fused
    }

    /// Takes every fused pair apart again, each layer a step of its own where the pair was.
    pub(super) fn unfuse_expand_depthwises(&mut self) {
        let mut at = 0;
        while at < self.steps.len() {
            if !matches!(self.steps[at].op, StepOp::ExpandDepthwise(_)) {
                at += 1;
                continue;
            }
            let step = self.steps.remove(at);
            let StepOp::ExpandDepthwise(pair) = step.op else {
                continue;
            };
            let [pw, dw] = *pair;
            self.uses[pw.outputs[0]] += 1;
            self.steps.insert(at, dw);
            self.steps.insert(at, pw);
            at += 2;
        }
    }

    /// The 1×1 layer step `at` (a depthwise convolution) can take in, if any.
    fn expand_before(&self, at: usize) -> Option<usize> {
        let dw = &self.steps[at];
        let Some(Node::Conv2d(d)) = dw.op.node() else {
            return None;
        };
        let groups = d.config.groups;
        let [_, Some(weight), ..] = dw.inputs[..] else {
            return None;
        };
        let dw_fits = groups > 1
            && dw.residual.is_none()
            && !dw.pool
            && dw.outputs.len() == 1
            && self
                .constant_dims(weight)
                .is_some_and(|d| d.first() == Some(&groups) && d.get(1) == Some(&1))
            && self.weights_constant(dw);
        if !dw_fits {
            return None;
        }
        let pw = self.sole_producer(dw.inputs[0]?)?;
        let p = &self.steps[pw];
        let Some(Node::Conv2d(c)) = p.op.node() else {
            return None;
        };
        let c = &c.config;
        let unpadded = matches!(
            c.padding,
            PaddingConfig2d::Valid | PaddingConfig2d::Explicit(0, 0, 0, 0)
        );
        let pw_fits = c.groups == 1
            && c.kernel_size == [1, 1]
            && c.stride == [1, 1]
            && c.dilation == [1, 1]
            && unpadded
            && matches!(c.auto_pad, AutoPad::NotSet | AutoPad::Valid)
            && p.residual.is_none()
            && !p.pool
            && p.outputs.len() == 1
            && self.weights_constant(p);
        pw_fits.then_some(pw)
    }

    /// The dimensions of constant slot `slot`, if it is one.
    fn constant_dims(&self, slot: usize) -> Option<Vec<usize>> {
        self.constants[slot].as_ref().map(|v| v.dims())
    }
}
