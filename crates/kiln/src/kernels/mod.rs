//! Kiln's own CPU kernels for the ops where Burn's `flex` backend was measured slow, exposed
//! as a Burn backend extension so models keep using ordinary `Tensor`s and autodiff.
//!
//! - [`conv`]: f32 convolution (forward, input and weight gradients) as one GEMM per image.
//! - [`linear`](mod@linear): f32 fully connected layer and its gradients, transposes read through strides.
//! - [`pool`]: f32 max pooling with arg-max indices and its backward scatter.
//! - [`int8`]: int8 dynamic quantization and the integer GEMM (AVX-512 VNNI, AVX2 and
//!   portable kernels, one file each) the inference passes use.
//! - [`norm`]: f32 BatchNorm in training mode (statistics, normalization with fused ReLU,
//!   backward) in two passes each way.
//! - [`conv2d`], [`linear`](fn@linear), [`max_pool2d`], [`batch_norm_train`]: the entry points models call; they run Kiln's kernel on the
//!   `flex` device (with or without autodiff) and Burn's own op on every other device.

/// Defines `fn $name(args)` whose body is compiled three times, for AVX-512, for AVX2 + FMA
/// and for the baseline, and run as [`implicit::F32Kernel::detect`] picks
/// (`KILN_F32_KERNEL`): the same Rust, so LLVM vectorizes each copy to its instruction set's
/// width. Used by the element-wise kernels of [`nhwc`] and [`activation`].
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn portable($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) {
                    portable($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) {
                    portable($($arg),*)
                }
                match $crate::kernels::implicit::F32Kernel::detect() {
                    // SAFETY: `detect` picks an instruction set only where the CPU has it.
                    $crate::kernels::implicit::F32Kernel::Avx512 => unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    $crate::kernels::implicit::F32Kernel::Avx2 => unsafe { avx2($($arg),*) },
                    $crate::kernels::implicit::F32Kernel::Portable => portable($($arg),*),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            portable($($arg),*)
        }
    };
}

pub mod activation;
pub mod adam;
mod aligned;
pub mod conv;
mod depthwise_strip;
mod direct;
pub mod expand_depthwise;
mod extension;
pub mod implicit;
pub mod int8;
pub mod layer_norm;
pub mod linear;
pub mod nhwc;
pub mod norm;
pub mod pool;
pub mod softmax;
pub mod spin;
pub mod stats_sync;
pub mod strided;
#[cfg(test)]
mod testing;
mod winograd;

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

/// A vector of `len` values, each written by `fill`, which must write all of them (why:
/// a kernel that writes every output value once need not pay a zero fill first).
pub(crate) fn filled(len: usize, fill: impl FnOnce(&mut [std::mem::MaybeUninit<f32>])) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: `fill` initialized the first `len` values (its callers' contract: each asserts
    // the output's length and writes every value of it).
    unsafe { out.set_len(len) };
    out
}

/// A vector of `len` values computed row by row (`row(index, values)`, rows of `row_len`),
/// over the pool when `parallel`. Each row is zeroed in its own task just before `row` runs,
/// so `row` may accumulate into it: the zeros are written while the row is in cache, by the
/// thread that computes it, instead of in a serial pass over the whole output first (a
/// depthwise layer's 4.8 MB output at batch 1 in MobileNet v2: BENCHMARKS.md run 40).
fn rows_from_zero(
    len: usize,
    row_len: usize,
    parallel: bool,
    row: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    use rayon::prelude::*;
    assert!(row_len > 0 && len.is_multiple_of(row_len), "whole rows");
    let task = |(i, values): (usize, &mut [std::mem::MaybeUninit<f32>])| {
        values.fill(std::mem::MaybeUninit::new(0.0));
        // SAFETY: every value of the row was just written.
        row(i, unsafe { assume_init(values) });
    };
    filled(len, |out| {
        if parallel {
            out.par_chunks_exact_mut(row_len).enumerate().for_each(task);
        } else {
            out.chunks_exact_mut(row_len).enumerate().for_each(task);
        }
    })
}

/// An initialized slice viewed as one the kernels only write to.
fn as_uninit(values: &mut [f32]) -> &mut [std::mem::MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and the kernels store only initialized
    // f32 values through the view, so the slice stays initialized.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), values.len()) }
}

/// A slice whose every value has been written, as initialized values.
///
/// # Safety
/// Every value of `values` is initialized.
unsafe fn assume_init(values: &mut [std::mem::MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: the caller's contract; the layouts are the same.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), values.len()) }
}

/// The kernel a family of SIMD kernels runs: `best` (what this CPU supports), or the one the
/// environment variable `var` names when this CPU runs it, so a lesser path (AVX2 on an
/// AVX-512 machine) can be measured. `all` is ordered best first; a named kernel before
/// `best` or an unknown name falls back to `best` with a warning that says why.
fn kernel_from_env<K: Copy + PartialEq>(
    var: &str,
    all: &[K],
    best: K,
    name: fn(K) -> &'static str,
) -> K {
    let Ok(wanted) = std::env::var(var) else {
        return best;
    };
    let rank = |k: K| all.iter().position(|a| *a == k);
    match all.iter().copied().find(|k| name(*k) == wanted) {
        Some(k) if rank(k) >= rank(best) => k,
        Some(k) => {
            tracing::warn!(
                "{var}={wanted}: this CPU lacks {}; using {}",
                name(k),
                name(best)
            );
            best
        }
        None => {
            let names: Vec<&str> = all.iter().map(|k| name(*k)).collect();
            tracing::warn!(
                "{var}={wanted} is not a kernel ({}); using {}",
                names.join(", "),
                name(best)
            );
            best
        }
    }
}

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

/// 2-D convolution (NCHW): Kiln's GEMM kernel on `flex` for f32 without groups, Burn's
/// `conv2d` otherwise. Differentiable either way.
pub fn conv2d(
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    options: ConvOptions<2>,
) -> Tensor<4> {
    let f32_only = all_f32([x.dtype(), weight.dtype()], &bias);
    if options.groups != 1 || !f32_only || !serves(&x.device()) {
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
        conv::out_len(
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

/// Whether [`adam_step`] runs Kiln's fused kernel for this parameter and gradient: f32, on
/// `flex`, Kiln's kernels on (the caller runs Burn's `Adam` otherwise).
pub fn adam_serves<const D: usize>(param: &Tensor<D>, grad: &Tensor<D>) -> bool {
    param.dtype() == DType::F32
        && grad.dtype() == DType::F32
        && param.dims() == grad.dims()
        && serves(&param.device())
}

/// One Adam update in one pass ([`adam::adam_update`]): the new parameter and moments, from
/// the parameter, its gradient, the previous moments (zeros before the first step) and the
/// step's device scalars (`[1]` each): `time`, this step's number if it is applied; `apply`,
/// 0 to leave everything unchanged (a skipped step); `grad_factor`, the gradient's
/// multiplier (`None` for 1). Call where [`adam_serves`] holds.
pub fn adam_step<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    (m, v): (Tensor<D>, Tensor<D>),
    (time, apply, grad_factor): (Tensor<1>, Tensor<1>, Option<Tensor<1>>),
    config: adam::AdamConfigScalars,
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
