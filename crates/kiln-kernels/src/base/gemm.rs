//! The f32 GEMM every dense kernel that does not carry its own register tiles calls: the
//! `gemm` crate (Burn's `flex` backend's own), with strides for transposed operands and a
//! destination that need not be initialized.

use std::mem::MaybeUninit;

use gemm::{Parallelism, gemm};

/// Row-major `dst[m×n] (+)= lhs · rhs`, with `lhs` element `(i, j)` at `lhs[i·lrs + j·lcs]` and
/// `rhs` element `(i, j)` at `rhs[i·rrs + j·rcs]`.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    dims: (usize, usize, usize),
    dst: &mut [f32],
    accumulate: bool,
    lhs: &[f32],
    lhs_strides: (usize, usize),
    rhs: &[f32],
    rhs_strides: (usize, usize),
    threads: usize,
) {
    assert!(dst.len() >= dims.0 * dims.1, "matmul destination too small");
    // SAFETY: `dst` holds m × n initialized values (so reading them to accumulate is fine) and
    // is a unique borrow.
    unsafe {
        gemm_raw(
            dims,
            dst.as_mut_ptr(),
            accumulate,
            (lhs, lhs_strides),
            (rhs, rhs_strides),
            threads,
        )
    }
}

/// [`matmul`] without accumulating into a destination that need not be initialized: the GEMM
/// writes every one of its `m × n` values without reading them.
pub fn matmul_fresh(
    dims: (usize, usize, usize),
    dst: &mut [MaybeUninit<f32>],
    lhs: (&[f32], (usize, usize)),
    rhs: (&[f32], (usize, usize)),
    threads: usize,
) {
    let (m, n, k) = dims;
    assert!(dst.len() >= m * n, "matmul destination too small");
    if k == 0 {
        // An empty sum: zeros (the GEMM would not need to touch `dst` at all).
        dst[..m * n].fill(MaybeUninit::new(0.0));
        return;
    }
    // SAFETY: `dst` holds m × n values and is a unique borrow; without `accumulate` the GEMM
    // only writes them.
    unsafe { gemm_raw(dims, dst.as_mut_ptr().cast(), false, lhs, rhs, threads) }
}

/// `dst (+)= scale · lhs · rhs` into a raw destination whose row `i` starts at `dst + i·drs`
/// (rows of `n` contiguous values): a result written straight into its place in a wider
/// layout, as attention's context goes into `[batch, tokens, heads·dims]`.
///
/// # Safety
/// `dst` is valid for writes of rows `0..m` of `n` values at stride `drs` (and reads,
/// initialized, with `accumulate`), aliases neither operand, and no other thread writes
/// those values during the call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_to(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    drs: usize,
    accumulate: bool,
    (lhs, (lrs, lcs)): (&[f32], (usize, usize)),
    (rhs, (rrs, rcs)): (&[f32], (usize, usize)),
    scale: f32,
    threads: usize,
) {
    assert!(m == 0 || k == 0 || lhs.len() > (m - 1) * lrs + (k - 1) * lcs);
    assert!(k == 0 || n == 0 || rhs.len() > (k - 1) * rrs + (n - 1) * rcs);
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                // SAFETY: the caller vouches for rows 0..m of n values at stride drs.
                unsafe { std::slice::from_raw_parts_mut(dst.add(i * drs), n).fill(0.0) };
            }
        }
        return;
    }
    let parallelism = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: the asserts keep every operand index in bounds; the caller vouches for `dst`.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst,
            1,
            drs as isize,
            accumulate,
            lhs.as_ptr(),
            lcs as isize,
            lrs as isize,
            rhs.as_ptr(),
            rcs as isize,
            rrs as isize,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// The GEMM behind [`matmul`] and [`matmul_fresh`].
///
/// # Safety
/// `dst` is valid for writes of `m × n` values (and reads, initialized, with `accumulate`) and
/// aliases neither operand.
unsafe fn gemm_raw(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    accumulate: bool,
    (lhs, (lrs, lcs)): (&[f32], (usize, usize)),
    (rhs, (rrs, rcs)): (&[f32], (usize, usize)),
    threads: usize,
) {
    assert!(m == 0 || k == 0 || lhs.len() > (m - 1) * lrs + (k - 1) * lcs);
    assert!(k == 0 || n == 0 || rhs.len() > (k - 1) * rrs + (n - 1) * rcs);
    let parallelism = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: the asserts above keep every index the GEMM reads inside the operands, and the
    // caller vouches for `dst`.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            accumulate,
            lhs.as_ptr(),
            lcs as isize,
            lrs as isize,
            rhs.as_ptr(),
            rcs as isize,
            rrs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}
