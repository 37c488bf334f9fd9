//! The shape of a 2-D convolution, shared by every convolution kernel (training GEMM,
//! implicit GEMM, Winograd, direct, channels-last patches).

/// Shape of one convolution: `[batch, cin, h, w]` input, `[cout, cin, kh, kw]` weight, no groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvShape {
    /// Images in the batch.
    pub batch: usize,
    /// Input channels.
    pub cin: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels.
    pub cout: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Stride (rows, columns).
    pub stride: [usize; 2],
    /// Padding before and after, per spatial dimension: `[(top, bottom), (left, right)]`.
    pub padding: [(usize, usize); 2],
    /// Dilation (rows, columns).
    pub dilation: [usize; 2],
}

impl ConvShape {
    /// Output height.
    pub fn out_h(&self) -> usize {
        out_len(
            self.h,
            self.kh,
            self.stride[0],
            self.padding[0],
            self.dilation[0],
        )
    }

    /// Output width.
    pub fn out_w(&self) -> usize {
        out_len(
            self.w,
            self.kw,
            self.stride[1],
            self.padding[1],
            self.dilation[1],
        )
    }

    /// Rows of the unfolded matrix: `cin · kh · kw`.
    pub fn k(&self) -> usize {
        self.cin * self.kh * self.kw
    }

    /// Output pixels per channel: `oh · ow`.
    pub fn pixels(&self) -> usize {
        self.out_h() * self.out_w()
    }

    /// Values of one input image (`cin·h·w`).
    pub fn image_len(&self) -> usize {
        self.cin * self.h * self.w
    }

    /// Elements of the weight.
    pub fn weight_len(&self) -> usize {
        self.cout * self.k()
    }

    /// Elements of the output.
    pub fn output_len(&self) -> usize {
        self.batch * self.cout * self.pixels()
    }

    /// Elements of the input.
    pub fn input_len(&self) -> usize {
        self.batch * self.image_len()
    }

    /// A 1×1 kernel with stride 1 and no padding reads the image as its own unfolded matrix.
    pub fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == [1, 1] && self.padding == [(0, 0), (0, 0)]
    }

    /// At stride 1 the input gradient is itself a forward convolution: of `dout` by the
    /// weight with its taps flipped and its channel axes swapped ([`flip_transposed`]),
    /// padded by `dilation·(k−1) − pad` on each side. This is that convolution's shape, or
    /// `None` where it does not apply (a stride, padding wider than the kernel's reach, a
    /// kernel that reads padding only, or fewer than [`FLIPPED_MIN_CIN`] input channels).
    ///
    /// Why: as `dcols = Wᵀ · dout` the GEMM's inner dimension is `cout` (64 in ResNet's
    /// first stage) and writes a `cin·kh·kw`-row matrix that `col2im` then scatter-adds back;
    /// as a forward the inner dimension is `cout·kh·kw` and the registers accumulate the
    /// whole sum. W5's 512-channel 4×4 layer (batch 64, 2 threads, 3 alternated runs): 30–39
    /// ms the first way, 21–26 ms as a forward; the 128- and 256-channel layers 5–10% faster,
    /// the 64-channel layer within noise (BENCHMARKS.md run 38).
    pub fn input_grad_as_forward(&self) -> Option<ConvShape> {
        if self.stride != [1, 1] || self.cin < FLIPPED_MIN_CIN {
            return None;
        }
        let flipped = |dim: usize| -> Option<(usize, usize)> {
            let (reach, (lo, hi)) = (
                self.dilation[dim] * ([self.kh, self.kw][dim] - 1),
                self.padding[dim],
            );
            let len = [self.h, self.w][dim];
            (lo <= reach && hi <= reach && len + lo + hi > reach).then(|| (reach - lo, reach - hi))
        };
        Some(ConvShape {
            cin: self.cout,
            h: self.out_h(),
            w: self.out_w(),
            cout: self.cin,
            padding: [flipped(0)?, flipped(1)?],
            ..*self
        })
    }
}

/// Output length of one spatial dimension.
pub fn out_len(len: usize, k: usize, stride: usize, pad: (usize, usize), dilation: usize) -> usize {
    let span = dilation * (k - 1) + 1;
    (len + pad.0 + pad.1).saturating_sub(span) / stride + 1
}

/// Input channels below which the input gradient stays `dcols = Wᵀ · dout`: they are the
/// forward form's output rows, and a GEMM with few rows wastes its register tile — W5's stem
/// (3 → 64 channels) took 1.3 ms the first way and 7.2 as a forward.
pub const FLIPPED_MIN_CIN: usize = 16;

/// Checks a forward's operand lengths: `(k, pixels)`, or `None` when there is nothing to
/// compute.
pub fn check_forward(
    s: &ConvShape,
    x: &[f32],
    weight: &[f32],
    out: usize,
) -> Option<(usize, usize)> {
    assert_eq!(x.len(), s.input_len(), "conv2d input length");
    assert_eq!(weight.len(), s.weight_len(), "conv2d weight length");
    assert_eq!(out, s.output_len(), "conv2d output length");
    let (k, p) = (s.k(), s.pixels());
    (s.cout * p != 0 && s.batch != 0).then_some((k, p))
}
