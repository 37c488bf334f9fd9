//! f32 convolution for inference as an implicit GEMM over a channels-last image: no patch
//! matrix is built. Each output pixel is a GEMM row whose K values are read in place from the
//! NHWC image (`bases[row] + run offset + j`), and the weight is packed once into column
//! panels the register tile streams through. Bias is the accumulators' initial value and
//! ReLU is applied in registers before the one store of the output.
//!
//! Why a kernel of Kiln's own here: the channels-last path through the `gemm` crate
//! ([`super::conv::conv2d_nhwc_forward`]) gathered a patch matrix per call (kh·kw copies of
//! every input value) and let `gemm` pack both operands again on every call, although the
//! weight never changes between inference calls. Profiles of W3 at batch 1 (BENCHMARKS.md
//! run 24) put the time in that convolution.
//!
//! One file per instruction set, as the int8 kernels: [`avx512`] (12 rows × 32 columns of
//! accumulators) and [`avx2`] (6 × 16). Elsewhere, or with `KILN_F32_KERNEL=portable`, the
//! weight keeps the `gemm` path's layout and that path runs.
//!
//! 3×3 layers with stride 1, enough input channels and enough output pixels leave the
//! implicit GEMM inside [`conv_simd`] for [`super::winograd`] (F(2×2, 3×3): 16 multiply-adds
//! per 2×2 tile and input channel instead of 36), with the same epilogues.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::OnceLock;

use rayon::prelude::*;

use super::activation::{Activation, activate};
use super::aligned::AlignedF32;
use super::conv::{ConvShape, conv2d_nhwc_forward, pack_weight_for_nhwc};
use super::nhwc::{Window2d, interleave3};
use super::pool::{PoolShape, max_pool2d_nhwc};
use super::winograd::{self, WinogradWeights};

/// Which f32 convolution kernel this CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F32Kernel {
    /// AVX-512F: 12 × 32 register tile.
    Avx512,
    /// AVX2 + FMA: 6 × 16 register tile.
    Avx2,
    /// The `gemm` crate over a gathered patch matrix.
    Portable,
}

impl F32Kernel {
    /// The kernel f32 convolutions use (decided once): the best this CPU supports, or the one
    /// named by `KILN_F32_KERNEL` (`avx512`, `avx2`, `portable`) when the CPU supports it, so
    /// the AVX2 path can be measured on an AVX-512 machine.
    pub fn detect() -> F32Kernel {
        static KERNEL: OnceLock<F32Kernel> = OnceLock::new();
        *KERNEL.get_or_init(|| {
            super::kernel_from_env(
                "KILN_F32_KERNEL",
                &[F32Kernel::Avx512, F32Kernel::Avx2, F32Kernel::Portable],
                F32Kernel::best_supported(),
                F32Kernel::name,
            )
        })
    }

    fn best_supported() -> F32Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            // The AVX-512 kernels use AVX2 and FMA too (every AVX-512 CPU has them).
            if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                return F32Kernel::Avx512;
            }
            if avx2 {
                return F32Kernel::Avx2;
            }
        }
        F32Kernel::Portable
    }

    /// Every kernel this CPU can run, best first (benchmarks and tests compare them).
    pub fn all_supported() -> Vec<F32Kernel> {
        [F32Kernel::Avx512, F32Kernel::Avx2, F32Kernel::Portable]
            .into_iter()
            .filter(|k| k.supported())
            .collect()
    }

    /// Whether this CPU can run the kernel (the variants go from the most demanding down).
    pub fn supported(self) -> bool {
        self as u8 >= F32Kernel::best_supported() as u8
    }

    /// Name for reports and `KILN_F32_KERNEL`.
    pub fn name(self) -> &'static str {
        match self {
            F32Kernel::Avx512 => "avx512",
            F32Kernel::Avx2 => "avx2",
            F32Kernel::Portable => "portable",
        }
    }

    /// Columns per weight panel (the register tile's width); `None` = the `gemm` layout.
    pub(crate) fn panel_width(self) -> Option<usize> {
        match self {
            F32Kernel::Avx512 => Some(avx512_dims::COLS),
            F32Kernel::Avx2 => Some(avx2_dims::COLS),
            F32Kernel::Portable => None,
        }
    }
}

/// Register tile sizes, visible on every architecture so the packing compiles everywhere.
mod avx512_dims {
    pub const ROWS: usize = 12;
    pub const COLS: usize = 32;
}
mod avx2_dims {
    pub const ROWS: usize = 6;
    pub const COLS: usize = 16;
}

/// A convolution's weight and bias packed once for [`conv2d_nhwc`].
#[derive(Debug, Clone)]
pub struct ConvWeights {
    kernel: F32Kernel,
    /// `[cout, cin, kh, kw]`.
    dims: [usize; 4],
    /// Panels of `width` output channels, each `[kh·kw·cin][width]` (zero columns past
    /// `cout`); for [`F32Kernel::Portable`], `[kh·kw·cin, cout]`.
    data: AlignedF32,
    /// The bias padded to whole panels (zeros without a bias); the portable path's bias
    /// unpadded, or empty.
    bias: Vec<f32>,
    has_bias: bool,
    /// Input channels per pixel of the image: `dims[1]`, except for a grouped convolution,
    /// whose panels each read a slice of `dims[1]` channels of a wider pixel.
    pixel: usize,
    /// Per panel, the first input channel of its slice (empty: 0 for every panel).
    panel_offsets: Vec<usize>,
    /// A 3×3 layer's weight transformed for Winograd F(2×2, 3×3), made on the first call
    /// that runs that way (a layer only ever called on shapes that stay on the implicit
    /// GEMM never pays its time or its 16/9 of the weight's memory).
    winograd: OnceLock<Option<WinogradWeights>>,
}

impl ConvWeights {
    /// Packs `weight` `[cout, cin, kh, kw]` (and `bias` `[cout]`) for the detected kernel.
    pub fn pack(dims: [usize; 4], weight: &[f32], bias: Option<&[f32]>) -> Self {
        Self::pack_for(F32Kernel::detect(), dims, weight, bias)
    }

    /// Packs for a given kernel (tests compare the kernels on one machine).
    pub fn pack_for(
        kernel: F32Kernel,
        dims: [usize; 4],
        weight: &[f32],
        bias: Option<&[f32]>,
    ) -> Self {
        Self::from_rows(kernel, dims, pack_weight_for_nhwc(dims, weight), bias)
    }

    /// Packs a grouped convolution's `weight` `[cout, cin / groups, kh, kw]` for the detected
    /// kernel, or `None` where the panels cannot hold it (the portable kernel, or groups of
    /// output channels that neither divide nor are divided by a panel).
    ///
    /// Each panel of output channels reads one contiguous slice of input channels: with
    /// groups narrower than a panel (RegNet's 8, ResNeXt's 4), the slice of all the groups
    /// it covers, the weights block-diagonal and zero elsewhere — full vector lanes at the
    /// price of multiply-adds by those zeros, as a narrow group would leave lanes empty
    /// anyway; with groups wider than a panel, its group's channels.
    pub fn pack_grouped(
        dims: [usize; 4],
        groups: usize,
        weight: &[f32],
        bias: Option<&[f32]>,
    ) -> Option<Self> {
        Self::pack_grouped_for(F32Kernel::detect(), dims, groups, weight, bias)
    }

    /// [`ConvWeights::pack_grouped`] for a given kernel.
    pub fn pack_grouped_for(
        kernel: F32Kernel,
        [cout, cg, kh, kw]: [usize; 4],
        groups: usize,
        weight: &[f32],
        bias: Option<&[f32]>,
    ) -> Option<Self> {
        let width = kernel.panel_width()?;
        if groups == 0 || !cout.is_multiple_of(groups) || cout == 0 || cg == 0 {
            return None;
        }
        assert_eq!(
            weight.len(),
            cout * cg * kh * kw,
            "grouped conv weight length"
        );
        let og = cout / groups;
        let panels = cout.div_ceil(width);
        // (input channels per panel, each panel's first input channel)
        let (slice, offsets): (usize, Vec<usize>) = if width.is_multiple_of(og) {
            let per = width / og * cg;
            (per, (0..panels).map(|p| p * per).collect())
        } else if og.is_multiple_of(width) {
            (cg, (0..panels).map(|p| p * width / og * cg).collect())
        } else {
            return None;
        };
        let taps = kh * kw;
        let mut plain = vec![0f32; taps * slice * cout];
        for o in 0..cout {
            let first = (o / og) * cg - offsets[o / width];
            for i in 0..cg {
                for t in 0..taps {
                    plain[(t * slice + first + i) * cout + o] = weight[(o * cg + i) * taps + t];
                }
            }
        }
        let mut packed = Self::from_rows(kernel, [cout, slice, kh, kw], plain, bias);
        packed.pixel = cg * groups;
        packed.panel_offsets = offsets;
        Some(packed)
    }

    /// Values a grouped convolution's last panel may read past the end of the image (its
    /// slice runs over the last pixel's channels); zeros there keep the reads in bounds.
    fn slack(&self) -> usize {
        let [_, slice, ..] = self.dims;
        self.panel_offsets
            .iter()
            .map(|&o| (o + slice).saturating_sub(self.pixel))
            .max()
            .unwrap_or(0)
    }

    /// A linear layer's weight `[inputs, outputs]` (Burn's layout: already one row per K
    /// value) for [`linear_rows`]: a 1×1 convolution over 1×1 images.
    pub fn linear(inputs: usize, outputs: usize, weight: &[f32], bias: Option<&[f32]>) -> Self {
        assert_eq!(weight.len(), inputs * outputs, "linear weight length");
        let dims = [outputs, inputs, 1, 1];
        Self::from_rows(F32Kernel::detect(), dims, weight.to_vec(), bias)
    }

    /// Packs `plain` `[kh·kw·cin, cout]` (rows in K order `(ky, kx, c)`).
    fn from_rows(
        kernel: F32Kernel,
        dims: [usize; 4],
        plain: Vec<f32>,
        bias: Option<&[f32]>,
    ) -> Self {
        let cout = dims[0];
        if let Some(b) = bias {
            assert_eq!(b.len(), cout, "conv2d bias length");
        }
        let Some(width) = kernel.panel_width() else {
            return ConvWeights {
                kernel,
                dims,
                data: AlignedF32::from_slice(&plain),
                bias: bias.map(<[f32]>::to_vec).unwrap_or_default(),
                has_bias: bias.is_some(),
                pixel: dims[1],
                panel_offsets: Vec::new(),
                winograd: OnceLock::new(),
            };
        };
        let k = dims[1] * dims[2] * dims[3];
        let panels = cout.div_ceil(width);
        let mut data = AlignedF32::zeroed(panels * k * width);
        for (p, panel) in data.chunks_exact_mut((k * width).max(1)).enumerate() {
            let cols = (cout - p * width).min(width);
            for (row, dst) in panel.chunks_exact_mut(width).enumerate() {
                dst[..cols].copy_from_slice(&plain[row * cout + p * width..][..cols]);
            }
        }
        let mut padded = vec![0f32; panels * width];
        if let Some(b) = bias {
            padded[..cout].copy_from_slice(b);
        }
        ConvWeights {
            kernel,
            dims,
            data,
            bias: padded,
            has_bias: bias.is_some(),
            pixel: dims[1],
            panel_offsets: Vec::new(),
            winograd: OnceLock::new(),
        }
    }

    /// `[cout, cin, kh, kw]` (for grouped weights, `cin` is the input channels one panel
    /// reads; [`ConvWeights::input_channels`] is the image's).
    pub fn dims(&self) -> [usize; 4] {
        self.dims
    }

    /// Input channels per pixel of the image these weights convolve.
    pub fn input_channels(&self) -> usize {
        self.pixel
    }

    /// The kernel these weights were packed for.
    pub fn kernel(&self) -> F32Kernel {
        self.kernel
    }

    /// The Winograd transform of a 3×3 layer's weight (made once, on first use), read back
    /// from the panels; `None` for other kernels, grouped layers and the portable kernel.
    fn winograd(&self) -> Option<&WinogradWeights> {
        self.winograd
            .get_or_init(|| {
                let [cout, cin, kh, kw] = self.dims;
                let width = self.kernel.panel_width()?;
                if (kh, kw) != (3, 3) || !self.panel_offsets.is_empty() {
                    return None;
                }
                let panel = 9 * cin * width;
                WinogradWeights::transform(self.kernel, cout, cin, |o, c, ky, kx| {
                    self.data[o / width * panel + ((ky * 3 + kx) * cin + c) * width + o % width]
                })
            })
            .as_ref()
    }
}

/// Multiply-adds of one convolution call below which it runs on the calling thread: handing
/// work to the pool and waiting for it costs more than a second thread saves. Low, because
/// a pool worker left idle between calls falls asleep and the next split pays its wake-up:
/// measured at two threads, batch 1, 2 Mi → 32 Ki (with the depthwise threshold, medians of
/// 5 alternated runs, BENCHMARKS run 34): MobileNet v3 small 3.00 → 2.47 ms, ShuffleNet v2
/// 4.31 → 3.75, EfficientNet-B0 9.23 → 8.77, ResNet-18 18.3 → 17.9; W3 unchanged.
pub(crate) const SPLIT_MACS: usize = 1 << 15;

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
            let nhwc = super::nhwc::nchw_to_nhwc(x.values(), [s.batch, s.cin, s.h, s.w]);
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
    let threads = rayon::current_num_threads().max(1);
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
    note_split();
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
/// that is itself one task of a split (a band of [`super::expand_depthwise`]). `None` when
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

thread_local! {
    // Calls on this thread that split over the pool: the executor reads it to learn whether
    // a forward has parallel work worth moving onto the pool.
    static SPLITS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Counts a call on this thread that splits over the pool (see [`split_calls`]).
pub(crate) fn note_split() {
    SPLITS.with(|n| n.set(n.get() + 1));
}

/// Convolution and linear calls made on this thread that split over the pool so far.
pub fn split_calls() -> usize {
    SPLITS.with(std::cell::Cell::get)
}

/// K steps ahead of the current one whose weight panel lines the SIMD kernels prefetch into
/// L1 (one or two lines per step). Why: a model's weights do not stay in cache between runs
/// (ResNet-50's 100 MB, BERT-base's 340 MB), so the first tile over each panel waited on
/// memory for every line; layer 4's 3×3 convolution of ResNet-50 at batch 1 (a 9.4 MB weight
/// over 49 rows) took 1.07 ms in the model against 0.63 ms with its weight warm in the
/// benchmark. Measured at two threads (medians of alternated runs, BENCHMARKS.md run 42):
/// ResNet-50 b1 29.6 → 27.0 ms, ResNet-18 b1 11.9 → 10.8, BERT-base b1 90.9 → 80.5;
/// 8 and 32 steps ahead within noise of 16.
const PREFETCH_STEPS: usize = 16;

/// Output rows per work item when a call has many (48 rows × K values of input stay in L2
/// while every panel passes over them).
const ROW_BLOCK: usize = 48;

/// Tasks per thread when a call splits: small ones, so an uneven share evens out (measured
/// on a strided ResNet-18 convolution at batch 1, two threads: 16 per thread 0.57 ms, 4 per
/// thread 0.61 ms; W3's conv2 the same either way).
const TASKS_PER_THREAD: usize = 16;

/// The output's base pointer, handed to the tasks that write disjoint parts of it (here
/// and in [`super::winograd`]).
#[derive(Clone, Copy)]
pub(super) struct SharedOut(pub(super) *mut f32);

impl SharedOut {
    /// The pointer (a method, so closures capture the `Sync` wrapper, not its field).
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: the tasks of a call write disjoint parts of its output (rectangles of rows ×
// panels here, blocks of tiles × panels in the Winograd path).
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

/// Where each output pixel's K values lie in the (padded) NHWC image.
struct Geometry {
    /// Offsets of the K runs from a pixel's base, in K order `(ky, kx, c)`.
    runs: Vec<usize>,
    /// Contiguous values per run: `kw·cin` when the kernel's columns are adjacent
    /// (dilation 1), else `cin`.
    run_len: usize,
    /// Padded height and width, output height and width, stride, channels.
    hp: usize,
    wp: usize,
    oh: usize,
    ow: usize,
    stride: [usize; 2],
    cin: usize,
    /// Output rows grouped by the runs they read (see [`kernel_rows`]): each
    /// group's first output row and its runs, in order from row 0. One group when no
    /// kernel row ever falls on the top or bottom padding; 3 for a 3×3 `same` convolution.
    row_groups: Vec<(usize, Range<usize>)>,
}

impl Geometry {
    /// The windows of `s` reading `channels` input channels from the start of each pixel
    /// (all of `s.cin`, or a grouped panel's slice, whose offset the caller adds).
    fn new(s: &ConvShape, channels: usize) -> Self {
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
    fn segment(&self, row: usize, end: usize) -> (Range<usize>, usize) {
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
    fn base(&self, n: usize, oy: usize, ox: usize) -> usize {
        let at = oy * self.stride[0] * self.wp + ox * self.stride[1];
        (n * self.hp * self.wp + at) * self.cin
    }

    /// Each GEMM row's window offset: output pixels in raster order, or with `pool` ordered
    /// by 2×2 pooling windows — for each pooled pixel `(n, py, px)` the output pixels
    /// `(2py, 2px)`, `(2py, 2px+1)`, `(2py+1, 2px)`, `(2py+1, 2px+1)` (an odd last row or
    /// column dropped).
    fn bases(&self, batch: usize, pool: bool) -> Vec<usize> {
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
    fn pad(&self, s: &ConvShape, x: Input, parallel: bool, slack: usize) -> Vec<f32> {
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
        super::filled(image_len + slack, |out| {
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
fn kernel_rows(s: &ConvShape, oy: usize, per_row: usize) -> Range<usize> {
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
struct Operands<'a> {
    image: &'a [f32],
    bases: &'a [usize],
    geometry: &'a Geometry,
    weights: &'a ConvWeights,
    width: usize,
    /// [`Tile::clamp`] and [`Tile::after`], split once per call.
    clamp: Option<[f32; 2]>,
    after: Option<Activation>,
    pool: bool,
    /// Added to the output before the ReLU (the output's layout).
    residual: Residual<'a>,
    /// Values from one output pixel to the next.
    out_stride: usize,
}

impl Operands<'_> {
    /// Output rows `rows` × the columns of panel `panel`, on this thread.
    ///
    /// # Safety
    /// `out` is the call's `[rows / row_group, cout]` output and no other thread touches this
    /// rectangle.
    unsafe fn rectangle(&self, rows: Range<usize>, panel: usize, out: *mut f32) {
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
fn walk_tiles(n: usize, full: usize, unit: usize, mut f: impl FnMut(usize, usize)) {
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
fn prefetch_tile_outputs(out: *mut f32, res: *const f32, rows: usize, stride: usize, lines: usize) {
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
struct Tile<'a> {
    image: &'a [f32],
    runs: &'a [usize],
    run_len: usize,
    /// `[k][width]`.
    panel: &'a [f32],
    /// `[width]`.
    bias: &'a [f32],
    /// Bounds applied in the registers after the bias and the residual, before the store
    /// (ReLU, Clip).
    clamp: Option<[f32; 2]>,
    /// Another activation (SiLU, HardSwish, ...), applied to the tile's output right after
    /// its store, while in L1: inlined into the register tile, its constants would be hoisted
    /// into registers the accumulators need (measured: every convolution twice as slow).
    after: Option<Activation>,
    /// Valid columns of this panel (≤ width).
    cols: usize,
    out_stride: usize,
    /// Rows come in groups of 4 (a 2×2 pooling window, see [`conv2d_nhwc_relu_pool2_new`]):
    /// each group's maximum after ReLU is stored, as one output row.
    pool: bool,
    /// A residual in the output's layout from the tile's first row, added before the ReLU;
    /// null for none.
    residual: *const f32,
}

/// GEMM rows per stored output row: 4 when the epilogue pools 2×2 windows.
fn row_group(pool: bool) -> usize {
    if pool { 4 } else { 1 }
}

impl Tile<'_> {
    /// The residual from output row `row` on (null without one).
    fn residual_at(&self, row: usize) -> *const f32 {
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
    unsafe fn run(&self, kernel: F32Kernel, bases: &[usize], out: *mut f32) {
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
