//! Winograd F(2×2, 3×3) convolution on channels-last images: 3×3 layers with stride 1
//! (VGG- and ResNet-style bodies, W3's second layer) in 16 multiply-adds per 2×2 output tile
//! and input channel where the implicit GEMM ([`crate::implicit`]) takes 36. Inference calls
//! come from the implicit GEMM's entry points; training's forward and input gradient come
//! from [`crate::conv`] through channels-last copies ([`conv2d_nchw`]), its weight gradient
//! as F(3×3, 2×2) ([`weight_grad`]).
//!
//! Why: on W3 at batch 1 that GEMM already ran the layer at ~114 G multiply-adds/s on two
//! threads — this CPU's peak — and the layer was still 55% of the run (BENCHMARKS.md run
//! 47). Fewer multiply-adds was what was left.
//!
//! The algorithm (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2016):
//! `Y = Aᵀ [(G g Gᵀ) ⊙ (Bᵀ d B)] A` for a 4×4 input tile `d` and a 3×3 kernel `g`. The
//! weight transform `U = G g Gᵀ` is done once per layer (in f64, then rounded). Per block of
//! [`BLOCK`] tiles the kernels then
//! 1. transform the input tiles (`V = Bᵀ d B`, additions only, a vector of channels at a
//!    time, zeros where the tile overlaps the padding — no padded copy of the image),
//! 2. run 16 independent GEMMs `M[ξ] = V[ξ] · U[ξ]` (tiles × input channels times input
//!    channels × output channels) on a register tile like the implicit GEMM's,
//! 3. transform the products back (`Aᵀ M A`, additions only) and store with the
//!    implicit GEMM's epilogues: bias, residual, activation, a 2×2 max pool (a 2×2 output
//!    tile is exactly one pooling window, so the pool costs three `max` per vector), or a
//!    slice of a wider output's channels.
//!
//! Numerics: the transforms' coefficients are 0, ±½ and ±1, so F(2×2, 3×3) adds little
//! rounding error (checked against an f64 direct convolution in the tests, within 1e-5 of
//! the output's largest magnitude). Larger tiles (F(4×4, 3×3): 4× fewer
//! multiply-adds) need coefficients up to 8 and lose about two more digits; not used.
//!
//! Why one file of ~820 lines: the transforms, the block walk and the epilogue dispatch
//! share the tile layout's constants and the `on_isa!` dispatch; the per-instruction-set
//! bodies (avx512.rs, avx2.rs), the weight gradient and the tests are already apart.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;
mod weight_grad;

pub(crate) use weight_grad::{applies as applies_weight_grad, weight_grad_nchw};

use std::cell::RefCell;

use rayon::prelude::*;

use crate::activation::Activation;
use crate::base::aligned::AlignedF32;
use crate::base::isa::F32Kernel;
use crate::base::shape::ConvShape;
use crate::base::threads::SharedOut;

/// Points of a transformed tile: the 4×4 input tile of one 2×2 output tile.
const POINTS: usize = 16;

/// The weight transform's `G` (4×3) of F(2×2, 3×3); the weight gradient's F(3×3, 2×2) turns
/// its sums back with the same matrix, as `Gᵀ S G`.
const G: [[f64; 3]; 4] = [
    [1.0, 0.0, 0.0],
    [0.5, 0.5, 0.5],
    [0.5, -0.5, 0.5],
    [0.0, 0.0, 1.0],
];

/// Image, tile row and tile column of tile `t` on a grid of `[th, tw]` tiles per image.
fn tile_at(t: usize, [th, tw]: [usize; 2]) -> (usize, usize, usize) {
    (t / (th * tw), t % (th * tw) / tw, t % tw)
}

/// The 16 input pixels of tile `(n, ty, tx)` of `s` in the channels-last `image`, null where
/// they fall on the padding.
fn input_tile_pixels(
    s: &ConvShape,
    image: &[f32],
    (n, ty, tx): (usize, usize, usize),
) -> [*const f32; POINTS] {
    let [(top, _), (left, _)] = s.padding;
    std::array::from_fn(|p| {
        let iy = (2 * ty + p / 4).wrapping_sub(top);
        let ix = (2 * tx + p % 4).wrapping_sub(left);
        if iy < s.h && ix < s.w {
            image[((n * s.h + iy) * s.w + ix) * s.cin..].as_ptr()
        } else {
            std::ptr::null()
        }
    })
}

/// Images per part of a training call turned channels-last at a time: as many as
/// `chunk_values` values hold at `per_image` each (at least one).
fn images_per_part(chunk_values: usize, per_image: usize) -> usize {
    (chunk_values / per_image).max(1)
}

/// Tiles per block: one register tile of rows on AVX-512, two on AVX2. A block's transformed
/// input (`16 × BLOCK × cin` values) and products (`16 × BLOCK × panel`) stay in L1/L2 while
/// every panel of output channels passes over them.
const BLOCK: usize = 12;

/// Input channels below which the implicit GEMM keeps the layer: each GEMM's K is the
/// input channels, and a short K spends as long storing the accumulators as multiplying
/// (W3's first layer has 1, RGB stems 3). At 16 (SqueezeNet's 55² layer) Winograd measured
/// 1.6× faster (BENCHMARKS.md run 47); between 3 and 16 it was not measured.
const MIN_CHANNELS: usize = 16;

/// Tiles per call below which the implicit GEMM keeps the layer: with few output pixels the
/// weight's reading is the cost (ResNet's 512-channel 7×7 layers at batch 1), and the
/// transformed weight is 16/9 of the plain one.
const MIN_TILES: usize = 48;

/// Largest share of the implicit GEMM's multiply-adds the Winograd form may take: odd
/// output sizes waste part of their last tile row and column (7×7: 64 outputs computed for
/// 49), and the transforms cost their own passes.
const MAX_MAC_RATIO: f64 = 0.6;

/// Multiply-adds of one call below which it stays on the calling thread (as the implicit
/// GEMM's threshold, [`crate::base::threads::SPLIT_MACS`]).
const SPLIT_MACS: usize = crate::base::threads::SPLIT_MACS;

/// Tasks per thread when a call splits (small ones even out an uneven last share).
const TASKS_PER_THREAD: usize = 16;

/// Whether a convolution of shape `s` on `kernel` runs as Winograd F(2×2, 3×3): a 3×3
/// kernel with stride and dilation 1, enough input channels and output tiles, and a SIMD
/// kernel (the portable path keeps the `gemm` crate). Grouped layers are the caller's to
/// exclude.
pub(crate) fn applies(s: &ConvShape, kernel: F32Kernel, pool: bool) -> bool {
    if s.kh != 3
        || s.kw != 3
        || s.stride != [1, 1]
        || s.dilation != [1, 1]
        || s.cin < MIN_CHANNELS
        || s.cout == 0
        || kernel.panel_width().is_none()
        || !crate::base::isa::winograd_enabled()
    {
        return false;
    }
    let (oh, ow) = (s.out_h(), s.out_w());
    let [th, tw] = tiles(oh, ow, pool);
    let tiles = s.batch * th * tw;
    // Pooled calls compute only the windows the pool keeps, as the implicit GEMM does.
    let direct_pixels = if pool { 4 * th * tw } else { oh * ow };
    let ratio = (POINTS * th * tw) as f64 / (9 * direct_pixels).max(1) as f64;
    tiles >= MIN_TILES && ratio <= MAX_MAC_RATIO
}

/// Whether the training forward [`conv2d_nchw`] takes a convolution of shape `s` (as
/// [`applies`] for the CPU's kernel).
pub(crate) fn applies_nchw(s: &ConvShape) -> bool {
    applies(s, F32Kernel::detect(), false)
}

/// The forward convolution `out` `[batch, cout, oh, ow]` of `x` `[batch, cin, h, w]` by
/// `weight` `[cout, cin, 3, 3]` (+ `bias`) for training, where [`applies_nchw`] holds: the
/// weight transformed for this call (it changes every step), the input turned channels-last,
/// the Winograd convolution, and its output turned back into `out` (every value written).
/// The two turns are passes over memory the direct kernel does not make; the 16 instead of
/// 36 multiply-adds per tile and channel outweigh them (BENCHMARKS.md run 47).
pub(crate) fn conv2d_nchw(
    s: &ConvShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [std::mem::MaybeUninit<f32>],
) {
    assert!(
        applies_nchw(s),
        "Winograd forward on a shape it does not cover"
    );
    nchw_in_parts(s, (x, weight, bias), out, CHUNK_VALUES);
}

/// [`conv2d_nchw`] a few images at a time: as many as `chunk_values` input plus output
/// values hold (at least one).
fn nchw_in_parts(
    s: &ConvShape,
    (x, weight, bias): (&[f32], &[f32], Option<&[f32]>),
    out: &mut [std::mem::MaybeUninit<f32>],
    chunk_values: usize,
) {
    assert_eq!(x.len(), s.input_len(), "conv2d input length");
    assert_eq!(weight.len(), s.weight_len(), "conv2d weight length");
    assert_eq!(out.len(), s.output_len(), "conv2d output length");
    let kernel = F32Kernel::detect();
    let cin = s.cin;
    let w = WinogradWeights::transform(kernel, s.cout, cin, |o, c, ky, kx| {
        weight[((o * cin + c) * 3 + ky) * 3 + kx]
    })
    .expect("applies only with a SIMD kernel");
    let mut padded_bias = vec![0f32; s.cout.div_ceil(w.width) * w.width];
    if let Some(b) = bias {
        assert_eq!(b.len(), s.cout, "conv2d bias length");
        padded_bias[..s.cout].copy_from_slice(b);
    }
    let store = Store {
        bias: &padded_bias,
        act: None,
        pool: false,
        residual: None,
        residual_in_output: false,
        serial: false,
        out_stride: s.cout,
    };
    // A few images at a time: the channels-last copies stay a few MB (in L3 between the
    // turn and the convolution) instead of two more batch-sized tensors per layer (W5's
    // peak RSS grew by 112 MB with whole batches).
    let (image_in, image_out) = (s.cin * s.h * s.w, s.cout * s.out_h() * s.out_w());
    if image_in == 0 || image_out == 0 {
        return;
    }
    let per_chunk = images_per_part(chunk_values, image_in + image_out);
    let chunks = x
        .chunks(image_in * per_chunk)
        .zip(out.chunks_mut(image_out * per_chunk));
    for (x, out) in chunks {
        let part = ConvShape {
            batch: x.len() / image_in,
            ..*s
        };
        let image = crate::base::layout::nchw_to_nhwc(x, [part.batch, cin, s.h, s.w]);
        let y = crate::base::buffers::filled(part.output_len(), |y| {
            // SAFETY: `y` holds the part's pixels × `cout` values, and an unpooled call
            // writes every one of them (each pixel lies in one tile; the panels cover every
            // column).
            unsafe { conv(&part, &image, &w, store, y.as_mut_ptr().cast()) }
        });
        let dims = [part.batch, s.out_h(), s.out_w(), s.cout];
        crate::base::layout::nhwc_to_nchw_into(&y, dims, out);
    }
}

/// Input plus output values per part of a training call's batch turned channels-last at a
/// time (8 MB).
const CHUNK_VALUES: usize = 2 << 20;

/// Output tiles per image, `[rows, columns]`: those covering the output, or with `pool`
/// only whole 2×2 windows (the pool drops an odd last row and column).
fn tiles(oh: usize, ow: usize, pool: bool) -> [usize; 2] {
    if pool {
        [oh / 2, ow / 2]
    } else {
        [oh.div_ceil(2), ow.div_ceil(2)]
    }
}

/// A 3×3 layer's weight transformed for [`conv`]: panels of `width` output channels, each
/// `[16][cin][width]` (point-major, then K, then the panel's columns; zero columns past
/// `cout`).
#[derive(Debug, Clone)]
pub(crate) struct WinogradWeights {
    kernel: F32Kernel,
    cin: usize,
    cout: usize,
    width: usize,
    data: AlignedF32,
}

impl WinogradWeights {
    /// `U = G g Gᵀ` of every (output, input) channel pair, `g(o, c, ky, kx)` the weight, for
    /// `kernel`'s panels (`None` for the portable kernel: no panels).
    pub(crate) fn transform(
        kernel: F32Kernel,
        cout: usize,
        cin: usize,
        g: impl Fn(usize, usize, usize, usize) -> f32 + Sync,
    ) -> Option<Self> {
        let width = kernel.panel_width()?;
        let panels = cout.div_ceil(width);
        let mut data = AlignedF32::zeroed(panels * POINTS * cin * width);
        let panel_len = (POINTS * cin * width).max(1);
        // A training step transforms every layer's weight again: over the pool by panels.
        data.par_chunks_mut(panel_len)
            .enumerate()
            .for_each(|(panel, data)| {
                for col in 0..(cout - panel * width).min(width) {
                    let o = panel * width + col;
                    Self::transform_channel(&g, o, cin, (col, width), data);
                }
            });
        Some(WinogradWeights {
            kernel,
            cin,
            cout,
            width,
            data,
        })
    }

    /// `U = G g Gᵀ` of output channel `o` and every input channel, into column `col` of its
    /// panel's `[16][cin][width]` values.
    fn transform_channel(
        g: &impl Fn(usize, usize, usize, usize) -> f32,
        o: usize,
        cin: usize,
        (col, width): (usize, usize),
        data: &mut [f32],
    ) {
        {
            for c in 0..cin {
                // G g (4×3), then (G g) Gᵀ (4×4).
                let mut gg = [[0f64; 3]; 4];
                for (i, row) in gg.iter_mut().enumerate() {
                    for (kx, v) in row.iter_mut().enumerate() {
                        *v = (0..3).map(|ky| G[i][ky] * g(o, c, ky, kx) as f64).sum();
                    }
                }
                for (i, gg) in gg.iter().enumerate() {
                    for (j, gj) in G.iter().enumerate() {
                        let u: f64 = gg.iter().zip(gj).map(|(a, b)| a * b).sum();
                        data[((i * 4 + j) * cin + c) * width + col] = u as f32;
                    }
                }
            }
        }
    }

    /// Values of one panel: `[16][cin][width]`.
    fn panel(&self, p: usize) -> &[f32] {
        let len = POINTS * self.cin * self.width;
        &self.data[p * len..][..len]
    }
}

/// What [`conv`] does between the transformed products and the store.
#[derive(Clone, Copy)]
pub(crate) struct Store<'a> {
    /// `[panels · width]`: each output channel's bias (zeros past `cout`, or without one).
    pub bias: &'a [f32],
    /// Applied after the bias and the residual.
    pub act: Option<Activation>,
    /// ReLU, then the maximum of each 2×2 output tile as one output pixel.
    pub pool: bool,
    /// A residual `[batch, oh, ow, cout]` added before the activation.
    pub residual: Option<&'a [f32]>,
    /// The output's own values are the residual (read where they are overwritten).
    pub residual_in_output: bool,
    /// On the calling thread whatever the size.
    pub serial: bool,
    /// Values from one output pixel to the next (`cout`, or wider for a slice of channels).
    pub out_stride: usize,
}

/// The convolution `x` `[batch, h, w, cin]` (unpadded: the padding of `s` is read as zeros)
/// by `w`, stored through `store` at `out` (`[batch, oh, ow]` pixels, or the pooled
/// `[batch, oh/2, ow/2]`, `store.out_stride` values apart, columns `0..cout` of each).
///
/// # Safety
/// `out` is valid for those writes (and, with `residual_in_output`, reads) and nothing else
/// accesses them during the call.
pub(crate) unsafe fn conv(
    s: &ConvShape,
    x: &[f32],
    w: &WinogradWeights,
    store: Store,
    out: *mut f32,
) {
    assert!(
        s.kh == 3 && s.kw == 3 && s.stride == [1, 1] && s.dilation == [1, 1],
        "Winograd F(2×2, 3×3) on a shape it does not cover"
    );
    assert_eq!(
        (s.cin, s.cout),
        (w.cin, w.cout),
        "Winograd weights of another layer"
    );
    assert_eq!(x.len(), s.input_len(), "conv2d input length");
    assert_eq!(
        store.bias.len(),
        s.cout.div_ceil(w.width) * w.width,
        "padded bias length"
    );
    if let Some(r) = store.residual {
        assert_eq!(r.len(), s.output_len(), "conv2d residual length");
    }
    let [th, tw] = tiles(s.out_h(), s.out_w(), store.pool);
    let tiles = s.batch * th * tw;
    if tiles == 0 || s.cout == 0 {
        return;
    }
    let blocks = tiles.div_ceil(BLOCK);
    let panels = s.cout.div_ceil(w.width);
    let threads = crate::base::threads::pool_threads();
    let macs = tiles * POINTS * s.cin * s.cout;
    let parallel = !store.serial && threads > 1 && macs >= SPLIT_MACS;
    // Few blocks (deep layers, small images) split the panels too: each part transforms its
    // block's input again, a sixteenth of one panel's multiply-adds per input channel.
    let chunks = if parallel {
        panels
            .min((threads * TASKS_PER_THREAD).div_ceil(blocks))
            .max(1)
    } else {
        1
    };
    let items = blocks * chunks;
    let out = SharedOut(out);
    let run = |item: usize| {
        let (block, chunk) = (item / chunks, item % chunks);
        let first = block * BLOCK;
        let job = Job {
            s,
            x,
            w,
            store: &store,
            tiles: first..(first + BLOCK).min(tiles),
            grid: [th, tw],
            panels: chunk * panels / chunks..(chunk + 1) * panels / chunks,
        };
        // SAFETY: items cover disjoint (tiles, panels) parts of the output, each run by one
        // task; the caller vouches for `out`.
        unsafe { job.run(out.get()) };
    };
    if !parallel || items == 1 {
        (0..items).for_each(run);
        return;
    }
    crate::base::threads::note_split();
    let tasks = (threads * TASKS_PER_THREAD).min(items);
    (0..tasks)
        .into_par_iter()
        .for_each(|t| (t * items / tasks..(t + 1) * items / tasks).for_each(run));
}

thread_local! {
    // A task's transformed input and products, kept between calls (a block's 16 × 12 ×
    // cin values would otherwise be allocated and zeroed per block).
    static SCRATCH: RefCell<(AlignedF32, AlignedF32)> = RefCell::new(Default::default());
}

/// One task's part of a call: a block of tiles × a range of panels.
struct Job<'a> {
    s: &'a ConvShape,
    x: &'a [f32],
    w: &'a WinogradWeights,
    store: &'a Store<'a>,
    /// Tiles in `(image, tile row, tile column)` order over the batch.
    tiles: std::ops::Range<usize>,
    /// Tile rows and columns per image.
    grid: [usize; 2],
    panels: std::ops::Range<usize>,
}

impl Job<'_> {
    /// Transforms the block's input, then per panel multiplies and stores.
    ///
    /// # Safety
    /// As [`conv`]'s, for this job's outputs.
    unsafe fn run(&self, out: *mut f32) {
        let (s, w) = (self.s, self.w);
        let lanes = lanes(w.kernel);
        let cs = s.cin.next_multiple_of(lanes);
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let (v, m) = &mut *scratch;
            if v.len() < POINTS * BLOCK * cs {
                *v = AlignedF32::zeroed(POINTS * BLOCK * cs);
            }
            if m.len() < POINTS * BLOCK * w.width {
                *m = AlignedF32::zeroed(POINTS * BLOCK * w.width);
            }
            for (i, t) in self.tiles.clone().enumerate() {
                let src = input_tile_pixels(s, self.x, tile_at(t, self.grid));
                // SAFETY: each non-null pointer starts a pixel's `cin` values inside `x`;
                // the scratch holds 16 points × BLOCK rows × `cs` values.
                unsafe {
                    on_isa!(
                        w.kernel,
                        input_tile(&src, s.cin, v.as_mut_ptr().add(i * cs), BLOCK * cs)
                    )
                };
            }
            let (oh, ow) = (s.out_h(), s.out_w());
            let stride = self.store.out_stride;
            for p in self.panels.clone() {
                let col0 = p * w.width;
                let cols = (s.cout - col0).min(w.width);
                // SAFETY: the scratch holds the block's transformed rows (unused rows of a
                // short last block hold finite leftovers, whose products are not stored);
                // the panel holds 16 × cin × width values.
                unsafe {
                    on_isa!(
                        w.kernel,
                        gemm(v.as_ptr(), cs, w.panel(p).as_ptr(), s.cin, m.as_mut_ptr())
                    )
                };
                for (i, t) in self.tiles.clone().enumerate() {
                    let (n, ty, tx) = tile_at(t, self.grid);
                    let mut dst = [std::ptr::null_mut(); 4];
                    let mut res = [std::ptr::null(); 4];
                    if self.store.pool {
                        let [th, tw] = self.grid;
                        dst[0] = out.wrapping_add(((n * th + ty) * tw + tx) * stride + col0);
                    } else {
                        for (q, (d, r)) in dst.iter_mut().zip(&mut res).enumerate() {
                            let (y, x) = (2 * ty + q / 2, 2 * tx + q % 2);
                            if y >= oh || x >= ow {
                                continue;
                            }
                            let pixel = (n * oh + y) * ow + x;
                            *d = out.wrapping_add(pixel * stride + col0);
                            if self.store.residual_in_output {
                                *r = d.cast_const();
                            } else if let Some(residual) = self.store.residual {
                                *r = residual[pixel * s.cout + col0..].as_ptr();
                            }
                        }
                    }
                    let epilogue = Epilogue {
                        bias: self.store.bias[col0..].as_ptr(),
                        cols,
                        act: self.store.act,
                        pool: self.store.pool,
                    };
                    // SAFETY: `m` holds the block's products; `dst` are this job's output
                    // pixels (the caller's contract), `res` the residual's matching ones.
                    unsafe {
                        on_isa!(
                            w.kernel,
                            output_tile(
                                m.as_ptr().add(i * w.width),
                                BLOCK * w.width,
                                &epilogue,
                                &dst,
                                &res
                            )
                        )
                    };
                }
            }
        });
    }
}

/// What the output transform applies before its store.
struct Epilogue {
    /// The panel's bias (`width` values).
    bias: *const f32,
    /// Valid columns of the panel.
    cols: usize,
    act: Option<Activation>,
    pool: bool,
}

/// Lanes of `kernel`'s vectors.
fn lanes(kernel: F32Kernel) -> usize {
    match kernel {
        F32Kernel::Avx512 => 16,
        _ => 8,
    }
}

/// Rows (input channels) of the weight gradient's register tile on `kernel`.
fn grad_rows(kernel: F32Kernel) -> usize {
    match kernel {
        F32Kernel::Avx512 => 12,
        _ => 6,
    }
}

/// Calls kernel function `$f` of `$kernel`'s instruction set (the ISA modules' `input_tile`,
/// `gemm`, `output_tile`, `grad_tile`, `grad_gemm`). Unsafe: the call's contract is that
/// function's.
macro_rules! on_isa {
    ($kernel:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $kernel {
            #[cfg(target_arch = "x86_64")]
            F32Kernel::Avx512 => crate::winograd::avx512::$f($($arg),*),
            #[cfg(target_arch = "x86_64")]
            F32Kernel::Avx2 => crate::winograd::avx2::$f($($arg),*),
            _ => unreachable!("Winograd runs only on SIMD kernels"),
        }
    };
}
pub(crate) use on_isa;

/// The three kernels of one instruction set, written once over its vector helpers (`V`,
/// `L`, `R`, `zero`, `load`, `loadn`, `store`, `storen`, `add`, `sub`, `max`, `fma`, `bcast`,
/// `activate`, all `#[inline]` and compiled with `$features`, so they inline here).
macro_rules! winograd_kernels {
    ($features:literal) => {
        /// Columns per panel: two vectors.
        const W: usize = 2 * L;

        /// `V = Bᵀ d B` of one tile for every input channel, a vector of channels at a time:
        /// point `ξ`'s values go to `dst + ξ·point_stride` (`cin` rounded up to `L`).
        ///
        /// # Safety
        /// The CPU has `$features`; each non-null `src[p]` is valid for `cin` reads; `dst`
        /// for writes of 16 points × `cin.next_multiple_of(L)` values.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn input_tile(
            src: &[*const f32; 16],
            cin: usize,
            dst: *mut f32,
            point_stride: usize,
        ) {
            let mut c = 0;
            while c < cin {
                let n = (cin - c).min(L);
                let d: [V; 16] = std::array::from_fn(|p| {
                    if src[p].is_null() {
                        zero()
                    } else {
                        // SAFETY: `n` channels from `c` lie inside the pixel.
                        unsafe { loadn(src[p].add(c), n) }
                    }
                });
                // Bᵀ d: rows 0 − 2, 1 + 2, 2 − 1, 1 − 3 (per column j).
                let mut t = [zero(); 16];
                for j in 0..4 {
                    let (d0, d1, d2, d3) = (d[j], d[4 + j], d[8 + j], d[12 + j]);
                    t[j] = sub(d0, d2);
                    t[4 + j] = add(d1, d2);
                    t[8 + j] = sub(d2, d1);
                    t[12 + j] = sub(d1, d3);
                }
                // (Bᵀ d) B: the same on each row's columns.
                for i in 0..4 {
                    let (a0, a1, a2, a3) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
                    let v = [sub(a0, a2), add(a1, a2), sub(a2, a1), sub(a1, a3)];
                    for (j, v) in v.into_iter().enumerate() {
                        // SAFETY: the caller's contract (channels rounded up to L).
                        unsafe { store(dst.add((4 * i + j) * point_stride + c), v) };
                    }
                }
                c += L;
            }
        }

        /// `Q = A dy Aᵀ` of one 2×2 output-gradient tile (`src`: its 4 pixels in raster
        /// order, null outside the output) for columns `0..qs` (zeros past `cout`), a vector
        /// of channels at a time: point `ξ`'s values go to `dst + ξ·point_stride`.
        ///
        /// # Safety
        /// The CPU has `$features`; each non-null `src[q]` is valid for `cout` reads; `dst`
        /// for writes of 16 points × `qs` values (`qs` a multiple of `L`).
        #[target_feature(enable = $features)]
        pub(super) unsafe fn grad_tile(
            src: &[*const f32; 4],
            (cout, qs): (usize, usize),
            dst: *mut f32,
            point_stride: usize,
        ) {
            let mut c = 0;
            while c < qs {
                let n = cout.saturating_sub(c).min(L);
                let d: [V; 4] = std::array::from_fn(|p| {
                    if src[p].is_null() || n == 0 {
                        zero()
                    } else {
                        // SAFETY: `n` channels from `c` lie inside the pixel.
                        unsafe { loadn(src[p].add(c), n) }
                    }
                });
                // A = [[1, 0], [1, 1], [1, −1], [0, −1]] on the rows, then on the columns.
                let t = [
                    [d[0], d[1]],
                    [add(d[0], d[2]), add(d[1], d[3])],
                    [sub(d[0], d[2]), sub(d[1], d[3])],
                    [sub(zero(), d[2]), sub(zero(), d[3])],
                ];
                for (i, [a, b]) in t.into_iter().enumerate() {
                    let v = [a, add(a, b), sub(a, b), sub(zero(), b)];
                    for (j, v) in v.into_iter().enumerate() {
                        // SAFETY: the caller's contract.
                        unsafe { store(dst.add((4 * i + j) * point_stride + c), v) };
                    }
                }
                c += L;
            }
        }

        /// One point's weight-gradient block: `sum[r][..W] += Σ_t v[t][r] · q[t][..W]` for
        /// `R` input channels `r` (rows of `sum` `qs` apart) and one panel of output
        /// channels, over `tiles` tiles (rows of `v` `cs` apart, of `q` `qs` apart).
        ///
        /// # Safety
        /// The CPU has `$features`; `v` is valid for reads of `R` values at each of its
        /// `tiles` rows, `q` for `W` values at each of its rows, `sum` for reads and writes
        /// of `W` values at each of its `R` rows.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn grad_gemm(
            v: *const f32,
            cs: usize,
            q: *const f32,
            qs: usize,
            tiles: usize,
            sum: *mut f32,
        ) {
            // SAFETY: the caller's contract, for every access below.
            unsafe {
                let mut acc: [[V; 2]; R] =
                    std::array::from_fn(|r| [load(sum.add(r * qs)), load(sum.add(r * qs + L))]);
                for t in 0..tiles {
                    let (w0, w1) = (load(q.add(t * qs)), load(q.add(t * qs + L)));
                    let row = v.add(t * cs);
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let a = bcast(row.add(r));
                        acc[0] = fma(a, w0, acc[0]);
                        acc[1] = fma(a, w1, acc[1]);
                    }
                }
                for (r, acc) in acc.iter().enumerate() {
                    store(sum.add(r * qs), acc[0]);
                    store(sum.add(r * qs + L), acc[1]);
                }
            }
        }

        /// The 16 GEMMs of a block: `m[ξ][t][..W] = Σ_k v[ξ][t][k] · u[ξ][k][..W]` for the
        /// block's `BLOCK` tiles, `R` rows × two vectors of accumulators at a time.
        ///
        /// # Safety
        /// The CPU has `$features`; `v` holds `[16][BLOCK][cs]` values (`cin ≤ cs`), `u`
        /// `[16][cin][W]`, `m` is valid for writes of `[16][BLOCK][W]`.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn gemm(
            v: *const f32,
            cs: usize,
            u: *const f32,
            cin: usize,
            m: *mut f32,
        ) {
            for point in 0..16 {
                let (vp, up) = (
                    v.wrapping_add(point * BLOCK * cs),
                    u.wrapping_add(point * cin * W),
                );
                let mp = m.wrapping_add(point * BLOCK * W);
                for r0 in (0..BLOCK).step_by(R) {
                    let rows: [*const f32; R] =
                        std::array::from_fn(|r| vp.wrapping_add((r0 + r) * cs));
                    let mut acc = [[zero(); 2]; R];
                    for k in 0..cin {
                        // SAFETY: K step k of the point's `[cin][W]` weights.
                        let (w0, w1) = unsafe { (load(up.add(k * W)), load(up.add(k * W + L))) };
                        for (row, acc) in rows.iter().zip(acc.iter_mut()) {
                            // SAFETY: row r's value k (k < cin ≤ cs).
                            let a = unsafe { bcast(row.add(k)) };
                            acc[0] = fma(a, w0, acc[0]);
                            acc[1] = fma(a, w1, acc[1]);
                        }
                    }
                    for (r, acc) in acc.iter().enumerate() {
                        // SAFETY: row r0 + r of the point's `[BLOCK][W]` products.
                        unsafe {
                            store(mp.add((r0 + r) * W), acc[0]);
                            store(mp.add((r0 + r) * W + L), acc[1]);
                        }
                    }
                }
            }
        }

        /// `Y = Aᵀ M A` of one tile (its products at `m + ξ·point_stride`), plus the bias,
        /// then either the pool (ReLU and the 2×2 maximum stored at `dst[0]`) or, per output
        /// pixel `dst[q]` that is not null, the residual `res[q]` (when not null) and the
        /// activation before the store of the panel's valid columns.
        ///
        /// # Safety
        /// The CPU has `$features`; `m` holds 16 points × W values; the bias `W`; each
        /// non-null `dst[q]` / `res[q]` is valid for the panel's valid columns.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn output_tile(
            m: *const f32,
            point_stride: usize,
            e: &crate::winograd::Epilogue,
            dst: &[*mut f32; 4],
            res: &[*const f32; 4],
        ) {
            for half in 0..2 {
                let c = half * L;
                if c >= e.cols {
                    break;
                }
                let n = (e.cols - c).min(L);
                // SAFETY: 16 points × W products; the bias holds W values.
                let mm: [V; 16] =
                    std::array::from_fn(|p| unsafe { load(m.add(p * point_stride + c)) });
                let bias = unsafe { load(e.bias.add(c)) };
                // Aᵀ M: rows 0 + 1 + 2 and 1 − 2 − 3 (per column j), then the same on columns.
                let s0: [V; 4] = std::array::from_fn(|j| add(add(mm[j], mm[4 + j]), mm[8 + j]));
                let s1: [V; 4] =
                    std::array::from_fn(|j| sub(sub(mm[4 + j], mm[8 + j]), mm[12 + j]));
                let y = [
                    add(add(add(s0[0], s0[1]), s0[2]), bias),
                    add(sub(sub(s0[1], s0[2]), s0[3]), bias),
                    add(add(add(s1[0], s1[1]), s1[2]), bias),
                    add(sub(sub(s1[1], s1[2]), s1[3]), bias),
                ];
                if e.pool {
                    // Starting from 0 is the ReLU; `max(v, m)` keeps `m` for a NaN `v`, so a
                    // NaN counts as 0, as in the unfused ReLU (and the implicit GEMM's pool).
                    let v = y.iter().fold(zero(), |mx, &v| max(v, mx));
                    // SAFETY: the pooled pixel's valid columns.
                    unsafe { storen(dst[0].add(c), n, v) };
                    continue;
                }
                for q in 0..4 {
                    if dst[q].is_null() {
                        continue;
                    }
                    let mut v = y[q];
                    if !res[q].is_null() {
                        // SAFETY: the residual pixel's valid columns.
                        v = add(v, unsafe { loadn(res[q].add(c), n) });
                    }
                    if let Some(act) = e.act {
                        v = activate(v, act);
                    }
                    // SAFETY: the output pixel's valid columns.
                    unsafe { storen(dst[q].add(c), n, v) };
                }
            }
        }
    };
}
pub(crate) use winograd_kernels;
