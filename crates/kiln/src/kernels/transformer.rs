//! The transformer's operations on Burn tensors, forward and backward through Kiln's
//! kernels on `flex` for f32 ([`layer_norm`], [`gelu`], [`softmax`], [`attention`]) and
//! through Burn's own ops everywhere else (other devices, half precision, Kiln's kernels
//! switched off, a case a kernel does not cover). Each takes Burn's arguments in Burn's
//! order, so a model swaps `burn::tensor::activation::gelu` for `kiln::nn::gelu` and
//! nothing else.
//!
//! Why: a transformer block on Burn's ops is a long chain of small element-wise tensors —
//! LayerNorm seven passes, softmax five, GELU's erf a scalar libm call per value — and
//! under autodiff their backward steps as many again (BENCHMARKS.md run 57: U2, a user's
//! pre-LN encoder, trained at 0.38× PyTorch on the AVX-512 machine).

use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, DType, Tensor, activation};

use super::{KilnKernels, serves};
use burn::backend::Dispatch;

/// Whether the kernels serve these f32 tensors on this thread's device.
fn f32_served<const D: usize>(x: &Tensor<D>, others: &[DType]) -> bool {
    x.dtype() == DType::F32 && others.iter().all(|d| *d == DType::F32) && serves(&x.device())
}

/// LayerNorm over the last axis, `(x − mean)/√(var + ε)·γ + β` (biased variance), as
/// `burn::tensor::module::layer_norm`: Kiln's one-pass kernels forward and backward for
/// f32 on `flex`, Burn's op otherwise. Differentiable in `x`, `gamma` and `beta`.
pub fn layer_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    epsilon: f64,
) -> Tensor<D> {
    let [d] = gamma.dims();
    let mut dtypes = vec![gamma.dtype()];
    dtypes.extend(beta.as_ref().map(|b| b.dtype()));
    if D == 0 || x.dims()[D - 1] != d || d == 0 || !f32_served(&x, &dtypes) {
        return burn::tensor::module::layer_norm(x, gamma, beta, epsilon);
    }
    // The kernel's shift is a tensor always: without one, zeros (no gradient asked of it).
    let beta = beta.unwrap_or_else(|| Tensor::zeros([d], &x.device()));
    let y = <Dispatch as KilnKernels>::kiln_layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
    );
    Tensor::from_dispatch(y)
}

/// ReLU, `max(x, 0)`, as `burn::tensor::activation::relu`: Kiln's kernel forward (one
/// parallel pass into a new tensor) and backward (one pass from the saved output) for f32 on
/// `flex`, Burn's op otherwise. Differentiable. Why: Burn's ReLU and its autodiff backward
/// cost a MobileNet-style CNN about a fifth of its step (BENCHMARKS.md run 57); where a
/// BatchNorm precedes it, `kiln::nn::BatchNorm::forward_relu` removes the pass altogether.
pub fn relu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !f32_served(&x, &[]) {
        return burn::tensor::activation::relu(x);
    }
    Tensor::from_dispatch(<Dispatch as KilnKernels>::kiln_relu(x.into_dispatch()))
}

/// Exact GELU, `x·Φ(x)`, as `burn::tensor::activation::gelu`: Kiln's vectorized kernel
/// (erf by a branch-free polynomial, absolute error below 1.5e-7) forward and backward for
/// f32 on `flex`, Burn's op otherwise. Differentiable.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !f32_served(&x, &[]) {
        return activation::gelu(x);
    }
    Tensor::from_dispatch(<Dispatch as KilnKernels>::kiln_gelu(x.into_dispatch()))
}

/// Softmax along `dim`, as `burn::tensor::activation::softmax`: Kiln's kernels (one pass
/// for the maximum, one storing and summing the exponentials, one scaling; the backward one
/// pass) for f32 on `flex` along the last axis, Burn's op otherwise. Differentiable.
pub fn softmax<const D: usize>(x: Tensor<D>, dim: usize) -> Tensor<D> {
    if D == 0 || dim != D - 1 || !f32_served(&x, &[]) {
        return activation::softmax(x, dim);
    }
    Tensor::from_dispatch(<Dispatch as KilnKernels>::kiln_softmax(x.into_dispatch()))
}

/// Scaled dot-product attention, `softmax(QKᵀ·scale + mask + bias)·V`, with Burn's
/// arguments and semantics (`burn::tensor::module::attention`: `[batch, heads, positions,
/// features]` operands, `mask` true where a score is hidden, the causal mask aligned at the
/// bottom-right, a row with nothing visible gives zeros): Kiln's kernel — per (batch, head)
/// one GEMM for the scores, the softmax on each row in cache, one GEMM for the context;
/// the operands read through their strides — for f32 on `flex`, forward and backward
/// (differentiable in query, key, value and bias). Burn's op for a softcap, other dtypes
/// and devices, and a mask or bias that does not broadcast to the scores.
pub fn attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    bias: Option<Tensor<4>>,
    options: AttentionModuleOptions,
) -> Tensor<4> {
    let [b, h, tq, dk] = query.dims();
    let [kb, kh, tk, kd] = key.dims();
    let [vb, vh, vk, _] = value.dims();
    let same = [kb, vb] == [b, b] && [kh, vh] == [h, h] && kd == dk && vk == tk;
    let dtypes = [key.dtype(), value.dtype()];
    let Some(extras) = same
        .then(|| {
            KernelExtras::new(
                &query,
                &dtypes,
                mask.clone(),
                bias.clone(),
                [b, h, tq, tk],
                &options,
            )
        })
        .flatten()
    else {
        return burn_attention(query, key, value, mask, bias, options);
    };
    let scale = extras.scale(dk);
    let out = <Dispatch as KilnKernels>::kiln_attention(
        query.into_dispatch(),
        key.into_dispatch(),
        value.into_dispatch(),
        extras.mask.into_dispatch(),
        extras.bias.into_dispatch(),
        scale,
        options.is_causal,
    );
    Tensor::from_dispatch(out)
}

/// Self-attention of a packed QKV projection `qkv` `[batch, tokens, 3·heads·head_dim]` with
/// the heads merged back (`[batch, tokens, heads·head_dim]`) through Kiln's kernel, which
/// reads the queries, keys and values where the projection wrote them and writes the
/// projection's gradient in its own layout (no split, no merge copy, no zero-filled
/// gradient per part); `None` where the kernel does not serve (the caller composes Burn's
/// ops). Mask and bias as [`attention`]'s, over `[batch, heads, tokens, tokens]`.
pub(crate) fn qkv_attention(
    qkv: Tensor<3>,
    heads: usize,
    mask: Option<Tensor<4, Bool>>,
    bias: Option<Tensor<4>>,
    options: &AttentionModuleOptions,
) -> Option<Tensor<3>> {
    let [b, t, width] = qkv.dims();
    let fits = heads > 0 && width % (3 * heads) == 0 && width > 0;
    let extras = fits
        .then(|| KernelExtras::new(&qkv, &[], mask, bias, [b, heads, t, t], options))
        .flatten()?;
    let scale = extras.scale(width / (3 * heads));
    let out = <Dispatch as KilnKernels>::kiln_qkv_attention(
        qkv.into_dispatch(),
        extras.mask.into_dispatch(),
        extras.bias.into_dispatch(),
        heads,
        scale,
        options.is_causal,
    );
    Some(Tensor::from_dispatch(out))
}

/// The attention kernel's mask and bias as it takes them (float tensors, a single 0 for
/// none), when the kernel serves the call: f32 on `flex` with the kernels on, no softcap,
/// and a mask and bias that broadcast to the scores.
struct KernelExtras {
    mask: Tensor<4>,
    bias: Tensor<4>,
    scale: Option<f64>,
}

impl KernelExtras {
    fn new<const D: usize>(
        operand: &Tensor<D>,
        other_dtypes: &[DType],
        mask: Option<Tensor<4, Bool>>,
        bias: Option<Tensor<4>>,
        scores: [usize; 4],
        options: &AttentionModuleOptions,
    ) -> Option<KernelExtras> {
        let broadcasts =
            |dims: [usize; 4]| dims.iter().zip(&scores).all(|(m, s)| m == s || *m == 1);
        let mut dtypes = other_dtypes.to_vec();
        dtypes.extend(bias.as_ref().map(|t| t.dtype()));
        let ours = options.softcap.is_none()
            && mask.as_ref().is_none_or(|m| broadcasts(m.dims()))
            && bias.as_ref().is_none_or(|t| broadcasts(t.dims()))
            && f32_served(operand, &dtypes);
        if !ours {
            return None;
        }
        let device = operand.device();
        let none = || Tensor::<4>::zeros([1, 1, 1, 1], &device);
        Some(KernelExtras {
            // The kernel's mask is a float tensor (1 = hidden).
            mask: mask.map_or_else(none, |m| m.float()),
            // Expanded to the scores' shape (a view, no copy): the gradient the kernel returns
            // has that shape, and the expansion's backward sums it over the broadcast axes.
            bias: bias.map_or_else(none, |b| b.expand(scores)),
            scale: options.scale,
        })
    }

    /// The call's scale, `1/√head_dim` by default (Burn's and PyTorch's).
    fn scale(&self, head_dim: usize) -> f64 {
        self.scale
            .unwrap_or_else(|| 1.0 / (head_dim.max(1) as f64).sqrt())
    }
}
