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
use crate::base::gemm::{matmul, matmul_fresh};
use crate::base::threads::pool_threads;
use crate::softmax::softmax_grad_in_place;

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

/// The forward's results: the context `[batch, heads, queries, value_dim]` and, when asked
/// for, the probabilities `[batch, heads, queries, keys]` the backward reads.
#[derive(Debug)]
pub struct AttentionOutput {
    /// `softmax(scores) · V`, dense.
    pub context: Vec<f32>,
    /// The softmax of the scores, dense; empty when not kept.
    pub probs: Vec<f32>,
}

/// The backward's results, each dense in its operand's dims.
#[derive(Debug)]
pub struct AttentionGrads {
    /// Gradient of the queries.
    pub query: Vec<f32>,
    /// Gradient of the keys.
    pub key: Vec<f32>,
    /// Gradient of the values.
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

/// Runs `task(pair, chunks…)` for every (batch, head) pair over disjoint `len`-long chunks of
/// each output, in parallel or in turn as [`split`] decides.
fn for_pairs<const N: usize>(
    pairs: usize,
    parallel: bool,
    outputs: [(&mut [MaybeUninit<f32>], usize); N],
    task: impl Fn(usize, [&mut [MaybeUninit<f32>]; N]) + Sync,
) {
    // Each output as its chunks per pair (a chunk may be empty: an output not kept).
    let mut chunks: Vec<[&mut [MaybeUninit<f32>]; N]> = Vec::with_capacity(pairs);
    let mut rests = outputs.map(|(values, len)| (Some(values), len));
    for _ in 0..pairs {
        chunks.push(std::array::from_fn(|i| {
            let (rest, len) = &mut rests[i];
            let (head, tail) = rest.take().unwrap_or_default().split_at_mut(*len);
            *rest = Some(tail);
            head
        }));
    }
    if parallel {
        chunks
            .into_par_iter()
            .enumerate()
            .for_each(|(p, c)| task(p, c));
    } else {
        chunks.into_iter().enumerate().for_each(|(p, c)| task(p, c));
    }
}

/// The forward: `softmax(mask(Q·Kᵀ·scale) + bias) · V` for every (batch, head) pair, with the
/// probabilities kept when `keep_probs` (training).
///
/// # Panics
/// When an operand's strides reach past its values.
pub fn attention_forward(
    s: &AttentionShape,
    query: Strided<'_, f32>,
    key: Strided<'_, f32>,
    value: Strided<'_, f32>,
    options: &ScoreOptions<'_>,
    keep_probs: bool,
) -> AttentionOutput {
    let (tq, tk) = (s.queries, s.keys);
    check("query", &query, [s.batch, s.heads, tq, s.head_dim]);
    check("key", &key, [s.batch, s.heads, tk, s.head_dim]);
    check("value", &value, [s.batch, s.heads, tk, s.value_dim]);
    let scores_dims = [s.batch, s.heads, tq, tk];
    if let Some(m) = &options.mask {
        check("mask", m, scores_dims);
    }
    if let Some(b) = &options.bias {
        check("bias", b, scores_dims);
    }
    let pairs = s.pairs();
    let (parallel, threads) = split(pairs);
    let mut probs = Vec::new();
    let context = filled(pairs * tq * s.value_dim, |context| {
        let kept = if keep_probs { tq * tk } else { 0 };
        let mut probs_buf = Vec::with_capacity(pairs * kept);
        let probs_out = &mut probs_buf.spare_capacity_mut()[..pairs * kept];
        for_pairs(
            pairs,
            parallel,
            [(context, tq * s.value_dim), (probs_out, kept)],
            |p, [ctx, kept_probs]| {
                let (b, h) = (p / s.heads, p % s.heads);
                let mut scratch = Vec::new();
                let scores: &mut [MaybeUninit<f32>] = if kept_probs.is_empty() {
                    scratch.resize(tq * tk, MaybeUninit::new(0.0));
                    &mut scratch
                } else {
                    kept_probs
                };
                let (q, qs) = query.pair(b, h);
                let (k, ks) = key.pair(b, h);
                matmul_fresh(
                    (tq, tk, s.head_dim),
                    scores,
                    (q, qs),
                    (k, (ks.1, ks.0)),
                    threads,
                );
                // SAFETY: the GEMM wrote every one of the pair's tq × tk scores.
                let scores = unsafe { crate::base::buffers::assume_init(scores) };
                let mask = options.mask.map(|m| m.pair(b, h));
                let bias = options.bias.map(|m| m.pair(b, h));
                for (i, row) in scores.chunks_exact_mut(tk).enumerate() {
                    let visible = if options.causal {
                        (i + tk).saturating_sub(tq) + 1
                    } else {
                        tk
                    };
                    let mask_row = mask.map(|(m, (rs, cs))| (&m[i * rs..], cs));
                    let bias_row = bias.map(|(v, (rs, cs))| (&v[i * rs..], cs));
                    softmax_row(row, options.scale, visible.min(tk), mask_row, bias_row);
                }
                let (v, vs) = value.pair(b, h);
                matmul_fresh(
                    (tq, s.value_dim, tk),
                    ctx,
                    (scores, (tk, 1)),
                    (v, vs),
                    threads,
                );
            },
        );
        // SAFETY: every pair wrote its whole chunk of probabilities (none when not kept).
        unsafe { probs_buf.set_len(pairs * kept) };
        probs = probs_buf;
    });
    AttentionOutput { context, probs }
}

/// One row of scores in place: `x·scale`, masked positions and those from `visible` on set
/// to −∞, the bias added, then the softmax; a row with nothing visible becomes zeros (the
/// maximum is clamped to the most negative finite value and the sum to the smallest normal,
/// as Burn's NaN-safe softmax).
#[inline]
fn softmax_row(
    row: &mut [f32],
    scale: f32,
    visible: usize,
    mask: Option<(&[f32], usize)>,
    bias: Option<(&[f32], usize)>,
) {
    for (j, v) in row.iter_mut().enumerate() {
        let hidden = j >= visible || mask.is_some_and(|(m, cs)| m[j * cs] != 0.0);
        *v = if hidden {
            f32::NEG_INFINITY
        } else {
            *v * scale + bias.map_or(0.0, |(b, cs)| b[j * cs])
        };
    }
    softmax_in_place(row);
}

multiversion! {
    /// The NaN-safe softmax of one row in place; −∞ becomes exactly 0 (the kernels' `exp`
    /// clamps its argument, so it would give the smallest normal instead, and a row with
    /// nothing visible would come out uniform).
    fn softmax_in_place(row: &mut [f32]) {
        let max = row.iter().fold(f32::MIN, |m, &v| m.max(v));
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = if *v == f32::NEG_INFINITY { 0.0 } else { exp(*v - max) };
            sum += *v;
        }
        let inv = 1.0 / sum.max(f32::MIN_POSITIVE);
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

/// The backward from the forward's operands, its probabilities and the context's gradient
/// `d_context` (`[batch, heads, queries, value_dim]`, any strides): the gradients of the
/// queries, keys and values, and of the bias when `bias_grad`. Per pair: `dV = Pᵀ·dO`, `dP =
/// dO·Vᵀ`, `dS = P ⊙ (dP − rowsum(dP ⊙ P))` (the bias's gradient), `dQ = dS·scale·K`, `dK =
/// (dS·scale)ᵀ·Q`.
///
/// # Panics
/// When an operand's strides reach past its values or `probs` is not the forward's.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    s: &AttentionShape,
    query: Strided<'_, f32>,
    key: Strided<'_, f32>,
    value: Strided<'_, f32>,
    probs: &[f32],
    d_context: Strided<'_, f32>,
    scale: f32,
    bias_grad: bool,
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
    let (parallel, threads) = split(pairs);
    let dbias_len = if bias_grad { pairs * tq * tk } else { 0 };
    let mut dq = Vec::with_capacity(pairs * tq * dk);
    let mut dkey = Vec::with_capacity(pairs * tk * dk);
    let mut dval = Vec::with_capacity(pairs * tk * dv);
    let mut dbias = Vec::with_capacity(dbias_len);
    for_pairs(
        pairs,
        parallel,
        [
            (&mut dq.spare_capacity_mut()[..pairs * tq * dk], tq * dk),
            (&mut dkey.spare_capacity_mut()[..pairs * tk * dk], tk * dk),
            (&mut dval.spare_capacity_mut()[..pairs * tk * dv], tk * dv),
            (
                &mut dbias.spare_capacity_mut()[..dbias_len],
                dbias_len / pairs.max(1),
            ),
        ],
        |p, [gq, gk, gv, gb]| {
            let (b, h) = (p / s.heads, p % s.heads);
            let prob = &probs[p * tq * tk..(p + 1) * tq * tk];
            let (d_out, ds) = d_context.pair(b, h);
            let (v, vs) = value.pair(b, h);
            // dV = Pᵀ · dO.
            matmul_fresh((tk, dv, tq), gv, (prob, (1, tk)), (d_out, ds), threads);
            // dP = dO · Vᵀ, then dS in place, the bias's gradient copied out, the scale.
            let mut d_scores = vec![0f32; tq * tk];
            matmul(
                (tq, tk, dv),
                &mut d_scores,
                false,
                d_out,
                ds,
                v,
                (vs.1, vs.0),
                threads,
            );
            softmax_grad_in_place(&mut d_scores, prob, tk);
            if !gb.is_empty() {
                for (o, &g) in gb.iter_mut().zip(&d_scores) {
                    *o = MaybeUninit::new(g);
                }
            }
            d_scores.iter_mut().for_each(|g| *g *= scale);
            let (q, qs) = query.pair(b, h);
            let (k, ks) = key.pair(b, h);
            // dQ = dS·scale · K; dK = (dS·scale)ᵀ · Q.
            matmul_fresh((tq, dk, tk), gq, (&d_scores, (tk, 1)), (k, ks), threads);
            matmul_fresh((tk, dk, tq), gk, (&d_scores, (1, tk)), (q, qs), threads);
        },
    );
    // SAFETY: every pair wrote its whole chunk of each gradient.
    unsafe {
        dq.set_len(pairs * tq * dk);
        dkey.set_len(pairs * tk * dk);
        dval.set_len(pairs * tk * dv);
        dbias.set_len(dbias_len);
    }
    AttentionGrads {
        query: dq,
        key: dkey,
        value: dval,
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
            let out = attention_forward(&s, qv, kv, vv, &options, true);
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
            let inference = attention_forward(&s, qv, kv, vv, &options, false);
            assert_eq!(
                inference.context, out.context,
                "{s:?}: the same context without probs"
            );
            assert!(inference.probs.is_empty());
            let grads = attention_backward(
                &s,
                qv,
                kv,
                vv,
                &out.probs,
                Strided::dense(&d_ctx[..], dims(tq, s.value_dim)),
                scale,
                biased,
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
        let a = attention_forward(&s, view(0), view(1), view(2), &options, true);
        let dense_ops = (
            Strided::dense(&q[..], dims),
            Strided::dense(&k[..], dims),
            Strided::dense(&v[..], dims),
        );
        let b = attention_forward(&s, dense_ops.0, dense_ops.1, dense_ops.2, &options, true);
        assert_eq!(a.context, b.context);
        assert_eq!(a.probs, b.probs);
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
        let out = attention_forward(&s, qv, kv, vv, &options, true);
        assert_eq!(&out.context[..2], &[0.0, 0.0]);
        assert!(out.context[2..].iter().all(|v| v.is_finite() && *v != 0.0));
        let ones = [1f32; 4];
        let grads = attention_backward(
            &s,
            qv,
            kv,
            vv,
            &out.probs,
            Strided::dense(&ones[..], dims(2)),
            1.0,
            false,
        );
        assert_eq!(&grads.query[..2], &[0.0, 0.0]);
        assert!(grads.key.iter().chain(&grads.value).all(|v| v.is_finite()));
    }
}
