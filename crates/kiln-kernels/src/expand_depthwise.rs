//! A pointwise (1×1) convolution and the depthwise convolution that reads its output, in one
//! pass: the inverted-residual block of MobileNet v2/v3, EfficientNet and their kin
//! (`1×1 expand → activation → depthwise → activation`).
//!
//! Why: the expanded image is the block's largest tensor (MobileNet v2's second block at
//! batch 8: 16 → 96 channels at 112², 38.5 MB), written by the 1×1 layer and read back by
//! the depthwise one — both memory-bound on it. Here each task makes a band of the expanded
//! rows into a scratch buffer that stays in L2 and runs the depthwise rows over it at once,
//! so the expanded image never reaches memory. A task works down its rows in order and keeps
//! the rows two bands share, so no expanded row is computed twice inside a task.
//!
//! The values are the unfused layers' to the bit: the same kernels compute each output from
//! the same inputs in the same order.

use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use crate::activation::Activation;
use crate::base::isa::F32Kernel;
use crate::base::window::Window2d;
use crate::depthwise::{DepthwiseWeights, depthwise_output_row};
use crate::implicit::{ConvWeights, linear_rows_serial_into};

/// Bytes of expanded rows a task keeps in its scratch buffer: well inside L2 (1–2 MB per
/// core on the CPUs measured), with room for the input rows and the output.
const SCRATCH_BYTES: usize = 256 << 10;

/// Bytes of the expanded image below which the two layers run apart: it stays in cache
/// between them, and the pair would only add the rows its chunks share. Measured at batch 1
/// (two threads, alternated medians, BENCHMARKS.md run 44): fused, ShuffleNet v2 (expanded
/// images of 0.2–0.4 MB) and MobileNet v3 small (0.3–0.9 MB) ran 4% slower, MobileNet v2's
/// 1.8 and 4.8 MB images 25% faster per layer pair.
const EXPANDED_MIN_BYTES: usize = 1 << 20;

/// Row chunks per thread when a call splits: enough that an uneven share evens out, few
/// enough that the rows recomputed where two chunks meet stay a small part.
const CHUNKS_PER_THREAD: usize = 2;

/// A chunk's input rows (`rows · stride`) are at least this many times the rows it shares
/// with the next chunk (`span − stride`), which both compute: at most 25% more 1×1 work.
/// Measured at batch 1 (MobileNet v2, two threads, BENCHMARKS.md run 44): chunks of 4 rows
/// at 14² (6 expanded rows each) made the pair 15–20% slower than the two layers apart.
const CHUNK_OVER_SHARED: usize = 4;

/// The two layers' weights and activations.
#[derive(Clone, Copy)]
pub struct ExpandDepthwise<'a> {
    /// The 1×1 convolution `[expanded, cin, 1, 1]` (stride 1, no padding).
    pub pointwise: &'a ConvWeights,
    /// Applied to the expanded values.
    pub pointwise_act: Option<Activation>,
    /// One filter per expanded channel.
    pub depthwise: &'a DepthwiseWeights,
    /// Applied to the output.
    pub depthwise_act: Option<Activation>,
}

/// `depthwise(act(pointwise(x)))` of `x` `[batch, h, w, cin]` over `win` (the depthwise
/// layer's window over the expanded image `[batch, h, w, expanded]`), output
/// `[batch, oh, ow, expanded]`. `None` where the pointwise weights have no SIMD kernel, where
/// the expanded image is small enough to stay in cache between the layers, or where the
/// pool's threads would not all get a chunk of rows long enough (a small image at batch 1:
/// the two layers apart split better): the caller runs the two layers apart.
///
/// # Panics
/// When the shapes disagree (the caller checks them against the model first).
pub fn expand_depthwise(x: &[f32], win: &Window2d, layers: &ExpandDepthwise) -> Option<Vec<f32>> {
    let [n, h, w, expanded] = win.dims;
    if n * h * w * expanded * 4 < EXPANDED_MIN_BYTES {
        return None;
    }
    let out = expand_depthwise_banded(x, win, layers, SCRATCH_BYTES)?;
    FUSED_CALLS.fetch_add(1, Ordering::Relaxed);
    Some(out)
}

/// Calls of [`expand_depthwise`] that ran fused, in this process so far: tests check the
/// fused path ran where it should.
pub fn fused_calls() -> usize {
    FUSED_CALLS.load(Ordering::Relaxed)
}

static FUSED_CALLS: AtomicUsize = AtomicUsize::new(0);

/// [`expand_depthwise`] with a scratch budget of `scratch_bytes` (tests force many bands).
pub(crate) fn expand_depthwise_banded(
    x: &[f32],
    win: &Window2d,
    layers: &ExpandDepthwise,
    scratch_bytes: usize,
) -> Option<Vec<f32>> {
    let [batch, h, w, expanded] = win.dims;
    let [pw_out, cin, pkh, pkw] = layers.pointwise.dims();
    assert_eq!(
        (pw_out, pkh, pkw),
        (expanded, 1, 1),
        "pointwise weights for another shape"
    );
    assert_eq!(
        (layers.depthwise.channels(), layers.depthwise.kernel()),
        (expanded, win.kernel),
        "depthwise weights for another shape"
    );
    assert_eq!(
        x.len(),
        batch * h * w * cin,
        "expand-depthwise input length"
    );
    layers.pointwise.kernel().panel_width()?;
    let [_, oh, ow, _] = win.out_dims();
    let out_row = ow * expanded;
    let len = batch * oh * out_row;
    if len == 0 {
        return Some(Vec::new());
    }
    let band = Band::new(win, scratch_bytes);
    // Chunks of output rows per image, each a task that works down its rows in order.
    let threads = crate::base::threads::pool_threads();
    let work = len * (cin + win.kernel[0] * win.kernel[1]);
    let parallel = threads > 1 && work >= crate::base::threads::SPLIT_MACS;
    let per_image = if parallel {
        let stride = win.stride[0];
        let shared = band.span.saturating_sub(stride);
        let min_rows = (CHUNK_OVER_SHARED * shared).div_ceil(stride).max(1);
        let per_image = (threads * CHUNKS_PER_THREAD)
            .div_ceil(batch)
            .min((oh / min_rows).max(1));
        if batch * per_image < threads {
            return None;
        }
        per_image
    } else {
        1
    };
    let chunk_rows = oh.div_ceil(per_image);
    // The depthwise rows on the instruction set the 1×1 layer was packed for.
    let kernel = layers.pointwise.kernel();
    let run = |image: usize, c: usize, chunk: &mut [f32]| {
        band.run_chunk(kernel, x, layers, image, c * chunk_rows, chunk);
    };
    Some(crate::base::buffers::filled(len, |out| {
        // SAFETY: the chunks below cover `out`, and each writes every value of its rows
        // (`depthwise_output_row` sets the whole row).
        let out = unsafe { crate::base::buffers::assume_init(out) };
        // Chunks of `chunk_rows` rows inside each image (the last one short).
        if parallel {
            out.par_chunks_mut(oh * out_row)
                .enumerate()
                .flat_map(|(image, o)| {
                    o.par_chunks_mut(chunk_rows * out_row)
                        .enumerate()
                        .map(move |(c, chunk)| (image, c, chunk))
                })
                .for_each(|(image, c, chunk)| run(image, c, chunk));
        } else {
            for (image, o) in out.chunks_mut(oh * out_row).enumerate() {
                for (c, chunk) in o.chunks_mut(chunk_rows * out_row).enumerate() {
                    run(image, c, chunk);
                }
            }
        }
    }))
}

thread_local! {
    /// A task's expanded rows, kept from call to call (grown, never shrunk): a fresh buffer
    /// per chunk cost an allocation and a zero fill each (`memset` and the kernel's page
    /// clearing were 10% of MobileNet v3 small's run at batch 1 under `perf`).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// How output rows map onto expanded rows, and how many output rows a band holds.
struct Band {
    win: Window2d,
    /// Output rows per band.
    rows: usize,
    /// Rows the kernel spans (dilated).
    span: usize,
}

impl Band {
    fn new(win: &Window2d, scratch_bytes: usize) -> Self {
        let [_, _, w, expanded] = win.dims;
        let span = (win.kernel[0] - 1) * win.dilation[0] + 1;
        let row_bytes = (w * expanded * 4).max(1);
        let stride = win.stride[0];
        // (rows − 1)·stride + span expanded rows fit the budget; one output row at least.
        let fit = (scratch_bytes / row_bytes).saturating_sub(span) / stride + 1;
        Band {
            win: *win,
            rows: fit.max(1),
            span,
        }
    }

    /// The expanded rows output rows `first..end` read, clipped to the image.
    fn input_rows(&self, first: usize, end: usize) -> (usize, usize) {
        let h = self.win.dims[1];
        let (stride, top) = (self.win.stride[0], self.win.pads[0].0);
        let lo = (first * stride).saturating_sub(top).min(h);
        let hi = ((end - 1) * stride + self.span).saturating_sub(top).min(h);
        (lo, hi.max(lo))
    }

    /// Output rows `first..` of `image` (as many as `out` holds), band by band.
    fn run_chunk(
        &self,
        kernel: F32Kernel,
        x: &[f32],
        layers: &ExpandDepthwise,
        image: usize,
        first: usize,
        out: &mut [f32],
    ) {
        let [_, h, w, expanded] = self.win.dims;
        let row_len = w * expanded;
        // The most expanded rows a band reads.
        let most = ((self.rows - 1) * self.win.stride[0] + self.span).min(h) * row_len;
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut kept) => {
                if kept.len() < most {
                    kept.resize(most, 0.0);
                }
                self.run_bands(kernel, x, layers, (image, first), out, &mut kept[..most]);
            }
            // Not reentered in practice (the bands call nothing that waits on the pool).
            Err(_) => {
                let mut own = vec![0.0; most];
                self.run_bands(kernel, x, layers, (image, first), out, &mut own);
            }
        });
    }

    /// [`Band::run_chunk`] with `scratch` for the expanded rows.
    fn run_bands(
        &self,
        kernel: F32Kernel,
        x: &[f32],
        layers: &ExpandDepthwise,
        (image, first): (usize, usize),
        out: &mut [f32],
        scratch: &mut [f32],
    ) {
        let [_, h, w, expanded] = self.win.dims;
        let cin = layers.pointwise.dims()[1];
        let out_row = self.win.out_dims()[2] * expanded;
        let row_len = w * expanded;
        let end = first + out.len() / out_row;
        // Expanded rows `have.0..have.1` of the image are in `scratch`, from its start.
        let mut have = (0, 0);
        let mut at = first;
        for rows in out.chunks_mut(self.rows * out_row) {
            let band_end = at + rows.len() / out_row;
            let (lo, hi) = self.input_rows(at, band_end);
            // Keep the rows this band shares with the last one, at the start.
            let kept = if have.0 <= lo && lo < have.1 {
                let keep = have.1.min(hi) - lo;
                scratch.copy_within((lo - have.0) * row_len..(lo - have.0 + keep) * row_len, 0);
                keep
            } else {
                0
            };
            let new = (lo + kept)..hi;
            if !new.is_empty() {
                let pixels = new.len() * w;
                let src = &x[(image * h + new.start) * w * cin..][..pixels * cin];
                let dst = &mut scratch[kept * row_len..][..pixels * expanded];
                linear_rows_serial_into(pixels, src, layers.pointwise, layers.pointwise_act, dst)
                    .expect("the caller checked the pointwise kernel");
            }
            have = (lo, hi);
            // The band's window over the scratch rows: its first output row reads from
            // `band_top` rows above `lo` (the image's top padding, if any, for the first).
            let stride = self.win.stride[0];
            let band_top = self.win.pads[0].0 + lo - at * stride;
            let sub = Window2d {
                dims: [1, hi - lo, w, expanded],
                pads: [(band_top, self.win.pads[0].1 + self.span), self.win.pads[1]],
                ..self.win
            };
            for (j, o_row) in rows.chunks_mut(out_row).enumerate() {
                depthwise_output_row(
                    kernel,
                    &scratch[..(hi - lo) * row_len],
                    &sub,
                    layers.depthwise,
                    layers.depthwise_act,
                    j,
                    o_row,
                );
            }
            at = band_end;
        }
        debug_assert_eq!(at, end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::depthwise::depthwise_conv2d_on;
    use crate::implicit::linear_rows_new;

    /// The fused pass against the two layers run apart (`linear_rows_new`, then
    /// `depthwise_conv2d_on`): the same values to the bit, on every SIMD kernel this CPU runs,
    /// over band sizes from one output row to the whole image and over the pool's splits.
    #[test]
    fn matches_the_two_layers_apart() {
        let cases = [
            // (batch, h, w, cin, expanded, kernel, stride, pad, pointwise act, depthwise act)
            (
                1,
                9,
                7,
                3,
                5,
                3,
                1,
                1,
                Some(Activation::Clip(0.0, 6.0)),
                None,
            ),
            (
                2,
                12,
                11,
                8,
                24,
                3,
                2,
                1,
                Some(Activation::Relu),
                Some(Activation::Relu),
            ),
            (
                3,
                10,
                10,
                16,
                40,
                5,
                2,
                2,
                Some(Activation::Silu),
                Some(Activation::Silu),
            ),
            (
                1,
                14,
                13,
                24,
                144,
                3,
                1,
                1,
                Some(Activation::HardSwish),
                None,
            ),
            (
                2,
                8,
                9,
                17,
                33,
                5,
                1,
                2,
                None,
                Some(Activation::Clip(0.0, 6.0)),
            ),
            (1, 6, 6, 4, 16, 3, 1, 0, Some(Activation::Relu), None),
            // Dilated (DeepLab's MobileNet backbones): the kernel spans 5 and 7 rows.
            (2, 13, 12, 8, 32, 3, 1, 2, Some(Activation::Relu), None),
            (1, 15, 11, 6, 24, 3, 2, 3, None, Some(Activation::Relu)),
        ];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a pool");
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("a pool");
        let mut split_runs = 0;
        for (n, h, w, cin, cexp, k, stride, pad, pact, dact) in cases {
            // Padding past the kernel's half is a dilated kernel's "same" padding.
            let dilation = (pad / (k / 2)).max(1);
            let x: Vec<f32> = (0..n * h * w * cin)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.02)
                .collect();
            let wp: Vec<f32> = (0..cexp * cin)
                .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.03)
                .collect();
            let bp: Vec<f32> = (0..cexp).map(|i| (i % 5) as f32 * 0.1 - 0.2).collect();
            let wd: Vec<f32> = (0..cexp * k * k)
                .map(|i| ((i * 7 % 23) as f32 - 11.0) * 0.05)
                .collect();
            let bd: Vec<f32> = (0..cexp).map(|i| (i % 3) as f32 * 0.1).collect();
            for kernel in F32Kernel::all_supported() {
                if kernel.panel_width().is_none() {
                    continue;
                }
                let pointwise = ConvWeights::pack_for(kernel, [cexp, cin, 1, 1], &wp, Some(&bp));
                let depthwise = DepthwiseWeights::pack(cexp, [k, k], &wd, Some(&bd));
                let win = Window2d {
                    dims: [n, h, w, cexp],
                    kernel: [k, k],
                    stride: [stride, stride],
                    dilation: [dilation, dilation],
                    pads: [(pad, pad); 2],
                    ceil_mode: false,
                };
                // A 1×1 convolution is a linear layer over the pixels.
                let expanded = linear_rows_new(n * h * w, &x, &pointwise, pact);
                let want = depthwise_conv2d_on(kernel, &expanded, &win, &depthwise, dact);
                let layers = ExpandDepthwise {
                    pointwise: &pointwise,
                    pointwise_act: pact,
                    depthwise: &depthwise,
                    depthwise_act: dact,
                };
                let row_bytes = w * cexp * 4;
                for rows in [1, 2, 3, 5, h + 4] {
                    let budget = rows * row_bytes;
                    let serial = one.install(|| expand_depthwise_banded(&x, &win, &layers, budget));
                    let split = pool.install(|| expand_depthwise_banded(&x, &win, &layers, budget));
                    for (got, how) in [(serial, "serial"), (split, "split")] {
                        // Split: declined where the threads would not all get a long chunk.
                        let Some(got) = got else {
                            assert_eq!(how, "split", "a SIMD kernel on x86-64");
                            continue;
                        };
                        split_runs += usize::from(how == "split");
                        assert_eq!(got.len(), want.len(), "{how} length, case {n}x{h}x{w}");
                        let worst = got
                            .iter()
                            .zip(&want)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0f32, f32::max);
                        assert!(
                            worst == 0.0,
                            "{how} {kernel:?}, {rows}-row budget, case {n}x{h}x{w}x{cin}→{cexp} \
                         k{k}/{stride}: max diff {worst}"
                        );
                    }
                }
            }
        }
        assert!(split_runs >= 10, "the split path ran {split_runs} times");
    }
}
