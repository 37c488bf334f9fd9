//! Direct f32 convolution on NCHW tensors for stride-1 layers whose output is as wide as their
//! input (`same` padding: ResNet's 3×3 layers and their input gradients), without unfolding.
//!
//! Why: [`crate::conv`]'s GEMM path writes every image unfolded (`cin·kh·kw × pixels`) before
//! the GEMM reads it back, a pass over memory that weighs most when the layer has few output
//! channels — W5's 64-channel 32×32 layers ran at 94 G multiply-adds/s there while its deeper
//! layers ran at 101–104 and the channels-last implicit GEMM reaches 116 on the same shape.
//!
//! With `ow = w` and stride 1, output pixel `q` (flattened over the image) reads input pixel
//! `q + dy·w + dx` for tap `(dy, dx)`: one shift per tap over the whole plane. A register tile
//! holds `MR` output channels × `NV` vectors of consecutive output pixels; each step loads one
//! vector of input pixels per tile vector (the shifted run, masked to zero where the tap
//! falls on padding or on a neighbouring row) and broadcasts `MR` weights. The masks depend
//! only on the vector's place in the image and the tap, so they are computed once per call.
//! The tiles are 8 channels × 3 vectors of 16 pixels (AVX-512). An AVX2 twin (4 channels × 3
//! vectors of 8, `vmaskmovps` loads) was measured at 43–46 G multiply-adds/s on W5's 64- and
//! 128-channel layers, half of the GEMM path's, so AVX2 CPUs keep the GEMM path.

use std::mem::MaybeUninit;
use std::ops::Range;

use rayon::prelude::*;

use crate::base::isa::F32Kernel;
use crate::base::shape::ConvShape;

/// Whether [`conv2d_direct`] computes this convolution: stride 1, output as wide and as high
/// as the input, a weight of at most [`MAX_WEIGHT`] values, and an AVX-512 CPU (elsewhere
/// the GEMM path runs).
pub(super) fn applies(s: &ConvShape) -> bool {
    s.stride == [1, 1]
        && s.out_w() == s.w
        && s.out_h() == s.h
        && s.cin > 0
        && s.kh * s.kw > 0
        && s.weight_len() <= MAX_WEIGHT
        && F32Kernel::detect() == F32Kernel::Avx512
}

/// Weight values above which the GEMM path stays: measured on W5's layers (batch 64, 2
/// threads, forward and input gradient, `train_conv` bench, alternated), the direct kernel
/// wins at 64 channels (94 → 108 G multiply-adds/s) and 128 (101 → 109), loses ~2% at 256
/// (104 → 102) and ties at 512.
const MAX_WEIGHT: usize = 256 << 10;

/// The forward convolution `out` `[batch, cout, h, w]` of `x` `[batch, cin, h, w]` by
/// `weight` `[cout, cin, kh, kw]` (+ `bias`), writing every value of `out`. Call only where
/// [`applies`] holds.
pub(super) fn conv2d_direct(
    s: &ConvShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) {
    assert!(
        applies(s),
        "direct convolution on a shape it does not cover"
    );
    assert_eq!(x.len(), s.input_len(), "conv2d input length");
    assert_eq!(weight.len(), s.weight_len(), "conv2d weight length");
    assert_eq!(out.len(), s.output_len(), "conv2d output length");
    if let Some(b) = bias {
        assert_eq!(b.len(), s.cout, "conv2d bias length");
    }
    if s.batch == 0 || s.cout == 0 || s.h * s.w == 0 {
        return;
    }
    let operands = (x, weight, bias);
    match F32Kernel::detect() {
        #[cfg(target_arch = "x86_64")]
        F32Kernel::Avx512 => run::<8, 3, 16>(s, operands, out, avx512::tile),
        _ => unreachable!("`applies` admits only the AVX-512 kernel"),
    }
}

/// A register tile's kernel: `tile(operands, bias, (outputs, store masks, rows))`.
type TileFn<const MR: usize, const NV: usize> =
    unsafe fn(Tile<'_, NV>, [f32; MR], ([*mut f32; NV], [u16; NV], usize));

/// [`conv2d_direct`] with tiles of `MR` output channels × `NV` vectors of `LANES` pixels.
fn run<const MR: usize, const NV: usize, const LANES: usize>(
    s: &ConvShape,
    (x, weight, bias): (&[f32], &[f32], Option<&[f32]>),
    out: &mut [MaybeUninit<f32>],
    tile: TileFn<MR, NV>,
) {
    let plan = Plan::new(s, LANES);
    let packed = pack_weight(s, weight, MR);
    let vectors = s.batch * plan.per_image;
    let tiles = vectors.div_ceil(NV);
    // Tasks split both the output channels (in chunks whose packed weights stay in L2 while
    // the task's tiles run through them) and the pixel vectors, with enough tasks per thread
    // to even out the last ones: W5's 512-channel 4×4 layer has only 11 tiles of vectors.
    let blocks = s.cout.div_ceil(MR);
    let block_floats = s.kh * s.kw * s.cin * MR;
    let chunk = (WEIGHT_CHUNK / block_floats).clamp(1, blocks);
    let chunks = blocks.div_ceil(chunk);
    let per_task = (tiles * chunks)
        .div_ceil(crate::base::threads::pool_threads() * 8)
        .clamp(1, tiles);
    let tile_tasks = tiles.div_ceil(per_task);
    let out = SendPtr(out.as_mut_ptr().cast::<f32>());
    let task = |task: usize| {
        let (c, t) = (task / tile_tasks, task % tile_tasks);
        // Each tile's input (NV vectors of every input channel) stays in L2 while the
        // chunk's output channels run over it, and the chunk's weights stay in L2 across
        // the tiles.
        for tile_index in t * per_task..((t + 1) * per_task).min(tiles) {
            let first = tile_index * NV;
            let vectors = first..(first + NV).min(vectors);
            for block in c * chunk..((c + 1) * chunk).min(blocks) {
                let operands = (x, packed.as_slice(), bias);
                // SAFETY: `plan` and `packed` were built for `s`; `x` and `bias` have the
                // lengths `conv2d_direct` asserted; each (block, tile) writes its own output
                // channels at its own vectors' pixels, so the tasks write disjoint values of
                // `out` (its length asserted); `tile` is the kernel of the CPU's
                // instruction set (`detect`).
                unsafe {
                    run_tile::<MR, NV, LANES>(
                        (s, &plan),
                        operands,
                        out.get(),
                        (vectors.clone(), block),
                        tile,
                    );
                }
            }
        }
    };
    let tasks = chunks * tile_tasks;
    if tasks > 1 {
        crate::base::threads::note_split();
        (0..tasks).into_par_iter().for_each(task);
    } else {
        // One task: on this thread (no round trip through the pool).
        (0..tasks).for_each(task);
    }
}

/// Packed weight floats per task's chunk of output channels: 64 K (256 KB, a quarter of L2).
const WEIGHT_CHUNK: usize = 64 << 10;

/// A raw output pointer the tasks share; each writes values no other task writes.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the tasks write disjoint values through it (see `run`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so a closure captures the whole `Send` wrapper).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// What every tile of one call shares: the taps' shifts and the lane masks.
struct Plan {
    /// Vectors per image: `⌈h·w / lanes⌉`.
    per_image: usize,
    /// Per tap, the input offset `dy·w + dx` from an output pixel.
    shifts: Vec<isize>,
    /// `masks[j·taps + t]`: the lanes of the image's vector `j` that read inside the image
    /// through tap `t` (and lie inside the image at all), one bit per lane.
    masks: Vec<u16>,
    /// Per vector `j`, its lanes inside the image (the last one may be partial).
    stores: Vec<u16>,
}

impl Plan {
    /// The plan of `s` for vectors of `lanes` (≤ 16) pixels.
    fn new(s: &ConvShape, lanes: usize) -> Plan {
        let (h, w, p) = (s.h as isize, s.w as isize, s.h * s.w);
        let per_image = p.div_ceil(lanes);
        let taps: Vec<(isize, isize)> = (0..s.kh)
            .flat_map(|ky| (0..s.kw).map(move |kx| (ky, kx)))
            .map(|(ky, kx)| {
                (
                    (ky * s.dilation[0]) as isize - s.padding[0].0 as isize,
                    (kx * s.dilation[1]) as isize - s.padding[1].0 as isize,
                )
            })
            .collect();
        let shifts = taps.iter().map(|&(dy, dx)| dy * w + dx).collect();
        let mut masks = Vec::with_capacity(per_image * taps.len());
        let mut stores = Vec::with_capacity(per_image);
        for j in 0..per_image {
            let pixels = || (j * lanes..(j + 1) * lanes).filter(|&q| q < p);
            let bits = |qs: &mut dyn Iterator<Item = usize>| {
                qs.fold(0u16, |m, q| m | 1 << (q - j * lanes))
            };
            stores.push(bits(&mut pixels()));
            for &(dy, dx) in &taps {
                masks.push(bits(&mut pixels().filter(|&q| {
                    let (y, x) = ((q / s.w) as isize + dy, (q % s.w) as isize + dx);
                    (0..h).contains(&y) && (0..w).contains(&x)
                })));
            }
        }
        Plan {
            per_image,
            shifts,
            masks,
            stores,
        }
    }
}

/// The weight as `[⌈cout/mr⌉][taps][cin][mr]` (output channels past `cout` zero): a tile's
/// `mr` weights for one (tap, input channel) are one contiguous run, read in order.
fn pack_weight(s: &ConvShape, weight: &[f32], mr: usize) -> Vec<f32> {
    let taps = s.kh * s.kw;
    let blocks = s.cout.div_ceil(mr);
    let mut packed = vec![0f32; blocks * taps * s.cin * mr];
    // Over the pool: W5's 512-channel weight is 9.4 MB, ~3 ms on one thread.
    packed
        .par_chunks_exact_mut(taps * s.cin * mr)
        .enumerate()
        .for_each(|(block, dst)| {
            for r in 0..mr.min(s.cout - block * mr) {
                let o = block * mr + r;
                for c in 0..s.cin {
                    let kernel = &weight[(o * s.cin + c) * taps..][..taps];
                    for (t, &v) in kernel.iter().enumerate() {
                        dst[(t * s.cin + c) * mr + r] = v;
                    }
                }
            }
        });
    packed
}

/// One register tile's operands.
struct Tile<'a, const NV: usize> {
    /// Packed weights of this tile's output channels: `[taps][cin][MR]`.
    weights: *const f32,
    /// Per vector, its first input pixel in channel 0 (before any tap's shift).
    inputs: [*const f32; NV],
    /// Per vector, its `taps` lane masks.
    masks: [*const u16; NV],
    /// Per tap, the input offset of an output pixel.
    shifts: &'a [isize],
    /// Input channels.
    cin: usize,
    /// Pixels per channel plane (the stride between input channels and output channels).
    plane: usize,
}

/// Computes output channels `block·MR..` (up to `MR` of them) at the output vectors `vectors`
/// (numbered over the batch, `per_image` per image).
///
/// # Safety
/// `plan` and `packed` were built for `s` (with `LANES` and `MR`); `x` and `bias` have the
/// lengths of `s` (as [`conv2d_direct`] asserts); `out` points to `s.output_len()` values
/// that only this call writes at these channels and vectors; `tile` runs on this CPU.
unsafe fn run_tile<const MR: usize, const NV: usize, const LANES: usize>(
    (s, plan): (&ConvShape, &Plan),
    (x, packed, bias): (&[f32], &[f32], Option<&[f32]>),
    out: *mut f32,
    (vectors, block): (Range<usize>, usize),
    tile: TileFn<MR, NV>,
) {
    let p = s.h * s.w;
    let taps = s.kh * s.kw;
    let rows = MR.min(s.cout - block * MR);
    // Vectors past the tile's last one repeat its first (loaded, never stored).
    let mut inputs = [x.as_ptr(); NV];
    let mut outputs = [out; NV];
    let mut masks = [plan.masks.as_ptr(); NV];
    let mut stores = [0u16; NV];
    for v in 0..NV {
        let vector = if v < vectors.len() {
            vectors.start + v
        } else {
            vectors.start
        };
        let (b, j) = (vector / plan.per_image, vector % plan.per_image);
        inputs[v] = x.as_ptr().wrapping_add(b * s.cin * p + j * LANES);
        outputs[v] = out.wrapping_add((b * s.cout + block * MR) * p + j * LANES);
        masks[v] = plan.masks.as_ptr().wrapping_add(j * taps);
        if v < vectors.len() {
            stores[v] = plan.stores[j];
        }
    }
    let weights = packed.as_ptr().wrapping_add(block * taps * s.cin * MR);
    let bias: [f32; MR] = std::array::from_fn(|r| match bias {
        Some(b) if r < rows => b[block * MR + r],
        _ => 0.0,
    });
    let operands = Tile {
        weights,
        inputs,
        masks,
        shifts: &plan.shifts,
        cin: s.cin,
        plane: p,
    };
    // SAFETY: the caller's contract; the tile reads `cin` channels of every tap through the
    // masks (lanes outside the image are never loaded) and writes `rows` channels of its
    // vectors' in-image lanes.
    unsafe { tile(operands, bias, (outputs, stores, rows)) }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::Tile;

    /// Accumulates the tile (8 channels × 3 vectors of 16 pixels) over every tap and input
    /// channel from `bias` and stores its first `rows` output channels at
    /// `outputs[v] + r·plane` through the store masks.
    ///
    /// # Safety
    /// AVX-512F; every pointer as [`crate::run_tile`] sets it up.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile(
        t: Tile<'_, 3>,
        bias: [f32; 8],
        (outputs, stores, rows): ([*mut f32; 3], [u16; 3], usize),
    ) {
        // Plain loops, not `array::map`: a `map` call the compiler chose not to inline (it
        // did so after unrelated code grew: BENCHMARKS.md run 47) ran once per input channel
        // and cost the kernel 2.5× its time.
        let mut acc = [[_mm512_setzero_ps(); 3]; 8];
        for (row, &b) in acc.iter_mut().zip(&bias) {
            *row = [_mm512_set1_ps(b); 3];
        }
        let mut weights = t.weights;
        for (tap, &shift) in t.shifts.iter().enumerate() {
            // SAFETY: each vector has a mask per tap.
            let masks: [__mmask16; 3] = std::array::from_fn(|v| unsafe { *t.masks[v].add(tap) });
            let mut inputs = t.inputs;
            for i in inputs.iter_mut() {
                *i = i.wrapping_offset(shift);
            }
            for _ in 0..t.cin {
                let xs: [__m512; 3] = std::array::from_fn(|v| {
                    // SAFETY: the mask keeps every loaded lane inside its image's channel
                    // plane; masked lanes are not accessed.
                    unsafe { _mm512_maskz_loadu_ps(masks[v], inputs[v]) }
                });
                for (r, row) in acc.iter_mut().enumerate() {
                    // SAFETY: `weights` walks the packed `[taps][cin][8]` block in order.
                    let w = _mm512_set1_ps(unsafe { *weights.add(r) });
                    for (a, &x) in row.iter_mut().zip(&xs) {
                        *a = _mm512_fmadd_ps(w, x, *a);
                    }
                }
                weights = weights.wrapping_add(8);
                for i in inputs.iter_mut() {
                    *i = i.wrapping_add(t.plane);
                }
            }
        }
        for (r, row) in acc.iter().enumerate().take(rows) {
            for (v, &a) in row.iter().enumerate() {
                // SAFETY: the store mask keeps the lanes inside the output channel's plane.
                unsafe {
                    _mm512_mask_storeu_ps(outputs[v].wrapping_add(r * t.plane), stores[v], a)
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::testing::{conv_shape, relative_error, values};

    /// The convolution in f64, straight from its definition.
    fn reference(s: &ConvShape, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Vec<f64> {
        let (h, wd) = (s.h as isize, s.w as isize);
        let mut out = vec![0f64; s.output_len()];
        for b in 0..s.batch {
            for o in 0..s.cout {
                for y in 0..s.h {
                    for xx in 0..s.w {
                        let mut sum = bias.map_or(0.0, |b| b[o] as f64);
                        for c in 0..s.cin {
                            for ky in 0..s.kh {
                                for kx in 0..s.kw {
                                    let iy =
                                        (y + ky * s.dilation[0]) as isize - s.padding[0].0 as isize;
                                    let ix = (xx + kx * s.dilation[1]) as isize
                                        - s.padding[1].0 as isize;
                                    if (0..h).contains(&iy) && (0..wd).contains(&ix) {
                                        let xi = ((b * s.cin + c) * s.h + iy as usize) * s.w
                                            + ix as usize;
                                        let wi = ((o * s.cin + c) * s.kh + ky) * s.kw + kx;
                                        sum += x[xi] as f64 * w[wi] as f64;
                                    }
                                }
                            }
                        }
                        out[((b * s.cout + o) * s.h + y) * s.w + xx] = sum;
                    }
                }
            }
        }
        out
    }

    /// A stride-1 convolution's shape.
    fn shape(
        batch: usize,
        cin: usize,
        (h, w): (usize, usize),
        cout: usize,
        (kh, kw): (usize, usize),
        padding: [(usize, usize); 2],
        dilation: usize,
    ) -> ConvShape {
        let (stride, dilation) = ([1, 1], [dilation, dilation]);
        conv_shape(
            batch,
            cin,
            [h, w],
            cout,
            [kh, kw],
            stride,
            padding,
            dilation,
        )
    }

    /// One way of running the direct convolution.
    type Runner = fn(&ConvShape, (&[f32], &[f32], Option<&[f32]>), &mut [MaybeUninit<f32>]);

    /// Every instruction set's tile this CPU runs, named.
    fn kernels() -> Vec<(&'static str, Runner)> {
        let mut all: Vec<(&'static str, Runner)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                all.push(("avx512", |s, o, out| {
                    run::<8, 3, 16>(s, o, out, avx512::tile)
                }));
            }
        }
        all
    }

    #[test]
    fn every_direct_kernel_matches_an_f64_reference_on_every_thread_count() {
        let same = [(1, 1), (1, 1)];
        let cases = [
            // Output channels not a multiple of the tile's, pixels not of the vector's.
            shape(2, 3, (5, 7), 5, (3, 3), same, 1),
            // 4×4 images: one vector per image, several images per tile.
            shape(7, 16, (4, 4), 24, (3, 3), same, 1),
            // W5's first stage, narrowed.
            shape(2, 8, (32, 32), 16, (3, 3), same, 1),
            // A 1×3 kernel, a 5×5 one, a dilated one, an even one padded on one side.
            shape(3, 8, (6, 9), 9, (1, 3), [(0, 0), (1, 1)], 1),
            shape(2, 4, (9, 11), 8, (5, 5), [(2, 2), (2, 2)], 1),
            shape(2, 4, (10, 10), 8, (3, 3), [(2, 2), (2, 2)], 2),
            shape(2, 4, (7, 6), 8, (2, 2), [(0, 1), (1, 0)], 1),
        ];
        for (name, kernel) in kernels() {
            for (i, s) in cases.iter().enumerate() {
                let x = values(s.input_len(), 3 + i as u64);
                let w = values(s.weight_len(), 5 + i as u64);
                let bias = values(s.cout, 7 + i as u64);
                for with_bias in [false, true] {
                    let bias = with_bias.then_some(bias.as_slice());
                    let want = reference(s, &x, &w, bias);
                    for threads in [1, 2, 3] {
                        let pool = rayon::ThreadPoolBuilder::new()
                            .num_threads(threads)
                            .build()
                            .expect("a thread pool");
                        let mut out = vec![f32::NAN; s.output_len()];
                        let uninit = crate::base::buffers::as_uninit(&mut out);
                        pool.install(|| kernel(s, (&x, &w, bias), uninit));
                        let err = relative_error(&out, &want);
                        assert!(
                            err <= 1e-5,
                            "{name}, case {i}, bias {with_bias}, {threads} threads: error {err:e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_direct_path_takes_only_same_sized_stride_one_layers_with_a_small_weight() {
        let same = [(1, 1), (1, 1)];
        let strided = ConvShape {
            stride: [2, 2],
            ..shape(1, 4, (8, 8), 4, (3, 3), same, 1)
        };
        let valid = shape(1, 4, (8, 8), 4, (3, 3), [(0, 0), (0, 0)], 1);
        let wide = shape(1, 256, (8, 8), 256, (3, 3), same, 1);
        for s in [strided, valid, wide] {
            assert!(!applies(&s), "{s:?} must stay on the GEMM path");
        }
    }
}
