//! The weight gradient of a 3×3 stride-1 training convolution as Winograd F(3×3, 2×2):
//! `dW = Gᵀ [Σ_tiles (A dy Aᵀ) ⊙ (Bᵀ d B)] G`, summed over the batch's 2×2 output tiles in the
//! transformed domain.
//!
//! Why this form: the forward's identity `M(d) g = Aᵀ[(G g) ⊙ (Bᵀ d)]` (one output tile's
//! correlation) holds for every `g`, so its transpose gives the correlation of the input tile
//! with the output gradient's tile, `M(d)ᵀ dy = Gᵀ[(A dy) ⊙ (Bᵀ d)]` — the same `B` and `G`
//! as the forward, `A` now on the output gradient. Per tile and channel pair that is 16
//! multiply-adds where the direct weight gradient takes 36, and the sum over tiles is 16
//! GEMMs `S[ξ] += V[ξ]ᵀ · Q[ξ]` (input channels × tiles times tiles × output channels).
//!
//! Each thread sums its tiles into its own `S` (`16 × cin × cout`), so the layers taken are
//! those whose `S` stays in L2 (≤ 128 × 128 channels: W5's 64- and 128-channel layers); the
//! parts are added in a fixed order at the end and turned back by `Gᵀ S G` in f64.

use rayon::prelude::*;

use super::{CHUNK_VALUES, G, POINTS, images_per_part, input_tile_pixels, lanes, on_isa, tile_at};
use crate::base::isa::F32Kernel;
use crate::base::shape::ConvShape;

/// Input × output channels above which the direct or GEMM weight gradient stays: each
/// thread's `S` holds 16 values per channel pair (1 MB at 128 × 128, L2's size).
const MAX_CHANNEL_PAIRS: usize = 128 * 128;

/// Transformed values per block (its input and output-gradient tiles: 512 KB), so a block
/// stays in L2 beside the thread's `S`.
const BLOCK_VALUES: usize = 128 << 10;

/// Whether [`weight_grad_nchw`] takes the weight gradient of shape `s`.
pub(crate) fn applies(s: &ConvShape) -> bool {
    s.cin * s.cout <= MAX_CHANNEL_PAIRS && super::applies(s, F32Kernel::detect(), false)
}

/// `dweight` `[cout, cin, 3, 3]` of the convolution `s` from `x` `[batch, cin, h, w]` and
/// `dout` `[batch, cout, oh, ow]`, where [`applies`] holds.
pub(crate) fn weight_grad_nchw(s: &ConvShape, x: &[f32], dout: &[f32], dweight: &mut [f32]) {
    weight_grad_in_parts(F32Kernel::detect(), s, (x, dout), dweight, CHUNK_VALUES);
}

/// [`weight_grad_nchw`] on `kernel`, turning as many images channels-last at a time as
/// `chunk_values` input and output-gradient values hold (at least one).
pub(super) fn weight_grad_in_parts(
    kernel: F32Kernel,
    s: &ConvShape,
    (x, dout): (&[f32], &[f32]),
    dweight: &mut [f32],
    chunk_values: usize,
) {
    assert!(
        s.cin * s.cout <= MAX_CHANNEL_PAIRS && super::applies(s, kernel, false),
        "Winograd weight gradient on a shape it does not cover"
    );
    let lengths = [x.len(), dout.len(), dweight.len()];
    let want = [s.input_len(), s.output_len(), s.weight_len()];
    assert_eq!(
        lengths, want,
        "input, output-gradient and weight-gradient lengths"
    );
    let width = kernel
        .panel_width()
        .expect("applies only with a SIMD kernel");
    let rows = super::grad_rows(kernel);
    let g = Geometry {
        cs: s.cin.next_multiple_of(lanes(kernel)),
        qs: s.cout.next_multiple_of(width),
        c_pad: s.cin.next_multiple_of(rows),
        width,
        rows,
    };
    let (oh, ow) = (s.out_h(), s.out_w());
    let (image_in, image_out) = (s.cin * s.h * s.w, s.cout * oh * ow);
    let threads = crate::base::threads::pool_threads();
    let mut sums: Vec<Vec<f32>> = vec![vec![0f32; POINTS * g.c_pad * g.qs]; threads];
    if image_in > 0 && image_out > 0 {
        let per_chunk = images_per_part(chunk_values, image_in + image_out);
        for (x, dout) in x
            .chunks(image_in * per_chunk)
            .zip(dout.chunks(image_out * per_chunk))
        {
            let part = ConvShape {
                batch: x.len() / image_in,
                ..*s
            };
            let image = crate::base::layout::nchw_to_nhwc(x, [part.batch, s.cin, s.h, s.w]);
            let grad = crate::base::layout::nchw_to_nhwc(dout, [part.batch, s.cout, oh, ow]);
            let tiles = part.batch * oh.div_ceil(2) * ow.div_ceil(2);
            sums.par_iter_mut().enumerate().for_each(|(t, sum)| {
                let range = t * tiles / threads..(t + 1) * tiles / threads;
                accumulate(&part, (&image, &grad), range, &g, kernel, sum);
            });
        }
    }
    // The threads' parts in a fixed order, then Gᵀ S G per channel pair.
    let (first, rest) = sums.split_first_mut().expect("at least one thread");
    for part in rest {
        first.iter_mut().zip(part.iter()).for_each(|(a, b)| *a += b);
    }
    dweight
        .par_chunks_mut(s.cin * 9)
        .enumerate()
        .for_each(|(o, rows)| {
            for (c, w) in rows.chunks_exact_mut(9).enumerate() {
                let at = |p: usize| first[(p * g.c_pad + c) * g.qs + o] as f64;
                // dW[ky][kx] = Σ_ij G[i][ky] · S[i·4 + j] · G[j][kx].
                for (k, w) in w.iter_mut().enumerate() {
                    let (ky, kx) = (k / 3, k % 3);
                    let mut v = 0f64;
                    for (i, gi) in G.iter().enumerate() {
                        for (j, gj) in G.iter().enumerate() {
                            v += gi[ky] * at(i * 4 + j) * gj[kx];
                        }
                    }
                    *w = v as f32;
                }
            }
        });
}

/// Buffer strides of one call.
struct Geometry {
    /// Values per transformed input row (`cin` rounded up to a vector).
    cs: usize,
    /// Values per transformed output-gradient row and per `S` row (`cout` rounded up to a
    /// panel).
    qs: usize,
    /// Rows of `S` per point (`cin` rounded up to the register tile's rows).
    c_pad: usize,
    width: usize,
    rows: usize,
}

/// Adds tiles `range` of `part` (channels-last `image` and output gradient `grad`) into
/// `sum` (`[16][c_pad][qs]`), block by block.
fn accumulate(
    s: &ConvShape,
    (image, grad): (&[f32], &[f32]),
    range: std::ops::Range<usize>,
    g: &Geometry,
    kernel: F32Kernel,
    sum: &mut [f32],
) {
    let (oh, ow) = (s.out_h(), s.out_w());
    let (th, tw) = (oh.div_ceil(2), ow.div_ceil(2));
    let block = (BLOCK_VALUES / (POINTS * (g.cs + g.qs))).clamp(12, 192);
    // The register tile reads `rows` input channels from each row of `v`: a last block of
    // channels past `cs` reads into the next row, and past the last row into the slack.
    let mut v = vec![0f32; POINTS * block * g.cs + g.rows];
    let mut q = vec![0f32; POINTS * block * g.qs];
    let mut first = range.start;
    while first < range.end {
        let n_tiles = (range.end - first).min(block);
        for i in 0..n_tiles {
            let t = first + i;
            let (n, ty, tx) = tile_at(t, [th, tw]);
            let src = input_tile_pixels(s, image, (n, ty, tx));
            let dy: [*const f32; 4] = std::array::from_fn(|p| {
                let (y, x) = (2 * ty + p / 2, 2 * tx + p % 2);
                if y < oh && x < ow {
                    grad[((n * oh + y) * ow + x) * s.cout..].as_ptr()
                } else {
                    std::ptr::null()
                }
            });
            // SAFETY: non-null pointers start a pixel's `cin` (`cout`) values inside the
            // images; `v` and `q` hold 16 points × `block` rows of `cs` and `qs` values.
            unsafe {
                on_isa!(
                    kernel,
                    input_tile(&src, s.cin, v.as_mut_ptr().add(i * g.cs), block * g.cs)
                );
                on_isa!(
                    kernel,
                    grad_tile(
                        &dy,
                        (s.cout, g.qs),
                        q.as_mut_ptr().add(i * g.qs),
                        block * g.qs
                    )
                );
            }
        }
        for p in 0..POINTS {
            for c0 in (0..s.cin).step_by(g.rows) {
                for o0 in (0..g.qs).step_by(g.width) {
                    // SAFETY: point p's rows of `v` (from channel c0, `rows` values each, the
                    // slack covering the last) and of `q` (from column o0, a panel each), and
                    // the `rows` × panel block of `sum` at (c0, o0).
                    unsafe {
                        on_isa!(
                            kernel,
                            grad_gemm(
                                v.as_ptr().add(p * block * g.cs + c0),
                                g.cs,
                                q.as_ptr().add(p * block * g.qs + o0),
                                g.qs,
                                n_tiles,
                                sum.as_mut_ptr().add((p * g.c_pad + c0) * g.qs + o0)
                            )
                        );
                    }
                }
            }
        }
        first += n_tiles;
    }
}
