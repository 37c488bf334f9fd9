//! f32 convolution for inference as an implicit GEMM over a channels-last image: no patch
//! matrix is built. Each output pixel is a GEMM row whose K values are read in place from the
//! NHWC image (`bases[row] + run offset + j`), and the weight is packed once into column
//! panels the register tile streams through. Bias is the accumulators' initial value and
//! ReLU is applied in registers before the one store of the output.
//!
//! Why a kernel of Kiln's own here: the channels-last path through the `gemm` crate
//! ([`crate::conv::conv2d_nhwc_forward`]) gathered a patch matrix per call (kh·kw copies of
//! every input value) and let `gemm` pack both operands again on every call, although the
//! weight never changes between inference calls. Profiles of W3 at batch 1 (BENCHMARKS.md
//! run 24) put the time in that convolution.
//!
//! One file per instruction set, as the int8 kernels: [`avx512`] (12 rows × 32 columns of
//! accumulators) and [`avx2`] (6 × 16). Elsewhere, or with `KILN_F32_KERNEL=portable`, the
//! weight keeps the `gemm` path's layout and that path runs.
//!
//! 3×3 layers with stride 1, enough input channels and enough output pixels leave the
//! implicit GEMM inside [`conv_simd`] for [`crate::winograd`] (F(2×2, 3×3): 16 multiply-adds
//! per 2×2 tile and input channel instead of 36), with the same epilogues.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;
mod tiles;
mod weights;

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::OnceLock;

use rayon::prelude::*;

use tiles::*;
pub use weights::ConvWeights;
use weights::{avx2_dims, avx512_dims};

use crate::activation::{Activation, activate};
use crate::base::aligned::AlignedF32;
use crate::base::isa::F32Kernel;
use crate::base::layout::interleave3;
use crate::base::shape::ConvShape;
use crate::base::threads::{SPLIT_MACS, SharedOut};
use crate::base::window::Window2d;
use crate::patches::{conv2d_nhwc_forward, pack_weight_for_nhwc};
use crate::pool::{PoolShape, max_pool2d_nhwc};
use crate::winograd::{self, WinogradWeights};

/// Weight values above which a call splits over the threads whatever its rows (1 MiB:
/// beyond L2, so the reading is what costs).
const SPLIT_WEIGHTS: usize = 1 << 18;

/// Forward convolution for inference in channels-last layout: `out` `[batch, oh, ow, cout]`
/// from `x` `[batch, h, w, cin]`, with the bias and (with `relu`) ReLU applied before the
/// output is stored.
pub fn conv2d_nhwc(s: &ConvShape, x: &[f32], w: &ConvWeights, relu: bool, out: &mut [f32]) {
    check_operands(s, x, w);
    assert_eq!(out.len(), s.output_len(), "conv2d output length");
    let [cout, cin, kh, kw] = w.dims;
    if cin * kh * kw == 0 {
        // No inputs: every output is its bias.
        for px in out.chunks_exact_mut(cout.max(1)) {
            for (o, v) in px.iter_mut().enumerate() {
                let b = if w.has_bias { w.bias[o] } else { 0.0 };
                *v = if relu { b.max(0.0) } else { b };
            }
        }
        return;
    }
    match simd_width(w) {
        // SAFETY: `out` holds the output's `output_len` values and is borrowed uniquely.
        Some(width) => unsafe {
            conv_simd(
                s,
                Input::Nhwc(x),
                w,
                width,
                Epilogue::relu(relu),
                out.as_mut_ptr(),
            )
        },
        None => {
            let bias = w.has_bias.then_some(&w.bias[..]);
            conv2d_nhwc_forward(s, x, &w.data, bias, relu, out)
        }
    }
}

/// [`conv2d_nhwc`] into a new vector. With a SIMD kernel the vector is not zeroed first:
/// the kernel stores every output exactly once (a 9.4 MB zero fill per W3 batch of 64 was
/// pure cost).
pub fn conv2d_nhwc_new(s: &ConvShape, x: &[f32], w: &ConvWeights, relu: bool) -> Vec<f32> {
    match simd_width(w) {
        Some(width) => conv_simd_new(s, Input::Nhwc(x), w, width, Epilogue::relu(relu)),
        None => {
            let mut out = vec![0f32; s.output_len()];
            conv2d_nhwc(s, x, w, relu, &mut out);
            out
        }
    }
}

/// `act(conv(x) + bias + residual)`: the residual (in the output's layout `[batch, oh, ow,
/// cout]`) when given, then the activation when given, both in the convolution's store on
/// the SIMD kernels, so neither is a separate pass over memory (ResNet's blocks end with a
/// sum and a ReLU, MobileNet v2's layers with ReLU6, EfficientNet's with SiLU, MobileNet v3's
/// with HardSwish).
pub fn conv2d_nhwc_fused_new(
    s: &ConvShape,
    x: &[f32],
    w: &ConvWeights,
    residual: Option<&[f32]>,
    act: Option<Activation>,
) -> Vec<f32> {
    if let Some(r) = residual {
        assert_eq!(r.len(), s.output_len(), "conv2d residual length");
    }
    match simd_width(w) {
        Some(width) => conv_simd_new(
            s,
            Input::Nhwc(x),
            w,
            width,
            Epilogue {
                act,
                pool: false,
                residual: Residual::from_option(residual),
                serial: false,
                out_stride: None,
            },
        ),
        None => {
            let mut out = conv2d_nhwc_new(s, x, w, false);
            if let Some(r) = residual {
                out.iter_mut().zip(r).for_each(|(o, r)| *o += r);
            }
            if let Some(act) = act {
                activate(&mut out, act);
            }
            out
        }
    }
}

/// [`conv2d_nhwc_fused_new`] with the residual's own buffer as the output: each value is
/// read where the sum overwrites it, so the output costs no buffer and no memory traffic of
/// its own. Why: a ResNet block's last 1×1 layer writes as many values as it reads from its
/// residual (25.7 MB each for ResNet-50's 56² 64 → 256 layers at batch 8), and a fresh output
/// is first read from memory for ownership before each line is written; over the residual's
/// lines, just read, it is not (BENCHMARKS.md run 45). The executor passes the residual here
/// when the convolution is its last reader.
pub fn conv2d_nhwc_fused_onto(
    s: &ConvShape,
    x: &[f32],
    w: &ConvWeights,
    mut residual: Vec<f32>,
    act: Option<Activation>,
) -> Vec<f32> {
    assert_eq!(residual.len(), s.output_len(), "conv2d residual length");
    match simd_width(w) {
        Some(width) => {
            check_operands(s, x, w);
            let epilogue = Epilogue {
                act,
                pool: false,
                residual: Residual::InOutput,
                serial: false,
                out_stride: None,
            };
            // SAFETY: `residual` holds the output's `output_len` values and is owned here.
            unsafe { conv_simd(s, Input::Nhwc(x), w, width, epilogue, residual.as_mut_ptr()) };
            residual
        }
        None => {
            let out = conv2d_nhwc_new(s, x, w, false);
            residual.iter_mut().zip(out).for_each(|(r, o)| *r += o);
            if let Some(act) = act {
                activate(&mut residual, act);
            }
            residual
        }
    }
}

/// [`conv2d_nhwc_fused_new`] of an input in NCHW layout `[batch, cin, h, w]` (a graph's
/// input image), output channels-last as before. The SIMD kernels read it while they copy
/// the input into its padded buffer, which they make anyway: one pass instead of a
/// transpose to NHWC and then that copy (MobileNet v3 small's stem at batch 8: the transpose
/// alone took 0.36 of the layer's 1.33 ms, BENCHMARKS.md run 42). Meant for few channels
/// (an RGB image: each padded row gathers from `cin` planes at once).
pub fn conv2d_nhwc_fused_from_nchw_new(
    s: &ConvShape,
    x: &[f32],
    w: &ConvWeights,
    act: Option<Activation>,
) -> Vec<f32> {
    // One channel: both layouts hold the same sequence.
    let x = if s.cin == 1 {
        Input::Nhwc(x)
    } else {
        Input::Nchw(x)
    };
    match simd_width(w) {
        Some(width) => conv_simd_new(
            s,
            x,
            w,
            width,
            Epilogue {
                act,
                pool: false,
                residual: Residual::None,
                serial: false,
                out_stride: None,
            },
        ),
        None => {
            let nhwc = crate::base::layout::nchw_to_nhwc(x.values(), [s.batch, s.cin, s.h, s.w]);
            conv2d_nhwc_fused_new(s, &nhwc, w, None, act)
        }
    }
}

/// [`conv2d_nhwc_fused_new`] (no residual) into channels `first..first + cout` of `out`,
/// `[batch, oh, ow, channels]`: a channel concatenation of convolutions written in place
/// (SqueezeNet's fire modules), no copy after. The other channels are left as they are.
/// `false` (nothing written) where `w` has no SIMD kernel: the caller concatenates.
///
/// # Panics
/// When `out` is not `batch · oh · ow · channels` long or the channels do not fit.
pub fn conv2d_nhwc_into_channels(
    s: &ConvShape,
    x: &[f32],
    w: &ConvWeights,
    act: Option<Activation>,
    (out, channels, first): (&mut [MaybeUninit<f32>], usize, usize),
) -> bool {
    let Some(width) = simd_width(w) else {
        return false;
    };
    check_operands(s, x, w);
    assert!(
        first + s.cout <= channels,
        "channels {first}.. of {channels}"
    );
    assert_eq!(
        out.len(),
        s.batch * s.out_h() * s.out_w() * channels,
        "concatenated output length"
    );
    let epilogue = Epilogue {
        act,
        pool: false,
        residual: Residual::None,
        serial: false,
        out_stride: Some(channels),
    };
    // SAFETY: `out` holds every pixel's `channels` values; the kernels store only columns
    // `first..first + cout` of each (masked to the panels' valid columns).
    let out = out.as_mut_ptr().cast::<f32>().wrapping_add(first);
    unsafe { conv_simd(s, Input::Nhwc(x), w, width, epilogue, out) };
    true
}

/// A convolution's input values and their layout.
#[derive(Clone, Copy)]
enum Input<'a> {
    /// `[batch, h, w, cin]`.
    Nhwc(&'a [f32]),
    /// `[batch, cin, h, w]`.
    Nchw(&'a [f32]),
}

impl<'a> Input<'a> {
    fn values(self) -> &'a [f32] {
        match self {
            Input::Nhwc(x) | Input::Nchw(x) => x,
        }
    }
}

/// The residual a convolution adds in its store, in the output's layout.
#[derive(Clone, Copy)]
enum Residual<'a> {
    /// None.
    None,
    /// A tensor apart from the output.
    Apart(&'a [f32]),
    /// The output buffer's own values, read where they are overwritten
    /// ([`conv2d_nhwc_fused_onto`]).
    InOutput,
}

impl<'a> Residual<'a> {
    fn from_option(r: Option<&'a [f32]>) -> Self {
        r.map_or(Residual::None, Residual::Apart)
    }
}

/// What the SIMD kernels do between the accumulators and the store.
#[derive(Clone, Copy)]
struct Epilogue<'a> {
    /// Applied after the residual, before the store.
    act: Option<Activation>,
    /// 2×2 max pool after the ReLU ([`conv2d_nhwc_relu_pool2_new`]).
    pool: bool,
    residual: Residual<'a>,
    /// On the calling thread whatever the size: the caller is a task of a split of its own.
    serial: bool,
    /// Values from one output pixel to the next (`None`: `cout`, the output alone); wider
    /// when the output is a slice of each pixel's channels ([`conv2d_nhwc_into_channels`]).
    out_stride: Option<usize>,
}

impl Epilogue<'_> {
    fn relu(relu: bool) -> Self {
        Epilogue {
            act: relu.then_some(Activation::Relu),
            pool: false,
            residual: Residual::None,
            serial: false,
            out_stride: None,
        }
    }
}

/// Convolution, ReLU and a 2×2 max pool with stride 2: `[batch, oh/2, ow/2, cout]` (an odd
/// last row or column dropped, as the pool does). With a SIMD kernel in one pass: the GEMM's
/// rows are ordered window by window (4 rows per pooled pixel), so each register tile holds
/// whole windows and only their maximum is stored — the convolution's full output never
/// reaches memory. The portable kernel convolves, then pools.
///
/// Why ReLU comes with it: ReLU turns a NaN into 0 in these kernels, as in the unfused
/// ReLU, before the maximum; a fused pool without it would have to reproduce the separate
/// pool's "NaN wins" rule.
pub fn conv2d_nhwc_relu_pool2_new(s: &ConvShape, x: &[f32], w: &ConvWeights) -> Vec<f32> {
    match simd_width(w) {
        Some(width) => conv_simd_new(
            s,
            Input::Nhwc(x),
            w,
            width,
            Epilogue {
                act: Some(Activation::Relu),
                pool: true,
                residual: Residual::None,
                serial: false,
                out_stride: None,
            },
        ),
        None => {
            let y = conv2d_nhwc_new(s, x, w, true);
            let pooled = PoolShape::nchw([s.batch, 1, s.out_h(), s.out_w()], [2, 2], [2, 2]);
            max_pool2d_nhwc(&pooled, s.cout, &y)
        }
    }
}

/// The panel width of `w`'s SIMD kernel, `None` where the portable path runs (no panels, or
/// a kernel without inputs).
fn simd_width(w: &ConvWeights) -> Option<usize> {
    let [_, cin, kh, kw] = w.dims;
    w.kernel.panel_width().filter(|_| cin * kh * kw > 0)
}

/// The shape agrees with the packed weights and the input.
fn check_operands(s: &ConvShape, x: &[f32], w: &ConvWeights) {
    let [cout, _, kh, kw] = w.dims;
    assert_eq!(
        (s.cout, s.cin, s.kh, s.kw),
        (cout, w.pixel, kh, kw),
        "conv2d weights packed for another shape"
    );
    assert_eq!(x.len(), s.input_len(), "conv2d input length");
}

/// Output pixels the call stores per image: all of them, or with `pool` one per 2×2 window.
fn stored_pixels(s: &ConvShape, pool: bool) -> usize {
    let (oh, ow) = (s.out_h(), s.out_w());
    if pool { (oh / 2) * (ow / 2) } else { oh * ow }
}

/// [`conv_simd`] into a new vector, not zeroed first.
fn conv_simd_new(
    s: &ConvShape,
    x: Input,
    w: &ConvWeights,
    width: usize,
    epilogue: Epilogue,
) -> Vec<f32> {
    check_operands(s, x.values(), w);
    let len = s.batch * stored_pixels(s, epilogue.pool) * s.cout;
    let mut out = Vec::with_capacity(len);
    // SAFETY: the capacity holds `len` values; the SIMD path stores each of them once (every
    // row by `walk_tiles`, which in pooled mode never splits a window since rows and tiles are
    // multiples of 4; every column by the panels' masked stores) before the length is set.
    unsafe {
        conv_simd(s, x, w, width, epilogue, out.as_mut_ptr());
        out.set_len(len);
    }
    out
}

/// The SIMD kernels' convolution (K > 0, weights in panels of `width`).
///
/// # Safety
/// `out` is valid for writes of `batch · stored_pixels · cout` values and nothing else
/// accesses them during the call.
unsafe fn conv_simd(
    s: &ConvShape,
    x: Input,
    w: &ConvWeights,
    width: usize,
    epilogue: Epilogue,
    out: *mut f32,
) {
    let Epilogue {
        act,
        pool,
        residual,
        serial,
        out_stride,
    } = epilogue;
    // A residual is read with the output's stride from where the output's row starts.
    let has_residual = !matches!(residual, Residual::None);
    assert!(
        !has_residual || out_stride.is_none(),
        "a convolution into a channel slice takes no residual"
    );
    assert!(
        !has_residual || !pool,
        "a pooled convolution takes no residual"
    );
    if let Residual::Apart(r) = residual {
        assert_eq!(r.len(), s.output_len(), "conv2d residual length");
    }
    if let Input::Nhwc(image) = x
        && w.panel_offsets.is_empty()
        && winograd::applies(s, w.kernel, pool)
        && let Some(transformed) = w.winograd()
    {
        let store = winograd::Store {
            bias: &w.bias,
            act,
            pool,
            residual: match residual {
                Residual::Apart(r) => Some(r),
                _ => None,
            },
            residual_in_output: matches!(residual, Residual::InOutput),
            serial,
            out_stride: out_stride.unwrap_or(s.cout),
        };
        // SAFETY: the caller's contract for `out`, which the Winograd path writes (and with
        // the residual in the output, reads) at the same pixels as this one.
        unsafe { winograd::conv(s, image, transformed, store, out) };
        return;
    }
    let [cout, cin, kh, kw] = w.dims;
    let k = cin * kh * kw;
    // GEMM rows: one per output pixel, or 4 per pooled pixel.
    let rows = s.batch * stored_pixels(s, pool) * row_group(pool);
    if rows == 0 || cout == 0 {
        return;
    }
    let threads = crate::base::threads::pool_threads();
    // A large weight splits even over few rows: reading it is the cost (a linear layer at
    // batch 1), and two cores read it faster than one.
    let parallel =
        !serial && threads > 1 && (rows * k * cout >= SPLIT_MACS || k * cout >= SPLIT_WEIGHTS);
    let geometry = Geometry::new(s, cin);
    let padded;
    let slack = w.slack();
    let image = match x {
        Input::Nhwc(x) if s.padding == [(0, 0), (0, 0)] && slack == 0 => x,
        x => {
            padded = geometry.pad(s, x, parallel, slack);
            &padded[..]
        }
    };
    let bases = geometry.bases(s.batch, pool);
    let (clamp, after) = Activation::split(act);
    let operands = Operands {
        image,
        bases: &bases,
        geometry: &geometry,
        weights: w,
        width,
        clamp,
        after,
        pool,
        residual,
        out_stride: out_stride.unwrap_or(cout),
    };
    // Work items: (block of rows, panel), row-block-major, so one task's consecutive items
    // reuse the block's input from cache across panels. Few rows (deep layers at batch 1)
    // make one block, and the panels are what splits over the threads.
    let block_rows = if rows < 2 * ROW_BLOCK {
        rows
    } else {
        ROW_BLOCK
    };
    let blocks = rows.div_ceil(block_rows);
    let panels = cout.div_ceil(width);
    let items = blocks * panels;
    // Item order: the operand that does not fit in L2 should be streamed once. A weight
    // larger than the image (deep layers: 256→256 3×3 is 2.4 MB against a 0.26 MB image at
    // 14²) goes panel-major, so a task's items share a panel and the image stays cached;
    // otherwise row-block-major, so a block's input is reused across the panels. Measured on
    // ResNet-18's 14² layers at two threads (BENCHMARKS run 31): row-block-major re-read the
    // whole weight from L3 per block: 1.22 → 1.07 ms on 256→256 at 14², all of
    // ResNet-18's convolutions 17.4 → 17.3 ms (3 A/B pairs, noisy).
    let panel_major = k * panels * width > image.len();
    let out_ptr = SharedOut(out);
    let run = |item: usize| {
        let (block, panel) = if panel_major {
            (item % blocks, item / blocks)
        } else {
            (item / panels, item % panels)
        };
        let first = block * block_rows;
        let rows = first..(first + block_rows).min(rows);
        // SAFETY: items are disjoint (row range, panel columns) rectangles of `out`, each run
        // by exactly one task, and `out` outlives the call.
        unsafe { operands.rectangle(rows, panel, out_ptr.get()) };
    };
    if !parallel || items == 1 {
        (0..items).for_each(run);
        return;
    }
    crate::base::threads::note_split();
    // Task t runs items [t·items/tasks, (t+1)·items/tasks): sizes differ by one item at most
    // (the former ceil-sized tasks left the last few short, e.g. 27 tasks of 5 and fewer for
    // 132 items, so one thread ran up to 6% more than the other).
    let tasks = (threads * TASKS_PER_THREAD).min(items);
    (0..tasks)
        .into_par_iter()
        .for_each(|t| (t * items / tasks..(t + 1) * items / tasks).for_each(run));
}

/// A linear layer on the host: `out` `[rows, outputs]` = `x` `[rows, inputs]` · W + b (and
/// ReLU with `relu`), `w` from [`ConvWeights::linear`].
pub fn linear_rows(rows: usize, x: &[f32], w: &ConvWeights, relu: bool, out: &mut [f32]) {
    conv2d_nhwc(&linear_shape(rows, w), x, w, relu, out);
}

/// [`linear_rows`] into a new vector (not zeroed first), with any activation in the store
/// (a transformer's or ConvNeXt's GELU, fused at load).
pub fn linear_rows_new(
    rows: usize,
    x: &[f32],
    w: &ConvWeights,
    act: Option<Activation>,
) -> Vec<f32> {
    linear_rows_residual_new(rows, x, w, None, act)
}

/// [`linear_rows_residual_new`] with the residual's own buffer as the output (see
/// [`conv2d_nhwc_fused_onto`]): for a transformer's `Add(x, Linear(·))` whose `x` is read
/// there last.
pub fn linear_rows_residual_onto(
    rows: usize,
    x: &[f32],
    w: &ConvWeights,
    residual: Vec<f32>,
    act: Option<Activation>,
) -> Vec<f32> {
    conv2d_nhwc_fused_onto(&linear_shape(rows, w), x, w, residual, act)
}

/// [`linear_rows_new`] plus `residual` (`rows × outputs`, row-major) added in the store,
/// before `act`: a transformer's `Add(x, Linear(·))` without a pass over the output after.
pub fn linear_rows_residual_new(
    rows: usize,
    x: &[f32],
    w: &ConvWeights,
    residual: Option<&[f32]>,
    act: Option<Activation>,
) -> Vec<f32> {
    conv2d_nhwc_fused_new(&linear_shape(rows, w), x, w, residual, act)
}

/// [`linear_rows_new`] into `out` (`rows × outputs`) on the calling thread, for a caller
/// that is itself one task of a split (a band of [`crate::expand_depthwise`]). `None` when
/// `w` has no SIMD kernel (the caller takes another path).
pub(crate) fn linear_rows_serial_into(
    rows: usize,
    x: &[f32],
    w: &ConvWeights,
    act: Option<Activation>,
    out: &mut [f32],
) -> Option<()> {
    let width = simd_width(w)?;
    let s = linear_shape(rows, w);
    check_operands(&s, x, w);
    assert_eq!(out.len(), s.output_len(), "linear output length");
    let epilogue = Epilogue {
        act,
        pool: false,
        residual: Residual::None,
        serial: true,
        out_stride: None,
    };
    // SAFETY: `out` holds the output's values and is borrowed uniquely.
    unsafe { conv_simd(&s, Input::Nhwc(x), w, width, epilogue, out.as_mut_ptr()) };
    Some(())
}

/// A linear layer as a 1×1 convolution over `rows` 1×1 images.
fn linear_shape(rows: usize, w: &ConvWeights) -> ConvShape {
    let [outputs, inputs, ..] = w.dims;
    ConvShape {
        batch: rows,
        cin: inputs,
        h: 1,
        w: 1,
        cout: outputs,
        kh: 1,
        kw: 1,
        stride: [1, 1],
        padding: [(0, 0); 2],
        dilation: [1, 1],
    }
}
