//! Depthwise convolution on channels-last images for inference: the weight packed tap-major,
//! each output row's borders per pixel and its interior as strips ([`strip`], in AVX-512 /
//! AVX2 intrinsics), bias and any activation fused into the store.
//!
//! Why channels-last: Kiln's implicit-GEMM convolution ([`crate::implicit`]) reads and writes
//! NHWC, so a depthwise-separable network keeps its activations NHWC from the first
//! convolution to the global pool, with no transpose per layer (ONNX Runtime keeps its NCHWc
//! blocked layout for the same reason). The inner loops run along the channels.

pub mod planar;
pub(crate) mod strip;

use crate::activation::{Activation, activate_slice};
use crate::base::isa::F32Kernel;
use crate::base::threads::SPLIT_MACS;
use crate::base::window::Window2d;
use strip::{SlideRow, Strip};

/// Multiply-adds below which a depthwise convolution stays on the calling thread: the dense
/// convolution's threshold ([`SPLIT_MACS`], which says why it is low).
const DEPTHWISE_PARALLEL_MACS: usize = SPLIT_MACS;

/// A depthwise convolution's weight `[channels, 1, kh, kw]` packed tap-major
/// (`[kh·kw][channels]`), with its bias.
#[derive(Debug, Clone)]
pub struct DepthwiseWeights {
    channels: usize,
    kernel: [usize; 2],
    taps: Vec<f32>,
    bias: Vec<f32>,
}

impl DepthwiseWeights {
    /// Packs `weight` `[channels, 1, kh, kw]` and `bias` `[channels]` (zeros without one).
    pub fn pack(channels: usize, kernel: [usize; 2], weight: &[f32], bias: Option<&[f32]>) -> Self {
        let taps_per = kernel[0] * kernel[1];
        assert_eq!(weight.len(), channels * taps_per, "depthwise weight length");
        let mut taps = vec![0f32; weight.len()];
        for ch in 0..channels {
            for t in 0..taps_per {
                taps[t * channels + ch] = weight[ch * taps_per + t];
            }
        }
        let bias = bias.map_or_else(|| vec![0.0; channels], <[f32]>::to_vec);
        assert_eq!(bias.len(), channels, "depthwise bias length");
        DepthwiseWeights {
            channels,
            kernel,
            taps,
            bias,
        }
    }

    /// Channels (input = output).
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Kernel height and width.
    pub fn kernel(&self) -> [usize; 2] {
        self.kernel
    }
}

/// Depthwise convolution (one filter per channel) of a channels-last image, bias added and
/// `act` applied: `[batch, oh, ow, channels]`. A ReLU or Clip is applied in the registers
/// before the store; another activation (SiLU, HardSwish, ...) to each output row right
/// after it is computed, while the row is in L1, so no activation is a pass over memory.
pub fn depthwise_conv2d(
    x: &[f32],
    win: &Window2d,
    w: &DepthwiseWeights,
    act: Option<Activation>,
) -> Vec<f32> {
    depthwise_conv2d_on(F32Kernel::detect(), x, win, w, act)
}

/// [`depthwise_conv2d`] with the interior strips of `kernel`'s instruction set (the portable
/// kernel: none, the multiversioned loop throughout), for tests and benchmarks that compare
/// them on one CPU.
///
/// # Panics
/// When the CPU lacks `kernel` ([`F32Kernel::supported`]).
pub fn depthwise_conv2d_on(
    kernel: F32Kernel,
    x: &[f32],
    win: &Window2d,
    w: &DepthwiseWeights,
    act: Option<Activation>,
) -> Vec<f32> {
    let [b, h, wd, c] = win.dims;
    assert_eq!(
        c, w.channels,
        "depthwise weights packed for another channel count"
    );
    assert_eq!(
        win.kernel, w.kernel,
        "depthwise weights packed for another kernel"
    );
    assert_eq!(x.len(), b * h * wd * c, "depthwise input length");
    let [_, oh, ow, _] = win.out_dims();
    let len = b * oh * ow * c;
    if len == 0 {
        return Vec::new();
    }
    let (clamp, after) = Activation::split(act);
    let row = |r: usize, o_row: &mut [f32]| {
        depthwise_row(kernel, x, win, w, clamp, r, o_row);
        if let Some(act) = after {
            activate_slice(o_row, act);
        }
    };
    let work = len * win.kernel[0] * win.kernel[1];
    crate::base::buffers::rows_from_zero(len, ow * c, work >= DEPTHWISE_PARALLEL_MACS, row)
}

/// Output row `r` of the depthwise convolution over `win` (as [`depthwise_conv2d`] computes
/// it: bias, taps, `act`) into `o_row`, on the calling thread: for a caller that makes the
/// input rows itself, band by band ([`super::expand_depthwise`]).
pub(crate) fn depthwise_output_row(
    kernel: F32Kernel,
    x: &[f32],
    win: &Window2d,
    w: &DepthwiseWeights,
    act: Option<Activation>,
    r: usize,
    o_row: &mut [f32],
) {
    let (clamp, after) = Activation::split(act);
    // The row accumulates into its values.
    o_row.fill(0.0);
    depthwise_row(kernel, x, win, w, clamp, r, o_row);
    if let Some(act) = after {
        activate_slice(o_row, act);
    }
}

multiversion! {
    /// Output row `r` (image `r / oh`, row `r mod oh`) of [`depthwise_conv2d`].
    fn depthwise_row(
        kernel: F32Kernel,
        x: &[f32],
        win: &Window2d,
        w: &DepthwiseWeights,
        clamp: Option<[f32; 2]>,
        r: usize,
        o_row: &mut [f32],
    ) {
        let [_, h, wd, c] = win.dims;
        let (oh, kw) = (win.out_len(0), win.kernel[1]);
        let (n, oy) = (r / oh, r % oh);
        let (ky0, ky1, iy0) = win.valid_taps(0, oy);
        let out_w = o_row.len() / c;
        // At stride 1 on x86 the whole row in sliding windows, its border included.
        if win.stride[1] == 1 && win.dilation[1] == 1 && ky1 - ky0 <= MAX_TAPS {
            let mut rows = [(0usize, 0usize); MAX_TAPS];
            for (i, ky) in (ky0..ky1).enumerate() {
                let iy = iy0 + (ky - ky0) * win.dilation[0];
                rows[i] = ((n * h + iy) * wd * c, ky * kw * c);
            }
            let slide = SlideRow {
                x,
                rows: &rows[..ky1 - ky0],
                first_col: -(win.pads[1].0 as isize),
                width: wd,
                kw,
                weights: &w.taps,
                bias: &w.bias,
                channels: c,
                pixels: out_w,
                clamp,
            };
            if strip::run_row(kernel, &slide, o_row) {
                return;
            }
        }
        // The row's taps for a pixel whose window lies inside the image's width, as offsets
        // from the window's first input pixel: built once per row, not per pixel (at 32
        // channels the per-pixel build cost as much as the multiply-adds).
        let mut inner = [(0usize, 0usize); MAX_TAPS];
        let inner_count = (ky1 - ky0) * kw;
        if inner_count <= MAX_TAPS {
            let mut t = 0;
            for ky in ky0..ky1 {
                for kx in 0..kw {
                    let dy = (ky - ky0) * win.dilation[0];
                    inner[t] = ((dy * wd + kx * win.dilation[1]) * c, (ky * kw + kx) * c);
                    t += 1;
                }
            }
        }
        let row = DepthwiseRow {
            x,
            w,
            win,
            clamp,
            // Clamped in the registers before the store (no clamp: the whole line).
            bounds: clamp.unwrap_or([f32::NEG_INFINITY, f32::INFINITY]),
            inner: &inner[..inner_count.min(MAX_TAPS)],
            all_inner: inner_count <= MAX_TAPS,
            n,
            oy,
            rows: (ky0, ky1, iy0),
            row_base: (n * h + iy0) * wd,
        };
        // The interior on x86: strips in registers of intrinsics; the border pixels here.
        let (lo, hi) = row.interior_range(out_w);
        if hi > lo {
            let strip = Strip {
                x,
                first: (row.row_base + win.valid_taps(1, lo).2) * c,
                step: win.stride[1] * c,
                taps: row.inner,
                weights: &w.taps,
                bias: &w.bias,
                channels: c,
                pixels: hi - lo,
                clamp,
            };
            if strip::run(kernel, &strip, &mut o_row[lo * c..hi * c]) {
                for ox in (0..lo).chain(hi..out_w) {
                    row.pixel(ox, &mut o_row[ox * c..(ox + 1) * c]);
                }
                return;
            }
        }
        if c >= DEPTHWISE_BLOCK {
            for (ox, o) in o_row.chunks_exact_mut(c).enumerate() {
                row.pixel(ox, o);
            }
            return;
        }
        let mut ox = 0;
        while ox < out_w {
            if ox + QUAD <= out_w && row.interior(ox) && row.interior(ox + QUAD - 1) {
                let first = (row.row_base + win.valid_taps(1, ox).2) * c;
                let quad = &mut o_row[ox * c..(ox + QUAD) * c];
                depthwise_quad(x, w, first, win.stride[1] * c, row.inner, row.bounds, quad);
                ox += QUAD;
            } else {
                row.pixel(ox, &mut o_row[ox * c..(ox + 1) * c]);
                ox += 1;
            }
        }
    }
}

/// One output row of [`depthwise_conv2d`] and what its pixels share. Methods, not closures:
/// a closure inside the multiversioned row does not inherit its instruction set (measured:
/// twice the time at 64+ channels).
struct DepthwiseRow<'a> {
    x: &'a [f32],
    w: &'a DepthwiseWeights,
    win: &'a Window2d,
    clamp: Option<[f32; 2]>,
    bounds: [f32; 2],
    /// Taps of a pixel whose window lies inside the image's width, from its first input.
    inner: &'a [(usize, usize)],
    /// Whether `inner` holds every such tap (not past [`MAX_TAPS`]).
    all_inner: bool,
    n: usize,
    oy: usize,
    /// The kernel rows inside the image and the first one's input row.
    rows: (usize, usize, usize),
    /// The first input row's offset in pixels.
    row_base: usize,
}

impl DepthwiseRow<'_> {
    /// Whether output pixel `ox`'s window lies inside the image's width.
    #[inline(always)]
    fn interior(&self, ox: usize) -> bool {
        let (kx0, kx1, _) = self.win.valid_taps(1, ox);
        kx0 == 0 && kx1 == self.win.kernel[1] && self.all_inner
    }

    /// The output pixels `lo..hi` whose windows lie inside the image's width (contiguous:
    /// only the first and last few pixels of a row reach into the padding).
    fn interior_range(&self, out_w: usize) -> (usize, usize) {
        let lo = (0..out_w).find(|&ox| self.interior(ox)).unwrap_or(out_w);
        let hi = (lo..out_w)
            .rev()
            .find(|&ox| self.interior(ox))
            .map_or(lo, |ox| ox + 1);
        (lo, hi)
    }

    /// Output pixel `ox` alone.
    #[inline(always)]
    fn pixel(&self, ox: usize, o: &mut [f32]) {
        let (win, c, kw) = (self.win, self.win.dims[3], self.win.kernel[1]);
        let [_, h, wd, _] = win.dims;
        let (kx0, kx1, ix0) = win.valid_taps(1, ox);
        if kx0 == 0 && kx1 == kw && self.all_inner {
            let base = (self.row_base + ix0) * c;
            return depthwise_pixel(self.x, self.w, base, self.inner, self.bounds, o);
        }
        // A pixel on the left or right border: the taps inside the image.
        let (ky0, ky1, iy0) = self.rows;
        let mut taps = [(0usize, 0usize); MAX_TAPS];
        let mut count = 0;
        for ky in ky0..ky1 {
            let iy = iy0 + (ky - ky0) * win.dilation[0];
            for kx in kx0..kx1 {
                let ix = ix0 + (kx - kx0) * win.dilation[1];
                if count < MAX_TAPS {
                    taps[count] = (((self.n * h + iy) * wd + ix) * c, (ky * kw + kx) * c);
                }
                count += 1;
            }
        }
        if count > MAX_TAPS {
            depthwise_pixel_plain(self.x, self.w, win, (self.n, self.oy, ox), o);
            if let Some([lo, hi]) = self.clamp {
                o.iter_mut().for_each(|v| *v = v.max(lo).min(hi));
            }
        } else {
            depthwise_pixel(self.x, self.w, 0, &taps[..count], self.bounds, o);
        }
    }
}

/// Kernel taps the blocked depthwise loop holds offsets for (7×7, ConvNeXt's, is the
/// largest in the exported families); larger kernels take the plain loop.
const MAX_TAPS: usize = 49;

/// Channels per register block of the depthwise loop: 64 floats are four AVX-512 or eight
/// AVX2 registers of accumulators, kept across all taps (the plain loop reloaded and stored
/// the output at every tap: three loads and a store per multiply-add).
const DEPTHWISE_BLOCK: usize = 64;

/// One output pixel `o` of a depthwise convolution from its `taps` (input offset from
/// `base`, weight offset), clamped to `bounds`: blocks of 64 channels, then of 16, then of 8,
/// then one by one, each block's accumulators held across all taps. Inlined into the
/// multiversioned row.
#[inline(always)]
fn depthwise_pixel(
    x: &[f32],
    w: &DepthwiseWeights,
    base: usize,
    taps: &[(usize, usize)],
    bounds: [f32; 2],
    o: &mut [f32],
) {
    let c = o.len();
    let x = &x[base..];
    let mut c0 = 0;
    while c0 + DEPTHWISE_BLOCK <= c {
        depthwise_block::<DEPTHWISE_BLOCK>(x, w, taps, bounds, o, c0);
        c0 += DEPTHWISE_BLOCK;
    }
    while c0 + 16 <= c {
        depthwise_block::<16>(x, w, taps, bounds, o, c0);
        c0 += 16;
    }
    // MobileNet v3's 72, 88 and 120 channels end in 8: one AVX2 register, not 8 scalars.
    if c0 + 8 <= c {
        depthwise_block::<8>(x, w, taps, bounds, o, c0);
        c0 += 8;
    }
    while c0 < c {
        depthwise_block::<1>(x, w, taps, bounds, o, c0);
        c0 += 1;
    }
}

/// Output pixels the interior loop computes together when there are fewer channels than one
/// [`DEPTHWISE_BLOCK`]: each weight vector loaded once for four pixels (MobileNet v2's
/// 32-channel 112² layer 362 → 324–344 µs; with more channels the 64-wide blocks were
/// faster: 144 channels at 56² 170 → 232 µs in quads).
const QUAD: usize = 4;

/// [`QUAD`] adjacent interior output pixels (`out`, `QUAD · c` values) whose windows start
/// at input offset `first` and `step` apart, from the row's `taps`, clamped to `bounds`:
/// blocks of 16 channels, then of 8, then one by one (four pixels' accumulators of 16 fit
/// the registers of AVX2 as of AVX-512).
#[inline(always)]
fn depthwise_quad(
    x: &[f32],
    w: &DepthwiseWeights,
    first: usize,
    step: usize,
    taps: &[(usize, usize)],
    bounds: [f32; 2],
    out: &mut [f32],
) {
    let c = out.len() / QUAD;
    let bases: [usize; QUAD] = std::array::from_fn(|p| first + p * step);
    let mut c0 = 0;
    while c0 + 16 <= c {
        depthwise_quad_block::<16>(x, w, bases, taps, bounds, out, c0);
        c0 += 16;
    }
    if c0 + 8 <= c {
        depthwise_quad_block::<8>(x, w, bases, taps, bounds, out, c0);
        c0 += 8;
    }
    while c0 < c {
        depthwise_quad_block::<1>(x, w, bases, taps, bounds, out, c0);
        c0 += 1;
    }
}

/// Channels `c0..c0 + B` of [`depthwise_quad`].
#[inline(always)]
fn depthwise_quad_block<const B: usize>(
    x: &[f32],
    w: &DepthwiseWeights,
    bases: [usize; QUAD],
    taps: &[(usize, usize)],
    [lo, hi]: [f32; 2],
    out: &mut [f32],
    c0: usize,
) {
    let c = out.len() / QUAD;
    let mut acc = [[0f32; B]; QUAD];
    for a in &mut acc {
        a.copy_from_slice(&w.bias[c0..c0 + B]);
    }
    for &(xo, wo) in taps {
        let k = &w.taps[wo + c0..][..B];
        for (a, &base) in acc.iter_mut().zip(&bases) {
            let px = &x[base + xo + c0..][..B];
            for i in 0..B {
                a[i] += px[i] * k[i];
            }
        }
    }
    for (p, a) in acc.iter_mut().enumerate() {
        for v in a.iter_mut() {
            *v = v.max(lo).min(hi);
        }
        out[p * c + c0..][..B].copy_from_slice(a);
    }
}

/// Channels `c0..c0 + B` of [`depthwise_pixel`].
#[inline(always)]
fn depthwise_block<const B: usize>(
    x: &[f32],
    w: &DepthwiseWeights,
    taps: &[(usize, usize)],
    [lo, hi]: [f32; 2],
    o: &mut [f32],
    c0: usize,
) {
    let mut acc = [0f32; B];
    acc.copy_from_slice(&w.bias[c0..c0 + B]);
    for &(xo, wo) in taps {
        let px = &x[xo + c0..][..B];
        let k = &w.taps[wo + c0..][..B];
        for i in 0..B {
            acc[i] += px[i] * k[i];
        }
    }
    for v in &mut acc {
        *v = v.max(lo).min(hi);
    }
    o[c0..c0 + B].copy_from_slice(&acc);
}

/// [`depthwise_pixel`] for kernels with more than [`MAX_TAPS`] taps: output pixel `(n, oy,
/// ox)` accumulated in place, tap by tap.
#[inline(always)]
fn depthwise_pixel_plain(
    x: &[f32],
    w: &DepthwiseWeights,
    win: &Window2d,
    (n, oy, ox): (usize, usize, usize),
    o: &mut [f32],
) {
    let [_, h, wd, c] = win.dims;
    let kw = win.kernel[1];
    let (ky0, ky1, iy0) = win.valid_taps(0, oy);
    let (kx0, kx1, ix0) = win.valid_taps(1, ox);
    o.copy_from_slice(&w.bias);
    for ky in ky0..ky1 {
        let iy = iy0 + (ky - ky0) * win.dilation[0];
        for kx in kx0..kx1 {
            let ix = ix0 + (kx - kx0) * win.dilation[1];
            let px = &x[((n * h + iy) * wd + ix) * c..][..c];
            let tap = &w.taps[(ky * kw + kx) * c..][..c];
            for ((o, &v), &k) in o.iter_mut().zip(px).zip(tap) {
                *o += v * k;
            }
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::Activation;
    use crate::base::testing::{relative_error, values, window};

    #[test]
    fn depthwise_matches_a_direct_loop() {
        for (dims, k, s, p) in [
            ([1, 28, 28, 144], 3, 1, (1, 1)),
            ([2, 15, 15, 40], 5, 2, (2, 2)),
            ([1, 9, 9, 7], 3, 2, (1, 1)),
            ([1, 10, 10, 93], 3, 1, (1, 1)), // every block: 64 + 16 + 8 + 5 single channels
            ([2, 13, 13, 27], 3, 1, (1, 1)), // quads of 16 + 8 + 3 channels, and single pixels
            ([1, 14, 14, 200], 7, 1, (3, 3)), // ConvNeXt's 7×7: 3 blocks + 8 channels
            ([1, 12, 12, 70], 9, 1, (4, 4)), // past MAX_TAPS: the plain loop
            ([1, 30, 30, 11], 3, 1, (1, 1)), // strips of 8, 4 and 1 pixels under one mask
            // Sliding-window strips (stride 1): 5×5 over 2 strips of 8 and a 4; 7×7 with
            // strips of 8, 4 and single pixels, 2 images, a masked last channel block.
            ([1, 24, 24, 24], 5, 1, (2, 2)),
            ([2, 21, 21, 17], 7, 1, (3, 3)),
        ] {
            let win = window(dims, k, s, p, false);
            let c = dims[3];
            let x = values(dims.iter().product(), 5);
            let wt = values(c * k * k, 6);
            let bias = values(c, 7);
            let packed = DepthwiseWeights::pack(c, [k, k], &wt, Some(&bias));
            // In registers (ReLU, Clip) and per row after it (SiLU, HardSwish).
            for act in [
                None,
                Some(Activation::Relu),
                Some(Activation::Clip(-0.5, 0.5)),
                Some(Activation::Silu),
                Some(Activation::HardSwish),
            ] {
                let got = depthwise_conv2d(&x, &win, &packed, act);
                let [b, h, w, _] = dims;
                let [_, oh, ow, _] = win.out_dims();
                let mut want = vec![0f64; got.len()];
                for n in 0..b {
                    for oy in 0..oh {
                        for ox in 0..ow {
                            for ch in 0..c {
                                let mut acc = bias[ch] as f64;
                                for ky in 0..k {
                                    for kx in 0..k {
                                        let iy = (oy * s + ky) as isize - p.0 as isize;
                                        let ix = (ox * s + kx) as isize - p.0 as isize;
                                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize
                                        {
                                            continue;
                                        }
                                        acc += x[((n * h + iy as usize) * w + ix as usize) * c + ch]
                                            as f64
                                            * wt[(ch * k + ky) * k + kx] as f64;
                                    }
                                }
                                want[((n * oh + oy) * ow + ox) * c + ch] =
                                    act.map_or(acc, |a| a.reference(acc));
                            }
                        }
                    }
                }
                assert!(relative_error(&got, &want) < 1e-5, "{dims:?} k{k} {act:?}");
                // Each instruction set's interior strips, and the portable loop alone.
                for kernel in F32Kernel::all_supported() {
                    let got = depthwise_conv2d_on(kernel, &x, &win, &packed, act);
                    assert!(
                        relative_error(&got, &want) < 1e-5,
                        "{} {dims:?} k{k} {act:?}",
                        kernel.name()
                    );
                }
            }
        }
    }
}
