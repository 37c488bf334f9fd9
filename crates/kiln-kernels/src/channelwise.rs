//! Element-wise and per-channel arithmetic on channels-last images for inference: `a ∘ b`
//! (Add, Sub, Mul, Div, optionally followed by ReLU), a per-channel operand broadcast along
//! the pixels, and a per-channel scale and shift (a folded BatchNorm) with a fused clamp.
//! Each inner loop runs along the channels and is compiled per instruction set
//! (`multiversion!`); above [`PARALLEL_MIN`] values, in parallel chunks.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::base::threads::PARALLEL_MIN;

/// An element-wise arithmetic operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arith {
    /// `a + b`.
    Add,
    /// `a − b`.
    Sub,
    /// `a · b`.
    Mul,
    /// `a / b`.
    Div,
}

impl Arith {
    #[inline(always)]
    fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            Arith::Add => a + b,
            Arith::Sub => a - b,
            Arith::Mul => a * b,
            Arith::Div => a / b,
        }
    }
}

/// `a = op(a, b)` element by element (same length), then `relu` when asked.
pub fn arith_in_place(a: &mut [f32], b: &[f32], op: Arith, relu: bool) {
    assert_eq!(a.len(), b.len(), "element-wise operands differ in length");
    if a.len() < PARALLEL_MIN {
        arith_slice(a, b, op, relu);
    } else {
        a.par_chunks_mut(PARALLEL_MIN)
            .zip(b.par_chunks(PARALLEL_MIN))
            .for_each(|(a, b)| arith_slice(a, b, op, relu));
    }
}

multiversion! {
    fn arith_slice(a: &mut [f32], b: &[f32], op: Arith, relu: bool) {
        for (x, &y) in a.iter_mut().zip(b) {
            let v = op.apply(*x, y);
            *x = if relu { v.max(0.0) } else { v };
        }
    }
}

/// `x = op(x, v)` per channel: `x` holds groups of `pixels` pixels of `channels` values, and
/// group `g` uses row `g mod rows` of `v` (`[rows, channels]`: one row for a per-channel
/// constant over a batch, one per image for a squeeze-excitation gate `[n, c]` over
/// `[n, h, w, c]`). With `swap`, `x = op(v, x)`.
pub fn arith_channels_in_place(
    x: &mut [f32],
    v: &[f32],
    [pixels, channels]: [usize; 2],
    op: Arith,
    swap: bool,
) {
    let group = pixels * channels;
    if group == 0 {
        return;
    }
    assert_eq!(x.len() % group, 0, "per-channel operand: image length");
    assert!(
        !v.is_empty() && v.len().is_multiple_of(channels),
        "per-channel operand: {} values for {channels} channels",
        v.len()
    );
    let rows = v.len() / channels;
    let run = |(g, xs): (usize, &mut [f32])| {
        let row = &v[(g % rows) * channels..][..channels];
        arith_pixels(xs, row, op, swap);
    };
    if x.len() < PARALLEL_MIN {
        x.chunks_mut(group).enumerate().for_each(run);
    } else {
        x.par_chunks_mut(group).enumerate().for_each(run);
    }
}

multiversion! {
    fn arith_pixels(xs: &mut [f32], row: &[f32], op: Arith, swap: bool) {
        for px in xs.chunks_exact_mut(row.len()) {
            for (x, &y) in px.iter_mut().zip(row) {
                *x = if swap { op.apply(y, *x) } else { op.apply(*x, y) };
            }
        }
    }
}

/// `x = x · scale + shift` per channel over channels-last pixels (an inference BatchNorm),
/// then clamped to `bounds` when given (a ReLU or ReLU6 fused after it: one pass, not two).
pub fn scale_shift_in_place(x: &mut [f32], scale: &[f32], shift: &[f32], bounds: Option<[f32; 2]>) {
    let chunk = scale_shift_chunk(x.len(), scale, shift);
    if chunk == 0 {
        return;
    }
    if x.len() < PARALLEL_MIN {
        scale_shift_pixels(x, scale, shift, bounds);
    } else {
        x.par_chunks_mut(chunk)
            .for_each(|xs| scale_shift_pixels(xs, scale, shift, bounds));
    }
}

/// [`scale_shift_in_place`] into a new vector, `x` left as it is: for an input another layer
/// still reads (DenseNet's BatchNorm reads a Concat's output that the next Concat reads too),
/// where a copy and then a pass over the copy went twice over memory. Each chunk is copied
/// and transformed while it is in cache.
pub fn scale_shift_new(
    x: &[f32],
    scale: &[f32],
    shift: &[f32],
    bounds: Option<[f32; 2]>,
) -> Vec<f32> {
    let chunk = scale_shift_chunk(x.len(), scale, shift);
    if chunk == 0 {
        return x.to_vec();
    }
    crate::base::buffers::filled(x.len(), |out| {
        let run = |(dst, src): (&mut [MaybeUninit<f32>], &[f32])| {
            // Every value of the chunk is written, then transformed in place.
            let dst = dst.write_copy_of_slice(src);
            scale_shift_pixels(dst, scale, shift, bounds);
        };
        if x.len() < PARALLEL_MIN {
            out.chunks_mut(chunk).zip(x.chunks(chunk)).for_each(run);
        } else {
            out.par_chunks_mut(chunk)
                .zip(x.par_chunks(chunk))
                .for_each(run);
        }
    })
}

/// Values per task of a per-channel scale and shift over `len` values (whole pixels, so each
/// chunk starts at channel 0); 0 when there are no channels.
fn scale_shift_chunk(len: usize, scale: &[f32], shift: &[f32]) -> usize {
    let c = scale.len();
    assert_eq!(shift.len(), c, "scale and shift lengths differ");
    if c == 0 {
        return 0;
    }
    assert_eq!(len % c, 0, "scale_shift: image length");
    (PARALLEL_MIN / c).max(1) * c
}

multiversion! {
    fn scale_shift_pixels(xs: &mut [f32], scale: &[f32], shift: &[f32], bounds: Option<[f32; 2]>) {
        match bounds {
            // Unbounded: no clamp at all, so a NaN stays a NaN.
            None => {
                for px in xs.chunks_exact_mut(scale.len()) {
                    for ((x, &a), &b) in px.iter_mut().zip(scale).zip(shift) {
                        *x = *x * a + b;
                    }
                }
            }
            // `max` first, as the convolutions' clamp: a NaN becomes the lower bound.
            Some([lo, hi]) => {
                for px in xs.chunks_exact_mut(scale.len()) {
                    for ((x, &a), &b) in px.iter_mut().zip(scale).zip(shift) {
                        *x = (*x * a + b).max(lo).min(hi);
                    }
                }
            }
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::{Activation, activate};
    use crate::base::testing::{relative_error, values};

    #[test]
    fn activations_and_arithmetic_match_their_definitions() {
        let x = values(40_000, 2);
        for act in [
            Activation::Relu,
            Activation::Clip(0.0, 6.0),
            Activation::HardSigmoid(0.2, 0.5),
            Activation::HardSwish,
            Activation::Sigmoid,
            Activation::Silu,
            Activation::Gelu,
        ] {
            let mut got = x.clone();
            activate(&mut got, act);
            let want: Vec<f64> = x.iter().map(|&v| act.reference(v as f64)).collect();
            assert!(relative_error(&got, &want) < 1e-6, "{act:?}");
        }
        let y = values(40_000, 3);
        for op in [Arith::Add, Arith::Sub, Arith::Mul, Arith::Div] {
            let mut got = x.clone();
            arith_in_place(&mut got, &y, op, true);
            let want: Vec<f64> = x
                .iter()
                .zip(&y)
                .map(|(&a, &b)| {
                    let (a, b) = (a as f64, b as f64);
                    match op {
                        Arith::Add => a + b,
                        Arith::Sub => a - b,
                        Arith::Mul => a * b,
                        Arith::Div => a / b,
                    }
                    .max(0.0)
                })
                .collect();
            assert!(relative_error(&got, &want) < 1e-6, "{op:?}");
        }
        // A gate per (image, channel) over 2 images of 10×10 pixels × 200 channels.
        let gate = values(2 * 200, 4);
        let mut got = x.clone();
        arith_channels_in_place(&mut got, &gate, [100, 200], Arith::Mul, false);
        let want: Vec<f64> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| v as f64 * gate[(i / 20_000) * 200 + i % 200] as f64)
            .collect();
        assert!(relative_error(&got, &want) < 1e-6);
    }

    #[test]
    fn scale_shift_is_per_channel() {
        let (c, pixels) = (37, 1000);
        let x = values(c * pixels, 9);
        let (a, b) = (values(c, 10), values(c, 11));
        let mut got = x.clone();
        scale_shift_in_place(&mut got, &a, &b, None);
        let want: Vec<f64> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| v as f64 * a[i % c] as f64 + b[i % c] as f64)
            .collect();
        assert!(relative_error(&got, &want) < 1e-6);
        // Into a new vector: the same values, the input untouched.
        assert_eq!(scale_shift_new(&x, &a, &b, None), got);
    }

    #[test]
    fn scale_shift_with_a_fused_clamp_matches_the_two_passes_in_place_or_new() {
        // Above PARALLEL_MIN values, so the chunked parallel paths run too.
        for (c, pixels) in [(37, 100), (64, 4096)] {
            let x = values(c * pixels, 12);
            let (a, b) = (values(c, 13), values(c, 14));
            for bounds in [[0.0, f32::INFINITY], [0.0, 6.0]] {
                let mut want = x.clone();
                scale_shift_in_place(&mut want, &a, &b, None);
                want.iter_mut()
                    .for_each(|v| *v = v.clamp(bounds[0], bounds[1]));
                let mut got = x.clone();
                scale_shift_in_place(&mut got, &a, &b, Some(bounds));
                assert_eq!(got, want, "in place, {c} channels, {bounds:?}");
                let new = scale_shift_new(&x, &a, &b, Some(bounds));
                assert_eq!(new, want, "new, {c} channels, {bounds:?}");
            }
        }
    }
}
