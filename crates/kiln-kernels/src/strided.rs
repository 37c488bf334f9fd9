//! A strided view's values copied into row-major order over the thread pool, for views whose
//! innermost dimension is contiguous (a permutation that keeps the last axis: a transformer's
//! heads split off or merged back, q/k/v picked out of one projection).
//!
//! Why: Burn's `flex` backend copies such a view on one thread before a reshape of it;
//! ViT-B/16's attention makes 5 such copies per layer (the `Squeeze` of its q/k/v projection
//! alone, 1.8 MB, took 0.26 ms), BENCHMARKS.md run 42.

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// Values per parallel task (whole runs of the last dimension).
const CHUNK: usize = 1 << 14;

/// Values below which the copy stays on the calling thread.
const PARALLEL_MIN: usize = 1 << 16;

/// A view's layout with the size-1 dimensions dropped and each dimension merged into the one
/// outside it where the two are laid out as one (`strides[a] = strides[a + 1] · dims[a + 1]`):
/// the fewest dimensions walking the same elements in the same order, so the innermost run
/// is as long as the layout allows.
pub fn collapse(dims: &[usize], strides: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let mut out_dims: Vec<usize> = Vec::with_capacity(dims.len());
    let mut out_strides: Vec<usize> = Vec::with_capacity(dims.len());
    for (&d, &s) in dims.iter().zip(strides).rev() {
        if d == 1 {
            continue;
        }
        match (out_dims.last_mut(), out_strides.last_mut()) {
            // The merged dimension keeps the inner one's stride.
            (Some(inner_d), Some(inner_s)) if s == *inner_s * *inner_d => *inner_d *= d,
            _ => {
                out_dims.push(d);
                out_strides.push(s);
            }
        }
    }
    out_dims.reverse();
    out_strides.reverse();
    (out_dims, out_strides)
}

/// The elements of the view of `src` with dimensions `dims`, element `strides` and first
/// element at `offset`, in row-major order; `None` unless the (collapsed) innermost stride is
/// 1 — a true transpose is left to a tiled copy.
///
/// # Panics
/// When the view reaches outside `src`.
pub fn contiguous(
    src: &[f32],
    offset: usize,
    dims: &[usize],
    strides: &[usize],
) -> Option<Vec<f32>> {
    let n: usize = dims.iter().product();
    let (dims, strides) = collapse(dims, strides);
    if n == 0 || strides.last().is_some_and(|&s| s != 1) {
        return None;
    }
    let Some((&run, outer)) = dims.split_last() else {
        // One element.
        return Some(vec![src[offset]]);
    };
    let rows_per_task = (CHUNK / run).max(1);
    let task = |(t, out): (usize, &mut [MaybeUninit<f32>])| {
        // The multi-index of the task's first row, then counted up row by row.
        let mut index = vec![0; outer.len()];
        let mut rest = t * rows_per_task;
        for (i, &d) in index.iter_mut().zip(outer).rev() {
            *i = rest % d;
            rest /= d;
        }
        let mut at = offset
            + index
                .iter()
                .zip(&strides)
                .map(|(i, s)| i * s)
                .sum::<usize>();
        for row in out.chunks_mut(run) {
            row.write_copy_of_slice(&src[at..at + run]);
            for ((i, &d), &s) in index.iter_mut().zip(outer).zip(&strides).rev() {
                *i += 1;
                at += s;
                if *i < d {
                    break;
                }
                *i = 0;
                at -= s * d;
            }
        }
    };
    Some(crate::base::buffers::filled(n, |out| {
        let chunks = out.chunks_mut(rows_per_task * run).enumerate();
        if n < PARALLEL_MIN {
            chunks.for_each(task);
        } else {
            out.par_chunks_mut(rows_per_task * run)
                .enumerate()
                .for_each(task);
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row-major strides of `dims`.
    fn row_major(dims: &[usize]) -> Vec<usize> {
        let mut strides = vec![1; dims.len()];
        for a in (0..dims.len().saturating_sub(1)).rev() {
            strides[a] = strides[a + 1] * dims[a + 1];
        }
        strides
    }

    /// `dims` permuted by `perm`, read element by element: the definition.
    fn permuted(src: &[f32], dims: &[usize], perm: &[usize]) -> (Vec<usize>, Vec<usize>, Vec<f32>) {
        let strides = row_major(dims);
        let pd: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
        let ps: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
        let n: usize = dims.iter().product();
        let want = (0..n)
            .map(|mut i| {
                let mut at = 0;
                for a in (0..pd.len()).rev() {
                    at += (i % pd[a]) * ps[a];
                    i /= pd[a];
                }
                src[at]
            })
            .collect();
        (pd, ps, want)
    }

    #[test]
    fn permutations_keeping_the_last_axis_copy_as_defined() {
        // ViT's q/k/v split ([197, 1, 3, 768] → [3, 197, 1, 768]) and head split, small and
        // large enough for the pool, an offset view, and size-1 dimensions anywhere.
        for (dims, perm) in [
            (vec![197, 1, 3, 768], vec![2, 0, 1, 3]),
            (vec![197, 12, 64], vec![1, 0, 2]),
            (vec![2, 3, 4, 5], vec![2, 0, 1, 3]),
            (vec![1, 5, 1, 7], vec![2, 1, 0, 3]),
        ] {
            let n: usize = dims.iter().product();
            let src: Vec<f32> = (0..n + 3).map(|i| i as f32).collect();
            let (pd, ps, want) = permuted(&src[3..], &dims, &perm);
            assert_eq!(
                contiguous(&src, 3, &pd, &ps),
                Some(want),
                "{dims:?} by {perm:?}"
            );
        }
        // A transpose of the last axis is not this kernel's.
        let src: Vec<f32> = (0..12).map(|i| i as f32).collect();
        assert_eq!(contiguous(&src, 0, &[4, 3], &[1, 4]), None);
    }

    #[test]
    fn collapse_merges_dimensions_laid_out_as_one() {
        assert_eq!(collapse(&[2, 3, 4], &[12, 4, 1]), (vec![24], vec![1]));
        assert_eq!(
            collapse(&[3, 1, 197, 768], &[768, 9, 2304, 1]),
            (vec![3, 197, 768], vec![768, 2304, 1])
        );
        assert_eq!(collapse(&[1, 1], &[5, 7]), (vec![], vec![]));
    }
}
