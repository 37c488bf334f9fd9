//! The f32 GEMM every dense kernel that does not carry its own register tiles calls: the
//! `gemm` crate (Burn's `flex` backend's own), with strides for transposed operands and a
//! destination that need not be initialized.

use std::mem::MaybeUninit;

use gemm::{Parallelism, gemm};
use rayon::prelude::*;

use super::buffers::{assume_init, filled};
use super::threads::PARALLEL_MIN;

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

/// Length of the summed dimension each thread's part of [`matmul_fresh_split_sum`] keeps at
/// least: below it, the parts' packing and the final sum cost more than the gemm crate's own
/// split saves.
const SUM_PART_MIN: usize = 256;

/// [`matmul_fresh`] for a long sum over a small output (a weight gradient: `xᵀ · grad` summed
/// over every row of the batch): the summed dimension cut into one part per thread, each
/// part a one-thread GEMM into its own buffer, the parts then added. Why: the gemm crate
/// splits the output between threads and meets them again after every block of the sum; for
/// W4's and U2's weight gradients (128–512 × 128–512 outputs summed over 1,792–4,096 rows, 2
/// threads) the parts run 7–13% faster with AVX2 and up to 18% with AVX-512 (one shape 1–4%
/// slower there), and in W4's step, where the operands come cold from other ops, the weight
/// gradients took 1.14 → 0.96 ms per call with AVX2 (`cargo bench -p kiln-kernels --bench
/// linear_grads`, `kiln profile`; BENCHMARKS.md run 58). Other shapes go to
/// [`matmul_fresh`] unchanged.
pub fn matmul_fresh_split_sum(
    dims: (usize, usize, usize),
    dst: &mut [MaybeUninit<f32>],
    (lhs, (lrs, lcs)): (&[f32], (usize, usize)),
    (rhs, (rrs, rcs)): (&[f32], (usize, usize)),
    threads: usize,
) {
    let (m, n, k) = dims;
    let parts = threads.min(k / SUM_PART_MIN);
    // Only where the sum outruns the output: a wide output splits well by itself.
    if parts < 2 || k < m.max(n) {
        return matmul_fresh(dims, dst, (lhs, (lrs, lcs)), (rhs, (rrs, rcs)), threads);
    }
    assert!(dst.len() >= m * n, "matmul destination too small");
    let start = |part: usize| part * k / parts;
    let part_dims = |part: usize| (m, n, start(part + 1) - start(part));
    let lhs_from = |part: usize| (&lhs[start(part) * lcs..], (lrs, lcs));
    let rhs_from = |part: usize| (&rhs[start(part) * rrs..], (rrs, rcs));
    let dst = &mut dst[..m * n];
    // Part 0 writes the destination itself; the others their own buffers, added after.
    let others: Vec<Vec<f32>> = rayon::join(
        || matmul_fresh(part_dims(0), dst, lhs_from(0), rhs_from(0), 1),
        || {
            (1..parts)
                .into_par_iter()
                .map(|part| {
                    filled(m * n, |buf| {
                        matmul_fresh(part_dims(part), buf, lhs_from(part), rhs_from(part), 1)
                    })
                })
                .collect()
        },
    )
    .1;
    // SAFETY: part 0's GEMM wrote all m × n values.
    let dst = unsafe { assume_init(dst) };
    dst.par_chunks_mut(PARALLEL_MIN)
        .enumerate()
        .for_each(|(chunk, values)| {
            let from = chunk * PARALLEL_MIN;
            for other in &others {
                for (v, o) in values.iter_mut().zip(&other[from..]) {
                    *v += o;
                }
            }
        });
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
        crate::base::threads::note_split();
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
        crate::base::threads::note_split();
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
