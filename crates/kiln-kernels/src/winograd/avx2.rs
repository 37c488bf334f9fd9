//! The Winograd kernels on AVX2 + FMA: vectors of 8 channels, panels of 16 output channels,
//! 6 tiles × 16 columns of accumulators (12 of the 16 registers) per GEMM step, twice per
//! block.
use std::arch::x86_64::*;

use super::BLOCK;
use crate::activation::{Activation, activate8};

type V = __m256;
/// Lanes per vector.
const L: usize = 8;
/// Tiles per register tile: half the block.
const R: usize = 6;
const _: () = assert!(BLOCK.is_multiple_of(R));

#[inline]
#[target_feature(enable = "avx2,fma")]
fn zero() -> V {
    _mm256_setzero_ps()
}

/// # Safety
/// `p` is valid for 8 reads.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load(p: *const f32) -> V {
    // SAFETY: the caller's contract.
    unsafe { _mm256_loadu_ps(p) }
}

/// Lanes below `n` set.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn mask(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// The first `n` lanes from `p`, zeros after.
///
/// # Safety
/// `p` is valid for `n ≤ 8` reads.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn loadn(p: *const f32, n: usize) -> V {
    if n == L {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_ps(p) }
    } else {
        // SAFETY: masked to the caller's `n` values.
        unsafe { _mm256_maskload_ps(p, mask(n)) }
    }
}

/// # Safety
/// `p` is valid for 8 writes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store(p: *mut f32, v: V) {
    // SAFETY: the caller's contract.
    unsafe { _mm256_storeu_ps(p, v) }
}

/// The first `n` lanes of `v` to `p`.
///
/// # Safety
/// `p` is valid for `n ≤ 8` writes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn storen(p: *mut f32, n: usize, v: V) {
    if n == L {
        // SAFETY: the caller's contract.
        unsafe { _mm256_storeu_ps(p, v) }
    } else {
        // SAFETY: masked to the caller's `n` values.
        unsafe { _mm256_maskstore_ps(p, mask(n), v) }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn add(a: V, b: V) -> V {
    _mm256_add_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn sub(a: V, b: V) -> V {
    _mm256_sub_ps(a, b)
}

/// `max(a, b)`, `b` where either is NaN.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn max(a: V, b: V) -> V {
    _mm256_max_ps(a, b)
}

/// `a · b + c`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn fma(a: V, b: V, c: V) -> V {
    _mm256_fmadd_ps(a, b, c)
}

/// # Safety
/// `p` is valid for one read.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bcast(p: *const f32) -> V {
    // SAFETY: the caller's contract.
    unsafe { _mm256_broadcast_ss(&*p) }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn activate(v: V, act: Activation) -> V {
    activate8(v, act)
}

super::winograd_kernels!("avx2,fma");
