//! Shape arithmetic run once per input shape.
//!
//! PyTorch's exporter writes a dynamic-batch model's reshapes as small integer graphs
//! (`Shape → Gather → Unsqueeze → Concat → Reshape`): ShuffleNet v2 has about 300 such nodes
//! per run, each a few microseconds on Burn — 15% of its batch-1 time (`kiln profile
//! --onnx`). When every tensor's dimensions follow from the inputs' dimensions alone, those
//! nodes give the same values on every run with the same input shapes, so the first such run
//! records them and later runs skip the nodes.
//!
//! The model is *shape-static* when no operator's output dimensions depend on data: every
//! operand that sets dimensions (a Reshape's shape, a Slice's bounds, an Expand's shape,
//! ...) is itself a constant or shape arithmetic. Otherwise nothing is cached and every node
//! runs as before.

use std::sync::{Mutex, OnceLock};

use onnx_ir::Node;

use super::ops::{is_reduction, unsupported};
use super::value::Value;
use super::{OnnxModel, StepOp};

/// Which steps are shape arithmetic, and the reads left when they are skipped.
#[derive(Debug)]
pub(super) struct ShapePlan {
    /// Whether the cache may be used at all (the model is shape-static).
    enabled: bool,
    /// Per step: its outputs follow from the input shapes alone.
    pub(super) derived: Vec<bool>,
    /// Per slot: written by a derived step and read by a step that still runs (or a graph
    /// output): the values a cached run puts in place.
    pub(super) kept: Vec<bool>,
    /// Per slot: its readers when derived steps are skipped (graph outputs count one more).
    pub(super) uses: Vec<usize>,
}

/// The recorded values, for one set of input shapes (the last one seen).
#[derive(Debug, Default)]
pub(super) struct ShapeCache {
    plan: OnceLock<ShapePlan>,
    entry: Mutex<Option<Entry>>,
}

#[derive(Debug)]
struct Entry {
    dims: Vec<Vec<usize>>,
    values: Vec<(usize, Value)>,
}

impl ShapeCache {
    /// Forgets the plan and the values (the steps changed).
    pub(super) fn reset(&mut self) {
        *self = Self::default();
    }

    /// The values recorded for inputs of these dimensions, when there are some.
    pub(super) fn lookup(&self, dims: &[Vec<usize>]) -> Option<Vec<(usize, Value)>> {
        let entry = self.entry.lock().ok()?;
        entry
            .as_ref()
            .filter(|e| e.dims == dims)
            .map(|e| e.values.clone())
    }

    /// Records the kept values of a run with inputs of these dimensions.
    pub(super) fn store(&self, dims: Vec<Vec<usize>>, values: Vec<(usize, Value)>) {
        if let Ok(mut entry) = self.entry.lock() {
            *entry = Some(Entry { dims, values });
        }
    }
}

impl OnnxModel {
    /// The model's shape plan (made on first use); `None` when it is not shape-static.
    pub(super) fn shape_plan(&self) -> Option<&ShapePlan> {
        let plan = self.shape_cache.plan.get_or_init(|| self.make_shape_plan());
        plan.enabled.then_some(plan)
    }

    fn make_shape_plan(&self) -> ShapePlan {
        let slots = self.uses.len();
        let mut from_shapes: Vec<bool> = self.constants.iter().map(Option::is_some).collect();
        let mut derived = vec![false; self.steps.len()];
        let mut enabled = true;
        for (i, step) in self.steps.iter().enumerate() {
            let known = |s: &Option<usize>| s.is_none_or(|s| from_shapes[s]);
            let role = match &step.op {
                StepOp::Onnx(node) => shape_role(node),
                // Its two reshapes' targets are inputs 1 and 2.
                StepOp::ChannelShuffle(_) => Role::SetsDims { from: 1 },
                _ => Role::Other,
            };
            match role {
                Role::DataDependent => enabled = false,
                Role::SetsDims { from } => {
                    enabled &= step.inputs.iter().skip(from).all(known);
                }
                Role::Other => {}
            }
            let Some(node) = step.op.node() else {
                continue;
            };
            derived[i] = match node {
                Node::Shape(_) | Node::Size(_) => true,
                _ => arithmetic(node) && step.plain_output() && step.inputs.iter().all(known),
            };
            if derived[i] {
                for &o in &step.outputs {
                    from_shapes[o] = true;
                }
            }
        }
        let mut uses = vec![0; slots];
        let mut kept = vec![false; slots];
        // Constants are in place on every run; the rest of `from_shapes` derived steps wrote.
        let written_by_derived = |s: usize| from_shapes[s] && self.constants[s].is_none();
        for (step, &d) in self.steps.iter().zip(&derived) {
            if d {
                continue;
            }
            for &s in step.inputs.iter().flatten() {
                uses[s] += 1;
                kept[s] |= written_by_derived(s);
            }
        }
        for &s in &self.output_slots {
            uses[s] += 1;
            kept[s] |= written_by_derived(s);
        }
        ShapePlan {
            enabled,
            derived,
            kept,
            uses,
        }
    }
}

/// How an operator's output dimensions depend on its operands' values.
enum Role {
    /// On data (NonZero; and any operator Kiln cannot run, which a model is refused for at
    /// load, so that adding one cannot silently make the cache wrong).
    DataDependent,
    /// On the values of the operands from this index on (a Reshape's shape, a Slice's
    /// bounds, a Range's limits).
    SetsDims { from: usize },
    /// On operand dimensions only.
    Other,
}

fn shape_role(node: &Node) -> Role {
    match node {
        Node::ConstantOfShape(_) | Node::Range(_) => Role::SetsDims { from: 0 },
        Node::Reshape(_)
        | Node::Slice(_)
        | Node::Expand(_)
        | Node::Pad(_)
        | Node::Resize(_)
        | Node::Split(_)
        | Node::Squeeze(_)
        | Node::Unsqueeze(_)
        | Node::TopK(_)
        | Node::OneHot(_)
        | Node::Tile(_) => Role::SetsDims { from: 1 },
        Node::NonZero(_) => Role::DataDependent,
        _ if is_reduction(node) => Role::SetsDims { from: 1 },
        _ if unsupported(node).is_some() => Role::DataDependent,
        _ => Role::Other,
    }
}

/// Deterministic operators that shape arithmetic is made of (recorded when every operand
/// is a constant or itself shape arithmetic).
fn arithmetic(node: &Node) -> bool {
    matches!(
        node,
        Node::Constant(_)
            | Node::Identity(_)
            | Node::Gather(_)
            | Node::Unsqueeze(_)
            | Node::Squeeze(_)
            | Node::Concat(_)
            | Node::Cast(_)
            | Node::Add(_)
            | Node::Sub(_)
            | Node::Mul(_)
            | Node::Div(_)
            | Node::Neg(_)
            | Node::Sqrt(_)
            | Node::Floor(_)
            | Node::Ceil(_)
            | Node::Min(_)
            | Node::Max(_)
            | Node::Equal(_)
            | Node::Where(_)
            | Node::Slice(_)
            | Node::Reshape(_)
            | Node::ConstantOfShape(_)
            | Node::Range(_)
            | Node::Expand(_)
            | Node::ReduceProd(_)
            // Index arithmetic and comparisons the exporters write around reshapes (an
            // attention's head split through `Mod`, `F.pad`'s pads through a `Transpose`).
            | Node::Mod(_)
            | Node::Abs(_)
            | Node::Pow(_)
            | Node::Sign(_)
            | Node::Greater(_)
            | Node::GreaterOrEqual(_)
            | Node::Less(_)
            | Node::LessOrEqual(_)
            | Node::And(_)
            | Node::Or(_)
            | Node::Xor(_)
            | Node::Not(_)
            | Node::Transpose(_)
            | Node::Flatten(_)
            | Node::Tile(_)
            | Node::Split(_)
            // A causal mask built from constants (`Trilu` of a `ConstantOfShape`).
            | Node::Trilu(_)
            | Node::CumSum(_)
    )
}
