//! A vectorized logistic sigmoid for inference on the CPU.
//!
//! Burn's `flex` sigmoid is a scalar `1 / (1 + expf(-x))` per element: 60% of EfficientNet-B0's
//! batch-1 time in BENCHMARKS run 20 (49 SiLU and squeeze-excitation gates). Here `exp` is a
//! branch-free Cody–Waite range reduction with a degree-6 polynomial (relative error below
//! 2e-7 over the clamped range), written so the loop vectorizes: compiled for AVX-512, for
//! AVX2 + FMA and for the baseline by the kernels' `multiversion!` (the instruction set
//! `KILN_F32_KERNEL` or the CPU picks), in parallel over chunks. Erf and GELU are built the
//! same way. On AVX-512 the sigmoid and SiLU run one pass of intrinsics instead, whose
//! reciprocal estimate replaces the loop's division (BENCHMARKS run 34: SiLU 47–50 → 37–39 µs
//! per EfficientNet-B0 call).

use burn::tensor::{DType, Tensor, TensorData, activation};
use rayon::prelude::*;

use super::serves;

/// Elements per parallel task: large enough that a task outweighs its scheduling.
const CHUNK: usize = 1 << 15;

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

/// Exact GELU, `x · (1 + erf(x / √2)) / 2`, on the vectorized `erf` (as [`erf`]).
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    on_host(x, "kiln.gelu", gelu_in_place, activation::gelu)
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

/// Replaces each value by its error function, in parallel chunks.
pub fn erf_in_place(values: &mut [f32]) {
    in_chunks(values, erf_slice);
}

/// Replaces each value by its exact GELU, in parallel chunks.
pub fn gelu_in_place(values: &mut [f32]) {
    in_chunks(values, gelu_slice);
}

/// Runs `slice` over `values`, in parallel chunks when there are many.
fn in_chunks(values: &mut [f32], slice: impl Fn(&mut [f32]) + Send + Sync) {
    if values.len() <= CHUNK {
        slice(values);
    } else {
        values.par_chunks_mut(CHUNK).for_each(slice);
    }
}

multiversion! {
    fn erf_slice(values: &mut [f32]) {
        for x in values.iter_mut() {
            *x = erf_one(*x);
        }
    }
}

multiversion! {
    fn gelu_slice(values: &mut [f32]) {
        for x in values.iter_mut() {
            *x *= 0.5 * (1.0 + erf_one(*x * std::f32::consts::FRAC_1_SQRT_2));
        }
    }
}

/// `erf(x)` by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7): `1 − p(t)·e^(−x²)`
/// with `t = 1 / (1 + 0.3275911·|x|)`, the sign restored; branch-free so loops vectorize.
#[inline(always)]
fn erf_one(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let p = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_8 + t * (-1.453_152 + t * 1.061_405_4))));
    (1.0 - p * exp(-a * a)).copysign(x)
}

/// Replaces each value by its sigmoid, in parallel chunks.
pub fn sigmoid_in_place(values: &mut [f32]) {
    in_chunks(values, |chunk| logistic(chunk, false));
}

/// Replaces each value `x` by `x · sigmoid(x)` (SiLU, "swish"), in parallel chunks: one pass
/// where the exported graph computes a sigmoid and then a product (EfficientNet's 49 gates).
pub fn silu_in_place(values: &mut [f32]) {
    in_chunks(values, |chunk| logistic(chunk, true));
}

/// [`logistic_slice`], or on AVX-512 [`logistic_avx512`]: there the portable loop spent most
/// of its time waiting on `vdivps` (57% of its samples, EfficientNet-B0 under `perf`).
fn logistic(values: &mut [f32], times_x: bool) {
    #[cfg(target_arch = "x86_64")]
    if super::implicit::F32Kernel::detect() == super::implicit::F32Kernel::Avx512 {
        // SAFETY: `detect` picks AVX-512 only where the CPU has it.
        return unsafe { logistic_avx512(values, times_x) };
    }
    logistic_slice(values, times_x);
}

/// The sigmoid (or SiLU) in one pass of AVX-512 intrinsics: [`exp`]'s reduction and
/// polynomial with fused multiply-adds, `2^k` by `vscalefps`, and `1 / (1 + e^(-x))` by the
/// reciprocal estimate plus one Newton step `r + r·(1 − d·r)` (the estimate's 2^-14 error
/// squared; exact where the estimate is, so σ(0) = ½ and σ(∞) = 1 stay exact). The tail
/// that fills no register runs the portable loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn logistic_avx512(values: &mut [f32], times_x: bool) {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm512_set1_ps(v);
    let (lo, hi, log2e) = (c(-87.3), c(88.3), c(std::f32::consts::LOG2_E));
    let (ln2_hi, ln2_lo, one) = (c(LN2_HI), c(LN2_LO), c(1.0));
    let taylor = [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ]
    .map(c);
    let mut lanes = values.chunks_exact_mut(16);
    for lane in &mut lanes {
        // SAFETY: `lane` holds 16 values.
        let v = unsafe { _mm512_loadu_ps(lane.as_ptr()) };
        let x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), v), lo), hi);
        // Round to nearest even (the portable `round_ties_even`).
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, log2e),
        );
        let r = _mm512_fnmadd_ps(k, ln2_lo, _mm512_fnmadd_ps(k, ln2_hi, x));
        let p = taylor[1..]
            .iter()
            .fold(taylor[0], |p, &t| _mm512_fmadd_ps(p, r, t));
        let d = _mm512_add_ps(one, _mm512_scalef_ps(p, k));
        let e = _mm512_rcp14_ps(d);
        let e = _mm512_fmadd_ps(e, _mm512_fnmadd_ps(d, e, one), e);
        let y = if times_x { _mm512_mul_ps(v, e) } else { e };
        // SAFETY: as the load.
        unsafe { _mm512_storeu_ps(lane.as_mut_ptr(), y) };
    }
    logistic_slice(lanes.into_remainder(), times_x);
}

multiversion! {
    /// Sigmoid, or with `times_x` SiLU, of every value.
    fn logistic_slice(values: &mut [f32], times_x: bool) {
        if times_x {
            for v in values.iter_mut() {
                *v /= 1.0 + exp(-*v);
            }
        } else {
            for v in values.iter_mut() {
                *v = 1.0 / (1.0 + exp(-*v));
            }
        }
    }
}

/// ln 2 split in two so `k·ln2` subtracts exactly (Cody–Waite).
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;

/// `e^x` without branches: `x = k·ln2 + r`, `e^x = 2^k · p(r)`, `|r| ≤ ln2/2`.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Below −87.3 the result is subnormal or zero, above 88.3 infinite; clamping keeps the
    // exponent arithmetic in range (the sigmoid is then exactly 0 or 1 anyway).
    let x = x.clamp(-87.3, 88.3);
    let k = (x * LOG2E).round_ties_even();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    // Taylor coefficients 1/n! to degree 6: error < 2e-7 relative on |r| ≤ 0.347.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^k from its exponent bits. `k as i32` would be a saturating conversion, which LLVM
    // leaves scalar (perf showed this loop as `vcvttss2si` + `cmova` per value); instead
    // k + 127 + 2^23 has k + 127 as its low mantissa bits (k is whole and in [-126, 128]),
    // and shifting them up by 23 makes them the exponent: all vector integer operations.
    let bits = (k + (8_388_608.0 + 127.0)).to_bits() << 23;
    p * f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against f64: relative error below 1e-6 where the sigmoid is a normal f32 (|x| ≤ 80),
    /// absolute error below 1e-7 beyond, exact 1 and ½ where they are exact.
    #[test]
    fn matches_f64_sigmoid() {
        let xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.05).collect();
        let mut ys = xs.clone();
        sigmoid_in_place(&mut ys);
        let (mut relative, mut absolute) = (0f64, 0f64);
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            let err = (y as f64 - want).abs();
            absolute = absolute.max(err);
            if x.abs() <= 80.0 {
                relative = relative.max(err / want);
            }
        }
        assert!(relative < 1e-6, "relative error {relative:e}");
        assert!(absolute < 1e-7, "absolute error {absolute:e}");
        let mut edges = [f32::MAX, f32::MIN, 100.0, -100.0, 0.0];
        sigmoid_in_place(&mut edges);
        assert_eq!(edges[0], 1.0);
        assert!(edges[1] < 1e-37 && edges[3] < 1e-37);
        assert_eq!(edges[4], 0.5);
        assert!(edges.iter().all(|v| v.is_finite() && *v >= 0.0));
    }

    /// erf and GELU against an f64 series (|x| ≤ 3, where the series converges in f64) and
    /// the tails (erf within 3e-5 of ±1 beyond 3).
    #[test]
    fn erf_and_gelu_match_f64() {
        fn erf64(x: f64) -> f64 {
            let (mut term, mut sum) = (x, x);
            for n in 1..200 {
                term *= -x * x / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        }
        let xs: Vec<f32> = (-300..=300).map(|i| i as f32 * 0.01).collect();
        let mut ys = xs.clone();
        erf_in_place(&mut ys);
        let mut gs = xs.clone();
        gelu_in_place(&mut gs);
        for ((&x, &y), &g) in xs.iter().zip(&ys).zip(&gs) {
            let want = erf64(x as f64);
            assert!(
                (y as f64 - want).abs() < 5e-7,
                "erf({x}) = {y}, want {want}"
            );
            let gelu = x as f64 * 0.5 * (1.0 + erf64(x as f64 / 2f64.sqrt()));
            assert!(
                (g as f64 - gelu).abs() < 1e-6,
                "gelu({x}) = {g}, want {gelu}"
            );
        }
        let mut tails = [3.5f32, -4.0, 10.0, -100.0, f32::MAX];
        erf_in_place(&mut tails);
        assert!(
            tails.iter().all(|v| v.abs() > 0.99997 && v.abs() <= 1.0),
            "{tails:?}"
        );
        assert!(tails[1] < 0.0 && tails[0] > 0.0);
    }

    /// SiLU against f64 `x · sigmoid(x)`, relative to the largest output.
    #[test]
    fn silu_matches_f64() {
        let xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.05).collect();
        let mut ys = xs.clone();
        silu_in_place(&mut ys);
        let worst = xs
            .iter()
            .zip(&ys)
            .map(|(&x, &y)| {
                let x = x as f64;
                (y as f64 - x / (1.0 + (-x).exp())).abs()
            })
            .fold(0f64, f64::max);
        assert!(worst / 100.0 < 1e-6, "error {worst:e}");
    }
}
