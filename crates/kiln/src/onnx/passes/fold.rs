//! The fold pass: a BatchNorm after a convolution folded into its weights and bias, any
//! other constant BatchNorm turned into a per-channel affine step.

use super::*;

/// `x · scale + shift` with `scale`/`shift` `[1, C, 1, 1]` and `x` `[N, C, ...]`.
pub(in crate::onnx) fn affine(
    ins: Inputs,
    scale: &Value,
    shift: &Value,
) -> Result<Vec<Value>, OnnxError> {
    use crate::onnx::ops::math::{Binary, binary};
    let x = first(ins)?;
    let rank = x.rank();
    let c = x.dims().get(1).copied().unwrap_or(1);
    let mut dims = vec![1; rank.max(2)];
    dims[1] = c;
    let (scale, shift) = (scale.clone().reshape(&dims)?, shift.clone().reshape(&dims)?);
    Ok(vec![binary(
        Binary::Add,
        binary(Binary::Mul, x, scale)?,
        shift,
    )?])
}

impl OnnxModel {
    pub(in crate::onnx) fn fold_batch_norm(&mut self) -> Result<Vec<String>, OnnxError> {
        let (mut folded, mut affine) = (0, 0);
        let mut at = 0;
        while at < self.steps.len() {
            if let Some(conv) = self.foldable(at) {
                self.fold_into(conv, at)?;
                // An activation fused after the BatchNorm now follows the convolution (which
                // had none: `foldable` takes only a plain output).
                let bn = &self.steps[at];
                let (relu, activation) = (bn.relu, bn.activation);
                let fused = bn.op_name.split_once('+').map(|(_, rest)| rest.to_string());
                let conv_step = &mut self.steps[conv];
                conv_step.relu = relu;
                conv_step.activation = activation;
                if let Some(fused) = fused {
                    conv_step.op_name.push('+');
                    conv_step.op_name.push_str(&fused);
                }
                self.remove_step(at);
                folded += 1;
                continue;
            }
            if self.make_affine(at)? {
                affine += 1;
            }
            at += 1;
        }
        Ok(vec![format!(
            "folded {folded} BatchNormalization into the Conv before it; {affine} other(s) \
             precomputed as x·scale + shift"
        )])
    }

    /// Replaces BatchNormalization step `at` (constant parameters) by its precomputed
    /// per-channel affine map. `true` when replaced.
    pub(in crate::onnx) fn make_affine(&mut self, at: usize) -> Result<bool, OnnxError> {
        let Some(Node::BatchNormalization(n)) = self.steps[at].op.node() else {
            return Ok(false);
        };
        let eps = crate::onnx::ops::batch_norm_epsilon(n);
        let params: Option<Vec<Vec<f32>>> = (1..5)
            .map(|i| {
                self.constant_f32s(self.steps[at].inputs.get(i).copied().flatten())
                    .map(|(v, _)| v)
            })
            .collect();
        let Some([scale, beta, mean, var]) = params.and_then(|p| <[Vec<f32>; 4]>::try_from(p).ok())
        else {
            return Ok(false);
        };
        let a: Vec<f32> = scale
            .iter()
            .zip(&var)
            .map(|(s, v)| (*s as f64 / (*v as f64 + eps).sqrt()) as f32)
            .collect();
        let b: Vec<f32> = (0..a.len()).map(|c| beta[c] - mean[c] * a[c]).collect();
        // `[1, C, 1, 1]`: broadcasts over NCHW images; lower ranks are lifted at run time.
        let dims = [1, a.len(), 1, 1];
        let (scale, shift) = (
            host_value(a, &dims, &self.device)?,
            host_value(b, &dims, &self.device)?,
        );
        let step = &mut self.steps[at];
        for s in step.inputs.drain(1..).flatten() {
            self.uses[s] = self.uses[s].saturating_sub(1);
        }
        step.op = StepOp::Affine { scale, shift };
        step.op_name = "Affine".into();
        Ok(true)
    }

    /// The convolution step that BatchNormalization step `at` can fold into.
    pub(in crate::onnx) fn foldable(&self, at: usize) -> Option<usize> {
        let step = &self.steps[at];
        let Some(Node::BatchNormalization(_)) = step.op.node() else {
            return None;
        };
        let x = (*step.inputs.first()?)?;
        let params_constant = step.inputs[1..]
            .iter()
            .take(4)
            .all(|s| s.is_some_and(|s| self.constants[s].is_some()));
        let conv = self.sole_producer(x)?;
        let conv_step = &self.steps[conv];
        let weight_constant = matches!(conv_step.op.node(), Some(Node::Conv2d(_)))
            && conv_step
                .inputs
                .get(1)
                .copied()
                .flatten()
                .is_some_and(|s| self.constants[s].is_some())
            && conv_step
                .inputs
                .get(2)
                .copied()
                .flatten()
                .is_none_or(|s| self.constants[s].is_some());
        // A convolution with a ReLU fused in no longer writes what the BatchNorm reads.
        (params_constant && weight_constant && conv_step.plain_output()).then_some(conv)
    }

    /// Folds BatchNormalization step `bn` into convolution step `conv`: `W' = W·s`,
    /// `b' = b·s + (beta − mean·s)` with `s = scale / √(var + ε)` per output channel
    /// ([`crate::infer::fold_into_outer_channels`], the graph pass's arithmetic).
    pub(in crate::onnx) fn fold_into(&mut self, conv: usize, bn: usize) -> Result<(), OnnxError> {
        let eps = match self.steps[bn].op.node() {
            Some(Node::BatchNormalization(n)) => crate::onnx::ops::batch_norm_epsilon(n),
            _ => return Err(OnnxError::Graph("fold: not a BatchNormalization".into())),
        };
        let param = |i: usize| {
            self.constant_f32s(self.steps[bn].inputs.get(i).copied().flatten())
                .map(|(v, _)| v)
                .ok_or_else(|| {
                    OnnxError::Graph("fold: a BatchNorm parameter is not constant".into())
                })
        };
        let (scale, beta, mean, var) = (param(1)?, param(2)?, param(3)?, param(4)?);
        let (mut weight, wdims) = self
            .constant_f32s(self.steps[conv].inputs[1])
            .ok_or_else(|| OnnxError::Graph("fold: the Conv weight is not constant".into()))?;
        let co = wdims[0];
        if [scale.len(), beta.len(), mean.len(), var.len()] != [co; 4] {
            return Err(OnnxError::Shape(format!(
                "fold: BatchNorm over {} channels after a Conv with {co}",
                scale.len()
            )));
        }
        let bias = self
            .constant_f32s(self.steps[conv].inputs.get(2).copied().flatten())
            .map(|(b, _)| b)
            .unwrap_or_else(|| vec![0.0; co]);
        // The graph pass's arithmetic (one fold for both inference roads).
        let new_bias = crate::infer::fold_into_outer_channels(
            &mut weight,
            Some(&bias),
            [&scale, &beta, &mean, &var],
            eps,
        );
        let w_slot = self.add_constant(weight, &wdims)?;
        let b_slot = self.add_constant(new_bias, &[co])?;
        self.rewire(conv, 1, w_slot);
        self.rewire(conv, 2, b_slot);
        // The convolution now writes what the BatchNorm wrote.
        let out = self.steps[bn].outputs[0];
        self.steps[conv].outputs[0] = out;
        Ok(())
    }
}
