//! Runs an inference [`Graph`] on a device: f32 ops through Burn (convolutions, linear layers
//! and max pooling through [`crate::kernels`], Kiln's kernels on the CPU), int8 ops through
//! Kiln's integer kernel on the host. Int8 layers pass activations to each other
//! channels-last on the host ([`Value::Nhwc`]), with their range measured as they are
//! written, so a quantized chain neither transposes nor re-scans its activations.

use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Device, FloatDType, Tensor, TensorData};

use kiln_kernels::base::layout::nhwc_to_nchw;
use kiln_kernels::base::spin::RunPlacement;
use kiln_kernels::implicit::ConvWeights;

use super::graph::{ConvGeometry, Graph, Op, QuantWeight, ValueId, Weight, batch_norm_affine};
use crate::error::{KilnError, Result};
use kiln_kernels::base::isa::Int8Kernel;
use kiln_kernels::int8::{
    ActivationQuant, ImageLayout, PackedWeights, QuantizedActivations, matmul_dequantized,
    pack_conv_weights, range_of,
};
use kiln_kernels::pool::{PoolShape, max_pool2d_forward};

mod host;
mod ops;

use host::*;

/// A value flowing through the graph: on the device, or on the host between int8 ops (so a
/// chain of quantized layers never round-trips through the device).
#[derive(Debug, Clone)]
enum Value {
    /// `[B, features]`.
    Flat(Tensor<2>),
    /// `[B, C, H, W]`.
    Image(Tensor<4>),
    /// A sequence of tokens `[B, T, D]`.
    Seq(Tensor<3>),
    /// Row-major host values with their dims (`[B, F]`, `[B, T, D]` or `[B, C, H, W]`).
    Host(Vec<f32>, Vec<usize>),
    /// Channels-last host images, `[B, H, W, C]`: what the int8 convolution writes (its
    /// GEMM's natural order), read as such by the next int8 convolution, ReLU, max pool and
    /// int8 linear layer, so a quantized chain never transposes. `flat` marks a flattened
    /// value (`[B, H·W·C]` logically, still channels-last in memory). Any other consumer gets
    /// it transposed to NCHW. `range` is the values' `(min, 0) .. (max, 0)` when known (the
    /// int8 GEMM's epilogue measures it), so the next int8 layer need not scan them again.
    Nhwc {
        data: Vec<f32>,
        dims: [usize; 4],
        flat: bool,
        range: Option<(f32, f32)>,
    },
}

/// An op with its constants already on the device (or widened for the int8 kernel).
#[derive(Debug)]
enum Prepared {
    Conv {
        weight: Tensor<4>,
        bias: Option<Tensor<1>>,
        options: ConvOptions<2>,
        /// The host form for Kiln's channels-last kernel (f32, no groups); `None` = Burn's
        /// layout only.
        nhwc: Option<Box<NhwcConv>>,
        /// ReLU fused into the output (the graph's next node was a ReLU reading only this).
        relu: bool,
        /// A 2×2 / stride 2 max pool fused after the ReLU (it read only the ReLU's output);
        /// Kiln's SIMD kernels pool in the convolution's epilogue, other paths pool after.
        pool: Option<MaxPool2d>,
    },
    Linear {
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        /// The weight with its rows in channels-last order, packed (once) for Kiln's host
        /// kernel when the input arrives as a flattened [`Value::Nhwc`], so the input needs
        /// no transpose.
        nhwc: Box<std::sync::OnceLock<([usize; 3], ConvWeights)>>,
        /// ReLU fused into the output (the graph's next node was a ReLU reading only this).
        relu: bool,
    },
    /// Inference BatchNorm as a per-channel affine map, uploaded once (`[C]`; reshaped to
    /// broadcast over the input's rank at run time, which is a view).
    Affine {
        scale: Tensor<1>,
        shift: Tensor<1>,
        /// The same on the host, for channels-last values (applied in place, no transpose).
        host: Box<(Vec<f32>, Vec<f32>)>,
    },
    Relu,
    MaxPool(MaxPool2d),
    GlobalAvgPool,
    Flatten,
    Add,
    Identity,
    Reshape(Vec<usize>),
    /// The constant left-padded with 1s to rank 3 (it broadcasts from the right).
    AddConstant(Tensor<3>),
    LayerNorm {
        gamma: Tensor<1>,
        beta: Option<Tensor<1>>,
        eps: f64,
    },
    Attention {
        heads: usize,
        head_dim: usize,
    },
    TokenMean,
    QLinear {
        weight: PackedWeights,
        /// The quantized weights as imported, re-packed (once) with their columns in
        /// channels-last order when the input arrives as a flattened [`Value::Nhwc`].
        source: QuantWeight,
        nhwc: std::sync::OnceLock<([usize; 3], PackedWeights)>,
        bias: Option<Vec<f32>>,
        relu: bool,
    },
    QConv {
        weight: PackedWeights,
        bias: Option<Vec<f32>>,
        geometry: ConvGeometry,
        relu: bool,
    },
}

/// A convolution's weights (packed once) and shape for
/// [`kiln_kernels::implicit::conv2d_nhwc`].
#[derive(Debug)]
struct NhwcConv {
    weights: ConvWeights,
    geometry: ConvGeometry,
}

impl NhwcConv {
    /// The host form of an f32 convolution without groups (on the implicit GEMM only unless
    /// `winograd`); `None` where the kernel does not apply.
    fn new(
        weight: &Weight,
        bias: Option<&Weight>,
        g: &ConvGeometry,
        winograd: bool,
    ) -> Option<Self> {
        let dims: [usize; 4] = weight.shape.clone().try_into().ok()?;
        let f32_only = weight.precision == crate::precision::Precision::F32
            && bias.is_none_or(|b| b.precision == crate::precision::Precision::F32);
        if g.groups != 1 || !f32_only || weight.values.len() != dims.iter().product::<usize>() {
            return None;
        }
        let bias = bias.map(|b| &b.values[..]);
        if bias.is_some_and(|b| b.len() != dims[0]) {
            return None;
        }
        let weights = ConvWeights::pack(dims, &weight.values, bias);
        Some(NhwcConv {
            weights: if winograd {
                weights
            } else {
                weights.without_winograd()
            },
            geometry: *g,
        })
    }

    /// The kernel's shape for a `[batch, cin, h, w]` input.
    fn shape(&self, [batch, _, h, w]: [usize; 4]) -> kiln_kernels::base::shape::ConvShape {
        let dims = self.weights.dims();
        nhwc_shape(dims, &self.geometry, [batch, dims[1], h, w])
    }
}

fn nhwc_shape(
    [cout, cin, kh, kw]: [usize; 4],
    g: &ConvGeometry,
    [batch, _, h, w]: [usize; 4],
) -> kiln_kernels::base::shape::ConvShape {
    let [top, left, bottom, right] = g.pads;
    kiln_kernels::base::shape::ConvShape {
        batch,
        cin,
        h,
        w,
        cout,
        kh,
        kw,
        stride: g.stride,
        padding: [(top, bottom), (left, right)],
        dilation: g.dilation,
    }
}

impl Prepared {
    /// The operation's name, for profiles.
    fn name(&self) -> &'static str {
        match self {
            Prepared::Conv { .. } => "Conv",
            Prepared::Linear { .. } => "Linear",
            Prepared::Affine { .. } => "Affine",
            Prepared::Relu => "Relu",
            Prepared::MaxPool(_) => "MaxPool",
            Prepared::GlobalAvgPool => "GlobalAvgPool",
            Prepared::Flatten => "Flatten",
            Prepared::Add => "Add",
            Prepared::Identity => "Identity",
            Prepared::Reshape(_) => "Reshape",
            Prepared::AddConstant(_) => "AddConstant",
            Prepared::LayerNorm { .. } => "LayerNorm",
            Prepared::Attention { .. } => "Attention",
            Prepared::TokenMean => "TokenMean",
            Prepared::QLinear { .. } => "QLinear",
            Prepared::QConv { .. } => "QConv",
        }
    }
}

/// A graph ready to run on a device.
#[derive(Debug)]
pub struct Executor {
    graph: Graph,
    ops: Vec<Prepared>,
    device: Device,
    /// The half precision convolutions, linear layers and attention products run in (the
    /// graph's, from the `f16` / `bf16` passes); `None` = f32 throughout.
    compute: Option<FloatDType>,
    /// Whether the forward uses Kiln's kernels (`device.kiln_kernels`), on whatever thread
    /// it runs.
    kiln_kernels: bool,
    /// Where forwards run (see [`Executor::forward`]).
    placement: RunPlacement,
}

fn tensor<const D: usize>(w: &Weight, device: &Device) -> Result<Tensor<D>> {
    let dims: [usize; D] =
        w.shape.clone().try_into().map_err(|_| {
            KilnError::Inference(format!("weight of shape {:?} is not {D}-D", w.shape))
        })?;
    Ok(Tensor::from_data(
        TensorData::new(w.values.clone(), dims),
        device,
    ))
}

/// `t` in the compute precision (`None` = as it is, f32).
fn to_compute<const D: usize>(t: Tensor<D>, compute: Option<FloatDType>) -> Tensor<D> {
    match compute {
        Some(dt) => t.cast(dt),
        None => t,
    }
}

/// `t` in f32 (a no-op when it already is).
fn to_f32<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    if t.dtype() == burn::tensor::DType::F32 {
        t
    } else {
        t.cast(FloatDType::F32)
    }
}

fn host_tensor<const D: usize>(values: Vec<f32>, dims: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, dims), device)
}

fn host_values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap_or_default()
}

impl Executor {
    /// Uploads the graph's constants to `device`.
    pub fn new(graph: Graph, device: &Device) -> Result<Self> {
        let compute = graph.precision.compute_dtype();
        // Every input must be defined before it is read (a hand-made or foreign graph file
        // may not be in order): an error naming the node, rather than an index panic later.
        let mut defined = vec![false; graph.next_value()];
        defined[Graph::INPUT] = true;
        for node in &graph.nodes {
            if let Some(v) = node
                .inputs
                .iter()
                .find(|&&v| !defined.get(v).copied().unwrap_or(false))
            {
                return Err(KilnError::Inference(format!(
                    "node `{}` reads value {v}, which no earlier node defines",
                    node.name
                )));
            }
            defined[node.output] = true;
        }
        if !defined.get(graph.output).copied().unwrap_or(false) {
            return Err(KilnError::Inference(format!(
                "the graph's output value {} is never defined",
                graph.output
            )));
        }
        let mut ops = Vec::with_capacity(graph.nodes.len());
        for node in &graph.nodes {
            ops.push(match &node.op {
                Op::Conv2d {
                    weight,
                    bias,
                    geometry: g,
                } => Prepared::Conv {
                    weight: to_compute(tensor(weight, device)?, compute),
                    bias: bias
                        .as_ref()
                        .map(|b| tensor(b, device).map(|t| to_compute(t, compute)))
                        .transpose()?,
                    options: conv_options(g),
                    nhwc: compute
                        .is_none()
                        .then(|| {
                            let winograd = !graph.direct_convs.contains(&node.name);
                            NhwcConv::new(weight, bias.as_ref(), g, winograd).map(Box::new)
                        })
                        .flatten(),
                    relu: false,
                    pool: None,
                },
                Op::Linear { weight, bias } => Prepared::Linear {
                    weight: to_compute(tensor(weight, device)?, compute),
                    bias: bias
                        .as_ref()
                        .map(|b| tensor(b, device).map(|t| to_compute(t, compute)))
                        .transpose()?,
                    nhwc: Box::default(),
                    relu: false,
                },
                Op::BatchNorm {
                    gamma,
                    beta,
                    mean,
                    var,
                    eps,
                } => {
                    let (scale, shift) = batch_norm_affine(gamma, beta, mean, var, *eps);
                    let c = scale.len();
                    Prepared::Affine {
                        scale: host_tensor(scale.clone(), [c], device),
                        shift: host_tensor(shift.clone(), [c], device),
                        host: Box::new((scale, shift)),
                    }
                }
                Op::Relu => Prepared::Relu,
                Op::MaxPool2d { kernel, stride } => {
                    Prepared::MaxPool(MaxPool2dConfig::new(*kernel).with_strides(*stride).init())
                }
                Op::GlobalAvgPool => Prepared::GlobalAvgPool,
                Op::Flatten => Prepared::Flatten,
                Op::Add => Prepared::Add,
                Op::Dropout { .. } => Prepared::Identity,
                Op::Reshape { shape } => Prepared::Reshape(shape.clone()),
                Op::AddConstant { value } => {
                    if value.shape.len() > 3 {
                        return Err(KilnError::Inference(format!(
                            "node `{}`: a constant of shape {:?} has more than 3 dims",
                            node.name, value.shape
                        )));
                    }
                    let mut dims = [1usize; 3];
                    dims[3 - value.shape.len()..].copy_from_slice(&value.shape);
                    Prepared::AddConstant(host_tensor(value.values.clone(), dims, device))
                }
                Op::LayerNorm { gamma, beta, .. }
                    if beta.as_ref().is_some_and(|b| b.len() != gamma.len()) =>
                {
                    return Err(KilnError::Inference(format!(
                        "node `{}`: LayerNorm scale and shift differ in length",
                        node.name
                    )));
                }
                Op::LayerNorm { gamma, beta, eps } => Prepared::LayerNorm {
                    gamma: host_tensor(gamma.clone(), [gamma.len()], device),
                    beta: beta
                        .as_ref()
                        .map(|b| host_tensor(b.clone(), [b.len()], device)),
                    eps: *eps,
                },
                Op::Attention { heads, head_dim } => Prepared::Attention {
                    heads: *heads,
                    head_dim: *head_dim,
                },
                Op::TokenMean => Prepared::TokenMean,
                Op::QLinear { weight, bias, relu } => Prepared::QLinear {
                    weight: PackedWeights::new(weight, Int8Kernel::detect()),
                    source: weight.clone(),
                    nhwc: std::sync::OnceLock::new(),
                    bias: bias.clone(),
                    relu: *relu,
                },
                Op::QConv2d {
                    weight,
                    bias,
                    geometry,
                    relu,
                } => Prepared::QConv {
                    weight: pack_conv_weights(
                        weight,
                        weight.cols / (geometry.kernel[0] * geometry.kernel[1]).max(1),
                        geometry,
                        Int8Kernel::detect(),
                    ),
                    bias: bias.clone(),
                    geometry: *geometry,
                    relu: *relu,
                },
            });
        }
        fuse_relu(&graph, &mut ops);
        fuse_relu_pool(&graph, &mut ops);
        Ok(Executor {
            graph,
            ops,
            device: device.clone(),
            compute,
            kiln_kernels: true,
            placement: RunPlacement::default(),
        })
    }

    /// Switches Kiln's kernels on or off for this executor's forwards (on by default).
    pub fn set_kiln_kernels(&mut self, enabled: bool) {
        self.kiln_kernels = enabled;
    }

    /// Whether this executor's forwards use Kiln's kernels.
    pub fn kiln_kernels(&self) -> bool {
        self.kiln_kernels
    }

    /// The convolution nodes whose forwards so far ran as Winograd F(2×2, 3×3), in graph
    /// order: what [`crate::infer::choose_winograd`] measures with and without it.
    pub fn winograd_layers(&self) -> Vec<String> {
        self.graph
            .nodes
            .iter()
            .zip(&self.ops)
            .filter(|(_, op)| match op {
                Prepared::Conv {
                    nhwc: Some(host), ..
                } => host.weights.ran_winograd(),
                _ => false,
            })
            .map(|(node, _)| node.name.clone())
            .collect()
    }

    /// The graph being run.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The device it runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Logits `[B, classes]` for images `[B, C, H, W]`.
    ///
    /// A forward with much parallel work runs on a thread of the (global) rayon pool. Called
    /// from any other thread, every parallel op inside (range scans, quantization, GEMMs,
    /// Burn's own ops) hands its work to the pool and sleeps until it is done: a futex
    /// wake-up and a context switch per op. Moving the whole forward onto a worker once makes
    /// each op's parallel work a plain fork-join — measured (2 threads, A/B in one run):
    /// W1 int8 b64 1.33× faster, W4 b1 1.23× (f32) and 1.7× (int8), W4 int8 b64 1.09×, W3
    /// b64 neutral. The hop itself costs ~25–45 µs, so small forwards whose work stays on
    /// the calling thread anyway (W1 and W3 int8 at batch 1: few nodes, GEMMs below the
    /// sequential threshold) run where they are called: hopping made W3 int8 b1 0.13 →
    /// 0.175 ms and W1 int8 b1 0.012 → 0.035 ms. Whether a small forward's work does split
    /// is learned from the first one (Kiln's f32 convolution counts its splits): W3 f32 at
    /// batch 1 splits its conv2 and hops, median 0.178 → 0.163 ms.
    pub fn forward(&self, images: Tensor<4>) -> Result<Tensor<2>> {
        let (nodes, batch) = (self.graph.nodes.len(), images.dims()[0]);
        self.placement
            .run(nodes, Some(batch), || self.forward_here(images))
    }

    /// Per node, the median wall time of running it, in ms, over `repeats` forwards of
    /// `images` after one warm-up, on the thread a forward would run on: what
    /// [`crate::infer::choose_int8`] compares layer by layer. A node's time includes reading
    /// its inputs in the layout it needs (an int8 layer's channels-last output read by an f32
    /// layer pays the transpose there). CPU only: on an asynchronous device a node's time
    /// is the time to queue it.
    pub fn node_times(&self, images: Tensor<4>, repeats: usize) -> Result<Vec<f64>> {
        let (nodes, batch) = (self.graph.nodes.len(), images.dims()[0]);
        self.placement.run(nodes, Some(batch), || {
            let mut samples = vec![Vec::with_capacity(repeats); nodes];
            for round in 0..=repeats.max(1) {
                let mut clock = Vec::with_capacity(nodes);
                self.forward_timed(images.clone(), Some(&mut clock))?;
                // Round 0 warms caches and lazily prepared kernels up.
                if round > 0 {
                    for (s, t) in samples.iter_mut().zip(clock) {
                        s.push(t);
                    }
                }
            }
            Ok(samples
                .into_iter()
                .map(crate::observe::timing::median)
                .collect())
        })
    }

    fn forward_here(&self, images: Tensor<4>) -> Result<Tensor<2>> {
        self.forward_timed(images, None)
    }

    /// The forward, pushing each node's wall time (ms) onto `clock` when given.
    fn forward_timed(
        &self,
        images: Tensor<4>,
        mut clock: Option<&mut Vec<f64>>,
    ) -> Result<Tensor<2>> {
        // Entered here, on the thread that runs the ops (the forward may have hopped to the
        // pool).
        let _kernels = crate::kernels::Scope::enter(self.kiln_kernels);
        let [_, c, h, w] = images.dims();
        if [c, h, w] != self.graph.input_shape {
            return Err(KilnError::Shape(format!(
                "images have shape [B, {c}, {h}, {w}] but the model expects [B, {}, {}, {}]",
                self.graph.input_shape[0], self.graph.input_shape[1], self.graph.input_shape[2]
            )));
        }
        let mut values: Vec<Option<Value>> = vec![None; self.graph.next_value()];
        values[Graph::INPUT] = Some(Value::Image(images));
        // Free each value after its last use: peak memory is the live set, not the graph.
        let mut remaining: Vec<usize> = (0..values.len()).map(|v| self.graph.uses(v)).collect();
        for (node, op) in self.graph.nodes.iter().zip(&self.ops) {
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for &v in &node.inputs {
                let value = take_or_clone(&mut values, &mut remaining, v, &node.name)?;
                inputs.push(value);
            }
            let started = clock.as_ref().map(|_| std::time::Instant::now());
            let out = ops::run(op, inputs, &self.device, self.compute)
                .map_err(|e| KilnError::Inference(format!("node `{}`: {e}", node.name)))?;
            if let (Some(clock), Some(t)) = (clock.as_mut(), started) {
                clock.push(t.elapsed().as_secs_f64() * 1e3);
            }
            values[node.output] = Some(out);
        }
        let out = take_or_clone(&mut values, &mut remaining, self.graph.output, "output")?;
        flat(out, &self.device).map_err(KilnError::Inference)
    }
}

fn take_or_clone(
    values: &mut [Option<Value>],
    remaining: &mut [usize],
    v: ValueId,
    node: &str,
) -> Result<Value> {
    remaining[v] = remaining[v].saturating_sub(1);
    let slot = &mut values[v];
    let value = if remaining[v] == 0 {
        slot.take()
    } else {
        slot.clone()
    };
    value.ok_or_else(|| KilnError::Inference(format!("node `{node}` reads undefined value {v}")))
}

/// Folds each ReLU that is the only reader of a convolution's or linear layer's output into
/// that op (its kernel applies it while the output is in cache); the ReLU node passes its
/// input on.
fn fuse_relu(graph: &Graph, ops: &mut [Prepared]) {
    for j in 0..graph.nodes.len() {
        if !matches!(ops[j], Prepared::Relu) {
            continue;
        }
        let Some(i) = sole_producer(graph, j) else {
            continue;
        };
        if let Prepared::Conv { relu, .. } | Prepared::Linear { relu, .. } = &mut ops[i] {
            *relu = true;
            ops[j] = Prepared::Identity;
        }
    }
}

/// Folds each 2×2 / stride 2 max pool that is the only reader of a fused convolution + ReLU
/// into that convolution (the ReLU's node is already an identity): the pooled maximum is
/// taken in the convolution's registers, so its full output is never written.
fn fuse_relu_pool(graph: &Graph, ops: &mut [Prepared]) {
    for j in 0..graph.nodes.len() {
        let Prepared::MaxPool(pool) = &ops[j] else {
            continue;
        };
        let plain_2x2 = pool.kernel_size == [2, 2]
            && pool.stride == [2, 2]
            && pool.dilation == [1, 1]
            && matches!(pool.padding, burn::nn::PaddingConfig2d::Valid);
        let Some(r) = sole_producer(graph, j).filter(|_| plain_2x2) else {
            continue;
        };
        let Some(c) = sole_producer(graph, r).filter(|_| matches!(ops[r], Prepared::Identity))
        else {
            continue;
        };
        let pool = pool.clone();
        if let Prepared::Conv {
            relu: true,
            pool: fused @ None,
            ..
        } = &mut ops[c]
        {
            *fused = Some(pool);
            ops[j] = Prepared::Identity;
        }
    }
}

/// The node whose output node `j` reads as its one input, when `j` is that output's only
/// reader (so folding `j` into it changes nothing else).
fn sole_producer(graph: &Graph, j: usize) -> Option<usize> {
    let [input] = graph.nodes[j].inputs[..] else {
        return None;
    };
    if graph.uses(input) != 1 {
        return None;
    }
    graph.nodes[..j].iter().rposition(|n| n.output == input)
}

fn conv_options(g: &ConvGeometry) -> ConvOptions<2> {
    let [top, left, bottom, right] = g.pads;
    ConvOptions::new_with_padding(
        g.stride,
        [(top, bottom), (left, right)],
        g.dilation,
        g.groups,
    )
}

/// The value as a device image `[B, C, H, W]`.
fn image(v: Value, device: &Device) -> std::result::Result<Tensor<4>, String> {
    match v {
        Value::Image(t) => Ok(t),
        Value::Host(data, dims) if dims.len() == 4 => Ok(host_tensor(
            data,
            [dims[0], dims[1], dims[2], dims[3]],
            device,
        )),
        Value::Host(_, dims) => Err(format!("expects an image, got {dims:?}")),
        Value::Flat(t) => Err(format!("expects an image, got {:?}", t.dims())),
        Value::Seq(t) => Err(format!("expects an image, got a sequence {:?}", t.dims())),
        Value::Nhwc { flat: true, .. } => Err("expects an image, got a flattened one".into()),
        Value::Nhwc { data, dims, .. } => {
            let [b, h, w, c] = dims;
            Ok(host_tensor(nhwc_to_nchw(&data, dims), [b, c, h, w], device))
        }
    }
}

/// The value as a device batch `[B, F]` (images are flattened).
fn flat(v: Value, device: &Device) -> std::result::Result<Tensor<2>, String> {
    match v {
        Value::Flat(t) => Ok(t),
        Value::Image(t) => Ok(t.flatten(1, 3)),
        Value::Seq(t) => Ok(t.flatten(1, 2)),
        Value::Host(data, dims) => {
            let b = dims.first().copied().unwrap_or(1);
            let f = data.len() / b.max(1);
            Ok(host_tensor(data, [b, f], device))
        }
        Value::Nhwc { data, dims, .. } => {
            let f = data.len() / dims[0].max(1);
            Ok(host_tensor(nhwc_to_nchw(&data, dims), [dims[0], f], device))
        }
    }
}

/// The value as a device sequence `[B, T, D]`.
fn seq(v: Value, device: &Device) -> std::result::Result<Tensor<3>, String> {
    match v {
        Value::Seq(t) => Ok(t),
        Value::Host(data, dims) if dims.len() == 3 => {
            Ok(host_tensor(data, [dims[0], dims[1], dims[2]], device))
        }
        other => Err(format!(
            "expects a sequence [B, T, D], got {:?}",
            value_dims(&other)
        )),
    }
}

/// The value's logical dims.
fn value_dims(v: &Value) -> Vec<usize> {
    match v {
        Value::Flat(t) => t.dims().to_vec(),
        Value::Image(t) => t.dims().to_vec(),
        Value::Seq(t) => t.dims().to_vec(),
        Value::Host(_, dims) => dims.clone(),
        Value::Nhwc {
            dims: [b, h, w, c],
            flat: true,
            ..
        } => vec![*b, h * w * c],
        Value::Nhwc {
            dims: [b, h, w, c], ..
        } => vec![*b, *c, *h, *w],
    }
}

/// `x` (a sequence or a batch of vectors) plus `y` broadcast from the right (`[1, T, D]`,
/// `[1, 1, D]`); a constant that does not broadcast to `x` is an error, not a panic.
fn add_broadcast(x: Value, y: Tensor<3>, device: &Device) -> std::result::Result<Value, String> {
    let dims = value_dims(&x);
    let padded: Vec<usize> = std::iter::repeat_n(1, 3usize.saturating_sub(dims.len()))
        .chain(dims.iter().copied())
        .collect();
    let fits = padded.len() == 3
        && y.dims()[0] == 1
        && y.dims()
            .iter()
            .zip(&padded)
            .all(|(&c, &v)| c == 1 || c == v);
    if !fits {
        return Err(format!(
            "a constant of shape {:?} does not broadcast to a value of shape {dims:?}",
            y.dims()
        ));
    }
    Ok(match x {
        Value::Flat(t) => {
            let [_, _, d] = y.dims();
            Value::Flat(t + y.reshape([1, d]))
        }
        other => Value::Seq(seq(other, device)? + y),
    })
}

/// Checks that `weight` (`[in, out]`) applies to values whose last axis is `dims`'s last.
fn check_features(dims: &[usize], weight: &Tensor<2>) -> std::result::Result<(), String> {
    let features = dims.last().copied().unwrap_or(0);
    let expected = weight.dims()[0];
    if features == expected {
        Ok(())
    } else {
        Err(format!(
            "expects {expected} features, got {features} ({dims:?})"
        ))
    }
}

/// Multi-head scaled dot-product attention over projected `q`, `k`, `v` `[B, T, D]`: the
/// zoo's own op sequence (`crate::zoo` W4), so the graph reproduces it to rounding.
fn attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    heads: usize,
    dk: usize,
    compute: Option<FloatDType>,
) -> std::result::Result<Tensor<3>, String> {
    let [b, t, d] = q.dims();
    if heads * dk != d || k.dims() != [b, t, d] || v.dims() != [b, t, d] {
        return Err(format!(
            "attention over q {:?}, k {:?}, v {:?} with {heads} heads of {dk}: the shapes \
             must match and hold {heads} × {dk} features",
            q.dims(),
            k.dims(),
            v.dims()
        ));
    }
    let split = |x: Tensor<3>| -> Tensor<4> {
        to_compute(x, compute)
            .reshape([b, t, heads, dk])
            .swap_dims(1, 2)
    };
    // Both products in the compute precision, the scaling and softmax in f32.
    let scores = to_f32(split(q).matmul(split(k).transpose())).div_scalar((dk as f32).sqrt());
    let weights = burn::tensor::activation::softmax(scores, 3);
    let context = to_f32(to_compute(weights, compute).matmul(split(v)));
    Ok(context.swap_dims(1, 2).reshape([b, t, d]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// W3 (conv → ReLU → conv → ReLU → 2×2 pool → linear → ReLU → linear): both ReLUs after
    /// the convolutions and the one after fc1 fold into their ops, and the pool into conv2,
    /// so `lowered_graphs_match_the_zoo_forward` (tests/inference.rs) checks the fused path.
    use burn::nn::conv::{Conv2d, Conv2dConfig};
    use burn::nn::{Linear, LinearConfig};

    use crate::infer::{GraphBuilder, Lower};

    /// W3's layers, described to the graph as the zoo's CNN describes itself.
    struct W3 {
        conv1: Conv2d,
        conv2: Conv2d,
        fc1: Linear,
        fc2: Linear,
    }

    impl Lower for W3 {
        fn lower_into(&self, b: &mut GraphBuilder) -> crate::error::Result<()> {
            let x = b.conv("conv1", &self.conv1, Graph::INPUT);
            let x = b.op("conv1.relu", Op::Relu, vec![x]);
            let x = b.conv("conv2", &self.conv2, x);
            let x = b.op("conv2.relu", Op::Relu, vec![x]);
            let pool = Op::MaxPool2d {
                kernel: [2, 2],
                stride: [2, 2],
            };
            let x = b.op("pool", pool, vec![x]);
            let x = b.op("flatten", Op::Flatten, vec![x]);
            let x = b.linear("fc1", &self.fc1, x);
            let x = b.op("fc1.relu", Op::Relu, vec![x]);
            b.linear("fc2", &self.fc2, x);
            Ok(())
        }
    }

    #[test]
    fn w3_folds_its_relus_and_its_pool() {
        let device = Device::flex();
        let model = W3 {
            conv1: Conv2dConfig::new([1, 32], [3, 3]).init(&device),
            conv2: Conv2dConfig::new([32, 64], [3, 3]).init(&device),
            fc1: LinearConfig::new(9216, 128).init(&device),
            fc2: LinearConfig::new(128, 10).init(&device),
        };
        let graph = crate::infer::lower(&model, "cnn", [1, 28, 28]).unwrap();
        let exec = Executor::new(graph, &device).unwrap();
        let count = |f: fn(&Prepared) -> bool| exec.ops.iter().filter(|op| f(op)).count();
        assert_eq!(
            count(|op| matches!(op, Prepared::Relu | Prepared::MaxPool(_))),
            0
        );
        assert_eq!(
            count(|op| matches!(op, Prepared::Conv { relu: true, .. })),
            2
        );
        assert_eq!(
            count(|op| matches!(op, Prepared::Conv { pool: Some(_), .. })),
            1
        );
        assert_eq!(
            count(|op| matches!(op, Prepared::Linear { relu: true, .. })),
            1
        );
    }
}
