//! Activations on Burn tensors: Kiln's vectorized slice kernels ([`kiln_kernels::activation`])
//! where Kiln's kernels serve an f32 tensor without an autodiff graph, Burn's operator
//! elsewhere.

use burn::tensor::{DType, Tensor, TensorData, activation};

use kiln_kernels::activation::{erf_in_place, sigmoid_in_place};

use super::serves;

/// `1 / (1 + e^(-x))`: Kiln's vectorized kernel for f32 on `flex`, Burn's sigmoid otherwise.
/// Inference only: the result carries no autodiff graph of its own.
pub fn sigmoid<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    on_host(x, "kiln.sigmoid", sigmoid_in_place, activation::sigmoid)
}

/// The error function, vectorized on `flex` for f32 (Burn's `erf` is a scalar libm call per
/// value: 13% of ConvNeXt-tiny's batch-1 time, BENCHMARKS run 31), Burn's elsewhere.
/// Inference only.
pub fn erf<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    on_host(x, "kiln.erf", erf_in_place, |x| x.erf())
}

/// Exact GELU, `x · (1 + erf(x / √2)) / 2`, on the vectorized `erf`: the differentiable
/// [`super::transformer::gelu`] (the same kernel with and without autodiff).
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    super::transformer::gelu(x)
}

/// `kernel` over `x`'s values on the host where Kiln's kernels serve an f32 tensor without
/// an autodiff graph; `fallback` (Burn's operator) otherwise.
fn on_host<const D: usize>(
    x: Tensor<D>,
    span: &'static str,
    kernel: fn(&mut [f32]),
    fallback: impl FnOnce(Tensor<D>) -> Tensor<D>,
) -> Tensor<D> {
    if x.dtype() != DType::F32 || !serves(&x.device()) || x.is_require_grad() {
        return fallback(x);
    }
    let (device, dims) = (x.device(), x.dims());
    let _op = tracing::trace_span!("kiln.activation", op = span, shape = ?dims).entered();
    let Ok(mut values) = x.clone().into_data().try_into_vec::<f32>() else {
        return fallback(x);
    };
    kernel(&mut values);
    Tensor::from_data(TensorData::new(values, dims), &device)
}
