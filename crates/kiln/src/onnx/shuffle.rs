//! ShuffleNet's channel shuffle as one step: the exported `Reshape` to `[n, g, c/g, h, w]`,
//! `Transpose` by `[0, 2, 1, 3, 4]` and `Reshape` back to `[n, c, h, w]`, fused at load.
//!
//! Why: the three operators have no channels-last meaning one at a time (a rank-5 value
//! leaves the host's images), so each shuffle converted the image to NCHW, ran three Burn
//! operators and converted back; as one step it is a per-pixel transpose of the channels
//! on the host ([`super::host`]), and the same three operators on values elsewhere.

use onnx_ir::Node;
use onnx_ir::node::reshape::ReshapeInput;

use super::ops::{Inputs, shape};
use super::value::Value;
use super::{OnnxError, OnnxModel, StepOp};

/// A reshape's target: fixed at load, or read at run time from an input of the fused step.
#[derive(Debug, Clone)]
pub(super) enum ShapeSpec {
    /// The ONNX shape spec (`0` copies, one `-1` inferred).
    Fixed(Vec<i64>),
    /// The step's input at this index holds the spec.
    Input(usize),
}

/// The fused shuffle: reshape by `into`, swap axes 1 and 2, reshape by `back`.
#[derive(Debug, Clone)]
pub(super) struct ChannelShuffle {
    /// The first reshape's target (`[n, g, c/g, h, w]` in a shuffle).
    pub into: ShapeSpec,
    /// The last reshape's target (`[n, c, h, w]` in a shuffle).
    pub back: ShapeSpec,
}

/// The transpose a channel shuffle exports: the group axis and the per-group channel axis
/// swapped.
pub(super) const SHUFFLE_PERM: [i64; 5] = [0, 2, 1, 3, 4];

impl ChannelShuffle {
    /// The three operators on values (any backend, any shapes they accept).
    pub(super) fn run(&self, ins: Inputs) -> Result<Vec<Value>, OnnxError> {
        let read = |spec: &ShapeSpec| match spec {
            ShapeSpec::Fixed(v) => Ok(v.clone()),
            ShapeSpec::Input(i) => ins
                .get(*i)
                .and_then(Option::as_ref)
                .ok_or_else(|| OnnxError::Graph(format!("channel shuffle: no shape input {i}")))?
                .to_i64s(),
        };
        let x = ins
            .first()
            .and_then(Option::clone)
            .ok_or_else(|| OnnxError::Graph("channel shuffle: no input".into()))?;
        let grouped = shape::reshape(x, &read(&self.into)?)?;
        let swapped = shape::transpose(grouped, &SHUFFLE_PERM)?;
        Ok(vec![shape::reshape(swapped, &read(&self.back)?)?])
    }
}

impl OnnxModel {
    /// Fuses each `Reshape → Transpose [0, 2, 1, 3, 4] → Reshape` chain whose inner values
    /// have no other reader into one [`ChannelShuffle`] step. Returns how many were fused.
    pub(super) fn fuse_channel_shuffles(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let Some((transpose, first)) = self.shuffle_chain(at) else {
                at += 1;
                continue;
            };
            let Some(Node::Reshape(inner)) = self.steps[first].op.node() else {
                unreachable!("shuffle_chain returns a Reshape");
            };
            let Some(Node::Reshape(outer)) = self.steps[at].op.node() else {
                unreachable!("shuffle_chain starts at a Reshape");
            };
            // The fused step reads x, then the first reshape's shape, then the last one's.
            let spec = |config: &ReshapeInput, index: usize| match config {
                ReshapeInput::Static(v) => (ShapeSpec::Fixed(v.clone()), None),
                ReshapeInput::Runtime(r) => (ShapeSpec::Input(index), Some(r.input_index)),
            };
            let (into, into_at) = spec(&inner.config.shape, 1);
            let (back, back_at) = spec(&outer.config.shape, 2);
            let input_of = |step: usize, i: Option<usize>| {
                i.and_then(|i| self.steps[step].inputs.get(i).copied().flatten())
            };
            let x = self.steps[first].inputs.first().copied().flatten();
            let new_inputs = vec![x, input_of(first, into_at), input_of(at, back_at)];
            // Read by the fused step before the two steps before it give their reads back.
            self.set_inputs(at, new_inputs);
            let step = &mut self.steps[at];
            step.op = StepOp::ChannelShuffle(ChannelShuffle { into, back });
            step.op_name = "ChannelShuffle".into();
            // Later steps first, so the earlier index stays valid.
            self.remove_step(transpose.max(first));
            self.remove_step(transpose.min(first));
            // The fused step moved two places back; go on after it.
            at -= 1;
            fused += 1;
        }
        fused
    }

    /// When step `at` is a Reshape of a shuffle's Transpose of a Reshape, each the sole
    /// reader of the one before: (the transpose's step, the first reshape's step).
    fn shuffle_chain(&self, at: usize) -> Option<(usize, usize)> {
        let step = &self.steps[at];
        if !matches!(step.op.node(), Some(Node::Reshape(_))) || !step.plain_output() {
            return None;
        }
        let transpose = self.sole_producer(step.inputs.first().copied().flatten()?)?;
        let t = &self.steps[transpose];
        match t.op.node() {
            Some(Node::Transpose(n)) if n.config.perm == SHUFFLE_PERM && t.plain_output() => {}
            _ => return None,
        }
        let first = self.sole_producer(t.inputs.first().copied().flatten()?)?;
        let f = &self.steps[first];
        let fits = matches!(f.op.node(), Some(Node::Reshape(_))) && f.plain_output();
        fits.then_some((transpose, first))
    }
}
