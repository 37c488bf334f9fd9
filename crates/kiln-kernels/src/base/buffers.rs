//! Output buffers the kernels write exactly once: allocated without a zero fill (a kernel
//! that writes every value need not pay a serial pass over the output first), or zeroed row
//! by row inside the task that computes the row.

use rayon::prelude::*;

/// A vector of `len` values, each written by `fill`, which must write all of them (why:
/// a kernel that writes every output value once need not pay a zero fill first).
pub fn filled(len: usize, fill: impl FnOnce(&mut [std::mem::MaybeUninit<f32>])) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: `fill` initialized the first `len` values (its callers' contract: each asserts
    // the output's length and writes every value of it).
    unsafe { out.set_len(len) };
    out
}

/// A vector of `len` values computed row by row (`row(index, values)`, rows of `row_len`),
/// over the pool when `parallel`. Each row is zeroed in its own task just before `row` runs,
/// so `row` may accumulate into it: the zeros are written while the row is in cache, by the
/// thread that computes it, instead of in a serial pass over the whole output first (a
/// depthwise layer's 4.8 MB output at batch 1 in MobileNet v2: BENCHMARKS.md run 40).
pub fn rows_from_zero(
    len: usize,
    row_len: usize,
    parallel: bool,
    row: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    assert!(row_len > 0 && len.is_multiple_of(row_len), "whole rows");
    let task = |(i, values): (usize, &mut [std::mem::MaybeUninit<f32>])| {
        values.fill(std::mem::MaybeUninit::new(0.0));
        // SAFETY: every value of the row was just written.
        row(i, unsafe { assume_init(values) });
    };
    filled(len, |out| {
        if parallel {
            out.par_chunks_exact_mut(row_len).enumerate().for_each(task);
        } else {
            out.chunks_exact_mut(row_len).enumerate().for_each(task);
        }
    })
}

/// An initialized slice viewed as one the kernels only write to.
pub fn as_uninit(values: &mut [f32]) -> &mut [std::mem::MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and the kernels store only initialized
    // f32 values through the view, so the slice stays initialized.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), values.len()) }
}

/// A slice whose every value has been written, as initialized values.
///
/// # Safety
/// Every value of `values` is initialized.
pub unsafe fn assume_init(values: &mut [std::mem::MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: the caller's contract; the layouts are the same.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), values.len()) }
}
