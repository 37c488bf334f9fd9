//! The Burn glue of Kiln's CPU kernels: the slice-level kernels live in the `kiln-kernels`
//! crate (no Burn there); here they become a Burn backend extension so models keep using
//! ordinary `Tensor`s and autodiff, and here is decided *when* they serve.
//!
//! - [`conv2d`], [`linear`], [`max_pool2d`], [`global_avg_pool2d`], [`batch_norm_train`],
//!   [`adam_step`]: the entry points models and optimizers call; they run Kiln's kernel on
//!   the `flex` device (with or without autodiff) and Burn's own op on every other device.
//! - [`Scope`] / [`enabled`]: the per-thread switch (`device.kiln_kernels`), [`serves`]: the
//!   one test of whether a tensor's device runs Kiln's kernels.
//! - [`activation`]: Kiln's vectorized sigmoid, erf and GELU on Burn tensors.
//! - [`stats_sync`]: SyncBatchNorm's scope (the summing hook the BatchNorm kernels call, and
//!   the bookkeeping of which layers synchronized).

pub mod activation;
mod extension;
pub mod stats_sync;
pub mod transformer;

use std::cell::Cell;
use std::marker::PhantomData;

use burn::backend::{Dispatch, DispatchDevice};
use burn::nn::PaddingConfig2d;
use burn::nn::pool::MaxPool2d;
use burn::tensor::module::{
    conv2d as burn_conv2d, linear as burn_linear, max_pool2d as burn_max_pool2d,
};
use burn::tensor::ops::{ConvOptions, MaxPoolOptions};
use burn::tensor::{DType, Device, Tensor};

pub use extension::KilnKernels;

thread_local! {
    // The switch in force on this thread (`device.kiln_kernels`): set by a [`Scope`], on
    // otherwise. Per thread, like autocast: a tuner trial, a baseline and a server instance
    // each choose for their own thread without touching anyone else's.
    static ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Kiln's kernels switched on or off on this thread until the scope is dropped (then the
/// previous setting returns). The trainer enters one for [`crate::train::TrainOptions`]'s
/// `kiln_kernels`, inference sessions for theirs; off = Burn's own ops, as a plain Burn
/// program runs (the benchmarks' baseline).
///
/// ```
/// let _burn_only = kiln::kernels::Scope::enter(false);
/// assert!(!kiln::kernels::enabled());
/// drop(_burn_only);
/// assert!(kiln::kernels::enabled());
/// ```
#[must_use = "the setting lasts only while the scope is alive"]
pub struct Scope {
    previous: bool,
    // A scope restores its own thread's setting: it must be dropped where it was entered.
    _not_send: PhantomData<*const ()>,
}

impl Scope {
    /// Switches Kiln's kernels on or off on this thread until the scope is dropped.
    pub fn enter(enabled: bool) -> Scope {
        Scope {
            previous: ENABLED.with(|e| e.replace(enabled)),
            _not_send: PhantomData,
        }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        ENABLED.with(|e| e.set(self.previous));
    }
}

/// Whether Kiln's kernels are switched on on this thread.
pub fn enabled() -> bool {
    ENABLED.with(Cell::get)
}

/// Whether Kiln's CPU kernels serve this device: switched on, and the `flex` backend (with or
/// without autodiff).
pub fn serves(device: &Device) -> bool {
    enabled() && is_flex(device)
}

/// Whether `device` is the CPU backend, `flex` (with or without autodiff): it computes each
/// operation before returning and compiles nothing per shape.
pub fn is_flex(device: &Device) -> bool {
    matches!(
        device.clone().inner().as_dispatch(),
        DispatchDevice::Flex(_)
    )
}

/// Whether the operands and the optional bias are all f32 (the only dtype the kernels take).
fn all_f32(dtypes: [DType; 2], bias: &Option<Tensor<1>>) -> bool {
    dtypes
        .into_iter()
        .chain(bias.as_ref().map(|b| b.dtype()))
        .all(|d| d == DType::F32)
}

/// 2-D convolution (NCHW): Kiln's kernels on `flex` for f32 — the GEMM kernel without
/// groups, the depthwise kernel with one filter per channel — Burn's `conv2d` otherwise
/// (other groupings, half precision, other devices). Differentiable either way.
pub fn conv2d(
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    options: ConvOptions<2>,
) -> Tensor<4> {
    let f32_only = all_f32([x.dtype(), weight.dtype()], &bias);
    let [_, channels, _, _] = x.dims();
    let [out, per_group, _, _] = weight.dims();
    let ours = options.groups == 1 || extension::is_depthwise(channels, out, per_group, &options);
    if !ours || !f32_only || !serves(&x.device()) {
        return burn_conv2d(x, weight, bias, options);
    }
    let _op = tracing::trace_span!(
        "kiln.conv2d",
        input = ?x.dims(),
        weight = ?weight.dims(),
        flops = conv2d_flops(x.dims(), weight.dims(), &options)
    )
    .entered();
    // The extension takes a bias tensor always (its dispatch glue routes plain tensors only);
    // a constant zero bias costs one fill of the output, which the GEMM then accumulates onto.
    let bias = bias.unwrap_or_else(|| Tensor::zeros([weight.dims()[0]], &x.device()));
    let out = <Dispatch as KilnKernels>::kiln_conv2d(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        options,
    );
    Tensor::from_dispatch(out)
}

/// Multiply-adds ×2 of a convolution of `input` `[N, C, H, W]` by `weight` `[O, C/g, KH, KW]`.
fn conv2d_flops(input: [usize; 4], weight: [usize; 4], options: &ConvOptions<2>) -> u64 {
    let out = |i: usize| {
        kiln_kernels::base::shape::out_len(
            input[2 + i],
            weight[2 + i],
            options.stride[i].max(1),
            options.padding[i],
            options.dilation[i],
        )
    };
    2 * (input[0] * weight[0] * out(0) * out(1) * weight[1] * weight[2] * weight[3]) as u64
}

/// `x · weight + bias` over the last dimension of `x` (`weight` `[inputs, outputs]`, Burn's
/// `Linear` layout): Kiln's GEMM kernel on `flex` for f32, Burn's `linear` otherwise.
/// Differentiable either way.
pub fn linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    let dims = x.dims();
    let [inputs, outputs] = weight.dims();
    let f32_only = all_f32([x.dtype(), weight.dtype()], &bias);
    // A shape mismatch goes to Burn too, which reports it in its own words.
    if D < 2 || dims[D - 1] != inputs || !f32_only || !serves(&x.device()) {
        return burn_linear(x, weight, bias);
    }
    let rows: usize = dims[..D - 1].iter().product();
    let _op = tracing::trace_span!(
        "kiln.linear",
        rows,
        inputs,
        outputs,
        flops = 2 * (rows * inputs * outputs) as u64
    )
    .entered();
    let device = x.device();
    let bias = bias.unwrap_or_else(|| Tensor::zeros([outputs], &device));
    let y = <Dispatch as KilnKernels>::kiln_linear(
        x.reshape([rows, inputs]).into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
    );
    let mut out = dims;
    out[D - 1] = outputs;
    Tensor::<2>::from_dispatch(y).reshape(out)
}

/// 2-D max pooling without padding or dilation (floor rounding): Kiln's kernel on `flex` for
/// f32, Burn's `max_pool2d` otherwise. Differentiable either way.
pub fn max_pool2d(x: Tensor<4>, kernel: [usize; 2], stride: [usize; 2]) -> Tensor<4> {
    if x.dtype() != DType::F32 || !serves(&x.device()) {
        return burn_max_pool2d(x, MaxPoolOptions::new(kernel).with_stride(stride));
    }
    let _op = tracing::trace_span!("kiln.max_pool2d", input = ?x.dims(), ?kernel).entered();
    let out = <Dispatch as KilnKernels>::kiln_max_pool2d(x.into_dispatch(), kernel, stride);
    Tensor::from_dispatch(out)
}

/// Global average pooling, `[B, C, H, W]` → `[B, C]` (PyTorch's `x.mean(dim=(2, 3))`): Kiln's
/// kernel on `flex` for f32 (one pass forward and one backward), Burn's mean otherwise.
/// Differentiable either way.
pub fn global_avg_pool2d(x: Tensor<4>) -> Tensor<2> {
    let [b, c, h, w] = x.dims();
    if x.dtype() != DType::F32 || !serves(&x.device()) || h * w == 0 {
        return x.flatten::<3>(2, 3).mean_dim(2).reshape([b, c]);
    }
    let out = <Dispatch as KilnKernels>::kiln_global_avg_pool2d(x.into_dispatch());
    Tensor::from_dispatch(out)
}

/// Whether [`adam_step`] runs Kiln's fused kernel for this parameter and gradient: f32, on
/// `flex`, Kiln's kernels on (the caller runs Burn's `Adam` otherwise).
pub fn adam_serves<const D: usize>(param: &Tensor<D>, grad: &Tensor<D>) -> bool {
    param.dtype() == DType::F32
        && grad.dtype() == DType::F32
        && param.dims() == grad.dims()
        && serves(&param.device())
}

/// One Adam update in one pass ([`kiln_kernels::adam::adam_update`]): the new parameter and moments, from
/// the parameter, its gradient, the previous moments (zeros before the first step) and the
/// step's device scalars (`[1]` each): `time`, this step's number if it is applied; `apply`,
/// 0 to leave everything unchanged (a skipped step); `grad_factor`, the gradient's
/// multiplier (`None` for 1). Call where [`adam_serves`] holds.
pub fn adam_step<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    (m, v): (Tensor<D>, Tensor<D>),
    (time, apply, grad_factor): (Tensor<1>, Tensor<1>, Option<Tensor<1>>),
    config: kiln_kernels::adam::AdamConfigScalars,
) -> (Tensor<D>, Tensor<D>, Tensor<D>) {
    // An applied step's factor of 1 is `apply` itself (a skipped step never reads it): no
    // tensor to make.
    let factor = grad_factor.unwrap_or_else(|| apply.clone());
    let (p, m, v) = <Dispatch as KilnKernels>::kiln_adam(
        param.into_dispatch(),
        grad.into_dispatch(),
        m.into_dispatch(),
        v.into_dispatch(),
        time.into_dispatch(),
        apply.into_dispatch(),
        factor.into_dispatch(),
        config.to_array(),
    );
    (
        Tensor::from_dispatch(p),
        Tensor::from_dispatch(m),
        Tensor::from_dispatch(v),
    )
}

/// Training-mode BatchNorm of `x` `[N, C, H, W]` (batch statistics), then ReLU when `relu`:
/// Kiln's kernels on `flex` for f32 (two passes forward, two backward), `None` otherwise (the
/// caller runs Burn's op). Returns the output and the batch mean and biased variance (for the
/// running statistics; not differentiated).
pub fn batch_norm_train(
    x: Tensor<4>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    epsilon: f64,
    relu: bool,
) -> Option<(Tensor<4>, Tensor<1>, Tensor<1>)> {
    let f32_only = [x.dtype(), gamma.dtype(), beta.dtype()]
        .iter()
        .all(|d| *d == DType::F32);
    let [_, c, _, _] = x.dims();
    if !f32_only || !serves(&x.device()) || gamma.dims() != [c] || beta.dims() != [c] {
        return None;
    }
    let _op = tracing::trace_span!("kiln.batch_norm", input = ?x.dims(), relu).entered();
    let stats: Tensor<2> = Tensor::from_dispatch(<Dispatch as KilnKernels>::kiln_batch_norm_stats(
        x.clone().detach().into_dispatch(),
    ));
    let out = <Dispatch as KilnKernels>::kiln_batch_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        stats.clone().into_dispatch(),
        epsilon,
        relu,
    );
    let mean = stats.clone().slice([0..1, 0..c]).reshape([c]);
    let var = stats.slice([1..2, 0..c]).reshape([c]);
    Some((Tensor::from_dispatch(out), mean, var))
}

/// `pool.forward(x)`, through [`max_pool2d`] when the layer has no padding, dilation or ceil
/// rounding (Burn's layer otherwise).
pub fn max_pool2d_layer(pool: &MaxPool2d, x: Tensor<4>) -> Tensor<4> {
    if pool.padding != PaddingConfig2d::Valid || pool.dilation != [1, 1] || pool.ceil_mode {
        return pool.forward(x);
    }
    max_pool2d(x, pool.kernel_size, pool.stride)
}
