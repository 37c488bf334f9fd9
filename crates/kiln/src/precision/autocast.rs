//! Autocast: run the ops where low precision is safe in bf16/f16, everything else in f32.
//!
//! Burn 0.22 has no autocast, so Kiln provides the torch.amp idea in the small: a scope
//! ([`autocast`]) sets the compute dtype for the current thread, and the zoo's forward passes
//! call [`linear`], [`conv2d`] and [`matmul`] instead of the plain ops. Inside a bf16/f16 scope
//! those ops cast their inputs *and the f32 master weights* to the low precision, compute
//! there, and cast the result back to f32; outside a scope they are exactly the plain ops.
//!
//! The per-op list (also in `docs/mixed-precision.md`):
//!
//! | runs in bf16/f16                     | stays in f32                                         |
//! |--------------------------------------|------------------------------------------------------|
//! | `linear` (matmul + bias)             | softmax / log-softmax and the cross-entropy loss     |
//! | `conv2d` (+ bias)                    | BatchNorm and LayerNorm (their statistics)           |
//! | `matmul` (attention scores, context) | reductions (means, pooling), residual adds, ReLU     |
//! | `attention` off the CPU kernels      | `attention` on the CPU kernels (f32 is faster there) |
//! |                                      | parameters, gradients applied, optimizer state       |
//!
//! Why the result goes back to f32 at once: every op that is *not* in the left column then
//! sees f32 without the model having to track dtypes, and the gradient that reaches each f32
//! master weight is f32 (the cast's backward casts it up). The price is one extra elementwise
//! pass per op; on a fusing GPU backend that pass merges into the neighbouring kernel.
//!
//! The scope is thread-local, like torch's: a forward pass runs on the calling thread (the
//! backend's own worker threads only execute kernels), so a server with several model
//! instances on several threads can run each in its own precision.

use std::cell::Cell;

use burn::nn::conv::Conv2d;
use burn::nn::{Linear, PaddingConfig2d};
use burn::tensor::module::{conv2d as plain_conv2d, linear as plain_linear};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{FloatDType, Tensor};

use super::Precision;

thread_local! {
    static COMPUTE: Cell<Option<FloatDType>> = const { Cell::new(None) };
}

/// While alive, the autocast ops on this thread compute in the scope's precision; dropping it
/// restores the previous setting (scopes nest).
#[must_use = "autocast is active only while the scope is alive"]
#[derive(Debug)]
pub struct AutocastScope {
    previous: Option<FloatDType>,
}

impl Drop for AutocastScope {
    fn drop(&mut self) {
        COMPUTE.with(|c| c.set(self.previous));
    }
}

/// Enters an autocast scope for `precision` on this thread (`F32` = plain ops).
pub fn autocast(precision: Precision) -> AutocastScope {
    let previous = COMPUTE.with(|c| c.replace(precision.compute_dtype()));
    AutocastScope { previous }
}

/// The low-precision compute dtype of the current scope, if any.
pub fn compute_dtype() -> Option<FloatDType> {
    COMPUTE.with(Cell::get)
}

/// `layer.forward(x)`, computed in the scope's precision.
/// In f32 it runs through [`crate::kernels::linear()`] (Kiln's kernel on the CPU).
pub fn linear<const D: usize>(layer: &Linear, x: Tensor<D>) -> Tensor<D> {
    linear_weights(x, layer.weight.val(), layer.bias.as_ref().map(|b| b.val()))
}

/// `x · weight + bias` (`weight` `[inputs, outputs]`), computed in the scope's precision: the
/// body of every autocast linear layer, Burn's or [`crate::nn::Linear`].
pub fn linear_weights<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    let Some(dt) = compute_dtype() else {
        return crate::kernels::linear(x, weight, bias);
    };
    let weight = weight.cast(dt);
    let bias = bias.map(|b| b.cast(dt));
    plain_linear(x.cast(dt), weight, bias).cast(FloatDType::F32)
}

/// `layer.forward(x)`, computed in the scope's precision.
/// In f32 it runs through [`crate::kernels::conv2d`] (Kiln's kernel on the CPU).
pub fn conv2d(layer: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    let geometry = ConvGeometry {
        kernel_size: layer.kernel_size,
        stride: layer.stride,
        dilation: layer.dilation,
        groups: layer.groups,
        padding: &layer.padding,
    };
    conv2d_weights(
        x,
        layer.weight.val(),
        layer.bias.as_ref().map(|b| b.val()),
        &geometry,
    )
}

/// The shape of a 2-D convolution, as Burn's `Conv2d` stores it.
#[derive(Debug, Clone, Copy)]
pub struct ConvGeometry<'a> {
    /// Kernel height and width.
    pub kernel_size: [usize; 2],
    /// Stride per spatial axis.
    pub stride: [usize; 2],
    /// Dilation per spatial axis.
    pub dilation: [usize; 2],
    /// Channel groups.
    pub groups: usize,
    /// Padding, resolved per input size.
    pub padding: &'a PaddingConfig2d,
}

/// A 2-D convolution of `x` with `weight` and `bias`, computed in the scope's precision: the
/// body of every autocast convolution layer, Burn's or [`crate::nn::Conv2d`].
pub fn conv2d_weights(
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    geometry: &ConvGeometry<'_>,
) -> Tensor<4> {
    let [_, _, height, width] = x.dims();
    let g = geometry;
    let pads = [
        padding_pair(g.padding, 0, height, g.kernel_size[0], g.stride[0]),
        padding_pair(g.padding, 1, width, g.kernel_size[1], g.stride[1]),
    ];
    let options = ConvOptions::new_with_padding(g.stride, pads, g.dilation, g.groups);
    let Some(dt) = compute_dtype() else {
        return crate::kernels::conv2d(x, weight, bias, options);
    };
    let weight = weight.cast(dt);
    let bias = bias.map(|b| b.cast(dt));
    plain_conv2d(x.cast(dt), weight, bias, options).cast(FloatDType::F32)
}

/// (start, end) padding of spatial axis `axis` (0 = height, 1 = width), resolved exactly as
/// `Conv2d::forward` does (Burn keeps its helper crate-private): `Same` puts the odd pixel at
/// the end, as ONNX does.
pub(crate) fn padding_pair(
    padding: &PaddingConfig2d,
    axis: usize,
    size: usize,
    kernel: usize,
    stride: usize,
) -> (usize, usize) {
    match *padding {
        PaddingConfig2d::Valid => (0, 0),
        PaddingConfig2d::Explicit(top, left, bottom, right) => {
            if axis == 0 {
                (top, bottom)
            } else {
                (left, right)
            }
        }
        PaddingConfig2d::Same => {
            let out = size.div_ceil(stride);
            let total = if out > 0 {
                ((out - 1) * stride + kernel).saturating_sub(size)
            } else {
                0
            };
            (total / 2, total - total / 2)
        }
    }
}

/// `a.matmul(b)`, computed in the scope's precision.
pub fn matmul<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    match compute_dtype() {
        None => a.matmul(b),
        Some(dt) => a.cast(dt).matmul(b.cast(dt)).cast(FloatDType::F32),
    }
}

/// Scaled dot-product attention with Burn's arguments ([`crate::kernels::transformer::
/// attention`]) under the scope's policy: where Kiln's CPU kernel serves (f32 operands on
/// `flex`) it runs in f32 whatever the scope — low precision on the CPU is emulated and
/// slower, and the kernel's softmax is f32 anyway; elsewhere inside a bf16/f16 scope the
/// operands and bias are cast to it and Burn's attention runs there (as `torch.autocast`
/// runs `scaled_dot_product_attention` in the low precision), the result cast back to f32.
pub fn attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: Option<Tensor<4, burn::tensor::Bool>>,
    bias: Option<Tensor<4>>,
    options: burn::tensor::ops::AttentionModuleOptions,
) -> Tensor<4> {
    match compute_dtype() {
        Some(dt) if !crate::kernels::serves(&query.device()) => burn::tensor::module::attention(
            query.cast(dt),
            key.cast(dt),
            value.cast(dt),
            mask,
            bias.map(|b| b.cast(dt)),
            options,
        )
        .cast(FloatDType::F32),
        _ => crate::kernels::transformer::attention(query, key, value, mask, bias, options),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(compute_dtype(), None);
        {
            let _outer = autocast(Precision::Bf16);
            assert_eq!(compute_dtype(), Some(FloatDType::BF16));
            {
                let _inner = autocast(Precision::F32);
                assert_eq!(compute_dtype(), None);
            }
            assert_eq!(compute_dtype(), Some(FloatDType::BF16));
        }
        assert_eq!(compute_dtype(), None);
    }

    #[test]
    fn scope_is_per_thread() {
        let _scope = autocast(Precision::F16);
        let other = std::thread::spawn(compute_dtype).join().ok().flatten();
        assert_eq!(other, None);
        assert_eq!(compute_dtype(), Some(FloatDType::F16));
    }
}
