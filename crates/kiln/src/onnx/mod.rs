//! ONNX models from any exporter, run on Burn tensors.
//!
//! ```text
//! model.onnx ──onnx-ir──▶ typed nodes ──load──▶ OnnxModel (steps over slots, constants
//!                         (parse, types,          uploaded once) ──run──▶ outputs
//!                          shapes, folding)
//! ```
//!
//! Parsing, type and shape inference, constant folding and operator normalization are
//! Burn's own [`onnx_ir`] crate (the front end of Burn's ONNX importer): one well-kept parser
//! rather than a hand-grown one. Kiln executes the typed graph it returns at run time on any
//! device Kiln builds (`flex`, `cuda`), with values of run-time rank ([`Value`]), and routes
//! convolutions, linear layers and plain max pooling through [`crate::kernels`].
//!
//! A model with operators Kiln cannot run is refused at load with one error that lists every
//! such operator and how often it occurs.

mod attention;
mod ceil_pool;
mod concat_convs;
mod declare;
mod expand_depthwise;
mod gelu;
mod host;
mod load;
mod lower_quant;
mod ops;
mod passes;
mod shape_cache;
mod shuffle;
mod value;

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use burn::tensor::{Device, TensorData};
use onnx_ir::Node;

use host::Slot;
use kiln_kernels::activation::Activation;
pub use passes::{OnnxPass, OnnxPassReport};
pub use value::{Value, ValueKind};

/// What went wrong loading or running an ONNX model.
#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    /// The bytes are not a model onnx-ir can read.
    #[error("not a readable ONNX model: {0}")]
    Parse(String),
    /// Operators Kiln cannot run, each with its count.
    #[error("{}", unsupported_message(.0))]
    UnsupportedOps(Vec<(String, usize)>),
    /// A feature of an operator Kiln does not support.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The graph is inconsistent (a missing input, a value nothing produces).
    #[error("malformed graph: {0}")]
    Graph(String),
    /// Shapes that do not fit together at run time.
    #[error("shape error: {0}")]
    Shape(String),
    /// A tensor of a rank Kiln's runtime does not hold.
    #[error("rank {0} tensors are not supported (1 to 8 dimensions)")]
    Rank(usize),
    /// Inputs that do not match the model's.
    #[error("bad input: {0}")]
    Input(String),
}

impl From<OnnxError> for crate::error::KilnError {
    fn from(e: OnnxError) -> Self {
        crate::error::KilnError::Onnx(Box::new(e))
    }
}

fn unsupported_message(ops: &[(String, usize)]) -> String {
    let list: Vec<String> = ops.iter().map(|(op, n)| format!("{op} ×{n}")).collect();
    format!(
        "the model uses {} operator kind(s) Kiln cannot run: {}; re-export without them \
         (e.g. a lower opset or a plainer layer) or open an issue naming them",
        ops.len(),
        list.join(", ")
    )
}

/// One declared input or output of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Port {
    /// The name in the ONNX file.
    pub name: String,
    /// Element kind.
    pub kind: ValueKind,
    /// ONNX element type name (`"float32"`, `"int64"`, ...).
    pub dtype: String,
    /// Dimensions; `None` where dynamic (a batch or sequence axis).
    pub dims: Vec<Option<usize>>,
    /// The axis that holds the batch: the one named like the first input's first named
    /// dynamic axis (`batch` in a sequence-first RNN's `[seq, batch, features]` and its
    /// initial state's `[layers, batch, hidden]`); the first axis in a model without named
    /// axes. `None` for an output, and for an input without the batch.
    pub batch_axis: Option<usize>,
}

/// What a step computes: an onnx-ir node, or a node a pass rewrote into a Kiln kernel.
#[derive(Debug)]
// A model holds one StepOp per node, built once at load: their sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum StepOp {
    /// Boxed: onnx-ir's node enum is several times the size of the other variants.
    Onnx(Box<Node>),
    /// An int8 linear layer (`[.., k] → [.., n]`, Kiln's integer GEMM).
    QLinear(passes::QLinear),
    /// An int8 convolution (implicit GEMM over NCHW input).
    QConv(passes::QConv),
    /// Inference BatchNorm reduced to `x · scale + shift` (constants shaped `[1, C, 1, ..]`).
    Affine { scale: Value, shift: Value },
    /// An activation fused at load from the exported nodes that compute it: SiLU (a
    /// `Sigmoid` and the `Mul` by its input), GELU (`Div`, `Erf`, `Add`, `Mul`, `Mul`).
    Activation(Activation),
    /// ShuffleNet's channel shuffle (reshape, transpose, reshape), fused at load.
    ChannelShuffle(shuffle::ChannelShuffle),
    /// An attention's `Softmax(Add(Div(scores, d), mask))`, fused at load.
    ScaledSoftmax(attention::ScaledSoftmax),
    /// A 1×1 convolution and the depthwise convolution that alone reads its output, fused at
    /// load (`fuse_expand_depthwises`): the two steps as they were, the step's inputs the
    /// first's followed by the second's after its first.
    ExpandDepthwise(Box<[Step; 2]>),
    /// A channel Concat of convolutions' outputs with those convolutions, fused at load
    /// (`fuse_concat_convs`): the step's inputs are the convolutions' in turn.
    ConcatConvs(Box<concat_convs::ConcatConvs>),
    /// A QuantizeLinear → DequantizeLinear pair of one per-tensor grid, fused at load
    /// (`passes/static_int8.rs`): f32 in, f32 out.
    QuantizeDequantize(ops::quant::QuantizeDequantize),
}

impl Step {
    /// Nothing was fused after the operator (ReLU, Clip, residual): its output is the
    /// operator's own, so another fusion may still act on it.
    fn plain_output(&self) -> bool {
        !self.relu && self.activation.is_none() && self.residual.is_none() && !self.pool
    }

    /// One output, and nothing fused after the operator: what a fusion folds into this step,
    /// or folds this step into.
    fn plain_single(&self) -> bool {
        self.plain_output() && self.outputs.len() == 1
    }

    /// The activation this step computes, when it is one a convolution can take in its
    /// store (a Clip only with constant bounds).
    fn activation_op(&self) -> Option<Activation> {
        match &self.op {
            StepOp::Activation(act) => Some(*act),
            StepOp::Onnx(node) => ops::activation_of(node),
            _ => None,
        }
    }

    /// The layers the step runs: those a fused step keeps, or the step itself.
    fn layers(&self) -> Vec<&Step> {
        match &self.op {
            StepOp::ExpandDepthwise(pair) => pair.iter().collect(),
            StepOp::ConcatConvs(fused) => fused.layers.iter().collect(),
            _ => vec![self],
        }
    }

    /// A step fused at load from others, made by the returned function from its operator
    /// (which may take `last` in): over `inputs`, writing what `last` (the step it replaces
    /// last in the graph) wrote, under its name; nothing fused after it.
    fn fused(
        op_name: String,
        inputs: Vec<Option<usize>>,
        last: &Step,
    ) -> impl FnOnce(StepOp) -> Step + use<> {
        let name = last.name.clone();
        let (outputs, scalar, kind) =
            (last.outputs.clone(), last.scalar.clone(), last.kind.clone());
        move |op| Step::plain(op, (name, op_name), inputs, (outputs, scalar, kind))
    }

    /// A step of `op` with nothing fused after it: its name and operator's name, the slots
    /// it reads, and per output its slot, whether it is an ONNX scalar and its declared kind.
    fn plain(
        op: StepOp,
        (name, op_name): (String, String),
        inputs: Vec<Option<usize>>,
        (outputs, scalar, kind): (Vec<usize>, Vec<bool>, Vec<Option<ValueKind>>),
    ) -> Step {
        Step {
            name,
            op_name,
            inputs,
            outputs,
            scalar,
            kind,
            packed: Default::default(),
            relu: false,
            activation: None,
            residual: None,
            pool: false,
            winograd: true,
            op,
        }
    }

    /// The activation fused after the operator: the ReLU or the other one (a fusion takes
    /// only a plain output, so the two never stack).
    fn fused_activation(&self) -> Option<Activation> {
        self.activation.or(self.relu.then_some(Activation::Relu))
    }
}

impl StepOp {
    /// The onnx-ir node, when the step still runs one.
    fn node(&self) -> Option<&Node> {
        match self {
            StepOp::Onnx(node) => Some(node),
            _ => None,
        }
    }
}

/// One node ready to run: where its inputs are and where its outputs go.
#[derive(Debug)]
struct Step {
    op: StepOp,
    /// The node's name and operator, for messages.
    name: String,
    op_name: String,
    inputs: Vec<Option<usize>>,
    outputs: Vec<usize>,
    /// Per output: whether onnx-ir declares it an ONNX scalar, and its kind when declared.
    scalar: Vec<bool>,
    kind: Vec<Option<ValueKind>>,
    /// A convolution's weights packed for the host kernels on its first host run.
    packed: host::PackCache,
    /// A ReLU fused into this step (a Conv or an Add) at load: the output is `max(0, ·)`.
    relu: bool,
    /// Another activation fused into this convolution at load: a Clip with constant bounds
    /// (ReLU6), SiLU, HardSwish, Sigmoid or HardSigmoid.
    activation: Option<Activation>,
    /// A residual Add fused into this convolution at load: the input (by index) added to its
    /// output, before the ReLU.
    residual: Option<usize>,
    /// A 2×2, stride-2 max pool fused after this convolution's ReLU at load.
    pool: bool,
    /// Whether this convolution may run as Winograd where the kernels' rule takes it (false:
    /// the Winograd pass kept it on the implicit GEMM, measured faster there).
    winograd: bool,
}

/// An imported ONNX model on a device.
#[derive(Debug)]
pub struct OnnxModel {
    name: String,
    inputs: Vec<Port>,
    outputs: Vec<Port>,
    input_slots: Vec<usize>,
    output_slots: Vec<usize>,
    /// Constants (weights, folded values), already on the device; `None` for computed slots.
    constants: Vec<Option<Value>>,
    steps: Vec<Step>,
    /// Readers of each slot (graph outputs count one more, so they are never taken).
    uses: Vec<usize>,
    device: Device,
    /// Whether runs use Kiln's kernels (`device.kiln_kernels`), on whatever thread they run.
    kiln_kernels: bool,
    /// Shape arithmetic recorded for the last input shapes ([`shape_cache`]).
    shape_cache: shape_cache::ShapeCache,
    /// Where runs execute (on the pool or the calling thread).
    placement: kiln_kernels::base::spin::RunPlacement,
}

impl OnnxModel {
    /// Loads the model in `path`.
    pub fn load(path: &Path, device: &Device) -> Result<Self, OnnxError> {
        let bytes = std::fs::read(path)
            .map_err(|e| OnnxError::Parse(format!("reading {}: {e}", path.display())))?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        Self::from_bytes(&bytes, &name, device)
    }

    /// Loads a model from the bytes of an ONNX file.
    pub fn from_bytes(bytes: &[u8], name: &str, device: &Device) -> Result<Self, OnnxError> {
        load::load(bytes, name, device)
    }

    /// The model's name (the file's stem).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Declared inputs, in order.
    pub fn inputs(&self) -> &[Port] {
        &self.inputs
    }

    /// Declared outputs, in order.
    pub fn outputs(&self) -> &[Port] {
        &self.outputs
    }

    /// The device it runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The model with Kiln's kernels switched on or off for its runs (on by default; the
    /// plan's `device.kiln_kernels`).
    pub fn with_kiln_kernels(mut self, enabled: bool) -> Self {
        self.kiln_kernels = enabled;
        self
    }

    /// Whether the model's runs use Kiln's kernels.
    pub fn kiln_kernels(&self) -> bool {
        self.kiln_kernels
    }

    /// How many nodes of each operator run (after onnx-ir's simplification and the passes).
    pub fn op_counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for step in &self.steps {
            *counts.entry(step.op_name.clone()).or_default() += 1;
        }
        counts
    }

    /// Layers whose weights have been packed for Kiln's host kernels (convolutions, linear
    /// layers and BatchNorms that ran channels-last on the CPU; packing happens on a layer's
    /// first run with Kiln's kernels on).
    pub fn packed_layers(&self) -> usize {
        self.steps
            .iter()
            .flat_map(Step::layers)
            .filter(|s| s.packed.get().is_some_and(Option::is_some))
            .count()
    }

    /// Steps of shape arithmetic (`Shape → Gather → Concat → ...`) that a run skips when the
    /// previous run had inputs of the same shapes: their values are recorded once. 0 when
    /// the model's shapes depend on data, which disables the record.
    pub fn cached_shape_steps(&self) -> usize {
        self.shape_plan()
            .map_or(0, |p| p.derived.iter().filter(|&&d| d).count())
    }

    /// Number of nodes that run.
    pub fn node_count(&self) -> usize {
        self.steps.len()
    }

    /// Runs the model on host inputs, in the order of [`OnnxModel::inputs`], and returns the
    /// outputs on the host.
    pub fn run_data(&self, inputs: Vec<TensorData>) -> Result<Vec<TensorData>, OnnxError> {
        let values = inputs
            .into_iter()
            .map(|d| Value::from_data(d, &self.device))
            .collect::<Result<Vec<_>, _>>()?;
        self.run(values)?.iter().map(Value::data).collect()
    }

    /// Runs the model on device values, in the order of [`OnnxModel::inputs`]. Inputs are
    /// checked against the declared kinds and static dimensions first; a failure inside an
    /// operator is an error naming the node, never a panic.
    pub fn run(&self, inputs: Vec<Value>) -> Result<Vec<Value>, OnnxError> {
        self.check_inputs(&inputs)?;
        // A small graph at a small batch hops onto the pool only if its work splits
        // (`RunPlacement`): W3 exported from PyTorch has 8 nodes, and its conv2 and fc1 each
        // paid a wake-up of an idle worker when run from the calling thread.
        let batch = inputs.first().and_then(|v| v.dims().first().copied());
        self.placement
            .run(self.steps.len(), batch, || self.run_here(inputs))
    }

    /// Per step, its node name and the median wall time of running it, in ms, over
    /// `repeats` runs of `inputs` after one warm-up run, on the thread a run would use: what
    /// `kiln optimize --onnx` compares layer by layer to keep int8 only where it is faster.
    /// A step the shape cache skips counts 0. CPU only (on an asynchronous device a step's
    /// time is the time to queue it).
    pub fn step_times(
        &self,
        inputs: &[Value],
        repeats: usize,
    ) -> Result<Vec<(String, f64)>, OnnxError> {
        self.check_inputs(inputs)?;
        let batch = inputs.first().and_then(|v| v.dims().first().copied());
        let mut samples = vec![Vec::with_capacity(repeats); self.steps.len()];
        self.placement.run(self.steps.len(), batch, || {
            for round in 0..=repeats.max(1) {
                let mut clock = Vec::with_capacity(self.steps.len());
                for out in self.run_timed(inputs.to_vec(), Some(&mut clock))? {
                    out.data()?;
                }
                if round > 0 {
                    for (s, t) in samples.iter_mut().zip(clock) {
                        s.push(t);
                    }
                }
            }
            Ok::<(), OnnxError>(())
        })?;
        Ok(self
            .steps
            .iter()
            .zip(samples)
            .map(|(step, v)| (step.name.clone(), crate::observe::timing::median(v)))
            .collect())
    }

    /// The names of the steps that run on the int8 kernels (after [`OnnxPass::Int8`]).
    pub fn int8_layers(&self) -> Vec<String> {
        self.steps
            .iter()
            .filter(|s| matches!(s.op, StepOp::QLinear(_) | StepOp::QConv(_)))
            .map(|s| s.name.clone())
            .collect()
    }

    /// The names of the convolutions whose runs so far went through Winograd F(2×2, 3×3)
    /// (what [`OnnxPass::Winograd`] can turn off), fused ones included.
    pub fn winograd_layers(&self) -> Vec<String> {
        let ran = |step: &Step| {
            matches!(
                step.packed.get(),
                Some(Some(host::Packed::Conv(host::PackedConv::Dense(w)))) if w.ran_winograd()
            )
        };
        let mut names = Vec::new();
        for step in &self.steps {
            match &step.op {
                StepOp::ConcatConvs(c) => {
                    names.extend(c.layers.iter().filter(|l| ran(l)).map(|l| l.name.clone()))
                }
                _ if ran(step) => names.push(step.name.clone()),
                _ => {}
            }
        }
        names
    }

    fn run_here(&self, inputs: Vec<Value>) -> Result<Vec<Value>, OnnxError> {
        self.run_timed(inputs, None)
    }

    /// The run, pushing each step's wall time (ms) onto `clock` when given.
    fn run_timed(
        &self,
        inputs: Vec<Value>,
        mut clock: Option<&mut Vec<f64>>,
    ) -> Result<Vec<Value>, OnnxError> {
        // Entered here, on the thread that runs the ops (the run may have hopped to the pool).
        let _kernels = crate::kernels::Scope::enter(self.kiln_kernels);
        // Image layers run channels-last on the host where Kiln's CPU kernels serve.
        let on_host = crate::kernels::serves(&self.device);
        let mut slots: Vec<Option<Slot>> = self
            .constants
            .iter()
            .map(|c| c.clone().map(Slot::Value))
            .collect();
        // Shape arithmetic recorded by an earlier run with inputs of these shapes is put in
        // place, and its steps skipped; a first run with new shapes records it.
        let plan = self.shape_plan();
        let dims: Vec<Vec<usize>> = inputs.iter().map(Value::onnx_dims).collect();
        let cached = plan.and_then(|_| self.shape_cache.lookup(&dims));
        let mut record = (plan.is_some() && cached.is_none()).then(Vec::new);
        let mut remaining = match (plan, &cached) {
            (Some(plan), Some(values)) => {
                for (slot, value) in values {
                    slots[*slot] = Some(Slot::Value(value.clone()));
                }
                plan.uses.clone()
            }
            _ => self.uses.clone(),
        };
        for (&slot, value) in self.input_slots.iter().zip(inputs) {
            slots[slot] = Some(Slot::Value(value));
        }
        for (at, step) in self.steps.iter().enumerate() {
            let derived = plan.is_some_and(|p| p.derived[at]);
            if derived && cached.is_some() {
                if let Some(clock) = clock.as_mut() {
                    clock.push(0.0);
                }
                continue;
            }
            let started = clock.as_ref().map(|_| std::time::Instant::now());
            // A value's last reader takes it, so its buffer may be reused in place.
            let mut ins: Vec<Option<Slot>> = step
                .inputs
                .iter()
                .map(|s| {
                    s.and_then(|s| {
                        remaining[s] = remaining[s].saturating_sub(1);
                        if remaining[s] == 0 && self.constants[s].is_none() {
                            slots[s].take()
                        } else {
                            slots[s].clone()
                        }
                    })
                })
                .collect();
            // One span per node (TRACE: free unless a profiler listens), grouped by operator
            // in the profile's table.
            let _node =
                tracing::trace_span!("onnx.node", op = %step.op_name, node = %step.name).entered();
            let outs = catch_unwind(AssertUnwindSafe(|| self.run_step(step, &mut ins, on_host)))
                .unwrap_or_else(|panic| {
                    Err(OnnxError::Shape(format!(
                        "the operator panicked: {}",
                        panic_text(&panic)
                    )))
                })
                .map_err(|e| {
                    OnnxError::Shape(format!("node `{}` ({}): {e}", step.name, step.op_name))
                })?;
            if let (Some(clock), Some(t)) = (clock.as_mut(), started) {
                clock.push(t.elapsed().as_secs_f64() * 1e3);
            }
            if outs.len() < step.outputs.len() {
                return Err(OnnxError::Unsupported(format!(
                    "node `{}` ({}) has {} outputs; Kiln computes {}",
                    step.name,
                    step.op_name,
                    step.outputs.len(),
                    outs.len()
                )));
            }
            for (i, (out, &slot)) in outs.into_iter().zip(&step.outputs).enumerate() {
                let out = match out {
                    Slot::Value(value) => {
                        let value = match step.kind[i] {
                            Some(kind) if kind != value.kind() => value.to_kind(kind)?,
                            _ => value,
                        };
                        Slot::Value(value.with_scalar(step.scalar[i]))
                    }
                    image => image,
                };
                if let (Some(recorded), Some(plan)) = (record.as_mut().filter(|_| derived), plan)
                    && plan.kept[slot]
                {
                    match &out {
                        Slot::Value(v) => recorded.push((slot, v.clone())),
                        // Not a value after all: this run records nothing.
                        _ => record = None,
                    }
                }
                slots[slot] = Some(out);
            }
        }
        if let Some(values) = record {
            self.shape_cache.store(dims, values);
        }
        self.output_slots
            .iter()
            .map(|&s| {
                slots[s]
                    .clone()
                    .ok_or_else(|| OnnxError::Graph(format!("output slot {s} was never written")))?
                    .into_value(&self.device)
            })
            .collect()
    }

    /// The step on the host's image kernels, when they take it (`None`: the inputs are
    /// untouched and the step runs on values).
    fn run_on_host(
        &self,
        step: &Step,
        ins: &mut [Option<Slot>],
    ) -> Option<Result<Vec<Slot>, OnnxError>> {
        // Asked only while packing (a step's first run), so not collected per run.
        let is_constant = |i: usize| self.input_is_constant(step, i);
        match &step.op {
            StepOp::Onnx(_) => host::run(&self.host_step(step, &is_constant)?, ins),
            StepOp::Affine { scale, shift } => {
                // Read back from the device once, on the step's first host run.
                let packed = step.packed.get_or_init(|| {
                    let (scale, shift) = (scale.to_f32s().ok()?, shift.to_f32s().ok()?);
                    Some(host::Packed::Affine { scale, shift })
                });
                let Some(host::Packed::Affine { scale, shift }) = packed else {
                    return None;
                };
                host::affine(ins, scale, shift, step.fused_activation())
            }
            StepOp::QConv(q) => {
                let outs = host::int8_conv(
                    q,
                    ins,
                    (step.residual, step.fused_activation()),
                    &self.device,
                )?;
                Some(if step.pool {
                    outs.and_then(host::max_pool_2x2)
                } else {
                    outs
                })
            }
            StepOp::Activation(act) => host::unary(ins, *act),
            StepOp::QuantizeDequantize(fq) => host::quantize_dequantize(ins, fq),
            StepOp::ChannelShuffle(shuffle) => host::channel_shuffle(shuffle, ins),
            StepOp::QLinear(q) => host::int8_linear(
                q,
                ins,
                (step.residual, step.fused_activation()),
                &self.device,
            ),
            StepOp::ScaledSoftmax(_) => None,
            StepOp::ExpandDepthwise(pair) => {
                let [pw, dw] = &**pair;
                let split = pw.inputs.len();
                // Each layer's inputs as it numbers them, found in the fused step's list.
                let pw_constant = |i: usize| i < split && is_constant(i);
                let dw_constant = |i: usize| i > 0 && is_constant(split + i - 1);
                let (pw, dw) = (
                    self.host_step(pw, &pw_constant)?,
                    self.host_step(dw, &dw_constant)?,
                );
                host::expand_depthwise(&pw, &dw, ins, split)
            }
            StepOp::ConcatConvs(fused) => {
                let is_constant = &is_constant;
                let mut first = 0;
                // Each convolution's inputs as it numbers them: `count` of the step's, from
                // `first`.
                let constants: Vec<_> = fused
                    .layers
                    .iter()
                    .map(|layer| {
                        let (at, count) = (first, layer.inputs.len());
                        first += count;
                        move |i: usize| i < count && is_constant(at + i)
                    })
                    .collect();
                let layers = fused
                    .layers
                    .iter()
                    .zip(&constants)
                    .map(|(layer, constant)| self.host_step(layer, constant))
                    .collect::<Option<Vec<_>>>()?;
                let counts: Vec<usize> = fused.layers.iter().map(|l| l.inputs.len()).collect();
                host::concat_convs(&layers, &counts, ins)
            }
        }
    }

    /// Whether `step`'s input `i` is a model constant (a weight).
    fn input_is_constant(&self, step: &Step, i: usize) -> bool {
        step.inputs
            .get(i)
            .copied()
            .flatten()
            .is_some_and(|s| self.constants[s].is_some())
    }

    /// Whether a layer step's weight (input 1) is a constant and its bias (input 2) absent
    /// or a constant: what the host packs once.
    fn weights_constant(&self, step: &Step) -> bool {
        let absent = step.inputs.get(2).copied().flatten().is_none();
        self.input_is_constant(step, 1) && (absent || self.input_is_constant(step, 2))
    }

    /// What the host kernels need of ONNX operator step `step` (`None`: another kind of
    /// step), its inputs' constness told by `constant`.
    fn host_step<'a>(
        &'a self,
        step: &'a Step,
        constant: &'a dyn Fn(usize) -> bool,
    ) -> Option<host::HostStep<'a>> {
        Some(host::HostStep {
            node: step.op.node()?,
            constant,
            cache: &step.packed,
            outputs: step.outputs.len(),
            relu: step.relu,
            act: step.fused_activation(),
            residual: step.residual,
            pool: step.pool,
            winograd: step.winograd,
            device: &self.device,
        })
    }

    /// Runs one step: on the host's image kernels when `on_host` and the step is one they
    /// take, else on values (images converted back to NCHW first).
    fn run_step(
        &self,
        step: &Step,
        ins: &mut [Option<Slot>],
        on_host: bool,
    ) -> Result<Vec<Slot>, OnnxError> {
        if on_host && let Some(outs) = self.run_on_host(step, ins) {
            return outs;
        }
        if let StepOp::ExpandDepthwise(pair) = &step.op {
            // The two layers apart, each on the host where it can be.
            let [pw, dw] = &**pair;
            let (pw_ins, dw_rest) = ins.split_at_mut(pw.inputs.len());
            let expanded = self.run_step(pw, pw_ins, on_host)?.into_iter().next();
            let mut dw_ins: Vec<Option<Slot>> = std::iter::once(expanded)
                .chain(dw_rest.iter_mut().map(Option::take))
                .collect();
            return self.run_step(dw, &mut dw_ins, on_host);
        }
        if let StepOp::ConcatConvs(fused) = &step.op {
            // The convolutions, then the Concat of their outputs.
            let mut outs: Vec<Option<Slot>> = Vec::with_capacity(fused.layers.len());
            let mut rest = &mut ins[..];
            for layer in &fused.layers {
                let (mine, tail) = rest.split_at_mut(layer.inputs.len());
                outs.push(self.run_step(layer, mine, on_host)?.into_iter().next());
                rest = tail;
            }
            return self.run_step(&fused.concat, &mut outs, on_host);
        }
        let mut ins: Vec<Option<Value>> = ins
            .iter_mut()
            .map(|s| s.take().map(|s| s.into_value(&self.device)).transpose())
            .collect::<Result<_, _>>()?;
        let mut residual = step
            .residual
            .and_then(|i| ins.get_mut(i).and_then(Option::take));
        let outs = match &step.op {
            StepOp::Onnx(node) => ops::run(node, &ins, &self.device),
            // Takes the residual into its epilogue when it can.
            StepOp::QLinear(q) => q.run(&ins, &mut residual),
            StepOp::QConv(q) => q.run(&ins),
            StepOp::Affine { scale, shift } => passes::affine(&ins, scale, shift),
            StepOp::Activation(act) => passes::activation(&ins, *act),
            StepOp::ChannelShuffle(shuffle) => shuffle.run(&ins),
            StepOp::ScaledSoftmax(softmax) => softmax.run(&ins),
            StepOp::QuantizeDequantize(fq) => match ins.first().cloned().flatten() {
                Some(x) => fq.run(&x).map(|y| vec![y]),
                None => Err(OnnxError::Graph(
                    "a quantize-dequantize step has no input".into(),
                )),
            },
            StepOp::ExpandDepthwise(_) | StepOp::ConcatConvs(_) => {
                Err(OnnxError::Graph("a fused step runs as its layers".into()))
            }
        }?;
        // What was fused into the step at load, after the operator: the residual sum, then
        // the activation.
        let mut outs = outs.into_iter();
        let mut first = outs.next();
        if let Some(r) = residual {
            first = first
                .map(|y| ops::math::binary(ops::math::Binary::Add, y, r))
                .transpose()?;
        }
        if let Some(act) = step.fused_activation() {
            first = first.map(|y| passes::activate(act, y)).transpose()?;
        }
        if step.pool {
            first = first.map(ops::nn::max_pool_2x2).transpose()?;
        }
        Ok(first.into_iter().chain(outs).map(Slot::Value).collect())
    }

    fn check_inputs(&self, inputs: &[Value]) -> Result<(), OnnxError> {
        if inputs.len() != self.inputs.len() {
            return Err(OnnxError::Input(format!(
                "the model takes {} input(s) ({}); got {}",
                self.inputs.len(),
                self.inputs
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                inputs.len()
            )));
        }
        for (port, value) in self.inputs.iter().zip(inputs) {
            let dims = value.onnx_dims();
            let fits = dims.len() == port.dims.len()
                && dims
                    .iter()
                    .zip(&port.dims)
                    .all(|(&d, p)| p.is_none_or(|p| p == d));
            if !fits {
                return Err(OnnxError::Input(format!(
                    "input `{}` must have shape {}; got {dims:?}",
                    port.name,
                    show_dims(&port.dims)
                )));
            }
            if value.kind() != port.kind {
                return Err(OnnxError::Input(format!(
                    "input `{}` must hold {}; got {:?} values",
                    port.name,
                    port.dtype,
                    value.kind()
                )));
            }
        }
        Ok(())
    }
}

/// `[?, 3, 224, 224]`-style text for declared dimensions.
pub fn show_dims(dims: &[Option<usize>]) -> String {
    let parts: Vec<String> = dims
        .iter()
        .map(|d| d.map_or_else(|| "?".to_string(), |d| d.to_string()))
        .collect();
    format!("[{}]", parts.join(", "))
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}
