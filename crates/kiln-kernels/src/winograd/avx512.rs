//! The Winograd kernels on AVX-512: vectors of 16 channels, panels of 32 output channels,
//! 12 tiles × 32 columns of accumulators (24 of the 32 registers) per GEMM step.
use std::arch::x86_64::*;

use super::BLOCK;
use crate::activation::{Activation, activate16};

type V = __m512;
/// Lanes per vector.
const L: usize = 16;
/// Tiles per register tile: the whole block.
const R: usize = 12;
const _: () = assert!(BLOCK.is_multiple_of(R));

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn zero() -> V {
    _mm512_setzero_ps()
}

/// # Safety
/// `p` is valid for 16 reads.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn load(p: *const f32) -> V {
    // SAFETY: the caller's contract.
    unsafe { _mm512_loadu_ps(p) }
}

/// The first `n` lanes from `p`, zeros after.
///
/// # Safety
/// `p` is valid for `n ≤ 16` reads.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn loadn(p: *const f32, n: usize) -> V {
    // SAFETY: masked to the caller's `n` values.
    unsafe { _mm512_maskz_loadu_ps(mask(n), p) }
}

/// # Safety
/// `p` is valid for 16 writes.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn store(p: *mut f32, v: V) {
    // SAFETY: the caller's contract.
    unsafe { _mm512_storeu_ps(p, v) }
}

/// The first `n` lanes of `v` to `p`.
///
/// # Safety
/// `p` is valid for `n ≤ 16` writes.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn storen(p: *mut f32, n: usize, v: V) {
    // SAFETY: masked to the caller's `n` values.
    unsafe { _mm512_mask_storeu_ps(p, mask(n), v) }
}

#[inline]
fn mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn add(a: V, b: V) -> V {
    _mm512_add_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn sub(a: V, b: V) -> V {
    _mm512_sub_ps(a, b)
}

/// `max(a, b)`, `b` where either is NaN.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn max(a: V, b: V) -> V {
    _mm512_max_ps(a, b)
}

/// `a · b + c`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn fma(a: V, b: V, c: V) -> V {
    _mm512_fmadd_ps(a, b, c)
}

/// # Safety
/// `p` is valid for one read.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn bcast(p: *const f32) -> V {
    // SAFETY: the caller's contract.
    _mm512_set1_ps(unsafe { *p })
}

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn activate(v: V, act: Activation) -> V {
    activate16(v, act)
}

super::winograd_kernels!("avx512f,avx2,fma");
