//! Activations for inference on the CPU: [`Activation`] applied in place to slices, and per
//! register ([`activate16`], [`activate8`]) in the convolutions' stores; a vectorized logistic
//! sigmoid, erf and GELU underneath.
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

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::base::threads::PARALLEL_MIN;

/// Elements per parallel task: large enough that a task outweighs its scheduling.
const CHUNK: usize = 1 << 15;

/// An activation applied in place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// Clamp to `[min, max]`.
    Clip(f32, f32),
    /// `1 / (1 + e^(-x))`.
    Sigmoid,
    /// `clamp(alpha·x + beta, 0, 1)`.
    HardSigmoid(f32, f32),
    /// `x · clamp(x/6 + 1/2, 0, 1)`.
    HardSwish,
    /// `x · sigmoid(x)`.
    Silu,
    /// Exact GELU, `x · (1 + erf(x / √2)) / 2`: transformers' and ConvNeXt's MLP
    /// activation, which PyTorch exports as five nodes (Div, Erf, Add, Mul, Mul).
    Gelu,
}

impl Activation {
    /// The `[lo, hi]` of an activation that is a clamp (ReLU: `[0, ∞]`, Clip), which kernels
    /// apply in their registers; `None` for the others.
    pub fn bounds(self) -> Option<[f32; 2]> {
        match self {
            Activation::Relu => Some([0.0, f32::INFINITY]),
            Activation::Clip(lo, hi) => Some([lo, hi]),
            _ => None,
        }
    }

    /// `act` split the way the kernels apply it: the bounds of a clamp (in the registers
    /// before the store) and any other activation (on the stored values right after).
    pub fn split(act: Option<Activation>) -> (Option<[f32; 2]>, Option<Activation>) {
        let clamp = act.and_then(Activation::bounds);
        (clamp, act.filter(|_| clamp.is_none()))
    }

    /// The definition in f64, what the kernels are checked against.
    #[cfg(test)]
    pub(crate) fn reference(self, v: f64) -> f64 {
        match self {
            Activation::Relu => v.max(0.0),
            Activation::Clip(lo, hi) => v.clamp(lo as f64, hi as f64),
            Activation::HardSigmoid(a, b) => (a as f64 * v + b as f64).clamp(0.0, 1.0),
            Activation::HardSwish => v * (v / 6.0 + 0.5).clamp(0.0, 1.0),
            Activation::Sigmoid => 1.0 / (1.0 + (-v).exp()),
            Activation::Silu => v / (1.0 + (-v).exp()),
            Activation::Gelu => v * 0.5 * (1.0 + erf64(v / std::f64::consts::SQRT_2)),
        }
    }
}

/// erf in f64 for the tests' references: the Maclaurin series where it converges in f64
/// (|x| ≤ 4, its terms' cancellation leaves ~1e-10), ±1 beyond (erfc(4) < 2e-8).
#[cfg(test)]
pub(crate) fn erf64(x: f64) -> f64 {
    if x.abs() > 4.0 {
        return x.signum();
    }
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// Applies `act` to every value, in parallel chunks when there are many.
pub fn activate(values: &mut [f32], act: Activation) {
    match act {
        Activation::Sigmoid => return sigmoid_in_place(values),
        Activation::Silu => return silu_in_place(values),
        Activation::Gelu => return gelu_in_place(values),
        _ => {}
    }
    if values.len() < PARALLEL_MIN {
        activate_slice(values, act);
    } else {
        values
            .par_chunks_mut(PARALLEL_MIN)
            .for_each(|chunk| activate_slice(chunk, act));
    }
}

multiversion! {
    /// [`activate`] of one chunk, on the calling thread.
    pub(crate) fn activate_slice(values: &mut [f32], act: Activation) {
        match act {
            Activation::Relu => values.iter_mut().for_each(|v| *v = v.max(0.0)),
            Activation::Clip(lo, hi) => values.iter_mut().for_each(|v| *v = v.max(lo).min(hi)),
            Activation::HardSigmoid(a, b) => values
                .iter_mut()
                .for_each(|v| *v = (a * *v + b).clamp(0.0, 1.0)),
            Activation::HardSwish => values
                .iter_mut()
                .for_each(|v| *v *= (*v * (1.0 / 6.0) + 0.5).clamp(0.0, 1.0)),
            Activation::Sigmoid => sigmoid_in_place(values),
            Activation::Silu => silu_in_place(values),
            Activation::Gelu => gelu_slice(values),
        }
    }
}

/// Replaces each value by its error function, in parallel chunks.
pub fn erf_in_place(values: &mut [f32]) {
    in_chunks(values, erf_slice);
}

/// Replaces each value by its exact GELU, in parallel chunks.
pub fn gelu_in_place(values: &mut [f32]) {
    in_chunks(values, gelu_slice);
}

/// The exact GELU of every value of `x`, into a new vector: each chunk copied and
/// transformed while it is in cache (one pass over memory, where a copy of the whole input
/// and then [`gelu_in_place`] made two).
pub fn gelu_of(x: &[f32]) -> Vec<f32> {
    map_chunks(x, |src, dst| {
        for (o, &v) in dst.iter_mut().zip(src) {
            *o = MaybeUninit::new(v);
        }
        // SAFETY: every value of the chunk was just written.
        gelu_slice(unsafe { crate::base::buffers::assume_init(dst) });
    })
}

/// A new vector from `x` by `chunk`, which writes every value of its output chunk from the
/// input chunk of the same place: one chunk on this thread when `x` is small, chunks of
/// [`CHUNK`] over the pool otherwise.
fn map_chunks(x: &[f32], chunk: impl Fn(&[f32], &mut [MaybeUninit<f32>]) + Sync) -> Vec<f32> {
    crate::base::buffers::filled(x.len(), |out| {
        if x.len() <= CHUNK {
            chunk(x, out);
        } else {
            x.par_chunks(CHUNK)
                .zip(out.par_chunks_mut(CHUNK))
                .for_each(|(x, out)| chunk(x, out));
        }
    })
}

/// [`map_chunks`] over two equally long inputs (a gradient from a saved tensor and the
/// output gradient).
fn zip_chunks(
    a: &[f32],
    b: &[f32],
    chunk: impl Fn(&[f32], &[f32], &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    crate::base::buffers::filled(a.len(), |out| {
        if a.len() <= CHUNK {
            chunk(a, b, out);
        } else {
            a.par_chunks(CHUNK)
                .zip(b.par_chunks(CHUNK))
                .zip(out.par_chunks_mut(CHUNK))
                .for_each(|((a, b), out)| chunk(a, b, out));
        }
    })
}

/// `max(x, 0)` into a new vector, in parallel chunks: one read and one write per value (the
/// training ReLU's forward, where the input must survive for the autodiff graph).
pub fn relu_of(x: &[f32]) -> Vec<f32> {
    map_chunks(x, relu_into)
}

multiversion! {
    /// [`relu_of`] of one chunk, on the calling thread.
    fn relu_into(x: &[f32], out: &mut [MaybeUninit<f32>]) {
        for (o, &v) in out.iter_mut().zip(x) {
            o.write(v.max(0.0));
        }
    }
}

/// ReLU's gradient from its output `y` and the output gradient `dy`: `dy` where `y > 0`,
/// zero elsewhere (PyTorch's and Burn's convention at 0), in one pass into a new vector.
pub fn relu_backward(y: &[f32], dy: &[f32]) -> Vec<f32> {
    assert_eq!(y.len(), dy.len(), "ReLU gradient length");
    zip_chunks(y, dy, relu_grad_into)
}

multiversion! {
    /// [`relu_backward`] of one chunk, on the calling thread.
    fn relu_grad_into(y: &[f32], dy: &[f32], dx: &mut [MaybeUninit<f32>]) {
        for ((d, &v), &g) in dx.iter_mut().zip(y).zip(dy) {
            d.write(if v > 0.0 { g } else { 0.0 });
        }
    }
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

/// GELU of every value: on AVX-512 [`gelu16`] per register (the reciprocal estimate and
/// fused multiply-adds; the portable loop's `vdivps` made it 1.4× slower on BERT's
/// feed-forward rows, `cargo bench --bench int8_linear`, BENCHMARKS.md run 43).
fn gelu_slice(values: &mut [f32]) {
    gelu_with(crate::base::isa::F32Kernel::detect(), values);
}

/// [`gelu_slice`] through `kernel`'s path (the tests run every supported one).
fn gelu_with(kernel: crate::base::isa::F32Kernel, values: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match kernel {
        // SAFETY: `detect` picks an instruction set only where the CPU has it.
        crate::base::isa::F32Kernel::Avx512 => return unsafe { gelu_avx512(values) },
        // SAFETY: as above.
        crate::base::isa::F32Kernel::Avx2 => return unsafe { gelu_avx2(values) },
        crate::base::isa::F32Kernel::Portable => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernel;
    gelu_portable(values);
}

/// [`gelu8`] over the slice, the tail through a padded register too: every value gets the
/// same bits wherever it sits (the int8 epilogue's rectangles end anywhere, and a row's tail
/// through the portable loop differed in the last bit from the same value in a register).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_avx2(values: &mut [f32]) {
    use std::arch::x86_64::*;
    let whole = values.len() / 8 * 8;
    let (regs, rest) = values.split_at_mut(whole);
    for lane in regs.chunks_exact_mut(8) {
        // SAFETY: each chunk holds exactly 8 values.
        unsafe { _mm256_storeu_ps(lane.as_mut_ptr(), gelu8(_mm256_loadu_ps(lane.as_ptr()))) };
    }
    if !rest.is_empty() {
        let mut pad = [0f32; 8];
        pad[..rest.len()].copy_from_slice(rest);
        // SAFETY: `pad` holds 8 values.
        unsafe { _mm256_storeu_ps(pad.as_mut_ptr(), gelu8(_mm256_loadu_ps(pad.as_ptr()))) };
        rest.copy_from_slice(&pad[..rest.len()]);
    }
}

/// [`gelu16`] over a slice, the tail through a masked register too: every value gets the
/// same bits wherever it sits (the int8 epilogue's rectangles end anywhere).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn gelu_avx512(values: &mut [f32]) {
    use std::arch::x86_64::*;
    for lane in values.chunks_mut(16) {
        let mask: __mmask16 = ((1u32 << lane.len()) - 1) as __mmask16;
        // SAFETY: the mask covers `lane`'s values only.
        let v = unsafe { _mm512_maskz_loadu_ps(mask, lane.as_ptr()) };
        // SAFETY: as the load.
        unsafe { _mm512_mask_storeu_ps(lane.as_mut_ptr(), mask, gelu16(v)) };
    }
}

multiversion! {
    fn gelu_portable(values: &mut [f32]) {
        for x in values.iter_mut() {
            *x *= 0.5 * (1.0 + erf_one(*x * std::f32::consts::FRAC_1_SQRT_2));
        }
    }
}

/// The gradient of exact GELU at `x` times the output's gradient `dy`: `dy · (Φ(x) + x·φ(x))`,
/// `Φ` the normal distribution (`(1 + erf(x/√2))/2`) and `φ` its density, in one pass where
/// Burn's autodiff takes a dozen (erf, exp, products and sums, each a new tensor).
///
/// # Panics
/// When the lengths differ.
pub fn gelu_backward(x: &[f32], dy: &[f32]) -> Vec<f32> {
    assert_eq!(x.len(), dy.len(), "GELU gradient length");
    zip_chunks(x, dy, gelu_grad_slice)
}

/// `1/√(2π)`: the normal density's factor.
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// [`gelu_backward`] on this thread: per register of intrinsics on AVX-512 ([`gelu_grad16`])
/// and AVX2 ([`gelu_grad8`]) — the portable loop's division and erf made it 3 ns a value
/// (U2's feed-forward gradient under `perf`) — the portable loop elsewhere and for AVX2's
/// tail.
fn gelu_grad_slice(x: &[f32], dy: &[f32], dx: &mut [std::mem::MaybeUninit<f32>]) {
    gelu_grad_with(crate::base::isa::F32Kernel::detect(), x, dy, dx);
}

/// [`gelu_grad_slice`] through `kernel`'s path (the tests run every supported one).
fn gelu_grad_with(
    kernel: crate::base::isa::F32Kernel,
    x: &[f32],
    dy: &[f32],
    dx: &mut [std::mem::MaybeUninit<f32>],
) {
    #[cfg(target_arch = "x86_64")]
    match kernel {
        // SAFETY: `detect` picks an instruction set only where the CPU has it.
        crate::base::isa::F32Kernel::Avx512 => return unsafe { gelu_grad_avx512(x, dy, dx) },
        // SAFETY: as above.
        crate::base::isa::F32Kernel::Avx2 => return unsafe { gelu_grad_avx2(x, dy, dx) },
        crate::base::isa::F32Kernel::Portable => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernel;
    gelu_grad_portable(x, dy, dx);
}

multiversion! {
    fn gelu_grad_portable(x: &[f32], dy: &[f32], dx: &mut [std::mem::MaybeUninit<f32>]) {
        for ((o, &v), &d) in dx.iter_mut().zip(x).zip(dy) {
            let cdf = 0.5 * (1.0 + erf_one(v * std::f32::consts::FRAC_1_SQRT_2));
            // x·φ(x) for x within ±12, where it is already below 1e-30: beyond, the floor
            // that keeps e^(−x²/2) from going subnormal (see `erf_one`) times a huge x
            // would no longer be 0.
            let t = v.clamp(-12.0, 12.0);
            let pdf = INV_SQRT_2PI * exp((-0.5 * t * t).max(ERF_EXP_MIN));
            *o = std::mem::MaybeUninit::new(d * (cdf + t * pdf));
        }
    }
}

/// [`gelu_grad16`] over the slices, the tail through masked registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn gelu_grad_avx512(x: &[f32], dy: &[f32], dx: &mut [std::mem::MaybeUninit<f32>]) {
    use std::arch::x86_64::*;
    for ((xs, ds), os) in x.chunks(16).zip(dy.chunks(16)).zip(dx.chunks_mut(16)) {
        let mask: __mmask16 = ((1u32 << xs.len()) - 1) as __mmask16;
        // SAFETY: the mask covers the chunk's values only (the three chunks are as long).
        unsafe {
            let v = _mm512_maskz_loadu_ps(mask, xs.as_ptr());
            let d = _mm512_maskz_loadu_ps(mask, ds.as_ptr());
            _mm512_mask_storeu_ps(os.as_mut_ptr().cast(), mask, gelu_grad16(v, d));
        }
    }
}

/// [`gelu_grad8`] over the slices' whole registers, the portable loop for the rest.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_grad_avx2(x: &[f32], dy: &[f32], dx: &mut [std::mem::MaybeUninit<f32>]) {
    use std::arch::x86_64::*;
    let whole = x.len() / 8 * 8;
    let regs = x[..whole].chunks_exact(8).zip(dy[..whole].chunks_exact(8));
    for ((xs, ds), os) in regs.zip(dx[..whole].chunks_exact_mut(8)) {
        // SAFETY: each chunk holds exactly 8 values.
        unsafe {
            let v = _mm256_loadu_ps(xs.as_ptr());
            let d = _mm256_loadu_ps(ds.as_ptr());
            _mm256_storeu_ps(os.as_mut_ptr().cast(), gelu_grad8(v, d));
        }
    }
    gelu_grad_portable(&x[whole..], &dy[whole..], &mut dx[whole..]);
}

/// `d · (Φ(v) + v·φ(v))` of 16 lanes: [`gelu16`]'s erf (reciprocal estimate and a Newton
/// step), whose `e^(−v²/2)` is also the density's exponential; `v·φ(v)` set to 0 where
/// `v²/2` passes the exponential's floor (there it is below 1e-35, and the floored
/// exponential times a huge `v` would not be).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn gelu_grad16(
    v: std::arch::x86_64::__m512,
    d: std::arch::x86_64::__m512,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm512_set1_ps(v);
    let one = c(1.0);
    let u = _mm512_mul_ps(v, c(std::f32::consts::FRAC_1_SQRT_2));
    let a = _mm512_abs_ps(u);
    let den = _mm512_fmadd_ps(a, c(ERF_P), one);
    let t = _mm512_rcp14_ps(den);
    let t = _mm512_fmadd_ps(t, _mm512_fnmadd_ps(den, t, one), t);
    let p = _mm512_mul_ps(
        t,
        ERF_A[1..]
            .iter()
            .fold(c(ERF_A[0]), |p, &k| _mm512_fmadd_ps(p, t, c(k))),
    );
    let a2 = _mm512_mul_ps(a, a);
    let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), a2));
    let magnitude = _mm512_fnmadd_ps(p, e, one);
    let sign = _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(i32::MIN));
    let erf = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
    let cdf = _mm512_mul_ps(c(0.5), _mm512_add_ps(one, erf));
    let live = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a2, c(-ERF_EXP_MIN));
    let v_pdf = _mm512_maskz_mul_ps(live, _mm512_mul_ps(v, c(INV_SQRT_2PI)), e);
    _mm512_mul_ps(d, _mm512_add_ps(cdf, v_pdf))
}

/// [`gelu_grad16`] on 8 lanes of AVX2 (a true division, as [`gelu8`]).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn gelu_grad8(
    v: std::arch::x86_64::__m256,
    d: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm256_set1_ps(v);
    let one = c(1.0);
    let u = _mm256_mul_ps(v, c(std::f32::consts::FRAC_1_SQRT_2));
    let sign_bit = c(-0.0);
    let a = _mm256_andnot_ps(sign_bit, u);
    let t = _mm256_div_ps(one, _mm256_fmadd_ps(a, c(ERF_P), one));
    let p = _mm256_mul_ps(
        t,
        ERF_A[1..]
            .iter()
            .fold(c(ERF_A[0]), |p, &k| _mm256_fmadd_ps(p, t, c(k))),
    );
    let a2 = _mm256_mul_ps(a, a);
    let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a2));
    let magnitude = _mm256_fnmadd_ps(p, e, one);
    let erf = _mm256_or_ps(magnitude, _mm256_and_ps(u, sign_bit));
    let cdf = _mm256_mul_ps(c(0.5), _mm256_add_ps(one, erf));
    let live = _mm256_cmp_ps::<_CMP_LT_OQ>(a2, c(-ERF_EXP_MIN));
    let v_pdf = _mm256_and_ps(live, _mm256_mul_ps(_mm256_mul_ps(v, c(INV_SQRT_2PI)), e));
    _mm256_mul_ps(d, _mm256_add_ps(cdf, v_pdf))
}

/// `erf(x)` by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7): `1 − p(t)·e^(−x²)`
/// with `t = 1 / (1 + 0.3275911·|x|)`, the sign restored; branch-free so loops vectorize.
#[inline(always)]
fn erf_one(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + ERF_P * a);
    let p = t * ERF_A[1..].iter().fold(ERF_A[0], |p, &k| p * t + k);
    // e^(−a²) no smaller than e^−80: below it `p · e` would be subnormal, and a multiply
    // with a subnormal result takes a microcode assist of ~150 cycles on Intel cores (GELU of
    // large negative inputs ran at 10 cycles per value). `1 − p·e` is exactly 1.0 there
    // either way (erfc(√80) < 1e-36).
    (1.0 - p * exp((-a * a).max(ERF_EXP_MIN))).copysign(x)
}

/// The smallest exponent [`erf_one`] passes to [`exp`] (see there).
const ERF_EXP_MIN: f32 = -80.0;

/// Abramowitz & Stegun 7.1.26: `t = 1 / (1 + ERF_P·|x|)`, and the polynomial's coefficients
/// `a5 … a1` in Horner order (`p(t) = t·(a1 + t·(a2 + …))`).
const ERF_P: f32 = 0.327_591_1;
const ERF_A: [f32; 5] = [
    1.061_405_4,
    -1.453_152,
    1.421_413_8,
    -0.284_496_74,
    0.254_829_6,
];

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
    if crate::base::isa::F32Kernel::detect() == crate::base::isa::F32Kernel::Avx512 {
        // SAFETY: `detect` picks AVX-512 only where the CPU has it.
        return unsafe { logistic_avx512(values, times_x) };
    }
    logistic_slice(values, times_x);
}

/// The sigmoid (or SiLU) in one pass of AVX-512 intrinsics ([`logistic16`] per register).
/// The tail that fills no register runs the portable loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn logistic_avx512(values: &mut [f32], times_x: bool) {
    use std::arch::x86_64::*;
    let mut lanes = values.chunks_exact_mut(16);
    for lane in &mut lanes {
        // SAFETY: `lane` holds 16 values.
        let v = unsafe { _mm512_loadu_ps(lane.as_ptr()) };
        // SAFETY: as the load.
        unsafe { _mm512_storeu_ps(lane.as_mut_ptr(), logistic16(v, times_x)) };
    }
    logistic_slice(lanes.into_remainder(), times_x);
}

/// `act` of 16 lanes, for a kernel's store on AVX-512 (the convolutions' epilogues). A clamp
/// takes `max(v, lo)` first, which turns a NaN into `lo` as the unfused ReLU does.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) fn activate16(
    v: std::arch::x86_64::__m512,
    act: Activation,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm512_set1_ps(v);
    let clamp = |v, lo, hi| _mm512_min_ps(_mm512_max_ps(v, c(lo)), c(hi));
    match act {
        Activation::Relu => _mm512_max_ps(v, _mm512_setzero_ps()),
        Activation::Clip(lo, hi) => clamp(v, lo, hi),
        Activation::Sigmoid => logistic16(v, false),
        Activation::Silu => logistic16(v, true),
        Activation::Gelu => gelu16(v),
        Activation::HardSigmoid(a, b) => clamp(_mm512_fmadd_ps(v, c(a), c(b)), 0.0, 1.0),
        Activation::HardSwish => {
            _mm512_mul_ps(v, clamp(_mm512_fmadd_ps(v, c(1.0 / 6.0), c(0.5)), 0.0, 1.0))
        }
    }
}

/// `act` of 8 lanes, for a kernel's store on AVX2 + FMA (as [`activate16`]).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn activate8(
    v: std::arch::x86_64::__m256,
    act: Activation,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm256_set1_ps(v);
    let clamp = |v, lo, hi| _mm256_min_ps(_mm256_max_ps(v, c(lo)), c(hi));
    match act {
        Activation::Relu => _mm256_max_ps(v, _mm256_setzero_ps()),
        Activation::Clip(lo, hi) => clamp(v, lo, hi),
        Activation::Sigmoid => logistic8(v, false),
        Activation::Silu => logistic8(v, true),
        Activation::Gelu => gelu8(v),
        Activation::HardSigmoid(a, b) => clamp(_mm256_fmadd_ps(v, c(a), c(b)), 0.0, 1.0),
        Activation::HardSwish => {
            _mm256_mul_ps(v, clamp(_mm256_fmadd_ps(v, c(1.0 / 6.0), c(0.5)), 0.0, 1.0))
        }
    }
}

/// σ(v), or with `times_x` v·σ(v), of 16 lanes: [`exp`]'s reduction and polynomial with
/// fused multiply-adds, `2^k` by `vscalefps`, and `1 / (1 + e^(-x))` by the reciprocal
/// estimate plus one Newton step `r + r·(1 − d·r)` (the estimate's 2^-14 error squared;
/// exact where the estimate is, so σ(0) = ½ and σ(∞) = 1 stay exact). The portable loop spent
/// most of its time waiting on `vdivps` (57% of its samples, EfficientNet-B0 under `perf`).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) fn logistic16(v: std::arch::x86_64::__m512, times_x: bool) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm512_set1_ps(v);
    let one = c(1.0);
    let d = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), v)));
    let e = _mm512_rcp14_ps(d);
    let e = _mm512_fmadd_ps(e, _mm512_fnmadd_ps(d, e, one), e);
    if times_x {
        // Below EXP_MIN the clamped e^(-x) would leave x·σ(x) ≈ x / 2^127 (−1.5 at f32::MIN):
        // the true value there is 0 to within 1e-36.
        let live = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, c(EXP_MIN));
        _mm512_maskz_mul_ps(live, v, e)
    } else {
        e
    }
}

/// σ(v), or with `times_x` v·σ(v), of 8 lanes on AVX2 + FMA: [`exp`] as in [`logistic16`],
/// `2^k` from its exponent bits as the portable [`exp`] builds it, and a true division (AVX2's
/// reciprocal estimate has 12 bits, too few for one Newton step to reach f32's precision).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn logistic8(v: std::arch::x86_64::__m256, times_x: bool) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm256_set1_ps(v);
    let d = _mm256_add_ps(c(1.0), exp8(_mm256_sub_ps(_mm256_setzero_ps(), v)));
    if times_x {
        // As in `logistic16`: 0 below EXP_MIN.
        let live = _mm256_cmp_ps::<_CMP_GE_OQ>(v, c(EXP_MIN));
        _mm256_and_ps(live, _mm256_div_ps(v, d))
    } else {
        _mm256_div_ps(c(1.0), d)
    }
}

/// e^x of 16 lanes, [`exp`]'s reduction and polynomial with fused multiply-adds and `2^k` by
/// `vscalefps` (x clamped to the exponential's range first).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm512_set1_ps(v);
    let x = _mm512_min_ps(_mm512_max_ps(x, c(EXP_MIN)), c(EXP_MAX));
    // Round to nearest even (the portable `round_ties_even`).
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, c(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(k, c(LN2_LO), _mm512_fnmadd_ps(k, c(LN2_HI), x));
    let p = EXP_TAYLOR[1..]
        .iter()
        .fold(c(EXP_TAYLOR[0]), |p, &t| _mm512_fmadd_ps(p, r, c(t)));
    _mm512_scalef_ps(p, k)
}

/// e^x of 8 lanes on AVX2 + FMA, as [`exp16`] with `2^k` from its exponent bits as the
/// portable [`exp`] builds it.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm256_set1_ps(v);
    let x = _mm256_min_ps(_mm256_max_ps(x, c(EXP_MIN)), c(EXP_MAX));
    let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        c(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(k, c(LN2_LO), _mm256_fnmadd_ps(k, c(LN2_HI), x));
    let p = EXP_TAYLOR[1..]
        .iter()
        .fold(c(EXP_TAYLOR[0]), |p, &t| _mm256_fmadd_ps(p, r, c(t)));
    let bits = _mm256_slli_epi32::<23>(_mm256_castps_si256(_mm256_add_ps(k, c(EXP_BIAS))));
    _mm256_mul_ps(p, _mm256_castsi256_ps(bits))
}

/// GELU of 16 lanes: [`erf_one`]'s formula with `1 / (1 + a·|u|)` by the reciprocal estimate
/// and one Newton step (as in [`logistic16`]), so a linear layer's or a convolution's store
/// applies it while the tile is in L1 instead of five exported nodes making four passes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn gelu16(v: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm512_set1_ps(v);
    let one = c(1.0);
    let u = _mm512_mul_ps(v, c(std::f32::consts::FRAC_1_SQRT_2));
    let a = _mm512_abs_ps(u);
    let d = _mm512_fmadd_ps(a, c(ERF_P), one);
    let t = _mm512_rcp14_ps(d);
    let t = _mm512_fmadd_ps(t, _mm512_fnmadd_ps(d, t, one), t);
    let p = _mm512_mul_ps(
        t,
        ERF_A[1..]
            .iter()
            .fold(c(ERF_A[0]), |p, &k| _mm512_fmadd_ps(p, t, c(k))),
    );
    let e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), a));
    let magnitude = _mm512_fnmadd_ps(p, e, one);
    let sign = _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(i32::MIN));
    let erf = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
    _mm512_mul_ps(_mm512_mul_ps(v, c(0.5)), _mm512_add_ps(one, erf))
}

/// GELU of 8 lanes on AVX2 + FMA, as [`gelu16`] with a true division (AVX2's reciprocal
/// estimate has too few bits for one Newton step).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn gelu8(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm256_set1_ps(v);
    let one = c(1.0);
    let u = _mm256_mul_ps(v, c(std::f32::consts::FRAC_1_SQRT_2));
    let sign_bit = c(-0.0);
    let a = _mm256_andnot_ps(sign_bit, u);
    let t = _mm256_div_ps(one, _mm256_fmadd_ps(a, c(ERF_P), one));
    let p = _mm256_mul_ps(
        t,
        ERF_A[1..]
            .iter()
            .fold(c(ERF_A[0]), |p, &k| _mm256_fmadd_ps(p, t, c(k))),
    );
    let e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), a), a));
    let magnitude = _mm256_fnmadd_ps(p, e, one);
    let erf = _mm256_or_ps(magnitude, _mm256_and_ps(u, sign_bit));
    _mm256_mul_ps(_mm256_mul_ps(v, c(0.5)), _mm256_add_ps(one, erf))
}

multiversion! {
    /// Sigmoid, or with `times_x` SiLU, of every value.
    fn logistic_slice(values: &mut [f32], times_x: bool) {
        if times_x {
            for v in values.iter_mut() {
                // Below EXP_MIN the clamped exponential would leave x / 2^127 (−1.5 at
                // f32::MIN); the true value is 0 to within 1e-36.
                let y = *v / (1.0 + exp(-*v));
                *v = if *v >= EXP_MIN { y } else { 0.0 };
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

/// [`exp`]'s input range: below −87.3 the result is subnormal or zero, above 88.3 infinite;
/// clamping keeps the exponent arithmetic in range (the sigmoid is then exactly 0 or 1).
const EXP_MIN: f32 = -87.3;
const EXP_MAX: f32 = 88.3;

/// Taylor coefficients 1/n! from degree 6 down to 0, in Horner order: error < 2e-7 relative
/// on |r| ≤ 0.347.
const EXP_TAYLOR: [f32; 7] = [
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `2^23 + 127`: for a whole `k` in [-126, 128], `k + EXP_BIAS` has `k + 127` as its low
/// mantissa bits, which shifted up by 23 are the exponent of `2^k`.
const EXP_BIAS: f32 = 8_388_608.0 + 127.0;

/// `e^x` without branches: `x = k·ln2 + r`, `e^x = 2^k · p(r)`, `|r| ≤ ln2/2`.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let k = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p = EXP_TAYLOR[1..]
        .iter()
        .fold(EXP_TAYLOR[0], |p, &t| p * r + t);
    // 2^k from its exponent bits. `k as i32` would be a saturating conversion, which LLVM
    // leaves scalar (perf showed this loop as `vcvttss2si` + `cmova` per value); these are
    // all vector integer operations.
    let bits = (k + EXP_BIAS).to_bits() << 23;
    p * f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The training ReLU's forward and gradient against the definition, on one chunk and
    /// across the parallel split, with exact zeros (gradient zero there, as Burn's).
    #[test]
    fn relu_and_its_gradient_are_exact() {
        for len in [37, 3 * CHUNK + 5] {
            let x: Vec<f32> = (0..len)
                .map(|i| {
                    if i % 7 == 0 {
                        0.0
                    } else {
                        (i % 13) as f32 - 6.5
                    }
                })
                .collect();
            let dy: Vec<f32> = (0..len).map(|i| (i % 5) as f32 + 0.25).collect();
            let y = relu_of(&x);
            assert!(
                y.iter().zip(&x).all(|(y, x)| *y == x.max(0.0)),
                "forward, {len}"
            );
            let dx = relu_backward(&y, &dy);
            let want = |i: usize| if y[i] > 0.0 { dy[i] } else { 0.0 };
            assert!((0..len).all(|i| dx[i] == want(i)), "gradient, {len}");
        }
    }

    /// GELU's gradient against the f64 derivative `Φ(x) + x·φ(x)` (erf from its series):
    /// absolute error below 1e-6 of the gradient over [−12, 12] (the derivative is at most
    /// 1.13), on both sides of the parallel threshold, and finite at the extremes.
    #[test]
    fn gelu_gradient_matches_f64() {
        fn erf64(x: f64) -> f64 {
            // Maclaurin series, exact to f64 rounding for |x| ≤ 3; beyond, 1 − erfc's tail.
            if x.abs() > 3.0 {
                let t = 1.0 / (x * x);
                let tail = (-x * x).exp() / (x.abs() * std::f64::consts::PI.sqrt())
                    * (1.0 - 0.5 * t + 0.75 * t * t);
                return (1.0 - tail).copysign(x);
            }
            let (mut term, mut sum) = (x, x);
            for n in 1..200 {
                term *= -x * x / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        }
        let kernels = crate::base::isa::F32Kernel::all_supported();
        let cases = [1001, 100_001, 1003]
            .into_iter()
            .flat_map(|n| kernels.iter().map(move |k| (n, *k)));
        for (count, kernel) in cases {
            let xs: Vec<f32> = (0..count)
                .map(|i| -12.0 + 24.0 * i as f32 / (count - 1) as f32)
                .collect();
            let dy: Vec<f32> = (0..count).map(|i| 1.0 - (i % 7) as f32 * 0.25).collect();
            let dx = crate::base::buffers::filled(count, |dx| gelu_grad_with(kernel, &xs, &dy, dx));
            let mut worst = 0f64;
            for ((&x, &d), &g) in xs.iter().zip(&dy).zip(&dx) {
                let x = f64::from(x);
                let cdf = 0.5 * (1.0 + erf64(x / std::f64::consts::SQRT_2));
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                worst = worst.max((f64::from(g) - f64::from(d) * (cdf + x * pdf)).abs());
            }
            assert!(worst < 1e-6, "{count} {kernel:?}: {worst:e}");
            if kernel == crate::base::isa::F32Kernel::detect() {
                assert_eq!(
                    gelu_backward(&xs, &dy),
                    dx,
                    "in parallel chunks, the same bits"
                );
            }
        }
        for kernel in kernels {
            let x = [f32::MAX, f32::MIN, 1e30, -1e30];
            let edges =
                crate::base::buffers::filled(4, |dx| gelu_grad_with(kernel, &x, &[1.0; 4], dx));
            for (got, want) in edges.iter().zip([1.0f32, 0.0, 1.0, 0.0]) {
                assert!((got - want).abs() < 1e-20, "{kernel:?}: {edges:?}");
            }
        }
        assert_eq!(gelu_backward(&[0.0, 1.0], &[1.0, 2.0]).len(), 2);
    }

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

    /// The kernels' per-register epilogues (AVX-512 and AVX2, where the CPU has them) against
    /// the f64 definitions lane by lane: relative error below 1e-6 where the result is a
    /// normal f32 above 1e-30 (plus one rounding where HardSwish cancels), absolute below 1e-7
    /// elsewhere; over ±90 and at the edges.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn register_epilogues_match_f64() {
        use std::arch::x86_64::*;
        let mut xs: Vec<f32> = (-1800..=1800).map(|i| i as f32 * 0.05).collect();
        xs.extend([f32::MAX, f32::MIN, 0.0, -0.0, 1e-20, -1e-20]);
        xs.resize(xs.len().next_multiple_of(16), 0.5);
        let acts = [
            Activation::Relu,
            Activation::Clip(-1.0, 6.0),
            Activation::Sigmoid,
            Activation::Silu,
            Activation::HardSigmoid(0.2, 0.5),
            Activation::HardSwish,
            Activation::Gelu,
        ];
        let check = |act: Activation, got: &[f32], xs: &[f32]| {
            for (&g, &x) in got.iter().zip(xs) {
                let want = act.reference(x as f64);
                let err = (g as f64 - want).abs();
                // The hard variants' `x/6 + 1/2` cancels near x = −3: one rounding of ½ is
                // 3e-8 absolute, so they get that much beside the relative bound.
                let cancels = matches!(act, Activation::HardSigmoid(..) | Activation::HardSwish);
                let slack = if cancels {
                    1e-7 * (x.abs() as f64).max(1.0)
                } else if act == Activation::Gelu {
                    // erf's absolute error (A&S: 1.5e-7, plus roundings), scaled by x / 2:
                    // for negative x, `1 + erf` cancels (as in PyTorch's formula).
                    2.5e-7 * x.abs() as f64
                } else {
                    1e-30
                };
                let ok = if want.abs() > 1e-30 && want.is_finite() {
                    err <= 1e-6 * want.abs() + slack
                } else {
                    err < 1e-7 || g as f64 == want
                };
                assert!(ok, "{act:?}({x}) = {g}, want {want}");
            }
        };
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        for act in acts {
            if avx2 {
                let got: Vec<f32> = xs
                    .chunks_exact(8)
                    .flat_map(|c| {
                        let mut out = [0f32; 8];
                        // SAFETY: AVX2 and FMA were detected; `c` and `out` hold 8 values.
                        unsafe {
                            let v = activate8(_mm256_loadu_ps(c.as_ptr()), act);
                            _mm256_storeu_ps(out.as_mut_ptr(), v);
                        }
                        out
                    })
                    .collect();
                check(act, &got, &xs);
            }
            if avx2 && is_x86_feature_detected!("avx512f") {
                let got: Vec<f32> = xs
                    .chunks_exact(16)
                    .flat_map(|c| {
                        let mut out = [0f32; 16];
                        // SAFETY: AVX-512F, AVX2 and FMA were detected; 16 values each.
                        unsafe {
                            let v = activate16(_mm512_loadu_ps(c.as_ptr()), act);
                            _mm512_storeu_ps(out.as_mut_ptr(), v);
                        }
                        out
                    })
                    .collect();
                check(act, &got, &xs);
            }
        }
    }

    /// erf and GELU against an f64 series (|x| ≤ 3, where the series converges in f64) and
    /// the tails (erf within 3e-5 of ±1 beyond 3).
    #[test]
    fn erf_and_gelu_match_f64() {
        let xs: Vec<f32> = (-300..=300).map(|i| i as f32 * 0.01).collect();
        let mut ys = xs.clone();
        erf_in_place(&mut ys);
        let mut gs = xs.clone();
        gelu_in_place(&mut gs);
        assert_eq!(gelu_of(&xs), gs, "into a new vector, the same bits");
        // Every instruction set's slice path gives the same values to within an ulp or two.
        for kernel in crate::base::isa::F32Kernel::all_supported() {
            let mut other = xs.clone();
            gelu_with(kernel, &mut other);
            for (a, b) in other.iter().zip(&gs) {
                assert!(
                    (a - b).abs() <= 4e-7 * (1.0 + b.abs()),
                    "{kernel:?}: {a} vs {b}"
                );
            }
        }
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
        // Far below the exponential's range x·σ(x) is 0, not x / 2^127; above it, x. Both in
        // a register's lanes and in the tail the portable loop takes.
        let mut edges = [f32::MIN, -1e30, -90.0, f32::MAX].repeat(5);
        silu_in_place(&mut edges);
        for e in edges.chunks(4) {
            assert!(e[0] == 0.0 && e[1] == 0.0 && e[2].abs() < 1e-36, "{e:?}");
            assert_eq!(e[3], f32::MAX);
        }
    }
}
