//! f32 BatchNorm in training mode over NCHW values: batch statistics, the normalization with
//! its affine transform (and the ReLU that usually follows, fused), and the backward pass in
//! two passes over memory.
//!
//! Burn's default `batch_norm_train` composes a dozen tensor ops (channel swaps that copy the
//! whole activation, means, broadcasts), each a pass over memory and an autodiff node; these
//! kernels read the activation twice forward (statistics, then normalize) and twice backward
//! (the two reductions, then the input gradient), one channel per task.

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use rayon::prelude::*;

/// Sums a buffer over the ranks of a data-parallel group in place, returning `false` where
/// statistics are not synchronized on the calling thread (the buffer is then left alone).
///
/// Why a hook: the kernels know nothing of collectives or of which layer calls them; the
/// training library (`kiln`'s SyncBatchNorm scope) installs one function that consults its
/// own per-thread state, so a thread without a scope pays one indirect call per layer.
pub type RankSum = fn(&mut [f64]) -> bool;

static RANK_SUM: OnceLock<RankSum> = OnceLock::new();

/// Installs the process's [`RankSum`] hook (the first call wins; later ones are ignored, as
/// the one hook consults per-thread state itself).
pub fn set_rank_sum(hook: RankSum) {
    let _ = RANK_SUM.set(hook);
}

/// Sums `buf` over the ranks through the installed hook (`false`: not synchronized here).
fn sum_over_ranks(buf: &mut [f64]) -> bool {
    RANK_SUM.get().is_some_and(|sum| sum(buf))
}

/// The layout of a BatchNorm input `[batch, channels, plane]` (plane = H·W).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormShape {
    /// Samples.
    pub batch: usize,
    /// Channels (statistics are per channel).
    pub channels: usize,
    /// Values per channel per sample (H·W).
    pub plane: usize,
}

impl NormShape {
    /// Values per channel over the batch.
    pub fn per_channel(&self) -> usize {
        self.batch * self.plane
    }

    /// Total values.
    pub fn len(&self) -> usize {
        self.batch * self.channels * self.plane
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Per-channel batch mean and biased variance of `x` (accumulated in f64: a channel of a
/// batch of 64 32×32 images sums 65,536 values).
///
/// Where a [`RankSum`] hook sums on this thread (SyncBatchNorm), the sums and the count are
/// summed over the ranks first: the statistics of the global batch.
pub fn batch_norm_stats(s: &NormShape, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let sums = channel_sums(s, x, x, |_| Moments);
    let (sums, m) = over_ranks(sums, s.per_channel());
    mean_and_variance(&sums, m)
}

/// Per-channel mean and biased variance from the sums of `x` and `x²` over `m` values each.
fn mean_and_variance(sums: &[(f64, f64)], m: f64) -> (Vec<f32>, Vec<f32>) {
    sums.iter()
        .map(|&(sum, sq)| {
            let mean = sum / m;
            (mean as f32, (sq / m - mean * mean).max(0.0) as f32)
        })
        .unzip()
}

/// [`batch_norm_stats`] from the buffer its synchronized call summed over the ranks (the
/// sums of `x` and `x²` per channel, then the count): what a rank without samples replays.
pub fn stats_from_summed(buf: &[f64]) -> (Vec<f32>, Vec<f32>) {
    let (sums, m) = unpack(buf);
    mean_and_variance(&sums, m)
}

/// Per-channel sums and the values per channel `m` behind them, summed over the ranks when
/// statistics are synchronized on this thread (one call: the sums, then the count).
fn over_ranks(sums: Vec<(f64, f64)>, m: usize) -> (Vec<(f64, f64)>, f64) {
    let mut buf: Vec<f64> = sums.iter().flat_map(|&(a, b)| [a, b]).collect();
    buf.push(m as f64);
    if !sum_over_ranks(&mut buf) {
        return (sums, m.max(1) as f64);
    }
    unpack(&buf)
}

/// The per-channel pairs and the count (at least 1) of a buffer laid out by [`over_ranks`].
fn unpack(buf: &[f64]) -> (Vec<(f64, f64)>, f64) {
    let (pairs, m) = buf.split_at(buf.len().saturating_sub(1));
    let sums = pairs.chunks_exact(2).map(|p| (p[0], p[1])).collect();
    (sums, m.first().copied().unwrap_or(0.0).max(1.0))
}

/// Values per task of [`channel_sums`] (whole samples, at least one).
const SUM_BLOCK: usize = 64 << 10;

/// Per channel `c`, the sums of `per_channel(c)`'s pairs ([`PairSum`]) over the batch, for
/// `xs` and `ys` of shape `s`: partial sums per run of a plane in f32 lanes ([`lane_sums`]),
/// totals in f64.
///
/// Read in memory order: each task takes a block of whole samples and sums every channel of
/// them, and the blocks' sums are added in block order (the same result on any thread
/// count). Why: one task per channel read its 64 planes 256 KB apart, a new short stream per
/// plane, and a cold activation came in at 4–5 GB/s against 24 for a pass in memory order
/// (W5's shapes, BENCHMARKS.md run 38).
fn channel_sums<P: PairSum>(
    s: &NormShape,
    xs: &[f32],
    ys: &[f32],
    per_channel: impl Fn(usize) -> P + Sync,
) -> Vec<(f64, f64)> {
    let sample = s.channels * s.plane;
    let per_block = (SUM_BLOCK / sample.max(1)).max(1);
    let blocks: Vec<Vec<(f64, f64)>> = (0..s.batch.div_ceil(per_block))
        .into_par_iter()
        .map(|block| {
            let mut sums = vec![(0f64, 0f64); s.channels];
            let first = block * per_block;
            for n in first..(first + per_block).min(s.batch) {
                for (c, sum) in sums.iter_mut().enumerate() {
                    let at = (n * s.channels + c) * s.plane;
                    let (x, y) = (&xs[at..][..s.plane], &ys[at..][..s.plane]);
                    let (a, b) = lane_sums(x, y, per_channel(c));
                    sum.0 += f64::from(a);
                    sum.1 += f64::from(b);
                }
            }
            sums
        })
        .collect();
    let mut total = vec![(0f64, 0f64); s.channels];
    for block in blocks {
        for (t, b) in total.iter_mut().zip(block) {
            t.0 += b.0;
            t.1 += b.1;
        }
    }
    total
}

/// The pair of values [`lane_sums`] adds up for a value `x` and its companion `y`. A trait
/// with an always-inlined method rather than a closure: a closure built inside another
/// closure was left as a call per value under `perf` (W5's statistics 9.8 → 9.0 ms per step
/// without it, `train_norm` bench).
pub(super) trait PairSum {
    /// The pair for `x` and `y`.
    fn pair(&self, x: f32, y: f32) -> (f32, f32);
}

impl<F: Fn(f32, f32) -> (f32, f32)> PairSum for F {
    #[inline(always)]
    fn pair(&self, x: f32, y: f32) -> (f32, f32) {
        self(x, y)
    }
}

/// `(x, x²)`: the batch statistics' sums.
struct Moments;

impl PairSum for Moments {
    #[inline(always)]
    fn pair(&self, x: f32, _: f32) -> (f32, f32) {
        (x, x * x)
    }
}

/// `(g, g·x̂)` for one channel: the backward's sums (`g` masked by a fused ReLU).
struct GradSums {
    k: Channel,
    relu: bool,
}

impl PairSum for GradSums {
    #[inline(always)]
    fn pair(&self, v: f32, g: f32) -> (f32, f32) {
        let g = self.k.through_relu(self.relu, v, g);
        (g, g * (v - self.k.mean) * self.k.inv)
    }
}

/// `(Σ f(x, y).0, Σ f(x, y).1)` over two equally long slices, summed in 16 independent f32
/// lanes. Why: a plain float fold is one dependency chain that the compiler may not reorder
/// (each add waits for the previous, ~3 cycles per value), so the statistics pass ran at a
/// fraction of memory speed; independent lanes vectorize.
#[inline(always)]
pub(super) fn lane_sums(xs: &[f32], ys: &[f32], f: impl PairSum) -> (f32, f32) {
    const LANES: usize = 16;
    let (mut a, mut b) = ([0f32; LANES], [0f32; LANES]);
    let (xc, yc) = (xs.chunks_exact(LANES), ys.chunks_exact(LANES));
    let (x_rest, y_rest) = (xc.remainder(), yc.remainder());
    for (xs, ys) in xc.zip(yc) {
        for i in 0..LANES {
            let (p, q) = f.pair(xs[i], ys[i]);
            a[i] += p;
            b[i] += q;
        }
    }
    let (mut sa, mut sb) = (a.iter().sum::<f32>(), b.iter().sum::<f32>());
    for (&x, &y) in x_rest.iter().zip(y_rest) {
        let (p, q) = f.pair(x, y);
        sa += p;
        sb += q;
    }
    (sa, sb)
}

/// One channel's constants: the affine form `y = x · a + b` of the normalization (`a = γ/σ`,
/// `b = β − mean · a`), `1/σ` and the mean.
#[derive(Clone, Copy)]
struct Channel {
    a: f32,
    b: f32,
    inv: f32,
    mean: f32,
}

impl Channel {
    /// The constants of every channel.
    fn all(gamma: &[f32], beta: &[f32], mean: &[f32], var: &[f32], eps: f64) -> Vec<Channel> {
        (0..gamma.len())
            .map(|c| {
                let inv = (1.0 / (f64::from(var[c]) + eps).sqrt()) as f32;
                let a = gamma[c] * inv;
                Channel {
                    a,
                    b: beta[c] - mean[c] * a,
                    inv,
                    mean: mean[c],
                }
            })
            .collect()
    }

    /// The output gradient `g` as it reaches the normalization: zero where a fused ReLU cut
    /// the (recomputed) output `v · a + b`.
    #[inline(always)]
    fn through_relu(&self, relu: bool, v: f32, g: f32) -> f32 {
        if relu && v * self.a + self.b <= 0.0 {
            0.0
        } else {
            g
        }
    }
}

/// The normalization's parameters: per-channel γ, β and batch statistics, ε, and whether a
/// ReLU follows (fused).
#[derive(Debug, Clone, Copy)]
pub struct NormParams<'a> {
    /// Scale γ `[C]`.
    pub gamma: &'a [f32],
    /// Shift β `[C]`.
    pub beta: &'a [f32],
    /// Batch mean `[C]`.
    pub mean: &'a [f32],
    /// Batch (biased) variance `[C]`.
    pub var: &'a [f32],
    /// Added to the variance.
    pub eps: f64,
    /// A ReLU after the normalization.
    pub relu: bool,
}

impl NormParams<'_> {
    fn channels(&self) -> Vec<Channel> {
        Channel::all(self.gamma, self.beta, self.mean, self.var, self.eps)
    }
}

/// `out = γ · (x − mean) / √(var + ε) + β`, then ReLU when `p.relu`.
pub fn batch_norm_forward(s: &NormShape, x: &[f32], p: &NormParams, out: &mut [f32]) {
    forward_into(s, x, p, crate::base::buffers::as_uninit(out));
}

/// [`batch_norm_forward`] into a new vector that is not zero-filled first: the kernel writes
/// every value once, and the fill of a fresh buffer cost as much as the kernel (W5's
/// BatchNorm outputs, cold: forward 12.9 ms per step, 21.4 with a zeroed allocation —
/// BENCHMARKS.md run 39).
pub fn batch_norm_forward_new(s: &NormShape, x: &[f32], p: &NormParams) -> Vec<f32> {
    crate::base::buffers::filled(s.len(), |out| forward_into(s, x, p, out))
}

fn forward_into(s: &NormShape, x: &[f32], p: &NormParams, out: &mut [MaybeUninit<f32>]) {
    assert_eq!(x.len(), s.len(), "batch norm input length");
    assert_eq!(out.len(), s.len(), "batch norm output length");
    let (ch, relu) = (p.channels(), p.relu);
    let (plane, channels) = (s.plane, s.channels);
    if plane == 0 {
        return;
    }
    out.par_chunks_mut(plane)
        .zip(x.par_chunks(plane))
        .enumerate()
        .for_each(|(i, (o, xs))| {
            let Channel { a, b, .. } = ch[i % channels];
            if relu {
                for (o, &v) in o.iter_mut().zip(xs) {
                    o.write((v * a + b).max(0.0));
                }
            } else {
                for (o, &v) in o.iter_mut().zip(xs) {
                    o.write(v * a + b);
                }
            }
        });
}

/// Gradients of [`batch_norm_forward`] in training mode (the statistics are functions of `x`):
/// `dx`, `dγ`, `dβ` from the output gradient `dy`. With `relu`, `dy` is masked where the
/// (recomputed) normalized value was not positive.
pub fn batch_norm_backward(
    s: &NormShape,
    x: &[f32],
    p: &NormParams,
    dy: &[f32],
    dx: &mut [f32],
) -> (Vec<f32>, Vec<f32>) {
    backward_into(s, x, p, dy, crate::base::buffers::as_uninit(dx))
}

/// [`batch_norm_backward`] with `dx` in a new vector, not zero-filled first (see
/// [`batch_norm_forward_new`]): `(dx, dγ, dβ)`.
pub fn batch_norm_backward_new(
    s: &NormShape,
    x: &[f32],
    p: &NormParams,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut sums = None;
    let dx =
        crate::base::buffers::filled(s.len(), |dx| sums = Some(backward_into(s, x, p, dy, dx)));
    let (dgamma, dbeta) = sums.expect("the backward ran");
    (dx, dgamma, dbeta)
}

fn backward_into(
    s: &NormShape,
    x: &[f32],
    p: &NormParams,
    dy: &[f32],
    dx: &mut [MaybeUninit<f32>],
) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(x.len(), s.len(), "batch norm input length");
    assert_eq!(dy.len(), s.len(), "batch norm output-gradient length");
    assert_eq!(dx.len(), s.len(), "batch norm input-gradient length");
    let (ch, relu) = (p.channels(), p.relu);
    let (plane, channels) = (s.plane, s.channels);
    // Pass 1, per channel: Σ g and Σ g·x̂ (g = dy, masked by the ReLU).
    let local = channel_sums(s, x, dy, |c| GradSums { k: ch[c], relu });
    // Synchronized statistics: dx is the gradient through the global batch's statistics, so
    // it takes the sums over all ranks; dγ and dβ stay this rank's (reduced with the others).
    let (sums, m) = over_ranks(local.clone(), s.per_channel());
    // Pass 2: dx = γ/σ · (g − Σg/M − x̂ · Σg·x̂/M).
    if plane > 0 {
        dx.par_chunks_mut(plane)
            .zip(x.par_chunks(plane).zip(dy.par_chunks(plane)))
            .enumerate()
            .for_each(|(i, (d, (xs, gs)))| {
                let c = i % channels;
                let k = ch[c];
                let mean_g = (sums[c].0 / m) as f32;
                let mean_gx = (sums[c].1 / m) as f32;
                for ((d, &v), &g) in d.iter_mut().zip(xs).zip(gs) {
                    let g = k.through_relu(relu, v, g);
                    d.write(k.a * (g - mean_g - (v - k.mean) * k.inv * mean_gx));
                }
            });
    }
    let dgamma = local.iter().map(|s| s.1 as f32).collect();
    let dbeta = local.iter().map(|s| s.0 as f32).collect();
    (dgamma, dbeta)
}

/// Inference BatchNorm as a per-channel affine map `y = x·scale + shift`, with
/// `scale = γ / sqrt(var + ε)` and `shift = β − mean·scale` (used by both inference executors and the
/// folding passes, so all of them agree to the bit).
pub fn batch_norm_affine(
    gamma: &[f32],
    beta: &[f32],
    mean: &[f32],
    var: &[f32],
    eps: f64,
) -> (Vec<f32>, Vec<f32>) {
    let scale: Vec<f32> = gamma
        .iter()
        .zip(var)
        .map(|(g, v)| g / (v + eps as f32).sqrt())
        .collect();
    let shift = beta
        .iter()
        .zip(mean)
        .zip(&scale)
        .map(|((b, m), s)| b - m * s)
        .collect();
    (scale, shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same computation in f64, straight from the definitions.
    fn reference(
        s: &NormShape,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        relu: bool,
        dy: &[f32],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let eps = 1e-5;
        let m = s.per_channel() as f64;
        let at = |n: usize, c: usize, p: usize| (n * s.channels + c) * s.plane + p;
        let mut y = vec![0f64; s.len()];
        let mut dx = vec![0f64; s.len()];
        let (mut dg, mut db) = (vec![0f64; s.channels], vec![0f64; s.channels]);
        for c in 0..s.channels {
            let idx: Vec<usize> = (0..s.batch)
                .flat_map(|n| (0..s.plane).map(move |p| at(n, c, p)))
                .collect();
            let mean = idx.iter().map(|&i| f64::from(x[i])).sum::<f64>() / m;
            let var = idx
                .iter()
                .map(|&i| (f64::from(x[i]) - mean).powi(2))
                .sum::<f64>()
                / m;
            let inv = 1.0 / (var + eps).sqrt();
            let mut g = vec![0f64; idx.len()];
            for (k, &i) in idx.iter().enumerate() {
                let xhat = (f64::from(x[i]) - mean) * inv;
                let pre = f64::from(gamma[c]) * xhat + f64::from(beta[c]);
                y[i] = if relu { pre.max(0.0) } else { pre };
                g[k] = if relu && pre <= 0.0 {
                    0.0
                } else {
                    f64::from(dy[i])
                };
            }
            let sg: f64 = g.iter().sum();
            let sgx: f64 = idx
                .iter()
                .zip(&g)
                .map(|(&i, g)| g * (f64::from(x[i]) - mean) * inv)
                .sum();
            dg[c] = sgx;
            db[c] = sg;
            for (k, &i) in idx.iter().enumerate() {
                let xhat = (f64::from(x[i]) - mean) * inv;
                dx[i] = f64::from(gamma[c]) * inv * (g[k] - sg / m - xhat * sgx / m);
            }
        }
        (y, dx, dg, db)
    }

    fn max_rel(ours: &[f32], reference: &[f64]) -> f64 {
        let scale = reference
            .iter()
            .fold(0f64, |m, v| m.max(v.abs()))
            .max(1e-12);
        ours.iter()
            .zip(reference)
            .fold(0f64, |m, (a, b)| m.max((f64::from(*a) - b).abs()))
            / scale
    }

    #[test]
    fn forward_and_gradients_match_an_f64_reference_with_and_without_relu() {
        // A plane shorter than the 16 summing lanes, and one with whole lanes and a remainder.
        // … and one of several blocks of samples (4 samples of 16 Ki values per block).
        for (batch, channels, plane) in [(3, 5, 7), (2, 3, 37), (6, 4, 4096)] {
            check_against_reference(NormShape {
                batch,
                channels,
                plane,
            });
        }
    }

    #[test]
    fn sums_do_not_depend_on_the_thread_count() {
        // 3 blocks of samples (4, 4, 1).
        let s = NormShape {
            batch: 9,
            channels: 4,
            plane: 4096,
        };
        assert!(s.channels * s.plane * 2 <= SUM_BLOCK && s.len() > 2 * SUM_BLOCK);
        let x: Vec<f32> = (0..s.len())
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        let dy: Vec<f32> = (0..s.len())
            .map(|i| ((i * 104729) % 997) as f32 * 1e-3)
            .collect();
        let (gamma, beta) = (vec![1.5f32; 4], vec![-0.2f32; 4]);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a thread pool");
            pool.install(|| {
                let stats = batch_norm_stats(&s, &x);
                let p = params(&gamma, &beta, &stats, true);
                let mut dx = vec![0f32; s.len()];
                let (dg, db) = batch_norm_backward(&s, &x, &p, &dy, &mut dx);
                (stats, dx, dg, db)
            })
        };
        let one = run(1);
        for threads in [2, 3] {
            assert!(run(threads) == one, "{threads} threads differ from one");
        }
    }

    /// The parameters of a training-mode normalization with batch statistics `(mean, var)`.
    fn params<'a>(
        gamma: &'a [f32],
        beta: &'a [f32],
        (mean, var): &'a (Vec<f32>, Vec<f32>),
        relu: bool,
    ) -> NormParams<'a> {
        NormParams {
            gamma,
            beta,
            mean,
            var,
            eps: 1e-5,
            relu,
        }
    }

    fn check_against_reference(s: NormShape) {
        let mut state = 17u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 1.5
        };
        let x: Vec<f32> = (0..s.len()).map(|_| next()).collect();
        let dy: Vec<f32> = (0..s.len()).map(|_| next()).collect();
        let gamma: Vec<f32> = (0..s.channels).map(|_| next()).collect();
        let beta: Vec<f32> = (0..s.channels).map(|_| next()).collect();
        for relu in [false, true] {
            let stats = batch_norm_stats(&s, &x);
            let p = params(&gamma, &beta, &stats, relu);
            let mut y = vec![0f32; s.len()];
            batch_norm_forward(&s, &x, &p, &mut y);
            let mut dx = vec![0f32; s.len()];
            let (dg, db) = batch_norm_backward(&s, &x, &p, &dy, &mut dx);
            let (ry, rdx, rdg, rdb) = reference(&s, &x, &gamma, &beta, relu, &dy);
            for (what, err) in [
                ("y", max_rel(&y, &ry)),
                ("dx", max_rel(&dx, &rdx)),
                ("dgamma", max_rel(&dg, &rdg)),
                ("dbeta", max_rel(&db, &rdb)),
            ] {
                assert!(err < 1e-5, "relu {relu}: {what} relative error {err}");
            }
            // The fresh-vector forms compute the same values, every one written.
            assert_eq!(batch_norm_forward_new(&s, &x, &p), y, "relu {relu}: y");
            let (ndx, ndg, ndb) = batch_norm_backward_new(&s, &x, &p, &dy);
            assert_eq!((ndx, ndg, ndb), (dx, dg, db), "relu {relu}: gradients");
        }
    }
}
