//! Kiln's own CPU kernels for the ops where Burn's `flex` backend was measured slow, exposed
//! as a Burn backend extension so models keep using ordinary `Tensor`s and autodiff.
//!
//! - [`conv`]: f32 convolution (forward, input and weight gradients) as one GEMM per image.
//! - [`conv2d`]: the entry point models call; it runs Kiln's kernel on the `flex` device (with
//!   or without autodiff) and Burn's own op on every other device.

pub mod conv;
mod extension;

use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::{Dispatch, DispatchDevice};
use burn::tensor::module::conv2d as burn_conv2d;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, Device, Tensor};

pub use extension::KilnConv;

/// Process-wide switch (the plan's `device.kiln_kernels`); on unless turned off.
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns Kiln's kernels on or off for the whole process (off = Burn's own ops everywhere, as
/// a plain Burn program runs; the benchmarks' baseline does this).
pub fn set_enabled(enabled: bool) {
    ENABLED.store(enabled, Ordering::Relaxed);
}

/// Whether Kiln's kernels are switched on.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Whether Kiln's CPU kernels serve this device: switched on, and the `flex` backend (with or
/// without autodiff).
pub fn serves(device: &Device) -> bool {
    enabled()
        && matches!(
            device.clone().inner().as_dispatch(),
            DispatchDevice::Flex(_)
        )
}

/// 2-D convolution (NCHW): Kiln's GEMM kernel on `flex` for f32 without groups, Burn's
/// `conv2d` otherwise. Differentiable either way.
pub fn conv2d(
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    options: ConvOptions<2>,
) -> Tensor<4> {
    let f32_only = [x.dtype(), weight.dtype()]
        .into_iter()
        .chain(bias.as_ref().map(|b| b.dtype()))
        .all(|d| d == DType::F32);
    if options.groups != 1 || !f32_only || !serves(&x.device()) {
        return burn_conv2d(x, weight, bias, options);
    }
    // The extension takes a bias tensor always (its dispatch glue routes plain tensors only);
    // a constant zero bias costs one fill of the output, which the GEMM then accumulates onto.
    let bias = bias.unwrap_or_else(|| Tensor::zeros([weight.dims()[0]], &x.device()));
    let out = <Dispatch as KilnConv>::kiln_conv2d(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        options,
    );
    Tensor::from_dispatch(out)
}
