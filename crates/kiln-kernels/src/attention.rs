//! Scaled dot-product attention on the host, forward and backward: per (batch, head) pair
//! one GEMM for the scores, the scale, masks, bias and a NaN-safe softmax in one pass over
//! each row while it is in cache, one GEMM for the context; the backward's four GEMMs with
//! the softmax's gradient between them. Operands are read through their strides, so the
//! query, key and value views a model cuts out of one packed projection (a permute of
//! `[batch, tokens, 3, heads, head_dim]`) are never copied.
//!
//! Why: on Burn's operators attention is a matmul, a scale, a mask fill, a softmax of five
//! passes and a matmul, each a fresh tensor; under autodiff the backward of those is some
//! twenty more (U2, the user-shaped pre-LN encoder, trained at 0.38× PyTorch on the AVX-512
//! machine and 0.60× on the AVX2 one, BENCHMARKS.md runs 52 and 57).
//!
//! The softmax's probabilities are kept for the backward (`[batch, heads, queries, keys]`),
//! as PyTorch's math path does: for the sequence lengths CPU training sees that costs less
//! than recomputing the scores. A row whose every key is masked attends to nothing (zeros),
//! as Burn's attention.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::activation::exp;
use crate::base::buffers::filled;
use crate::base::gemm::matmul_to;
use crate::base::threads::{SharedOut, pool_threads};
use crate::softmax::{LANES, across, softmax_grad_in_place};

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Batch.
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Query positions.
    pub queries: usize,
    /// Key (and value) positions.
    pub keys: usize,
    /// Features per query and key.
    pub head_dim: usize,
    /// Features per value (and output).
    pub value_dim: usize,
}

impl AttentionShape {
    /// (batch, head) pairs: the kernel's independent tasks.
    pub fn pairs(&self) -> usize {
        self.batch * self.heads
    }
}

/// A four-axis operand read through strides: `[batch, head, position, feature]` (or
/// `[batch, head, query, key]` for a bias), element `(b, h, i, j)` at `values[b·s0 + h·s1 +
/// i·s2 + j·s3]`; a stride of 0 broadcasts.
#[derive(Debug, Clone, Copy)]
pub struct Strided<'a, T> {
    /// The values, from the operand's first element.
    pub values: &'a [T],
    /// Element strides of the four axes.
    pub strides: [usize; 4],
}

impl<'a, T> Strided<'a, T> {
    /// A dense operand of `dims` in row-major order.
    pub fn dense(values: &'a [T], dims: [usize; 4]) -> Self {
        Strided {
            values,
            strides: [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1],
        }
    }

    /// The values from pair `(b, h)`'s first element on, and its row and column strides.
    fn pair(&self, b: usize, h: usize) -> (&'a [T], (usize, usize)) {
        let start = b * self.strides[0] + h * self.strides[1];
        (
            self.values.get(start..).unwrap_or(&[]),
            (self.strides[2], self.strides[3]),
        )
    }

    /// Whether every element of `dims` lies inside `values`.
    fn covers(&self, dims: [usize; 4]) -> bool {
        if dims.contains(&0) {
            return true;
        }
        let last: usize = dims
            .iter()
            .zip(&self.strides)
            .map(|(d, s)| (d - 1) * s)
            .sum();
        last < self.values.len()
    }
}

/// What the scores go through before the softmax, in Burn's order: the scale, the boolean
/// mask (true = masked), the causal mask (aligned at the bottom-right corner, as Burn's and
/// PyTorch's for `keys > queries`), then the additive bias.
#[derive(Debug, Clone, Copy)]
pub struct ScoreOptions<'a> {
    /// The scores' factor (`1/√head_dim` by default in Burn and PyTorch).
    pub scale: f32,
    /// Positions not attended (nonzero = masked), `[batch, heads, queries, keys]`.
    pub mask: Option<Strided<'a, f32>>,
    /// Whether key `j` is hidden from query `i` when `j > i + keys − queries`.
    pub causal: bool,
    /// Added to the scores, `[batch, heads, queries, keys]`.
    pub bias: Option<Strided<'a, f32>>,
}

/// How a `[batch, heads, positions, features]` result is laid out in its vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `[batch, heads, positions, features]`, dense (Burn's attention's output).
    Heads,
    /// `[batch, positions, heads, features]`: each token's heads side by side, the merged
    /// `[batch, tokens, heads·features]` a model's output projection reads with no copy.
    Tokens,
}

impl Layout {
    /// Element strides of (batch, head, position) for `dims` (features are contiguous).
    fn strides(self, [_, heads, positions, features]: [usize; 4]) -> [usize; 3] {
        match self {
            Layout::Heads => [heads * positions * features, positions * features, features],
            Layout::Tokens => [positions * heads * features, features, heads * features],
        }
    }
}

/// Where the backward's query, key and value gradients go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradLayout {
    /// Three vectors, each in its own layout (the glue matches each operand's memory order,
    /// so the gradient of a view cut from token-ordered memory needs no copy back).
    Separate([Layout; 3]),
    /// One vector `[batch, tokens, 3, heads, head_dim]`: the gradient of a packed QKV
    /// projection (`[batch, tokens, 3·heads·head_dim]`) the three were cut from. Needs as many
    /// queries as keys and values as wide as keys.
    Packed,
}

/// The forward's results: the context in the layout asked for and, when asked for, the
/// probabilities `[batch, heads, queries, keys]` the backward reads.
#[derive(Debug)]
pub struct AttentionOutput {
    /// `softmax(scores) · V`.
    pub context: Vec<f32>,
    /// The softmax of the scores, dense; empty when not kept.
    pub probs: Vec<f32>,
}

/// The backward's results.
#[derive(Debug)]
pub struct AttentionGrads {
    /// The query, key and value gradients: three vectors in the layouts asked for, or with
    /// [`GradLayout::Packed`] one packed vector in `query` and `key`, `value` empty.
    pub query: Vec<f32>,
    /// Gradient of the keys (empty when packed).
    pub key: Vec<f32>,
    /// Gradient of the values (empty when packed).
    pub value: Vec<f32>,
    /// Gradient of the additive bias (the scores' gradient), when asked for.
    pub bias: Option<Vec<f32>>,
}

/// Panics with a clear message when an operand does not hold its dims.
fn check<T>(name: &str, operand: &Strided<'_, T>, dims: [usize; 4]) {
    assert!(
        operand.covers(dims),
        "attention {name}: {dims:?} through strides {:?} reach past its {} values",
        operand.strides,
        operand.values.len()
    );
}

/// How the pairs and the GEMMs share the pool: pairs in parallel with one-thread GEMMs when
/// there are enough pairs to keep every thread busy, else pairs in turn with pooled GEMMs.
fn split(pairs: usize) -> (bool, usize) {
    let threads = pool_threads();
    if pairs >= threads {
        (true, 1)
    } else {
        (false, threads)
    }
}

/// Runs `task(batch, head)` for every pair, in parallel or in turn.
fn for_pairs(s: &AttentionShape, parallel: bool, task: impl Fn(usize, usize) + Sync) {
    let run = |p: usize| task(p / s.heads, p % s.heads);
    if parallel {
        (0..s.pairs()).into_par_iter().for_each(run);
    } else {
        (0..s.pairs()).for_each(run);
    }
}

/// One output of the kernel: a buffer the pairs write disjoint rows of, element (b, h, i, j)
/// at `offset + b·s0 + h·s1 + i·s2 + j`.
#[derive(Clone, Copy)]
struct Dest {
    out: SharedOut,
    offset: usize,
    strides: [usize; 3],
}

impl Dest {
    fn new(buffer: &mut [MaybeUninit<f32>], offset: usize, strides: [usize; 3]) -> Dest {
        Dest {
            out: SharedOut(buffer.as_mut_ptr().cast()),
            offset,
            strides,
        }
    }

    /// Pair `(b, h)`'s first element and its row stride.
    fn pair(self, b: usize, h: usize) -> (*mut f32, usize) {
        let start = self.offset + b * self.strides[0] + h * self.strides[1];
        // SAFETY (of the arithmetic): the buffer holds every pair's rows (each caller sizes
        // it for its layout), so the offset stays inside it.
        (unsafe { self.out.get().add(start) }, self.strides[2])
    }
}

/// The forward: `softmax(mask(Q·Kᵀ·scale) + bias) · V` for every (batch, head) pair, the
/// context in `layout`, with the probabilities kept when `keep_probs` (training).
///
/// # Panics
/// When an operand's strides reach past its values.
pub fn attention_forward(
    s: &AttentionShape,
    (query, key, value): (Strided<'_, f32>, Strided<'_, f32>, Strided<'_, f32>),
    options: &ScoreOptions<'_>,
    keep_probs: bool,
    layout: Layout,
) -> AttentionOutput {
    let (tq, tk, dk, dv) = (s.queries, s.keys, s.head_dim, s.value_dim);
    check("query", &query, [s.batch, s.heads, tq, dk]);
    check("key", &key, [s.batch, s.heads, tk, dk]);
    check("value", &value, [s.batch, s.heads, tk, dv]);
    let scores_dims = [s.batch, s.heads, tq, tk];
    if let Some(m) = &options.mask {
        check("mask", m, scores_dims);
    }
    if let Some(b) = &options.bias {
        check("bias", b, scores_dims);
    }
    let pairs = s.pairs();
    let (parallel, threads) = split(pairs);
    let kept = if keep_probs { pairs * tq * tk } else { 0 };
    let mut probs = Vec::with_capacity(kept);
    let probs_dest = Dest::new(
        &mut probs.spare_capacity_mut()[..kept],
        0,
        Layout::Heads.strides(scores_dims),
    );
    let context = filled(pairs * tq * dv, |context| {
        let ctx_dest = Dest::new(context, 0, layout.strides([s.batch, s.heads, tq, dv]));
        for_pairs(s, parallel, |b, h| {
            let mut scratch = Vec::new();
            let scores: &mut [f32] = if keep_probs {
                let (start, _) = probs_dest.pair(b, h);
                // SAFETY: pair (b, h)'s tq × tk probabilities are its own (dense layout), and
                // the GEMM below writes every one of them before anything reads them.
                unsafe { std::slice::from_raw_parts_mut(start, tq * tk) }
            } else {
                scratch.resize(tq * tk, 0.0);
                &mut scratch
            };
            let (q, qs) = query.pair(b, h);
            let (k, ks) = key.pair(b, h);
            // SAFETY: `scores` holds tq rows of tk values, this pair's alone.
            unsafe {
                matmul_to(
                    (tq, tk, dk),
                    scores.as_mut_ptr(),
                    tk,
                    false,
                    (q, qs),
                    (k, (ks.1, ks.0)),
                    options.scale,
                    threads,
                )
            };
            let mask = options.mask.map(|m| m.pair(b, h));
            let bias = options.bias.map(|m| m.pair(b, h));
            for (i, row) in scores.chunks_exact_mut(tk).enumerate() {
                let visible = if options.causal {
                    (i + tk + 1).saturating_sub(tq)
                } else {
                    tk
                };
                let mask_row = mask.map(|(m, (rs, cs))| (&m[i * rs..], cs));
                let bias_row = bias.map(|(v, (rs, cs))| (&v[i * rs..], cs));
                softmax_row(row, visible, mask_row, bias_row);
            }
            let (v, vs) = value.pair(b, h);
            let (out, rs) = ctx_dest.pair(b, h);
            // SAFETY: the context's rows of pair (b, h) in `layout` are its own.
            unsafe {
                matmul_to(
                    (tq, dv, tk),
                    out,
                    rs,
                    false,
                    (scores, (tk, 1)),
                    (v, vs),
                    1.0,
                    threads,
                )
            };
        });
    });
    // SAFETY: every pair wrote its whole block of probabilities (none when not kept).
    unsafe { probs.set_len(kept) };
    AttentionOutput { context, probs }
}

/// One row of already scaled scores in place (the GEMM applied the scale): the bias added,
/// masked positions and those from `visible` on set to −∞, then the softmax; a row with
/// nothing visible becomes zeros (the maximum is clamped to the most negative finite value
/// and the sum to the smallest normal, as Burn's NaN-safe softmax). The masks and the bias,
/// when there are any, are one pass each.
#[inline]
fn softmax_row(
    row: &mut [f32],
    visible: usize,
    mask: Option<(&[f32], usize)>,
    bias: Option<(&[f32], usize)>,
) {
    if let Some((b, cs)) = bias {
        for (j, v) in row.iter_mut().enumerate() {
            *v += b[j * cs];
        }
    }
    if let Some((m, cs)) = mask {
        for (j, v) in row.iter_mut().enumerate() {
            if m[j * cs] != 0.0 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    let visible = visible.min(row.len());
    row[visible..].fill(f32::NEG_INFINITY);
    softmax_in_place(row);
}

multiversion! {
    /// The NaN-safe softmax of one row in place, its maximum and sum in [`LANES`] independent
    /// partial results (one running value is a serial chain the compiler may not reorder);
    /// −∞ becomes exactly 0 (the kernels' `exp` clamps its argument, so it would give the
    /// smallest normal instead, and a row with nothing visible would come out uniform).
    fn softmax_in_place(row: &mut [f32]) {
        let mut maxes = [f32::MIN; LANES];
        let mut blocks = row.chunks_exact(LANES);
        for block in &mut blocks {
            for (m, &v) in maxes.iter_mut().zip(block) {
                *m = m.max(v);
            }
        }
        // The partial block padded as a whole one (a scalar tail was a serial chain).
        let mut block = [f32::MIN; LANES];
        let rest = blocks.remainder();
        block[..rest.len()].copy_from_slice(rest);
        for (m, &v) in maxes.iter_mut().zip(&block) {
            *m = m.max(v);
        }
        let max = across(maxes, f32::max);
        let mut sums = [0f32; LANES];
        let mut blocks = row.chunks_exact_mut(LANES);
        for block in &mut blocks {
            for (s, v) in sums.iter_mut().zip(block.iter_mut()) {
                let e = if *v == f32::NEG_INFINITY { 0.0 } else { exp(*v - max) };
                *v = e;
                *s += e;
            }
        }
        // The last partial block as a whole one padded with −∞ (exponential 0): a scalar
        // tail was most of a short row (W4's 28 keys: 12 of them).
        let rest = blocks.into_remainder();
        let mut block = [f32::NEG_INFINITY; LANES];
        block[..rest.len()].copy_from_slice(rest);
        for (s, v) in sums.iter_mut().zip(block.iter_mut()) {
            *v = if *v == f32::NEG_INFINITY { 0.0 } else { exp(*v - max) };
            *s += *v;
        }
        rest.copy_from_slice(&block[..rest.len()]);
        let sum = across(sums, |a, b| a + b);
        let inv = 1.0 / sum.max(f32::MIN_POSITIVE);
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

/// The backward from the forward's operands, its probabilities and the context's gradient
/// `d_context` (`[batch, heads, queries, value_dim]`, any strides): the gradients of the
/// queries, keys and values in `layout`, and of the bias when `bias_grad`. Per pair: `dV =
/// Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ⊙ (dP − rowsum(dP ⊙ P))` (the bias's gradient), `dQ =
/// scale·dS·K`, `dK = scale·dSᵀ·Q`.
///
/// # Panics
/// When an operand's strides reach past its values, `probs` is not the forward's, or the
/// packed layout is asked of unequal query and key counts or widths.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    s: &AttentionShape,
    (query, key, value): (Strided<'_, f32>, Strided<'_, f32>, Strided<'_, f32>),
    probs: &[f32],
    d_context: Strided<'_, f32>,
    scale: f32,
    bias_grad: bool,
    layout: GradLayout,
) -> AttentionGrads {
    let (tq, tk, dk, dv) = (s.queries, s.keys, s.head_dim, s.value_dim);
    check("query", &query, [s.batch, s.heads, tq, dk]);
    check("key", &key, [s.batch, s.heads, tk, dk]);
    check("value", &value, [s.batch, s.heads, tk, dv]);
    check("context gradient", &d_context, [s.batch, s.heads, tq, dv]);
    let pairs = s.pairs();
    assert_eq!(
        probs.len(),
        pairs * tq * tk,
        "attention probabilities length"
    );
    let packed = layout == GradLayout::Packed;
    assert!(
        !packed || (tq == tk && dk == dv),
        "packed attention gradients need as many queries as keys ({tq} vs {tk}) and values as wide as keys ({dv} vs {dk})"
    );
    let (parallel, threads) = split(pairs);
    let scores = [s.batch, s.heads, tq, tk];
    let mut dbias = Vec::with_capacity(if bias_grad { pairs * tq * tk } else { 0 });
    let bias_dest = Dest::new(
        &mut dbias.spare_capacity_mut()[..],
        0,
        Layout::Heads.strides(scores),
    );
    let run = |[gq, gk, gv]: [Dest; 3]| {
        for_pairs(s, parallel, |b, h| {
            let p = b * s.heads + h;
            let prob = &probs[p * tq * tk..(p + 1) * tq * tk];
            let (d_out, ds) = d_context.pair(b, h);
            let (v, vs) = value.pair(b, h);
            let (q, qs) = query.pair(b, h);
            let (k, ks) = key.pair(b, h);
            let (gq, gk, gv) = (gq.pair(b, h), gk.pair(b, h), gv.pair(b, h));
            let mut d_scores = vec![0f32; tq * tk];
            // SAFETY: each destination's rows of pair (b, h) are its own; `d_scores` is local.
            unsafe {
                // dV = Pᵀ · dO.
                matmul_to(
                    (tk, dv, tq),
                    gv.0,
                    gv.1,
                    false,
                    (prob, (1, tk)),
                    (d_out, ds),
                    1.0,
                    threads,
                );
                // dP = dO · Vᵀ, then dS in place and the bias's gradient copied out.
                let d_scores_ptr = d_scores.as_mut_ptr();
                matmul_to(
                    (tq, tk, dv),
                    d_scores_ptr,
                    tk,
                    false,
                    (d_out, ds),
                    (v, (vs.1, vs.0)),
                    1.0,
                    threads,
                );
            }
            softmax_grad_in_place(&mut d_scores, prob, tk);
            if bias_grad {
                let (out, _) = bias_dest.pair(b, h);
                // SAFETY: pair (b, h)'s block of the bias gradient (dense) is its own.
                unsafe { std::ptr::copy_nonoverlapping(d_scores.as_ptr(), out, tq * tk) };
            }
            // SAFETY: as above.
            unsafe {
                // dQ = scale · dS · K; dK = scale · dSᵀ · Q.
                matmul_to(
                    (tq, dk, tk),
                    gq.0,
                    gq.1,
                    false,
                    (&d_scores, (tk, 1)),
                    (k, ks),
                    scale,
                    threads,
                );
                matmul_to(
                    (tk, dk, tq),
                    gk.0,
                    gk.1,
                    false,
                    (&d_scores, (1, tk)),
                    (q, qs),
                    scale,
                    threads,
                );
            }
        });
    };
    let grads = match layout {
        GradLayout::Packed => {
            // [batch, tokens, 3, heads, head_dim]: q, k and v of a token side by side.
            let row = 3 * s.heads * dk;
            let strides = [tq * row, dk, row];
            let all = filled(pairs * tq * 3 * dk, |g| {
                run([0, 1, 2].map(|part| Dest::new(g, part * s.heads * dk, strides)))
            });
            (all, Vec::new(), Vec::new())
        }
        GradLayout::Separate([lq, lk, lv]) => {
            let dims = |t: usize, d: usize| [s.batch, s.heads, t, d];
            let (mut gq, mut gk, mut gv) = (
                Vec::with_capacity(pairs * tq * dk),
                Vec::with_capacity(pairs * tk * dk),
                Vec::with_capacity(pairs * tk * dv),
            );
            run([
                Dest::new(
                    &mut gq.spare_capacity_mut()[..pairs * tq * dk],
                    0,
                    lq.strides(dims(tq, dk)),
                ),
                Dest::new(
                    &mut gk.spare_capacity_mut()[..pairs * tk * dk],
                    0,
                    lk.strides(dims(tk, dk)),
                ),
                Dest::new(
                    &mut gv.spare_capacity_mut()[..pairs * tk * dv],
                    0,
                    lv.strides(dims(tk, dv)),
                ),
            ]);
            // SAFETY: every pair wrote its whole block of each gradient.
            unsafe {
                gq.set_len(pairs * tq * dk);
                gk.set_len(pairs * tk * dk);
                gv.set_len(pairs * tk * dv);
            }
            (gq, gk, gv)
        }
    };
    if bias_grad {
        // SAFETY: every pair wrote its whole block of the bias gradient.
        unsafe { dbias.set_len(pairs * tq * tk) };
    }
    AttentionGrads {
        query: grads.0,
        key: grads.1,
        value: grads.2,
        bias: bias_grad.then_some(dbias),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::testing::{relative_error, values};

    /// Attention in f64, straight from the definition: the context, and the gradients of
    /// `Σ context ⊙ d_context` for q, k, v and the bias.
    #[allow(clippy::type_complexity)]
    fn reference(
        s: &AttentionShape,
        (q, k, v): (&[f32], &[f32], &[f32]),
        mask: Option<&[f32]>,
        causal: bool,
        bias: Option<&[f32]>,
        scale: f64,
        d_ctx: &[f32],
    ) -> [Vec<f64>; 5] {
        let (tq, tk, dk, dv) = (s.queries, s.keys, s.head_dim, s.value_dim);
        let f = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
        let (q, k, v, d_ctx) = (f(q), f(k), f(v), f(d_ctx));
        let mut ctx = vec![0f64; s.pairs() * tq * dv];
        let (mut gq, mut gk, mut gv) = (
            vec![0f64; q.len()],
            vec![0f64; k.len()],
            vec![0f64; v.len()],
        );
        let mut gb = vec![0f64; s.pairs() * tq * tk];
        for p in 0..s.pairs() {
            let (qo, ko, vo, so) = (p * tq * dk, p * tk * dk, p * tk * dv, p * tq * tk);
            for i in 0..tq {
                let mut z = vec![f64::NEG_INFINITY; tk];
                for (j, zj) in z.iter_mut().enumerate() {
                    let hidden = mask.is_some_and(|m| m[so + i * tk + j] != 0.0)
                        || (causal && j + tq > i + tk);
                    if !hidden {
                        let dot: f64 = (0..dk)
                            .map(|d| q[qo + i * dk + d] * k[ko + j * dk + d])
                            .sum();
                        *zj = dot * scale + bias.map_or(0.0, |b| f64::from(b[so + i * tk + j]));
                    }
                }
                let max = z.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = z.iter().map(|&v| (v - max).exp()).collect();
                let sum = e.iter().sum::<f64>().max(f64::MIN_POSITIVE);
                let pr: Vec<f64> = e.iter().map(|v| v / sum).collect();
                let mut dp = vec![0f64; tk];
                for d in 0..dv {
                    let go = d_ctx[p * tq * dv + i * dv + d];
                    for j in 0..tk {
                        ctx[p * tq * dv + i * dv + d] += pr[j] * v[vo + j * dv + d];
                        gv[vo + j * dv + d] += pr[j] * go;
                        dp[j] += go * v[vo + j * dv + d];
                    }
                }
                let dot: f64 = dp.iter().zip(&pr).map(|(a, b)| a * b).sum();
                for j in 0..tk {
                    let dsj = pr[j] * (dp[j] - dot);
                    gb[so + i * tk + j] = dsj;
                    for d in 0..dk {
                        gq[qo + i * dk + d] += dsj * scale * k[ko + j * dk + d];
                        gk[ko + j * dk + d] += dsj * scale * q[qo + i * dk + d];
                    }
                }
            }
        }
        [ctx, gq, gk, gv, gb]
    }

    fn shape(
        batch: usize,
        heads: usize,
        tq: usize,
        tk: usize,
        dk: usize,
        dv: usize,
    ) -> AttentionShape {
        AttentionShape {
            batch,
            heads,
            queries: tq,
            keys: tk,
            head_dim: dk,
            value_dim: dv,
        }
    }

    /// The forward and every gradient within 1e-5 of f64: self- and cross-attention, odd
    /// sizes, a padding mask, the causal mask with more keys than queries, an additive bias,
    /// few pairs (pooled GEMMs) and many (pairs in parallel).
    #[test]
    fn forward_and_gradients_match_the_f64_reference() {
        for (s, masked, causal, biased) in [
            (shape(2, 3, 5, 5, 4, 4), false, false, false),
            (shape(1, 1, 7, 9, 3, 5), true, false, true),
            (shape(3, 2, 6, 8, 8, 8), false, true, false),
            // More queries than keys, causal: the first rows see nothing (zeros).
            (shape(2, 2, 9, 5, 4, 4), true, true, true),
            (shape(16, 4, 17, 17, 32, 32), true, true, true),
        ] {
            let (tq, tk) = (s.queries, s.keys);
            let q = values(s.pairs() * tq * s.head_dim, 1);
            let k = values(s.pairs() * tk * s.head_dim, 2);
            let v = values(s.pairs() * tk * s.value_dim, 3);
            let d_ctx = values(s.pairs() * tq * s.value_dim, 4);
            // Every third row masks its last two keys (never a whole row).
            let mask: Vec<f32> = (0..s.pairs() * tq * tk)
                .map(|i| f32::from(u8::from((i / tk) % 3 == 0 && i % tk >= tk - 2)))
                .collect();
            let bias = values(s.pairs() * tq * tk, 5);
            let scale = 1.0 / (s.head_dim as f32).sqrt();
            let dims = |t, d| [s.batch, s.heads, t, d];
            let options = ScoreOptions {
                scale,
                mask: masked.then(|| Strided::dense(&mask[..], dims(tq, tk))),
                causal,
                bias: biased.then(|| Strided::dense(&bias[..], dims(tq, tk))),
            };
            let (qv, kv, vv) = (
                Strided::dense(&q[..], dims(tq, s.head_dim)),
                Strided::dense(&k[..], dims(tk, s.head_dim)),
                Strided::dense(&v[..], dims(tk, s.value_dim)),
            );
            let out = attention_forward(&s, (qv, kv, vv), &options, true, Layout::Heads);
            let want = reference(
                &s,
                (&q, &k, &v),
                masked.then_some(&mask[..]),
                causal,
                biased.then_some(&bias[..]),
                f64::from(scale),
                &d_ctx,
            );
            assert!(
                relative_error(&out.context, &want[0]) < 1e-5,
                "{s:?} context"
            );
            let inference = attention_forward(&s, (qv, kv, vv), &options, false, Layout::Heads);
            assert_eq!(
                inference.context, out.context,
                "{s:?}: the same context without probs"
            );
            assert!(inference.probs.is_empty());
            let grads = attention_backward(
                &s,
                (qv, kv, vv),
                &out.probs,
                Strided::dense(&d_ctx[..], dims(tq, s.value_dim)),
                scale,
                biased,
                GradLayout::Separate([Layout::Heads; 3]),
            );
            for (name, got, want) in [
                ("dq", &grads.query, &want[1]),
                ("dk", &grads.key, &want[2]),
                ("dv", &grads.value, &want[3]),
            ] {
                let err = relative_error(got, want);
                assert!(err < 1e-5, "{s:?} {name}: {err:e}");
            }
            match grads.bias {
                Some(gb) => assert!(relative_error(&gb, &want[4]) < 1e-5, "{s:?} dbias"),
                None => assert!(!biased),
            }
        }
    }

    /// Q, K and V as strided views of one packed `[batch, tokens, 3, heads, head_dim]`
    /// projection give the same bits as dense copies of them.
    #[test]
    fn strided_views_of_a_packed_projection_match_dense_copies() {
        let (batch, tokens, heads, hd) = (2, 5, 3, 4);
        let packed = values(batch * tokens * 3 * heads * hd, 7);
        let s = shape(batch, heads, tokens, tokens, hd, hd);
        // Element (b, h, t, d) of part `which` at b·T·3·H·D + t·3·H·D + which·H·D + h·D + d.
        let strides = [tokens * 3 * heads * hd, hd, 3 * heads * hd, 1];
        let view = |which: usize| Strided {
            values: &packed[which * heads * hd..],
            strides,
        };
        let dense = |which: usize| -> Vec<f32> {
            let mut out = Vec::new();
            for b in 0..batch {
                for h in 0..heads {
                    for t in 0..tokens {
                        for d in 0..hd {
                            out.push(
                                packed[b * strides[0]
                                    + t * strides[2]
                                    + which * heads * hd
                                    + h * hd
                                    + d],
                            );
                        }
                    }
                }
            }
            out
        };
        let (q, k, v) = (dense(0), dense(1), dense(2));
        let dims = [batch, heads, tokens, hd];
        let options = ScoreOptions {
            scale: 0.5,
            mask: None,
            causal: true,
            bias: None,
        };
        let a = attention_forward(
            &s,
            (view(0), view(1), view(2)),
            &options,
            true,
            Layout::Heads,
        );
        let dense_ops = (
            Strided::dense(&q[..], dims),
            Strided::dense(&k[..], dims),
            Strided::dense(&v[..], dims),
        );
        let b = attention_forward(&s, dense_ops, &options, true, Layout::Heads);
        assert_eq!(a.context, b.context);
        assert_eq!(a.probs, b.probs);
        // The context in token order is the same values, each token's heads side by side.
        let by_token = attention_forward(
            &s,
            (view(0), view(1), view(2)),
            &options,
            false,
            Layout::Tokens,
        );
        for bi in 0..batch {
            for h in 0..heads {
                for t in 0..s.queries {
                    for d in 0..hd {
                        let want = a.context[((bi * heads + h) * s.queries + t) * hd + d];
                        let got = by_token.context[((bi * s.queries + t) * heads + h) * hd + d];
                        assert_eq!(got, want);
                    }
                }
            }
        }
        // The gradients into the packed projection's layout: the dense ones, interleaved.
        let d_ctx = values(batch * heads * s.queries * hd, 8);
        let d = Strided::dense(&d_ctx[..], dims);
        let dense_grads = attention_backward(
            &s,
            dense_ops,
            &b.probs,
            d,
            0.5,
            false,
            GradLayout::Separate([Layout::Heads; 3]),
        );
        let packed_grads = attention_backward(
            &s,
            (view(0), view(1), view(2)),
            &a.probs,
            d,
            0.5,
            false,
            GradLayout::Packed,
        );
        assert!(packed_grads.key.is_empty() && packed_grads.value.is_empty());
        // Each gradient in token order: the dense ones, each token's heads side by side.
        let by_token = attention_backward(
            &s,
            dense_ops,
            &b.probs,
            d,
            0.5,
            false,
            GradLayout::Separate([Layout::Tokens; 3]),
        );
        let pairs = [
            (&dense_grads.query, &by_token.query),
            (&dense_grads.key, &by_token.key),
            (&dense_grads.value, &by_token.value),
        ];
        for (heads_order, token_order) in pairs {
            for bi in 0..batch {
                for h in 0..heads {
                    for t in 0..s.queries {
                        for dd in 0..hd {
                            let want = heads_order[((bi * heads + h) * s.queries + t) * hd + dd];
                            let got = token_order[((bi * s.queries + t) * heads + h) * hd + dd];
                            assert_eq!(got, want);
                        }
                    }
                }
            }
        }
        let parts = [&dense_grads.query, &dense_grads.key, &dense_grads.value];
        for (which, part) in parts.into_iter().enumerate() {
            for bi in 0..batch {
                for h in 0..heads {
                    for t in 0..s.queries {
                        for dd in 0..hd {
                            let want = part[((bi * heads + h) * s.queries + t) * hd + dd];
                            let at =
                                bi * strides[0] + t * strides[2] + which * heads * hd + h * hd + dd;
                            assert_eq!(packed_grads.query[at], want, "part {which}");
                        }
                    }
                }
            }
        }
    }

    /// A row whose every key is masked attends to nothing: zeros forward, zero gradients.
    #[test]
    fn a_fully_masked_row_gives_zeros() {
        let s = shape(1, 1, 2, 3, 2, 2);
        let q = values(4, 1);
        let k = values(6, 2);
        let v = values(6, 3);
        let mask = [1f32, 1.0, 1.0, 0.0, 0.0, 0.0];
        let dims = |t| [1, 1, t, 2];
        let options = ScoreOptions {
            scale: 1.0,
            mask: Some(Strided::dense(&mask[..], [1, 1, 2, 3])),
            causal: false,
            bias: None,
        };
        let (qv, kv, vv) = (
            Strided::dense(&q[..], dims(2)),
            Strided::dense(&k[..], dims(3)),
            Strided::dense(&v[..], dims(3)),
        );
        let out = attention_forward(&s, (qv, kv, vv), &options, true, Layout::Heads);
        assert_eq!(&out.context[..2], &[0.0, 0.0]);
        assert!(out.context[2..].iter().all(|v| v.is_finite() && *v != 0.0));
        let ones = [1f32; 4];
        let grads = attention_backward(
            &s,
            (qv, kv, vv),
            &out.probs,
            Strided::dense(&ones[..], dims(2)),
            1.0,
            false,
            GradLayout::Separate([Layout::Heads; 3]),
        );
        assert_eq!(&grads.query[..2], &[0.0, 0.0]);
        assert!(grads.key.iter().chain(&grads.value).all(|v| v.is_finite()));
    }
}
