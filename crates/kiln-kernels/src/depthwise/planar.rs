//! Depthwise convolution for training, on NCHW images (what Burn's autodiff hands a layer):
//! the forward and both gradients.
//!
//! Why its own kernel: a depthwise layer (`groups = channels`, one `kh × kw` filter per
//! channel) has no reduction over channels, so the GEMM forms of a dense convolution degrade
//! to thousands of tiny products — Burn's grouped convolution runs one per group.
//!
//! How: the planes of one channel are copied, a group of images at a time, into
//! `stride × stride` *phase planes* of the padded input (phase `(py, px)` holds padded rows
//! `py, py + sy, …` and columns `px, px + sx, …`, zero where the padded input is padding),
//! each `ha × wa`, `wa` wider than the output, the group's planes stacked one under the
//! other. Every tap then reads one phase at a fixed offset, and the group's whole output —
//! computed on the `wa`-wide grid, the extra rows and columns dropped at the end — is one
//! contiguous run per tap: no padding test, no stride gather and no per-row loop inside, which
//! matters because depthwise planes are small (an 8×8 row is half an AVX-512 register; a
//! per-row loop ran U1's layers at 2–6 G multiply-adds/s). Stacking several images' small
//! planes makes the run long enough to amortize each tap's setup. The runs are
//! register-blocked: 64 outputs stay in registers across all taps.
//!
//! The input gradient is the same correlation per phase over the output gradient spread onto
//! the `wa`-wide grid (zero in the extra rows and columns, which is why a stacked plane never
//! reads its neighbour), with the taps' offsets mirrored; the weight gradient is one dot
//! product per tap of that spread gradient with the tap's run, summed in 64 lanes over the
//! batch. Shapes are [`ConvShape`]s with `cin = cout = channels`.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::base::shape::ConvShape;
use crate::base::threads::SharedOut;

/// Outputs a register block holds across the taps (4 AVX-512 or 8 AVX2 registers).
const BLOCK: usize = 64;

/// Values of one phase plane set above which a group stops taking images: small enough to
/// stay in L1 with the output run, large enough that 3×3 planes stack ~80 deep.
const GROUP_VALUES: usize = 2048;

/// Whether `s` describes a depthwise convolution these kernels take (one filter per
/// channel: the caller passes a weight `[channels, 1, kh, kw]`).
pub fn fits(s: &ConvShape) -> bool {
    s.cin == s.cout
        && s.cin > 0
        && s.kh > 0
        && s.kw > 0
        && s.stride[0] > 0
        && s.stride[1] > 0
        && s.out_h() > 0
        && s.out_w() > 0
}

/// One layer's phase-plane geometry, shared by the three kernels.
struct Geometry {
    /// Input plane.
    h: usize,
    w: usize,
    /// Output plane.
    oh: usize,
    ow: usize,
    /// Row stride: phases per column of phases.
    sy: usize,
    /// Leading padding (top).
    top: usize,
    /// Each phase plane's rows and columns.
    ha: usize,
    wa: usize,
    /// Images stacked per group.
    group: usize,
    /// Each tap's offset into the phase planes (`phase·phase_len + row·wa + column`),
    /// tap-major like the weight (`ky·kw + kx`).
    offsets: Vec<usize>,
    /// The largest of the taps' offsets within their phase.
    reach: usize,
    /// Phases along a row (the column stride).
    sx: usize,
    /// Per phase column `px`: the first input column it holds, that column's place in the
    /// phase row (`px·phase_len + b`), and how many input columns (`sx` apart) it holds —
    /// the columns past the phase planes' width are read by no output.
    strided: Vec<(usize, usize, usize)>,
}

impl Geometry {
    fn new(s: &ConvShape) -> Self {
        let (sy, sx) = (s.stride[0], s.stride[1]);
        let (oh, ow) = (s.out_h(), s.out_w());
        let ha = oh + (s.kh - 1) * s.dilation[0] / sy;
        let wa = ow + (s.kw - 1) * s.dilation[1] / sx;
        let group = (GROUP_VALUES / (ha * wa * sy * sx)).clamp(1, s.batch.max(1));
        let phase_len = group * ha * wa;
        let mut offsets = Vec::with_capacity(s.kh * s.kw);
        for ky in 0..s.kh {
            let dy = ky * s.dilation[0];
            for kx in 0..s.kw {
                let dx = kx * s.dilation[1];
                let inner = (dy / sy) * wa + dx / sx;
                offsets.push(((dy % sy) * sx + dx % sx) * phase_len + inner);
            }
        }
        let reach = offsets.iter().map(|o| o % phase_len).max().unwrap_or(0);
        let left = s.padding[1].0;
        let strided = (0..sx)
            .map(|px| {
                let c0 = (px + sx - left % sx) % sx;
                let b0 = (c0 + left) / sx;
                let n = if c0 < s.w && b0 < wa {
                    (s.w - c0).div_ceil(sx).min(wa - b0)
                } else {
                    0
                };
                (c0, px * phase_len + b0, n)
            })
            .collect();
        Geometry {
            h: s.h,
            w: s.w,
            oh,
            ow,
            sy,
            top: s.padding[0].0,
            ha,
            wa,
            group,
            offsets,
            reach,
            sx,
            strided,
        }
    }

    /// Values of one phase (a group's planes) and of all phases.
    fn phase_len(&self) -> usize {
        self.group * self.ha * self.wa
    }

    fn phases_len(&self) -> usize {
        self.sy * self.sx * self.phase_len()
    }

    /// Length of the output run of `count` stacked images on the `wa`-wide grid (the last
    /// row's extra columns cut).
    fn run(&self, count: usize) -> usize {
        ((count - 1) * self.ha + self.oh - 1) * self.wa + self.ow
    }

    /// Where input row `r` of image `g` starts in the phase planes, if any output reads it.
    fn row_base(&self, g: usize, r: usize) -> Option<usize> {
        let padded = r + self.top;
        let (a, py) = (padded / self.sy, padded % self.sy);
        (a < self.ha).then(|| py * self.sx * self.phase_len() + (g * self.ha + a) * self.wa)
    }

    /// Copies `count` input planes (`plane(g)`, each `[h, w]`) into the phase planes,
    /// writing every value of `out`.
    fn split<'a>(&self, count: usize, plane: impl Fn(usize) -> &'a [f32], out: &mut [f32]) {
        out.fill(0.0);
        for g in 0..count {
            let x = plane(g);
            for (r, src) in x.chunks_exact(self.w).enumerate() {
                let Some(base) = self.row_base(g, r) else {
                    break;
                };
                if self.sx == 1 {
                    // Contiguous: input column c lands at c + left.
                    let (_, at, n) = self.strided[0];
                    out[base + at..][..n].copy_from_slice(&src[..n]);
                } else {
                    for &(c0, at, n) in &self.strided {
                        gather(&mut out[base + at..][..n], &src[c0..], self.sx);
                    }
                }
            }
        }
    }

    /// The inverse of [`Geometry::split`] for gradients: image `g`'s input pixels from the
    /// phase planes (the padding's cells dropped; a pixel no output reads gets zero),
    /// writing every value of `dx` (`[h, w]`).
    fn merge(&self, g: usize, phases: &[f32], dx: &mut [MaybeUninit<f32>]) {
        for (r, row) in dx.chunks_exact_mut(self.w).enumerate() {
            let Some(base) = self.row_base(g, r) else {
                row.fill(MaybeUninit::new(0.0));
                continue;
            };
            if self.sx == 1 {
                let (_, at, n) = self.strided[0];
                for (v, p) in row[..n].iter_mut().zip(&phases[base + at..]) {
                    v.write(*p);
                }
                row[n..].fill(MaybeUninit::new(0.0));
            } else {
                // Columns past the phase planes' width keep the zero.
                row.fill(MaybeUninit::new(0.0));
                for &(c0, at, n) in &self.strided {
                    scatter(&mut row[c0..], &phases[base + at..][..n], self.sx);
                }
            }
        }
    }

    /// Image `g`'s output (`[oh, ow]`) from the `wa`-wide grid, writing every value of `out`.
    fn compact(&self, g: usize, grid: &[f32], out: &mut [MaybeUninit<f32>]) {
        for (oy, row) in out.chunks_exact_mut(self.ow).enumerate() {
            for (d, v) in row.iter_mut().zip(&grid[(g * self.ha + oy) * self.wa..]) {
                d.write(*v);
            }
        }
    }

    /// `count` output-gradient planes (`plane(g)`, each `[oh, ow]`) onto the `wa`-wide grid
    /// from `at` on in `out`, zero in the extra rows and columns and everywhere else in `out`
    /// (a buffer in cache: zeroing it whole first is cheaper than working out its gaps).
    fn spread<'a>(
        &self,
        count: usize,
        plane: impl Fn(usize) -> &'a [f32],
        out: &mut [f32],
        at: usize,
    ) {
        out.fill(0.0);
        for g in 0..count {
            for (oy, src) in plane(g).chunks_exact(self.ow).enumerate() {
                out[at + (g * self.ha + oy) * self.wa..][..self.ow].copy_from_slice(src);
            }
        }
    }
}

/// `dst[k] = src[k·stride]`, with the strides layers use as constants (so the compiler
/// vectorizes the interleaved loads).
#[inline(always)]
fn gather(dst: &mut [f32], src: &[f32], stride: usize) {
    #[inline(always)]
    fn fixed<const S: usize>(dst: &mut [f32], src: &[f32]) {
        let mut chunks = src.chunks_exact(S);
        let whole = dst.len().min(src.len() / S);
        for (d, c) in dst[..whole].iter_mut().zip(&mut chunks) {
            *d = c[0];
        }
        if whole < dst.len() {
            // The last value, without a whole stride after it.
            dst[whole] = src[whole * S];
        }
    }
    match stride {
        2 => fixed::<2>(dst, src),
        3 => fixed::<3>(dst, src),
        4 => fixed::<4>(dst, src),
        _ => {
            for (d, v) in dst.iter_mut().zip(src.iter().step_by(stride)) {
                *d = *v;
            }
        }
    }
}

/// `dst[k·stride] = src[k]`: [`gather`]'s inverse, into values to write.
#[inline(always)]
fn scatter(dst: &mut [MaybeUninit<f32>], src: &[f32], stride: usize) {
    #[inline(always)]
    fn fixed<const S: usize>(dst: &mut [MaybeUninit<f32>], src: &[f32]) {
        let whole = src.len().min(dst.len() / S);
        for (c, v) in dst.chunks_exact_mut(S).zip(&src[..whole]) {
            c[0].write(*v);
        }
        if whole < src.len() {
            dst[whole * S].write(src[whole]);
        }
    }
    match stride {
        2 => fixed::<2>(dst, src),
        3 => fixed::<3>(dst, src),
        4 => fixed::<4>(dst, src),
        _ => {
            for (d, v) in dst.iter_mut().step_by(stride).zip(src) {
                d.write(*v);
            }
        }
    }
}

/// `out[j] = init + Σ w · src[o + j]` over the `(o, w)` pairs: every tap's run added into a
/// block of [`BLOCK`] outputs held in registers, so each output is loaded and stored once.
#[inline(always)]
fn correlate(out: &mut [f32], src: &[f32], taps: &[(usize, f32)], init: f32) {
    let n = out.len();
    let mut j = 0;
    while j + BLOCK <= n {
        let mut acc = [init; BLOCK];
        for &(o, w) in taps {
            let Some(run) = src[o + j..].first_chunk::<BLOCK>() else {
                unreachable!("the phase planes hold every tap's run");
            };
            for l in 0..BLOCK {
                acc[l] = w.mul_add(run[l], acc[l]);
            }
        }
        out[j..j + BLOCK].copy_from_slice(&acc);
        j += BLOCK;
    }
    if j < n {
        let tail = &mut out[j..];
        tail.fill(init);
        for &(o, w) in taps {
            for (a, v) in tail.iter_mut().zip(&src[o + j..]) {
                *a = w.mul_add(*v, *a);
            }
        }
    }
}

/// `lanes[l] += Σ a[l + 64·i] · b[l + 64·i]`: a dot product kept in 64 lanes (independent
/// accumulators, so it vectorizes without reassociating, and sums more accurately).
#[inline(always)]
fn dot_into(a: &[f32], b: &[f32], lanes: &mut [f32; BLOCK]) {
    let mut acc = *lanes;
    let mut ca = a.chunks_exact(BLOCK);
    let mut cb = b.chunks_exact(BLOCK);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..BLOCK {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    for ((l, p), q) in acc.iter_mut().zip(ca.remainder()).zip(cb.remainder()) {
        *l = p.mul_add(*q, *l);
    }
    *lanes = acc;
}

/// The scratch one task reuses across its groups.
#[derive(Default)]
struct Scratch {
    phases: Vec<f32>,
    grid: Vec<f32>,
}

impl Scratch {
    fn sized(&mut self, phases: usize, grid: usize) -> (&mut [f32], &mut [f32]) {
        self.phases.resize(phases, 0.0);
        self.grid.resize(grid, 0.0);
        (&mut self.phases, &mut self.grid)
    }
}

/// One task's images: channel `c` (of `channels`) of images `n0 .. n0 + count`.
#[derive(Clone, Copy)]
struct Task {
    c: usize,
    channels: usize,
    n0: usize,
    count: usize,
}

impl Task {
    /// Group `k` of channel `c`'s images (groups of `group`, the last one cut short).
    fn new(group: usize, batch: usize, channels: usize, c: usize, k: usize) -> Task {
        let n0 = k * group;
        Task {
            c,
            channels,
            n0,
            count: group.min(batch - n0),
        }
    }

    /// The tasks covering every (image, channel) plane, a group of images per task.
    fn all(
        g: &Geometry,
        batch: usize,
        channels: usize,
    ) -> impl IndexedParallelIterator<Item = Task> {
        let (group, per_channel) = (g.group, batch.div_ceil(g.group));
        (0..channels * per_channel)
            .into_par_iter()
            .map(move |t| Task::new(group, batch, channels, t / per_channel, t % per_channel))
    }

    /// Plane index (`n·channels + c`) of the task's image `g`.
    fn plane(self, g: usize) -> usize {
        (self.n0 + g) * self.channels + self.c
    }
}

/// Plane `i` (`len` values each) of `out` as a slice to write.
///
/// # Safety
/// `out` points at a live buffer of at least `(i + 1)·len` values, and no other task writes
/// plane `i` while the slice lives.
unsafe fn plane_mut<'a>(
    out: SharedOut<MaybeUninit<f32>>,
    i: usize,
    len: usize,
) -> &'a mut [MaybeUninit<f32>] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(out.get().add(i * len), len) }
}

multiversion! {
    /// One task's forward: its planes of `y` from those of `x`, through `scratch`.
    fn forward_task(
        g: &Geometry,
        t: Task,
        x: &[f32],
        taps: &[(usize, f32)],
        bias: f32,
        scratch: &mut Scratch,
        y: SharedOut<MaybeUninit<f32>>,
    ) {
        let (input, output) = (g.h * g.w, g.oh * g.ow);
        let (phases, grid) = scratch.sized(g.phases_len(), g.run(t.count));
        g.split(t.count, |i| &x[t.plane(i) * input..][..input], phases);
        correlate(grid, phases, taps, bias);
        for i in 0..t.count {
            // SAFETY: `y` holds every plane, and each plane belongs to exactly one task.
            let out = unsafe { plane_mut(y, t.plane(i), output) };
            g.compact(i, grid, out);
        }
    }
}

multiversion! {
    /// One task's input gradient: its planes of `dx` from those of `dy`, through `scratch`.
    fn input_grad_task(
        g: &Geometry,
        t: Task,
        dy: &[f32],
        taps_by_phase: &[Vec<(usize, f32)>],
        scratch: &mut Scratch,
        dx: SharedOut<MaybeUninit<f32>>,
    ) {
        let (input, output) = (g.h * g.w, g.oh * g.ow);
        let (phases, grid) = scratch.sized(g.phases_len(), g.reach + g.phase_len());
        g.spread(t.count, |i| &dy[t.plane(i) * output..][..output], grid, g.reach);
        let used = t.count * g.ha * g.wa;
        for (phase, taps) in phases.chunks_exact_mut(g.phase_len()).zip(taps_by_phase) {
            correlate(&mut phase[..used], grid, taps, 0.0);
        }
        for i in 0..t.count {
            // SAFETY: `dx` holds every plane, and each plane belongs to exactly one task.
            let out = unsafe { plane_mut(dx, t.plane(i), input) };
            g.merge(i, phases, out);
        }
    }
}

multiversion! {
    /// One task's share of its channel's weight gradient: `lanes[t]` gathers tap `t`'s
    /// products over the task's images.
    fn weight_grad_task(
        g: &Geometry,
        t: Task,
        x: &[f32],
        dy: &[f32],
        scratch: &mut Scratch,
        lanes: &mut [[f32; BLOCK]],
    ) {
        let (input, output) = (g.h * g.w, g.oh * g.ow);
        let run = g.run(t.count);
        let (phases, grid) = scratch.sized(g.phases_len(), run);
        g.split(t.count, |i| &x[t.plane(i) * input..][..input], phases);
        g.spread(t.count, |i| &dy[t.plane(i) * output..][..output], grid, 0);
        for (lane, &o) in lanes.iter_mut().zip(&g.offsets) {
            dot_into(grid, &phases[o..o + run], lane);
        }
    }
}

/// `y[n][c] = bias[c] + x[n][c] ⋆ w[c]`: `x` `[batch, channels, h, w]`, `w`
/// `[channels, 1, kh, kw]`, result `[batch, channels, out_h, out_w]`.
pub fn forward(s: &ConvShape, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    let g = Geometry::new(s);
    let taps = s.kh * s.kw;
    let by_channel: Vec<Vec<(usize, f32)>> = (0..s.cout)
        .map(|c| {
            g.offsets
                .iter()
                .copied()
                .zip(w[c * taps..][..taps].iter().copied())
                .collect()
        })
        .collect();
    crate::base::buffers::filled(s.batch * s.cout * g.oh * g.ow, |y| {
        let out = SharedOut(y.as_mut_ptr());
        Task::all(&g, s.batch, s.cout).for_each_init(Scratch::default, |scratch, t| {
            let b = bias.map_or(0.0, |b| b[t.c]);
            forward_task(&g, t, x, &by_channel[t.c], b, scratch, out);
        });
    })
}

/// The gradient of [`forward`] with respect to `x`, from the output's gradient `dy`.
pub fn input_grad(s: &ConvShape, dy: &[f32], w: &[f32]) -> Vec<f32> {
    let g = Geometry::new(s);
    let taps = s.kh * s.kw;
    // Per channel and phase: the taps reading that phase, their offsets within it mirrored
    // (`reach − within`) into the spread gradient.
    let by_channel: Vec<Vec<Vec<(usize, f32)>>> = (0..s.cin)
        .map(|c| {
            let mut by_phase = vec![Vec::new(); g.sy * g.sx];
            for (t, &o) in g.offsets.iter().enumerate() {
                let (phase, within) = (o / g.phase_len(), o % g.phase_len());
                by_phase[phase].push((g.reach - within, w[c * taps + t]));
            }
            by_phase
        })
        .collect();
    crate::base::buffers::filled(s.batch * s.cin * s.h * s.w, |dx| {
        let out = SharedOut(dx.as_mut_ptr());
        Task::all(&g, s.batch, s.cin).for_each_init(Scratch::default, |scratch, t| {
            input_grad_task(&g, t, dy, &by_channel[t.c], scratch, out);
        });
    })
}

/// The gradient of [`forward`] with respect to `w` (`[channels, 1, kh, kw]`), from `x` and
/// the output's gradient `dy`: per channel, each tap's correlation of the two over the batch.
pub fn weight_grad(s: &ConvShape, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let g = Geometry::new(s);
    let taps = s.kh * s.kw;
    let mut dw = vec![0f32; s.cout * taps];
    let per_channel = s.batch.div_ceil(g.group);
    dw.par_chunks_mut(taps)
        .enumerate()
        .for_each_init(Scratch::default, |scratch, (c, grad)| {
            let mut lanes = vec![[0f32; BLOCK]; taps];
            for k in 0..per_channel {
                let t = Task::new(g.group, s.batch, s.cout, c, k);
                weight_grad_task(&g, t, x, dy, scratch, &mut lanes);
            }
            for (d, lane) in grad.iter_mut().zip(&lanes) {
                *d = lane.iter().sum();
            }
        });
    dw
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Input position of output `o`, tap `k` along one axis, if inside.
    fn at(o: usize, k: usize, stride: usize, dil: usize, pad: usize, len: usize) -> Option<usize> {
        (o * stride + k * dil).checked_sub(pad).filter(|&i| i < len)
    }

    /// The forward and both gradients in f64, by definition, for `dy` given.
    fn reference(
        s: &ConvShape,
        x: &[f32],
        w: &[f32],
        dy: &[f32],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (oh, ow) = (s.out_h(), s.out_w());
        let mut y = vec![0f64; s.batch * s.cout * oh * ow];
        let mut dx = vec![0f64; x.len()];
        let mut dw = vec![0f64; w.len()];
        for n in 0..s.batch {
            for c in 0..s.cin {
                let plane = n * s.cin + c;
                for oy in 0..oh {
                    for ox in 0..ow {
                        let o = (plane * oh + oy) * ow + ox;
                        for ky in 0..s.kh {
                            for kx in 0..s.kw {
                                let iy =
                                    at(oy, ky, s.stride[0], s.dilation[0], s.padding[0].0, s.h);
                                let ix =
                                    at(ox, kx, s.stride[1], s.dilation[1], s.padding[1].0, s.w);
                                let (Some(iy), Some(ix)) = (iy, ix) else {
                                    continue;
                                };
                                let i = (plane * s.h + iy) * s.w + ix;
                                let t = (c * s.kh + ky) * s.kw + kx;
                                y[o] += w[t] as f64 * x[i] as f64;
                                dx[i] += w[t] as f64 * dy[o] as f64;
                                dw[t] += x[i] as f64 * dy[o] as f64;
                            }
                        }
                    }
                }
            }
        }
        (y, dx, dw)
    }

    fn close(got: &[f32], want: &[f64], what: &str) {
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-12);
        let err = got
            .iter()
            .zip(want)
            .fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
        assert!(
            err / scale <= 1e-5,
            "{what}: relative error {:.2e}",
            err / scale
        );
    }

    /// Forward, input gradient and weight gradient against an f64 reference: 3×3 and 5×5,
    /// strides 1 and 2, asymmetric padding, dilation, odd sizes.
    #[test]
    fn depthwise_forward_and_gradients_match_an_f64_reference() {
        let mut seed = 3;
        for (k, stride, pad, dil, h, w) in [
            (3, 1, (1, 1), 1, 9, 8),
            (3, 2, (1, 1), 1, 9, 10),
            (5, 1, (2, 2), 1, 7, 11),
            (5, 2, (2, 1), 1, 12, 9),
            (3, 1, (0, 2), 2, 8, 8),
            (1, 1, (0, 0), 1, 4, 5),
            // Planes past one register block, even sizes at stride 2, no padding, a 7×7
            // (ConvNeXt), stride 3, a kernel wider than the image.
            (3, 1, (1, 1), 1, 17, 19),
            (3, 2, (1, 1), 1, 16, 16),
            (3, 2, (0, 0), 1, 11, 12),
            (7, 1, (3, 3), 1, 14, 13),
            (3, 3, (1, 0), 1, 10, 11),
            (5, 1, (2, 2), 1, 3, 2),
            // Planes a group stacks two of, over five images: a last group of one.
            (3, 1, (1, 1), 1, 30, 30),
            (3, 2, (1, 1), 1, 30, 30),
        ] {
            let s = ConvShape {
                batch: if h >= 30 { 5 } else { 3 },
                cin: 5,
                h,
                w,
                cout: 5,
                kh: k,
                kw: k,
                stride: [stride, stride],
                padding: [pad, (pad.1, pad.0)],
                dilation: [dil, dil],
            };
            assert!(fits(&s));
            let x: Vec<f32> = (0..s.batch * s.cin * h * w)
                .map(|_| lcg(&mut seed))
                .collect();
            let wt: Vec<f32> = (0..s.cin * k * k).map(|_| lcg(&mut seed)).collect();
            let bias: Vec<f32> = (0..s.cin).map(|_| lcg(&mut seed)).collect();
            let dy: Vec<f32> = (0..s.batch * s.cout * s.out_h() * s.out_w())
                .map(|_| lcg(&mut seed))
                .collect();
            let (y, dx, dw) = reference(&s, &x, &wt, &dy);
            let plane = s.out_h() * s.out_w();
            let with_bias: Vec<f64> = y
                .iter()
                .enumerate()
                .map(|(i, v)| v + bias[(i / plane) % s.cout] as f64)
                .collect();
            let case = format!("k{k} s{stride} p{pad:?} d{dil} {h}×{w}");
            close(
                &forward(&s, &x, &wt, Some(&bias)),
                &with_bias,
                &format!("{case} forward"),
            );
            close(
                &forward(&s, &x, &wt, None),
                &y,
                &format!("{case} forward, no bias"),
            );
            close(
                &input_grad(&s, &dy, &wt),
                &dx,
                &format!("{case} input gradient"),
            );
            close(
                &weight_grad(&s, &x, &dy),
                &dw,
                &format!("{case} weight gradient"),
            );
        }
    }
}
