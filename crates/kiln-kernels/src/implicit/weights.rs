//! A convolution's (or linear layer's) weight and bias packed once for the implicit GEMM:
//! column panels as wide as the instruction set's register tile, the bias padded to whole
//! panels; the portable path keeps the `gemm` layout.

use super::*;

impl F32Kernel {
    /// Columns per weight panel (the register tile's width); `None` = the `gemm` layout.
    pub fn panel_width(self) -> Option<usize> {
        match self {
            F32Kernel::Avx512 => Some(avx512_dims::COLS),
            F32Kernel::Avx2 => Some(avx2_dims::COLS),
            F32Kernel::Portable => None,
        }
    }
}

/// Register tile sizes, visible on every architecture so the packing compiles everywhere.
pub(super) mod avx512_dims {
    pub const ROWS: usize = 12;
    pub const COLS: usize = 32;
}

pub(super) mod avx2_dims {
    pub const ROWS: usize = 6;
    pub const COLS: usize = 16;
}

/// A convolution's weight and bias packed once for [`conv2d_nhwc`].
#[derive(Debug, Clone)]
pub struct ConvWeights {
    pub(super) kernel: F32Kernel,
    /// `[cout, cin, kh, kw]`.
    pub(super) dims: [usize; 4],
    /// Panels of `width` output channels, each `[kh·kw·cin][width]` (zero columns past
    /// `cout`); for [`F32Kernel::Portable`], `[kh·kw·cin, cout]`.
    pub(super) data: AlignedF32,
    /// The bias padded to whole panels (zeros without a bias); the portable path's bias
    /// unpadded, or empty.
    pub(super) bias: Vec<f32>,
    pub(super) has_bias: bool,
    /// Input channels per pixel of the image: `dims[1]`, except for a grouped convolution,
    /// whose panels each read a slice of `dims[1]` channels of a wider pixel.
    pub(super) pixel: usize,
    /// Per panel, the first input channel of its slice (empty: 0 for every panel).
    pub(super) panel_offsets: Vec<usize>,
    /// A 3×3 layer's weight transformed for Winograd F(2×2, 3×3), made on the first call
    /// that runs that way (a layer only ever called on shapes that stay on the implicit
    /// GEMM never pays its time or its 16/9 of the weight's memory).
    pub(super) winograd: OnceLock<Option<WinogradWeights>>,
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
    pub(super) fn slack(&self) -> usize {
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
    pub(super) fn from_rows(
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

    /// These weights with the Winograd path turned off: every call runs the implicit GEMM.
    /// For a layer measured slower in Winograd form on this machine (`kiln optimize` times
    /// both; the kernel's own rule in [`crate::winograd`] is a static threshold).
    pub fn without_winograd(self) -> Self {
        ConvWeights {
            winograd: OnceLock::from(None),
            ..self
        }
    }

    /// Whether a call with these weights has run as Winograd (the transformed weight is made
    /// on the first such call): which layers `kiln optimize` measures both ways.
    pub fn ran_winograd(&self) -> bool {
        matches!(self.winograd.get(), Some(Some(_)))
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
    pub(super) fn winograd(&self) -> Option<&WinogradWeights> {
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
