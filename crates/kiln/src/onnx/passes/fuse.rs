//! Fusions made when a model loads: activations into the convolutions and linear layers
//! that feed them, ReLU + 2×2 max pool, residual adds into the layer that computes one
//! operand, and SiLU as one step.

use super::*;

impl OnnxModel {
    /// Folds each activation that alone reads a Conv's, a BatchNorm's or a linear layer's
    /// (Linear, Gemm, MatMul) output into that layer, and each ReLU that alone reads an
    /// Add's: ReLU, Clip with constant bounds (ReLU6), SiLU and GELU (fused from their
    /// exported nodes first), HardSwish, Sigmoid and HardSigmoid. On the host path the
    /// convolution and the linear layer apply it in their store, the BatchNorm
    /// and the addition in their pass (DenseNet's pre-activation BatchNorm + ReLU: one pass
    /// over the image, not two); elsewhere it runs right after the operator. Returns how many
    /// were fused.
    pub(in crate::onnx) fn fuse_activations(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let Some(act) = self.steps[at].activation_op() else {
                at += 1;
                continue;
            };
            let layer = self.steps[at]
                .inputs
                .first()
                .copied()
                .flatten()
                .and_then(|x| {
                    let layer = self.sole_producer(x)?;
                    let step = &self.steps[layer];
                    let kind_fits = match step.op.node() {
                        Some(
                            Node::Conv2d(_)
                            | Node::BatchNormalization(_)
                            | Node::Linear(_)
                            | Node::Gemm(_)
                            | Node::MatMul(_),
                        ) => true,
                        Some(Node::Add(_)) => act == Activation::Relu,
                        _ => matches!(step.op, StepOp::Affine { .. }),
                    };
                    let fusable = kind_fits && step.plain_single();
                    fusable.then_some(layer)
                });
            let Some(layer) = layer else {
                at += 1;
                continue;
            };
            self.absorb(at, layer, |step| match act {
                Activation::Relu => step.relu = true,
                other => step.activation = Some(other),
            });
            fused += 1;
        }
        fused
    }

    /// Folds each 2×2, stride-2 max pool (no padding, floor mode) that alone reads a
    /// convolution with a fused ReLU into that convolution: on the host path the pooled
    /// maximum is what the register tile stores, so the convolution's full output never
    /// reaches memory (W3 / LeNet / VGG-style blocks). Returns how many were fused.
    pub(in crate::onnx) fn fuse_relu_pools(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let conv = match self.steps[at].op.node() {
                Some(node @ Node::MaxPool2d(n))
                    if !n.config.ceil_mode && crate::onnx::ops::nn::is_plain_2x2(node) =>
                {
                    self.steps[at]
                        .inputs
                        .first()
                        .copied()
                        .flatten()
                        .and_then(|x| self.sole_producer(x))
                        .filter(|&c| {
                            let c = &self.steps[c];
                            matches!(c.op.node(), Some(Node::Conv2d(_)))
                                && c.relu
                                && c.activation.is_none()
                                && c.residual.is_none()
                                && !c.pool
                                && c.outputs.len() == 1
                        })
                }
                _ => None,
            };
            let Some(conv) = conv else {
                at += 1;
                continue;
            };
            self.absorb(at, conv, |step| step.pool = true);
            fused += 1;
        }
        fused
    }

    /// Folds each residual `Add` of a convolution's output and an earlier value into that
    /// convolution (added, and a fused ReLU applied, in its store on the host path; right
    /// after the operator elsewhere). The convolution must be the Add's only reader of its
    /// output and come after the other operand's producer (ResNet's downsample convolution
    /// is exported after the block's second one: the sum goes into whichever runs last).
    /// Returns how many were fused.
    pub(in crate::onnx) fn fuse_residuals(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let step = &self.steps[at];
            let operands = match (step.op.node(), step.inputs.as_slice()) {
                (Some(Node::Add(_)), &[Some(a), Some(b)]) if step.outputs.len() == 1 => [a, b],
                _ => {
                    at += 1;
                    continue;
                }
            };
            let conv_for = |i: usize| -> Option<usize> {
                let (mine, other) = (operands[i], operands[1 - i]);
                let conv = self.sole_producer(mine)?;
                let c = &self.steps[conv];
                let fusable = matches!(c.op.node(), Some(Node::Conv2d(_) | Node::Linear(_)))
                    && c.plain_single()
                    && mine != other
                    && self.producer(other).is_none_or(|p| p < conv);
                fusable.then_some(conv)
            };
            let Some((conv, skip)) = [0, 1]
                .into_iter()
                .filter_map(|i| conv_for(i).map(|c| (c, operands[1 - i])))
                .max_by_key(|&(c, _)| c)
            else {
                at += 1;
                continue;
            };
            let relu = self.steps[at].relu;
            self.uses[skip] += 1;
            // The Add's name is "Add", or "Add+Relu" with its ReLU fused.
            self.absorb(at, conv, |c| {
                // Conv inputs: x, weight, bias (absent: None), then the residual.
                c.inputs.resize(3, None);
                c.inputs.push(Some(skip));
                c.residual = Some(3);
                c.relu = relu;
            });
            fused += 1;
        }
        fused
    }

    /// Fuses `Mul(x, Sigmoid(x))` (either operand order; the Sigmoid read by nothing else)
    /// into one SiLU step: one pass over the values, where the exported pair made a copy
    /// (the sigmoid's input is still read by the product), a sigmoid pass and a product pass.
    /// Returns how many were fused.
    pub(in crate::onnx) fn fuse_silus(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let step = &self.steps[at];
            let operands = match (step.op.node(), step.inputs.as_slice()) {
                (Some(Node::Mul(_)), &[Some(a), Some(b)]) => [a, b],
                _ => {
                    at += 1;
                    continue;
                }
            };
            // (the sigmoid step, x)
            let gate = (0..2).find_map(|i| {
                let (x, s) = (operands[1 - i], operands[i]);
                let p = self.sole_producer(s)?;
                let step = &self.steps[p];
                let is_gate = matches!(step.op.node(), Some(Node::Sigmoid(_)))
                    && step.inputs.first() == Some(&Some(x))
                    && x != s;
                is_gate.then_some((p, x, s))
            });
            let Some((sigmoid, x, s)) = gate else {
                at += 1;
                continue;
            };
            let step = &mut self.steps[at];
            step.inputs = vec![Some(x)];
            step.op = StepOp::Activation(Activation::Silu);
            step.op_name = "Silu".into();
            self.uses[s] -= 1;
            self.remove_step(sigmoid);
            fused += 1;
            // The sigmoid ran before the product: the product moved one step back.
        }
        fused
    }
}
