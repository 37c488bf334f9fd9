//! The exact GELU as one step: PyTorch (opset < 20) exports `gelu(x)` as five nodes,
//! `Div(x, √2) → Erf → Add(·, 1) → Mul(x, ·) → Mul(·, 0.5)` (the dynamo exporter takes the
//! product by 0.5 first, older Hugging Face code `x · 0.5`), fused at load into one
//! [`Activation::Gelu`](kiln_kernels::activation::Activation::Gelu) step.
//!
//! Why: the five nodes are four passes over the MLP's widest tensor and three temporaries
//! (ConvNeXt-tiny at batch 1: Erf, Div, Mul and Add took 19% of the run, BENCHMARKS.md run
//! 41); as one step the activation then fuses into the linear layer before it and runs in its
//! store, while the tile is in L1.

use onnx_ir::Node;

use super::{OnnxModel, StepOp};
use kiln_kernels::activation::Activation;

/// A GELU chain found in the steps: its input, the step that computes its output (the
/// chain's last `Mul`), and the other four steps.
struct GeluChain {
    x: usize,
    last: usize,
    inner: [usize; 4],
}

/// The element-wise operators the chain is made of.
#[derive(Clone, Copy, PartialEq)]
enum Op {
    Div,
    Mul,
    Add,
}

impl OnnxModel {
    /// Fuses each exported GELU chain whose intermediate values have no other reader into
    /// one step. Returns how many were fused.
    pub(super) fn fuse_gelus(&mut self) -> usize {
        let mut fused = 0;
        let mut at = 0;
        while at < self.steps.len() {
            let Some(chain) = self.gelu_chain(at) else {
                at += 1;
                continue;
            };
            // The last step reads x alone.
            self.set_inputs(chain.last, vec![Some(chain.x)]);
            let step = &mut self.steps[chain.last];
            step.op = StepOp::Activation(Activation::Gelu);
            step.op_name = "Gelu".into();
            let mut inner = chain.inner;
            inner.sort_unstable();
            // Later steps first, so the earlier indices stay valid.
            for &s in inner.iter().rev() {
                self.remove_step(s);
            }
            // Every step before the chain's first was looked at already.
            at = inner[0];
            fused += 1;
        }
        fused
    }

    /// The GELU chain around step `at` when it is the chain's `Erf`.
    fn gelu_chain(&self, at: usize) -> Option<GeluChain> {
        let erf = &self.steps[at];
        if !matches!(erf.op.node(), Some(Node::Erf(_))) || !erf.plain_single() {
            return None;
        }
        // x / √2, or x · (1/√2).
        let scale = self.sole_producer(erf.inputs.first().copied().flatten()?)?;
        let x = self
            .with_constant(scale, Op::Div, std::f32::consts::SQRT_2)
            .or_else(|| self.with_constant(scale, Op::Mul, std::f32::consts::FRAC_1_SQRT_2))?;
        // 1 + erf.
        let erf_out = erf.outputs[0];
        let add = self.sole_reader(erf_out)?;
        if self.with_constant(add, Op::Add, 1.0)? != erf_out {
            return None;
        }
        let shifted = self.steps[add].outputs[0];
        // Then the products by x and by ½, in any order.
        let product = self.sole_reader(shifted)?;
        let other = self.other_operand(product, shifted)?;
        let product_out = self.steps[product].outputs[0];
        let (last, half_of) = if other == x {
            // (x · (1 + erf)) · ½
            let last = self.sole_reader(product_out)?;
            (last, self.with_constant(last, Op::Mul, 0.5)? == product_out)
        } else if self.with_constant(product, Op::Mul, 0.5) == Some(shifted) {
            // x · (½ · (1 + erf)), as the dynamo exporter writes it
            let last = self.sole_reader(product_out)?;
            (last, self.other_operand(last, product_out)? == x)
        } else {
            // (x · ½) · (1 + erf)
            let half = self.sole_producer(other)?;
            let fits = self.with_constant(half, Op::Mul, 0.5)? == x;
            return fits.then_some(GeluChain {
                x,
                last: product,
                inner: [scale, at, add, half],
            });
        };
        half_of.then_some(GeluChain {
            x,
            last,
            inner: [scale, at, add, product],
        })
    }

    /// The step that reads `slot`, when it is its only reader and `slot` is no graph output.
    fn sole_reader(&self, slot: usize) -> Option<usize> {
        if self.uses[slot] != 1 || self.output_slots.contains(&slot) {
            return None;
        }
        self.steps
            .iter()
            .position(|s| s.inputs.contains(&Some(slot)))
    }

    /// When step `at` is a two-operand `Mul` with `known` as one operand: the other operand.
    fn other_operand(&self, at: usize, known: usize) -> Option<usize> {
        if !self.steps[at].plain_single() || !is(self.steps[at].op.node()?, Op::Mul) {
            return None;
        }
        match self.steps[at].inputs[..] {
            [Some(a), Some(b)] if a == known => Some(b),
            [Some(a), Some(b)] if b == known => Some(a),
            _ => None,
        }
    }

    /// When step `at` is the two-operand `op` of a value and a one-value constant equal to
    /// `value` (to 1e-6 relative; the divisor for a division) of rank 0 or 1, so the
    /// broadcast leaves the value's shape as it is: the value's slot.
    fn with_constant(&self, at: usize, op: Op, value: f32) -> Option<usize> {
        if !self.steps[at].plain_single() || !is(self.steps[at].op.node()?, op) {
            return None;
        }
        let [Some(a), Some(b)] = self.steps[at].inputs[..] else {
            return None;
        };
        let equals = |slot: usize| {
            self.constant_f32s(Some(slot)).is_some_and(|(v, dims)| {
                v.len() == 1 && dims.len() <= 1 && (v[0] - value).abs() <= 1e-6 * value.abs()
            })
        };
        if equals(b) && self.constants[a].is_none() {
            Some(a)
        } else if op != Op::Div && equals(a) && self.constants[b].is_none() {
            Some(b)
        } else {
            None
        }
    }
}

/// `node` is the element-wise `op`.
fn is(node: &Node, op: Op) -> bool {
    matches!(
        (node, op),
        (Node::Div(_), Op::Div) | (Node::Mul(_), Op::Mul) | (Node::Add(_), Op::Add)
    )
}
