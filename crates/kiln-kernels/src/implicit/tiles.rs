//! The implicit GEMM's geometry and register tiles: where each output pixel's K values lie
//! in the (padded) channels-last image, the operands a call hands its tasks, and the walk
//! of a tile over rows × panels with the weight panel prefetched ahead (the per-instruction
//! set kernels in [`super::avx512`] and [`super::avx2`] run the tile itself).

use super::*;

/// K steps ahead of the current one whose weight panel lines the SIMD kernels prefetch into
/// L1 (one or two lines per step). Why: a model's weights do not stay in cache between runs
/// (ResNet-50's 100 MB, BERT-base's 340 MB), so the first tile over each panel waited on
/// memory for every line; layer 4's 3×3 convolution of ResNet-50 at batch 1 (a 9.4 MB weight
/// over 49 rows) took 1.07 ms in the model against 0.63 ms with its weight warm in the
/// benchmark. Measured at two threads (medians of alternated runs, BENCHMARKS.md run 42):
/// ResNet-50 b1 29.6 → 27.0 ms, ResNet-18 b1 11.9 → 10.8, BERT-base b1 90.9 → 80.5;
/// 8 and 32 steps ahead within noise of 16.
pub(super) const PREFETCH_STEPS: usize = 16;

/// Output rows per work item when a call has many (48 rows × K values of input stay in L2
/// while every panel passes over them).
pub(super) const ROW_BLOCK: usize = 48;

/// Tasks per thread when a call splits: small ones, so an uneven share evens out (measured
/// on a strided ResNet-18 convolution at batch 1, two threads: 16 per thread 0.57 ms, 4 per
/// thread 0.61 ms; W3's conv2 the same either way).
pub(super) const TASKS_PER_THREAD: usize = 16;

/// Where each output pixel's K values lie in the (padded) NHWC image.
pub(super) struct Geometry {
    /// Offsets of the K runs from a pixel's base, in K order `(ky, kx, c)`.
    pub(super) runs: Vec<usize>,
    /// Contiguous values per run: `kw·cin` when the kernel's columns are adjacent
    /// (dilation 1), else `cin`.
    pub(super) run_len: usize,
    /// Padded height and width, output height and width, stride, channels.
    pub(super) hp: usize,
    pub(super) wp: usize,
    pub(super) oh: usize,
    pub(super) ow: usize,
    pub(super) stride: [usize; 2],
    pub(super) cin: usize,
    /// Output rows grouped by the runs they read (see [`kernel_rows`]): each
    /// group's first output row and its runs, in order from row 0. One group when no
    /// kernel row ever falls on the top or bottom padding; 3 for a 3×3 `same` convolution.
    pub(super) row_groups: Vec<(usize, Range<usize>)>,
}

impl Geometry {
    /// The windows of `s` reading `channels` input channels from the start of each pixel
    /// (all of `s.cin`, or a grouped panel's slice, whose offset the caller adds).
    pub(super) fn new(s: &ConvShape, channels: usize) -> Self {
        let [(top, bottom), (left, right)] = s.padding;
        let (hp, wp) = (s.h + top + bottom, s.w + left + right);
        let (cin, [dy, dx]) = (s.cin, s.dilation);
        let mut runs = Vec::new();
        // A kernel row is one run when its pixels' channels are all read and adjacent.
        let run_len = if dx == 1 && channels == cin {
            for ky in 0..s.kh {
                runs.push(ky * dy * wp * cin);
            }
            s.kw * cin
        } else {
            for ky in 0..s.kh {
                for kx in 0..s.kw {
                    runs.push((ky * dy * wp + kx * dx) * cin);
                }
            }
            channels
        };
        let per_row = runs.len() / s.kh.max(1);
        let mut row_groups: Vec<(usize, Range<usize>)> = Vec::new();
        for oy in 0..s.out_h() {
            let read = kernel_rows(s, oy, per_row);
            if row_groups.last().is_none_or(|(_, runs)| *runs != read) {
                row_groups.push((oy, read));
            }
        }
        Geometry {
            runs,
            run_len,
            hp,
            wp,
            oh: s.out_h(),
            ow: s.out_w(),
            stride: s.stride,
            cin,
            row_groups,
        }
    }

    /// From GEMM row `row` (raster order, [`Geometry::bases`] without pooling) up to `end`:
    /// the runs row `row` reads and where the rows reading the same runs stop. A segment
    /// goes on into the next image when that image's first rows read the same runs: without
    /// vertical padding (a linear layer is a batch of 1×1 images) the whole range is one
    /// segment, not one per image.
    pub(super) fn segment(&self, row: usize, end: usize) -> (Range<usize>, usize) {
        let pixels = self.oh * self.ow;
        let (image, oy) = (row / pixels, row % pixels / self.ow);
        let groups = &self.row_groups;
        let at = groups.partition_point(|(first, _)| *first <= oy) - 1;
        let runs = groups[at].1.clone();
        let stop = match (groups.get(at + 1), groups.len()) {
            (Some((next, _)), _) => image * pixels + next * self.ow,
            // The image's last rows; every row reads the same runs.
            (None, 1) => end,
            // The next image's first rows read other runs: both ends of `kernel_rows` only
            // decrease from the top row to the bottom one, so the first group equals the
            // last only when there is one.
            (None, _) => (image + 1) * pixels,
        };
        (runs, stop.min(end))
    }

    /// Offset in the padded image of output pixel `(n, oy, ox)`'s window.
    pub(super) fn base(&self, n: usize, oy: usize, ox: usize) -> usize {
        let at = oy * self.stride[0] * self.wp + ox * self.stride[1];
        (n * self.hp * self.wp + at) * self.cin
    }

    /// Each GEMM row's window offset: output pixels in raster order, or with `pool` ordered
    /// by 2×2 pooling windows — for each pooled pixel `(n, py, px)` the output pixels
    /// `(2py, 2px)`, `(2py, 2px+1)`, `(2py+1, 2px)`, `(2py+1, 2px+1)` (an odd last row or
    /// column dropped).
    pub(super) fn bases(&self, batch: usize, pool: bool) -> Vec<usize> {
        if !pool {
            // One output row's windows step by the stride: a loop the compiler vectorizes
            // (the window loops below took 3% of MobileNet v3 small's batch-1 run under
            // `perf` when unpooled rows went through them too).
            let step = self.stride[1] * self.cin;
            let mut bases = Vec::with_capacity(batch * self.oh * self.ow);
            for n in 0..batch {
                for oy in 0..self.oh {
                    let first = self.base(n, oy, 0);
                    bases.extend((0..self.ow).map(|ox| first + ox * step));
                }
            }
            return bases;
        }
        let (ph, pw) = (self.oh / 2, self.ow / 2);
        let mut bases = Vec::with_capacity(batch * ph * pw * 4);
        for n in 0..batch {
            for py in 0..ph {
                for px in 0..pw {
                    for dy in 0..2 {
                        for dx in 0..2 {
                            bases.push(self.base(n, 2 * py + dy, 2 * px + dx));
                        }
                    }
                }
            }
        }
        bases
    }

    /// Copies `x` (`[batch, h, w, cin]`, or NCHW transposed on the way) into a zero border
    /// of the convolution's padding (and `slack` zeros after the end); row by row over the pool when `parallel` (at batch 1 a
    /// serial copy of a large image cost ~10% of a strided ResNet convolution on two
    /// threads). Each value is written once: the border's zeros beside the copied rows, not
    /// a zero fill of the whole buffer first (a serial `memset` of the padded image, as long
    /// as the copy: BENCHMARKS.md run 40).
    pub(super) fn pad(&self, s: &ConvShape, x: Input, parallel: bool, slack: usize) -> Vec<f32> {
        let [(top, _), (left, _)] = s.padding;
        let (hp, row, cin) = (self.hp, self.wp * self.cin, self.cin);
        let image_len = s.batch * hp * row;
        let plane = s.h * s.w;
        let copy_row = |(i, dst): (usize, &mut [MaybeUninit<f32>])| {
            let (n, y) = (i / hp, i % hp);
            if y >= top && y < top + s.h {
                let (before, rest) = dst.split_at_mut(left * cin);
                let (middle, after) = rest.split_at_mut(s.w * cin);
                before.fill(MaybeUninit::new(0.0));
                match x {
                    Input::Nhwc(x) => {
                        middle.write_copy_of_slice(
                            &x[(n * s.h + y - top) * s.w * cin..][..s.w * cin],
                        );
                    }
                    Input::Nchw(x) => {
                        // Row `y` of each channel's plane, interleaved pixel by pixel.
                        let planes = &x[n * cin * plane + (y - top) * s.w..];
                        let row = |c: usize| &planes[c * plane..][..s.w];
                        if cin == 3 {
                            interleave3(row(0), row(1), row(2), middle);
                        } else {
                            for (i, px) in middle.chunks_exact_mut(cin).enumerate() {
                                for (c, v) in px.iter_mut().enumerate() {
                                    *v = MaybeUninit::new(row(c)[i]);
                                }
                            }
                        }
                    }
                }
                after.fill(MaybeUninit::new(0.0));
            } else {
                dst.fill(MaybeUninit::new(0.0));
            }
        };
        crate::base::buffers::filled(image_len + slack, |out| {
            let (image, tail) = out.split_at_mut(image_len);
            tail.fill(MaybeUninit::new(0.0));
            if parallel {
                image.par_chunks_mut(row).enumerate().for_each(copy_row);
            } else {
                image.chunks_mut(row).enumerate().for_each(copy_row);
            }
        })
    }
}

/// The runs (a range of [`Geometry::runs`], `per_row` runs per kernel row) output row `oy`
/// of `s` reads from the image: its kernel rows that fall on the top or bottom padding read
/// only zeros, so a tile of such rows skips them. Runs are kernel-row-major, so the rest is
/// one range: the kernel rows inside the image, as the depthwise and pooling windows find
/// them.
pub(super) fn kernel_rows(s: &ConvShape, oy: usize, per_row: usize) -> Range<usize> {
    let window = Window2d {
        dims: [s.batch, s.h, s.w, s.cin],
        kernel: [s.kh, s.kw],
        stride: s.stride,
        dilation: s.dilation,
        pads: s.padding,
        ceil_mode: false,
    };
    let (first, last, _) = window.valid_taps(0, oy);
    first * per_row..last * per_row
}

/// One call's operands, shared by its tasks.
pub(super) struct Operands<'a> {
    pub(super) image: &'a [f32],
    pub(super) bases: &'a [usize],
    pub(super) geometry: &'a Geometry,
    pub(super) weights: &'a ConvWeights,
    pub(super) width: usize,
    /// [`Tile::clamp`] and [`Tile::after`], split once per call.
    pub(super) clamp: Option<[f32; 2]>,
    pub(super) after: Option<Activation>,
    pub(super) pool: bool,
    /// Added to the output before the ReLU (the output's layout).
    pub(super) residual: Residual<'a>,
    /// Values from one output pixel to the next.
    pub(super) out_stride: usize,
}

impl Operands<'_> {
    /// Output rows `rows` × the columns of panel `panel`, on this thread.
    ///
    /// # Safety
    /// `out` is the call's `[rows / row_group, cout]` output and no other thread touches this
    /// rectangle.
    pub(super) unsafe fn rectangle(&self, rows: Range<usize>, panel: usize, out: *mut f32) {
        let cout = self.weights.dims[0];
        let (runs, run_len) = (&self.geometry.runs[..], self.geometry.run_len);
        let k = runs.len() * run_len;
        // The last window reads up to here: every base + offset + j must stay inside.
        let shift = self.weights.panel_offsets.get(panel).copied().unwrap_or(0);
        let last = self.bases[rows.end - 1] + runs[runs.len() - 1] + run_len;
        assert!(
            last + shift <= self.image.len(),
            "conv2d window outside the image"
        );
        let col0 = panel * self.width;
        let panel_values = &self.weights.data[panel * k * self.width..][..k * self.width];
        let group = row_group(self.pool);
        // Rows on the image's top or bottom border skip the kernel rows that read padding
        // (a 3×3 kernel on a 7×7 image: 2 of 21 kernel rows per image column). Pooled rows
        // are ordered by windows, not by image rows: all their runs are read.
        let mut start = rows.start;
        while start < rows.end {
            let (span, end) = if self.pool {
                (0..runs.len(), rows.end)
            } else {
                self.geometry.segment(start, rows.end)
            };
            // Row r of the rectangle starts at (r·out_stride + col0).
            let dest = out.wrapping_add(start / group * self.out_stride + col0);
            let tile = Tile {
                // A grouped panel reads its slice of each pixel's channels.
                image: &self.image[shift..],
                runs: &runs[span.clone()],
                run_len,
                panel: &panel_values
                    [span.start * run_len * self.width..span.end * run_len * self.width],
                bias: &self.weights.bias[col0..col0 + self.width],
                clamp: self.clamp,
                after: self.after,
                cols: (cout - col0).min(self.width),
                out_stride: self.out_stride,
                pool: self.pool,
                residual: match self.residual {
                    Residual::None => std::ptr::null(),
                    Residual::Apart(r) => r[start / group * cout + col0..].as_ptr(),
                    // The values the tile overwrites.
                    Residual::InOutput => dest.cast_const(),
                },
            };
            // SAFETY: the caller's contract.
            unsafe { tile.run(self.weights.kernel, &self.bases[start..end], dest) };
            start = end;
        }
    }
}

/// Runs an instruction set's `block::<R>` on the `$rows`-row tile starting at row `$i`, for
/// each `R` the kernel instantiates (`[1 2 …]`: every size up to its full tile, so a short
/// segment is one tile of its own size, not a narrow tile plus single rows at half speed).
/// [`walk_tiles`] keeps every tile inside `bases` and within the listed sizes, so the slice
/// conversions cannot fail.
macro_rules! tile_rows {
    ($block:ident, $tile:expr, $bases:expr, $i:expr, $rows:expr, $dest:expr, $masks:expr,
     [$($r:literal)*]) => {
        match $rows {
            $($r => $block::<$r>($tile, $bases[$i..][..$r].try_into().unwrap(), $dest, $masks),)*
            rows => unreachable!("no {rows}-row register tile"),
        }
    };
}

pub(crate) use tile_rows;

/// Walks `n` rows in as few tiles of at most `full` rows as possible, their sizes as equal as
/// possible and multiples of `unit` (4 when rows come in pooling windows; `n` is then a
/// multiple of 4 too): `f(first_row, rows)`. Why equal sizes: a tile of one or two rows keeps
/// too few accumulator chains to hide the FMA latency, while 25 rows as 9 + 8 + 8 run at the
/// full tile's speed.
pub(super) fn walk_tiles(n: usize, full: usize, unit: usize, mut f: impl FnMut(usize, usize)) {
    let units = n / unit;
    let tiles = units.div_ceil(full / unit);
    let mut i = 0;
    for t in 0..tiles {
        let rows = (units / tiles + usize::from(t < units % tiles)) * unit;
        f(i, rows);
        i += rows;
    }
}

/// Asks for the cache lines a register tile will store to (`rows` rows `stride` values
/// apart, `lines` cache lines from each row's start) and of the residual it will add, when it
/// has one, before its K loop starts. Why: a short K loop (ResNet-50's 64 → 256 1×1 layers:
/// 64 steps) ends before a demand miss on the output or the residual would come back, and
/// the rows lie a whole output pixel apart (1 KB there), a stride the hardware prefetchers
/// follow poorly; fetched now, they arrive while the tile multiplies. Measured at two
/// threads, batch 8, the layer with its residual into a fresh output (`conv_kernels`,
/// BENCHMARKS.md run 45): 6.87 → 6.03 ms.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_tile_outputs(
    out: *mut f32,
    res: *const f32,
    rows: usize,
    stride: usize,
    lines: usize,
) {
    use std::arch::x86_64::{_MM_HINT_ET0, _MM_HINT_T0, _mm_prefetch};
    for r in 0..rows {
        for line in 0..lines {
            let at = r * stride + line * 16;
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe {
                if !res.is_null() {
                    _mm_prefetch::<_MM_HINT_T0>(res.wrapping_add(at).cast());
                }
                _mm_prefetch::<_MM_HINT_ET0>(out.wrapping_add(at).cast::<i8>().cast_const());
            }
        }
    }
}

/// One panel's work over a range of rows.
pub(super) struct Tile<'a> {
    pub(super) image: &'a [f32],
    pub(super) runs: &'a [usize],
    pub(super) run_len: usize,
    /// `[k][width]`.
    pub(super) panel: &'a [f32],
    /// `[width]`.
    pub(super) bias: &'a [f32],
    /// Bounds applied in the registers after the bias and the residual, before the store
    /// (ReLU, Clip).
    pub(super) clamp: Option<[f32; 2]>,
    /// Another activation (SiLU, HardSwish, ...), applied to the tile's output right after
    /// its store, while in L1: inlined into the register tile, its constants would be hoisted
    /// into registers the accumulators need (measured: every convolution twice as slow).
    pub(super) after: Option<Activation>,
    /// Valid columns of this panel (≤ width).
    pub(super) cols: usize,
    pub(super) out_stride: usize,
    /// Rows come in groups of 4 (a 2×2 pooling window, see [`conv2d_nhwc_relu_pool2_new`]):
    /// each group's maximum after ReLU is stored, as one output row.
    pub(super) pool: bool,
    /// A residual in the output's layout from the tile's first row, added before the ReLU;
    /// null for none.
    pub(super) residual: *const f32,
}

/// GEMM rows per stored output row: 4 when the epilogue pools 2×2 windows.
pub(super) fn row_group(pool: bool) -> usize {
    if pool { 4 } else { 1 }
}

impl Tile<'_> {
    /// The residual from output row `row` on (null without one).
    pub(super) fn residual_at(&self, row: usize) -> *const f32 {
        if self.residual.is_null() {
            self.residual
        } else {
            self.residual.wrapping_add(row * self.out_stride)
        }
    }

    /// Runs the register tiles over `bases` (one per row), writing row `i` at
    /// `out[i·out_stride..][..cols]`.
    ///
    /// # Safety
    /// `out` is valid for those writes and nothing else accesses them meanwhile.
    pub(super) unsafe fn run(&self, kernel: F32Kernel, bases: &[usize], out: *mut f32) {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the kernel was chosen by feature detection; `Operands::rectangle`
            // checked that every window lies inside the image, the panel holds k × 32 values,
            // and the caller vouches for `out`.
            F32Kernel::Avx512 => unsafe { avx512::rows(self, bases, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for the AVX2 + FMA kernel and a k × 16 panel.
            F32Kernel::Avx2 => unsafe { avx2::rows(self, bases, out) },
            _ => unreachable!("the portable kernel has no panels"),
        }
    }
}
