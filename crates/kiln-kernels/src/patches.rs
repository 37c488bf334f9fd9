//! Channels-last f32 convolution through the `gemm` crate over a gathered patch matrix (each
//! output pixel's `kh·kw·cin` inputs copied into a row): the portable path of the implicit
//! GEMM ([`crate::implicit`]) where no SIMD register tile runs, and its reference shape.

use std::ops::Range;

use rayon::prelude::*;

use crate::base::gemm::matmul;
use crate::base::scratch::per_group;
use crate::base::shape::{ConvShape, check_forward};
use crate::base::threads::pool_threads;

/// A convolution's weight `[cout, cin, kh, kw]` reordered for [`conv2d_nhwc_forward`]:
/// `[kh·kw·cin, cout]`, row `(ky, kx, c)`, so each output pixel is one row of patches times
/// this matrix.
pub fn pack_weight_for_nhwc([cout, cin, kh, kw]: [usize; 4], weight: &[f32]) -> Vec<f32> {
    assert_eq!(weight.len(), cout * cin * kh * kw, "conv2d weight length");
    let mut packed = vec![0f32; weight.len()];
    for o in 0..cout {
        for c in 0..cin {
            for ky in 0..kh {
                for kx in 0..kw {
                    let from = ((o * cin + c) * kh + ky) * kw + kx;
                    let to = ((ky * kw + kx) * cin + c) * cout + o;
                    packed[to] = weight[from];
                }
            }
        }
    }
    packed
}

/// Gathers output pixels `rows` of one channels-last image `[h, w, cin]` into `patches`
/// `[rows.len(), kh·kw·cin]` (zeros where the kernel reads padding): each kernel tap copies a
/// run of `cin` contiguous values.
fn nhwc_patches(s: &ConvShape, image: &[f32], rows: Range<usize>, patches: &mut [f32]) {
    let (ow, cin, k) = (s.out_w(), s.cin, s.k());
    for (pixel, row) in rows.zip(patches.chunks_exact_mut(k)) {
        let (oy, ox) = (pixel / ow, pixel % ow);
        for ky in 0..s.kh {
            let iy = (oy * s.stride[0] + ky * s.dilation[0]) as isize - s.padding[0].0 as isize;
            for kx in 0..s.kw {
                let ix = (ox * s.stride[1] + kx * s.dilation[1]) as isize - s.padding[1].0 as isize;
                let dst = &mut row[(ky * s.kw + kx) * cin..][..cin];
                if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize {
                    dst.fill(0.0);
                } else {
                    let at = (iy as usize * s.w + ix as usize) * cin;
                    dst.copy_from_slice(&image[at..at + cin]);
                }
            }
        }
    }
}

/// Multiply-adds per image above which one image's channels-last convolution is split over
/// the threads by output pixels (each task gathers and multiplies its own rows; one fork-join
/// per image instead of the GEMM's own synchronization). W3's conv2 (10.6 M) is split; its
/// conv1 (0.2 M) is not.
const SPLIT_MACS: usize = 2 << 20;

/// What one channels-last convolution computes: the operands of [`conv2d_nhwc_forward`].
struct NhwcOperands<'a> {
    s: &'a ConvShape,
    packed: &'a [f32],
    bias: Option<&'a [f32]>,
    relu: bool,
}

impl NhwcOperands<'_> {
    /// Output pixels `rows` of one image into `out` `[rows.len(), cout]`, on this thread.
    fn rows(&self, image: &[f32], rows: Range<usize>, out: &mut [f32], patches: &mut Vec<f32>) {
        let (s, k, n) = (self.s, self.s.k(), rows.len());
        let accumulate = match self.bias {
            Some(b) => {
                for px in out.chunks_exact_mut(s.cout) {
                    px.copy_from_slice(b);
                }
                true
            }
            None => false,
        };
        let lhs: &[f32] = if s.is_pointwise() {
            &image[rows.start * k..rows.end * k]
        } else {
            patches.resize(n * k, 0.0);
            nhwc_patches(s, image, rows, patches);
            patches
        };
        matmul(
            (n, s.cout, k),
            out,
            accumulate,
            lhs,
            (k, 1),
            self.packed,
            (s.cout, 1),
            1,
        );
        if self.relu {
            for v in out.iter_mut() {
                *v = v.max(0.0);
            }
        }
    }
}

/// Forward convolution for inference in channels-last layout: `out` `[batch, oh, ow, cout]`
/// from `x` `[batch, h, w, cin]` and `packed` ([`pack_weight_for_nhwc`]), the bias as the
/// GEMM's initial value and, with `relu`, ReLU applied to each block of output right after its
/// GEMM, while it is still in cache (one pass fewer over memory than a separate op).
///
/// Why channels-last: the GEMM's output rows are pixels, so it is written in the layout the
/// next convolution, pooling and int8 layers read without a transpose, the patch gather
/// copies whole channel runs instead of single values (a 1×1 convolution reads the image as
/// is), and an image splits over the threads by output pixels, each task gathering only its
/// own rows.
pub fn conv2d_nhwc_forward(
    s: &ConvShape,
    x: &[f32],
    packed: &[f32],
    bias: Option<&[f32]>,
    relu: bool,
    out: &mut [f32],
) {
    let Some((k, p)) = check_forward(s, x, packed, out.len()) else {
        return;
    };
    let ops = NhwcOperands {
        s,
        packed,
        bias,
        relu,
    };
    let image_out = s.cout * p;
    let threads = pool_threads();
    let images = x
        .chunks_exact(s.image_len())
        .zip(out.chunks_exact_mut(image_out));
    // Enough images for every thread, or a small one: each image whole, on one thread.
    if s.batch >= threads || image_out * k < SPLIT_MACS {
        per_group(images, s.batch >= threads, |scratch, (image, out)| {
            ops.rows(image, 0..p, out, &mut scratch.cols)
        });
        return;
    }
    let per_task = p.div_ceil(threads);
    for (image, out) in images {
        out.par_chunks_mut(per_task * s.cout)
            .enumerate()
            .for_each_init(Vec::new, |patches, (t, out)| {
                let start = t * per_task;
                ops.rows(image, start..start + out.len() / s.cout, out, patches)
            });
    }
}
