//! f32 2-D convolution on the host as one GEMM per image, for the forward pass and both
//! gradients: `out = W · cols`, `dcols = Wᵀ · dout` (scattered back to `dx`), and
//! `dW = Σ dout · colsᵀ`, where `cols` is the image unfolded into a `[cin·kh·kw, oh·ow]` matrix.
//!
//! Why not Burn's own convolution: profiling W2/W3 on `flex` (BENCHMARKS.md, runs 2 and 13)
//! showed its GEMM micro-kernel at under a third of the time and the rest in NHWC transposes,
//! zero-fills and a transposed convolution for the input gradient. Here each image's
//! unfolded matrix (W2/W3's conv2: 288 × 576 floats, 650 KB) is built in a per-thread buffer that
//! stays in L2, the output is written in NCHW straight from the GEMM (no transpose), and the
//! bias is the GEMM's initial value. Images are spread over the threads; a single image uses a
//! multi-threaded GEMM instead.

use std::ops::Range;

use gemm::{Parallelism, gemm};
use rayon::prelude::*;

/// Shape of one convolution: `[batch, cin, h, w]` input, `[cout, cin, kh, kw]` weight, no groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvShape {
    /// Images in the batch.
    pub batch: usize,
    /// Input channels.
    pub cin: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels.
    pub cout: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Stride (rows, columns).
    pub stride: [usize; 2],
    /// Padding before and after, per spatial dimension: `[(top, bottom), (left, right)]`.
    pub padding: [(usize, usize); 2],
    /// Dilation (rows, columns).
    pub dilation: [usize; 2],
}

impl ConvShape {
    /// Output height.
    pub fn out_h(&self) -> usize {
        out_len(
            self.h,
            self.kh,
            self.stride[0],
            self.padding[0],
            self.dilation[0],
        )
    }

    /// Output width.
    pub fn out_w(&self) -> usize {
        out_len(
            self.w,
            self.kw,
            self.stride[1],
            self.padding[1],
            self.dilation[1],
        )
    }

    /// Rows of the unfolded matrix: `cin · kh · kw`.
    fn k(&self) -> usize {
        self.cin * self.kh * self.kw
    }

    /// Output pixels per channel: `oh · ow`.
    fn pixels(&self) -> usize {
        self.out_h() * self.out_w()
    }

    fn image_len(&self) -> usize {
        self.cin * self.h * self.w
    }

    /// Elements of the weight.
    pub fn weight_len(&self) -> usize {
        self.cout * self.k()
    }

    /// Elements of the output.
    pub fn output_len(&self) -> usize {
        self.batch * self.cout * self.pixels()
    }

    /// Elements of the input.
    pub fn input_len(&self) -> usize {
        self.batch * self.image_len()
    }

    /// A 1×1 kernel with stride 1 and no padding reads the image as its own unfolded matrix.
    fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == [1, 1] && self.padding == [(0, 0), (0, 0)]
    }
}

/// Output length of one spatial dimension.
pub(super) fn out_len(
    len: usize,
    k: usize,
    stride: usize,
    pad: (usize, usize),
    dilation: usize,
) -> usize {
    let span = dilation * (k - 1) + 1;
    (len + pad.0 + pad.1).saturating_sub(span) / stride + 1
}

/// Unfolds one image `[cin, h, w]` into `cols` `[cin·kh·kw, oh·ow]` (zeros where the kernel
/// reads padding).
fn im2col(s: &ConvShape, image: &[f32], cols: &mut [f32]) {
    let (oh, ow) = (s.out_h(), s.out_w());
    let p = oh * ow;
    let mut row = 0;
    for c in 0..s.cin {
        let plane = &image[c * s.h * s.w..(c + 1) * s.h * s.w];
        for ki in 0..s.kh {
            for kj in 0..s.kw {
                let dst = &mut cols[row * p..(row + 1) * p];
                let di = (ki * s.dilation[0]) as isize - s.padding[0].0 as isize;
                let dj = (kj * s.dilation[1]) as isize - s.padding[1].0 as isize;
                // Output columns whose input column lies inside the image: [lo, hi).
                let (lo, hi) = valid_range(ow, s.stride[1], dj, s.w);
                for oy in 0..oh {
                    let out = &mut dst[oy * ow..(oy + 1) * ow];
                    let iy = (oy * s.stride[0]) as isize + di;
                    if iy < 0 || iy >= s.h as isize || lo >= hi {
                        out.fill(0.0);
                        continue;
                    }
                    let src = &plane[iy as usize * s.w..(iy as usize + 1) * s.w];
                    out[..lo].fill(0.0);
                    out[hi..].fill(0.0);
                    let x0 = (lo * s.stride[1]) as isize + dj;
                    if s.stride[1] == 1 {
                        out[lo..hi].copy_from_slice(&src[x0 as usize..x0 as usize + hi - lo]);
                    } else {
                        for (k, o) in out[lo..hi].iter_mut().enumerate() {
                            *o = src[x0 as usize + k * s.stride[1]];
                        }
                    }
                }
                row += 1;
            }
        }
    }
}

/// Adds the unfolded gradient `dcols` `[cin·kh·kw, oh·ow]` back into the image gradient
/// `[cin, h, w]` (the transpose of [`im2col`]); `dx` must start zeroed.
fn col2im(s: &ConvShape, dcols: &[f32], dx: &mut [f32]) {
    let (oh, ow) = (s.out_h(), s.out_w());
    let p = oh * ow;
    let mut row = 0;
    for c in 0..s.cin {
        let plane = &mut dx[c * s.h * s.w..(c + 1) * s.h * s.w];
        for ki in 0..s.kh {
            for kj in 0..s.kw {
                let src = &dcols[row * p..(row + 1) * p];
                let di = (ki * s.dilation[0]) as isize - s.padding[0].0 as isize;
                let dj = (kj * s.dilation[1]) as isize - s.padding[1].0 as isize;
                let (lo, hi) = valid_range(ow, s.stride[1], dj, s.w);
                for oy in 0..oh {
                    let iy = (oy * s.stride[0]) as isize + di;
                    if iy < 0 || iy >= s.h as isize || lo >= hi {
                        continue;
                    }
                    let dst = &mut plane[iy as usize * s.w..(iy as usize + 1) * s.w];
                    let g = &src[oy * ow..(oy + 1) * ow];
                    let x0 = ((lo * s.stride[1]) as isize + dj) as usize;
                    if s.stride[1] == 1 {
                        for (d, v) in dst[x0..x0 + hi - lo].iter_mut().zip(&g[lo..hi]) {
                            *d += v;
                        }
                    } else {
                        for (k, v) in g[lo..hi].iter().enumerate() {
                            dst[x0 + k * s.stride[1]] += v;
                        }
                    }
                }
                row += 1;
            }
        }
    }
}

/// Output columns `[lo, hi)` whose input column `ox·stride + offset` lies in `[0, w)`.
fn valid_range(ow: usize, stride: usize, offset: isize, w: usize) -> (usize, usize) {
    let lo = if offset >= 0 {
        0
    } else {
        ((-offset) as usize).div_ceil(stride)
    };
    let last = w as isize - 1 - offset; // largest ox·stride allowed
    let hi = if last < 0 {
        0
    } else {
        (last as usize / stride + 1).min(ow)
    };
    (lo.min(hi), hi)
}

/// Row-major `dst[m×n] (+)= lhs · rhs`, with `lhs` element `(i, j)` at `lhs[i·lrs + j·lcs]` and
/// `rhs` element `(i, j)` at `rhs[i·rrs + j·rcs]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    accumulate: bool,
    lhs: &[f32],
    (lrs, lcs): (usize, usize),
    rhs: &[f32],
    (rrs, rcs): (usize, usize),
    threads: usize,
) {
    assert!(dst.len() >= m * n, "matmul destination too small");
    assert!(m == 0 || k == 0 || lhs.len() > (m - 1) * lrs + (k - 1) * lcs);
    assert!(k == 0 || n == 0 || rhs.len() > (k - 1) * rrs + (n - 1) * rcs);
    let parallelism = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: the asserts above keep every index the GEMM reads or writes inside the slices,
    // and `dst` does not alias the inputs (it is a unique borrow).
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
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

/// Threads to use: rayon's pool size.
pub(super) fn pool_threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// Runs `run` on each image's (input, output) pair with a scratch buffer: one image per
/// parallel task (a scratch buffer per thread) when `parallel`, else in order with one buffer
/// (each GEMM then uses every thread).
fn per_image<'a, 'b>(
    pairs: impl Iterator<Item = (&'a [f32], &'b mut [f32])>,
    parallel: bool,
    run: impl Fn(&mut Vec<f32>, (&'a [f32], &'b mut [f32])) + Send + Sync,
) {
    if parallel {
        pairs
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each_init(Vec::new, run);
    } else {
        let mut scratch = Vec::new();
        pairs.for_each(|pair| run(&mut scratch, pair));
    }
}

/// Multiply-adds per image below which [`conv2d_forward`] runs one image's GEMM on the calling
/// thread: handing a GEMM of this size to the pool and waiting costs more than the second
/// thread saves. Measured on W3 at batch 1 with the channels-last kernel while it still used
/// this rule (conv2: 10.6 M multiply-adds, 2 threads, dev-2c-epyc): the whole forward 0.53 ms
/// with a two-thread GEMM, 0.43 ms with one. The NCHW kernel's GEMM pays the same hand-off;
/// its own batch-1 figure was not measured separately.
const SEQUENTIAL_MACS: usize = 16 << 20;

/// Checks a forward's operand lengths: `(k, pixels)`, or `None` when there is nothing to
/// compute.
fn check_forward(s: &ConvShape, x: &[f32], weight: &[f32], out: &[f32]) -> Option<(usize, usize)> {
    assert_eq!(x.len(), s.input_len(), "conv2d input length");
    assert_eq!(weight.len(), s.weight_len(), "conv2d weight length");
    assert_eq!(out.len(), s.output_len(), "conv2d output length");
    let (k, p) = (s.k(), s.pixels());
    (s.cout * p != 0 && s.batch != 0).then_some((k, p))
}

/// Forward convolution: `out` `[batch, cout, oh, ow]` from `x` `[batch, cin, h, w]`, `weight`
/// `[cout, cin, kh, kw]` and an optional `bias` `[cout]`.
pub fn conv2d_forward(
    s: &ConvShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let Some((k, p)) = check_forward(s, x, weight, out) else {
        return;
    };
    let image_out = s.cout * p;
    let threads = pool_threads();
    // One image per task when there are enough images to keep every thread busy; otherwise
    // each image's GEMM is itself split over the threads, unless it is small.
    let gemm_threads = if s.batch >= threads || image_out * k < SEQUENTIAL_MACS {
        1
    } else {
        threads
    };
    let run = |cols: &mut Vec<f32>, (image, out): (&[f32], &mut [f32])| {
        let accumulate = match bias {
            Some(b) => {
                for (row, &v) in out.chunks_exact_mut(p).zip(b) {
                    row.fill(v);
                }
                true
            }
            None => false,
        };
        let cols: &[f32] = if s.is_pointwise() {
            image
        } else {
            cols.resize(k * p, 0.0);
            im2col(s, image, cols);
            cols
        };
        matmul(
            (s.cout, p, k),
            out,
            accumulate,
            weight,
            (k, 1),
            cols,
            (p, 1),
            gemm_threads,
        );
    };
    let pairs = x
        .chunks_exact(s.image_len())
        .zip(out.chunks_exact_mut(image_out));
    per_image(pairs, gemm_threads == 1, run);
}

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
    let Some((k, p)) = check_forward(s, x, packed, out) else {
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
        per_image(images, s.batch >= threads, |patches, (image, out)| {
            ops.rows(image, 0..p, out, patches)
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

/// Gradient of the input: `dx` `[batch, cin, h, w]` from the output gradient `dout`
/// `[batch, cout, oh, ow]` and `weight`.
pub fn conv2d_input_grad(s: &ConvShape, dout: &[f32], weight: &[f32], dx: &mut [f32]) {
    assert_eq!(dout.len(), s.output_len(), "conv2d output-gradient length");
    assert_eq!(weight.len(), s.weight_len(), "conv2d weight length");
    assert_eq!(dx.len(), s.input_len(), "conv2d input-gradient length");
    let (k, p) = (s.k(), s.pixels());
    let image_out = s.cout * p;
    if s.image_len() == 0 || s.batch == 0 {
        return;
    }
    let threads = pool_threads();
    let gemm_threads = if s.batch >= threads { 1 } else { threads };
    let run = |dcols: &mut Vec<f32>, (g, dx): (&[f32], &mut [f32])| {
        if s.is_pointwise() {
            // dx = Wᵀ · dout directly.
            matmul(
                (k, p, s.cout),
                dx,
                false,
                weight,
                (1, k),
                g,
                (p, 1),
                gemm_threads,
            );
            return;
        }
        dcols.resize(k * p, 0.0);
        matmul(
            (k, p, s.cout),
            dcols,
            false,
            weight,
            (1, k),
            g,
            (p, 1),
            gemm_threads,
        );
        dx.fill(0.0);
        col2im(s, dcols, dx);
    };
    let pairs = dout
        .chunks_exact(image_out)
        .zip(dx.chunks_exact_mut(s.image_len()));
    per_image(pairs, gemm_threads == 1, run);
}

/// Gradient of the weight: `dweight` `[cout, cin, kh, kw]` from `x` and `dout`, summed over the
/// batch. Each thread sums its share of the images into its own buffer; the buffers are added
/// at the end in a fixed order, so the result depends only on the thread count.
pub fn conv2d_weight_grad(s: &ConvShape, x: &[f32], dout: &[f32], dweight: &mut [f32]) {
    assert_eq!(x.len(), s.input_len(), "conv2d input length");
    assert_eq!(dout.len(), s.output_len(), "conv2d output-gradient length");
    assert_eq!(
        dweight.len(),
        s.weight_len(),
        "conv2d weight-gradient length"
    );
    let (k, p) = (s.k(), s.pixels());
    let image_out = s.cout * p;
    if s.batch == 0 || image_out == 0 {
        dweight.fill(0.0);
        return;
    }
    let threads = pool_threads();
    let share = s.batch.div_ceil(threads.min(s.batch));
    let gemm_threads = if s.batch >= threads { 1 } else { threads };
    let partial = |(images, grads): (&[f32], &[f32])| {
        let mut acc = vec![0.0f32; s.weight_len()];
        let mut cols = Vec::new();
        for (n, (image, g)) in images
            .chunks_exact(s.image_len())
            .zip(grads.chunks_exact(image_out))
            .enumerate()
        {
            let cols: &[f32] = if s.is_pointwise() {
                image
            } else {
                cols.resize(k * p, 0.0);
                im2col(s, image, &mut cols);
                &cols
            };
            // dW (cout × k) += dout (cout × p) · colsᵀ (p × k).
            matmul(
                (s.cout, k, p),
                &mut acc,
                n > 0,
                g,
                (p, 1),
                cols,
                (1, p),
                gemm_threads,
            );
        }
        acc
    };
    let shares: Vec<_> = x
        .chunks(share * s.image_len())
        .zip(dout.chunks(share * image_out))
        .collect();
    let partials: Vec<Vec<f32>> = if shares.len() > 1 {
        shares.into_par_iter().map(partial).collect()
    } else {
        shares.into_iter().map(partial).collect()
    };
    dweight.copy_from_slice(&partials[0]);
    for part in &partials[1..] {
        for (d, v) in dweight.iter_mut().zip(part) {
            *d += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{relative_error, values};

    /// Direct f64 convolution: the reference every kernel result is checked against.
    /// Calls `f(output index, input index, weight index)` for every kernel tap that reads
    /// inside the image: the direct convolution both references are built from.
    fn for_each_tap(s: &ConvShape, mut f: impl FnMut(usize, usize, usize)) {
        let (oh, ow) = (s.out_h(), s.out_w());
        for n in 0..s.batch {
            for co in 0..s.cout {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let oi = ((n * s.cout + co) * oh + oy) * ow + ox;
                        for c in 0..s.cin {
                            for ki in 0..s.kh {
                                for kj in 0..s.kw {
                                    let iy = (oy * s.stride[0] + ki * s.dilation[0]) as isize
                                        - s.padding[0].0 as isize;
                                    let ix = (ox * s.stride[1] + kj * s.dilation[1]) as isize
                                        - s.padding[1].0 as isize;
                                    if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize
                                    {
                                        continue;
                                    }
                                    let xi =
                                        ((n * s.cin + c) * s.h + iy as usize) * s.w + ix as usize;
                                    f(oi, xi, ((co * s.cin + c) * s.kh + ki) * s.kw + kj);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Direct f64 convolution: the reference every kernel result is checked against.
    fn reference_forward(s: &ConvShape, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f64> {
        let p = s.out_h() * s.out_w();
        let mut out: Vec<f64> = (0..s.output_len())
            .map(|oi| b.map_or(0.0, |b| b[(oi / p) % s.cout] as f64))
            .collect();
        for_each_tap(s, |oi, xi, wi| out[oi] += x[xi] as f64 * w[wi] as f64);
        out
    }

    /// f64 gradients of `Σ out · g` with respect to x and w, by the same direct loops.
    fn reference_grads(s: &ConvShape, x: &[f32], w: &[f32], g: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let mut dx = vec![0f64; s.input_len()];
        let mut dw = vec![0f64; s.weight_len()];
        for_each_tap(s, |oi, xi, wi| {
            dx[xi] += g[oi] as f64 * w[wi] as f64;
            dw[wi] += g[oi] as f64 * x[xi] as f64;
        });
        (dx, dw)
    }

    fn shapes() -> Vec<ConvShape> {
        let base = ConvShape {
            batch: 3,
            cin: 4,
            h: 9,
            w: 8,
            cout: 5,
            kh: 3,
            kw: 3,
            stride: [1, 1],
            padding: [(0, 0), (0, 0)],
            dilation: [1, 1],
        };
        vec![
            base,
            // W3's conv2 at batch 1 (multi-threaded GEMM path).
            ConvShape {
                batch: 1,
                cin: 32,
                h: 26,
                w: 26,
                cout: 64,
                ..base
            },
            // ResNet's padded, strided 3×3 and its 1×1 shortcut.
            ConvShape {
                stride: [2, 2],
                padding: [(1, 1), (1, 1)],
                ..base
            },
            ConvShape {
                kh: 1,
                kw: 1,
                ..base
            },
            ConvShape {
                kh: 1,
                kw: 1,
                stride: [2, 2],
                ..base
            },
            // Asymmetric padding, dilation, non-square everything.
            ConvShape {
                kh: 2,
                kw: 3,
                stride: [1, 2],
                padding: [(0, 1), (2, 0)],
                dilation: [2, 1],
                ..base
            },
            // A kernel wider than the padded input leaves whole rows of padding only.
            ConvShape {
                h: 3,
                w: 2,
                kh: 3,
                kw: 3,
                padding: [(2, 2), (2, 2)],
                ..base
            },
        ]
    }

    /// `[batch, c, h, w]` values as `[batch, h, w, c]`.
    fn to_nhwc(x: &[f32], [b, c, h, w]: [usize; 4]) -> Vec<f32> {
        let mut y = vec![0f32; x.len()];
        for n in 0..b {
            for ch in 0..c {
                for p in 0..h * w {
                    y[(n * h * w + p) * c + ch] = x[(n * c + ch) * h * w + p];
                }
            }
        }
        y
    }

    #[test]
    fn channels_last_forward_with_fused_relu_matches_an_f64_reference() {
        for (i, s) in shapes().into_iter().enumerate() {
            let x = values(s.input_len(), 1 + i as u64);
            let w = values(s.weight_len(), 100 + i as u64);
            let b = values(s.cout, 200 + i as u64);
            let x_nhwc = to_nhwc(&x, [s.batch, s.cin, s.h, s.w]);
            let packed = pack_weight_for_nhwc([s.cout, s.cin, s.kh, s.kw], &w);
            let dims = [s.batch, s.cout, s.out_h(), s.out_w()];
            for (bias, relu) in [(Some(&b[..]), false), (None, false), (Some(&b[..]), true)] {
                let mut out = vec![f32::NAN; s.output_len()];
                conv2d_nhwc_forward(&s, &x_nhwc, &packed, bias, relu, &mut out);
                let want: Vec<f64> = reference_forward(&s, &x, &w, bias)
                    .into_iter()
                    .map(|v| if relu { v.max(0.0) } else { v })
                    .collect();
                let want_f32: Vec<f32> = want.iter().map(|v| *v as f32).collect();
                let want_nhwc: Vec<f64> =
                    to_nhwc(&want_f32, dims).iter().map(|v| *v as f64).collect();
                let err = relative_error(&out, &want_nhwc);
                assert!(
                    err <= 1e-5,
                    "shape {i} {s:?} bias {} relu {relu}: error {err:e}",
                    bias.is_some()
                );
            }
        }
    }

    #[test]
    fn forward_and_gradients_match_an_f64_reference() {
        for (i, s) in shapes().into_iter().enumerate() {
            let x = values(s.input_len(), 1 + i as u64);
            let w = values(s.weight_len(), 100 + i as u64);
            let b = values(s.cout, 200 + i as u64);
            let g = values(s.output_len(), 300 + i as u64);

            let mut out = vec![f32::NAN; s.output_len()];
            conv2d_forward(&s, &x, &w, Some(&b), &mut out);
            let want = reference_forward(&s, &x, &w, Some(&b));
            let err = relative_error(&out, &want);
            assert!(err <= 1e-5, "shape {i} {s:?}: forward error {err:e}");

            conv2d_forward(&s, &x, &w, None, &mut out);
            let want = reference_forward(&s, &x, &w, None);
            let err = relative_error(&out, &want);
            assert!(err <= 1e-5, "shape {i}: forward without bias error {err:e}");

            let (want_dx, want_dw) = reference_grads(&s, &x, &w, &g);
            let mut dx = vec![f32::NAN; s.input_len()];
            conv2d_input_grad(&s, &g, &w, &mut dx);
            let err = relative_error(&dx, &want_dx);
            assert!(err <= 1e-5, "shape {i}: input-gradient error {err:e}");
            let mut dw = vec![f32::NAN; s.weight_len()];
            conv2d_weight_grad(&s, &x, &g, &mut dw);
            let err = relative_error(&dw, &want_dw);
            assert!(err <= 1e-5, "shape {i}: weight-gradient error {err:e}");
        }
    }

    #[test]
    fn valid_range_keeps_reads_inside_the_row() {
        for w in 1..7 {
            for stride in 1..4 {
                for offset in -4isize..4 {
                    let ow = 6;
                    let (lo, hi) = valid_range(ow, stride, offset, w);
                    for ox in 0..ow {
                        let ix = (ox * stride) as isize + offset;
                        let inside = ix >= 0 && ix < w as isize;
                        assert_eq!(
                            inside,
                            (lo..hi).contains(&ox),
                            "w {w} s {stride} o {offset}"
                        );
                    }
                }
            }
        }
    }
}
