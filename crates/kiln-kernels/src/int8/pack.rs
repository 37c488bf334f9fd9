//! Packed int8 weights: a linear layer's or convolution's quantized weight reordered into
//! the K-groups × output-channel blocks the integer kernels read (VNNI's and AMX's byte
//! layout, or the AVX2 kernel's i16 pairs), and a convolution's geometry and image layout.

use super::*;

/// 2-D convolution geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConvGeometry {
    /// Stride (h, w).
    pub stride: [usize; 2],
    /// Padding (top, left, bottom, right), ONNX's order.
    pub pads: [usize; 4],
    /// Dilation (h, w).
    pub dilation: [usize; 2],
    /// Groups.
    pub groups: usize,
    /// Kernel size (h, w).
    pub kernel: [usize; 2],
}

/// Bytes past a convolution's image that a padded K-group may read (< one group; generous).
pub(super) const K_SLACK: usize = 64;

/// How a batch of images is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageLayout {
    /// `[batch, channels, h, w]` (Burn's and the model's layout).
    Nchw,
    /// `[batch, h, w, channels]` (channels-last: what the int8 GEMM produces).
    Nhwc,
}

/// Quantized weights packed for a kernel: channel blocks of `lanes`, and within a block, for
/// each K-group, the group's values of every channel side by side
/// (`[n / lanes][k / group][lanes][group]`, zero-padded).
#[derive(Debug, Clone)]
pub struct PackedWeights {
    /// Output channels.
    pub rows: usize,
    /// Inputs per channel (before padding).
    pub cols: usize,
    /// Per-channel dequantization scales.
    pub scales: Vec<f32>,
    /// `Σ_k q_w` per channel, for the zero-point correction.
    pub row_sums: Vec<i32>,
    pub(super) kernel: Int8Kernel,
    pub(super) groups: usize,
    pub(super) blocks: usize,
    pub(super) bytes: Vec<u8>,
    pub(super) wide: Vec<i16>,
}

impl PackedWeights {
    /// Packs `w` for `kernel`.
    pub fn new(w: &QuantWeight, kernel: Int8Kernel) -> Self {
        let (g, l) = (kernel.group(), kernel.lanes());
        let groups = w
            .cols
            .div_ceil(g)
            .max(1)
            .next_multiple_of(kernel.group_multiple());
        let blocks = w.rows.div_ceil(l).max(1);
        let index = |j: usize, k: usize| ((j / l) * groups + k / g) * l * g + (j % l) * g + k % g;
        let len = blocks * groups * l * g;
        let (mut bytes, mut wide) = (Vec::new(), Vec::new());
        if kernel.packs_bytes() {
            bytes = vec![0u8; len];
        } else {
            wide = vec![0i16; len];
        }
        for j in 0..w.rows {
            for k in 0..w.cols {
                let v = w.values[j * w.cols + k];
                if kernel.packs_bytes() {
                    bytes[index(j, k)] = v as u8; // i8 bit pattern
                } else {
                    wide[index(j, k)] = v as i16;
                }
            }
        }
        PackedWeights {
            rows: w.rows,
            cols: w.cols,
            scales: w.scales.clone(),
            row_sums: w
                .values
                .chunks_exact(w.cols.max(1))
                .take(w.rows)
                .map(|r| r.iter().map(|v| *v as i32).sum())
                .collect(),
            kernel,
            groups,
            blocks,
            bytes,
            wide,
        }
    }

    /// The kernel these weights are packed for.
    pub fn kernel(&self) -> Int8Kernel {
        self.kernel
    }
}

/// How a convolution's K is laid out over the NHWC image.
///
/// With unit horizontal dilation, one kernel row's `kw` taps of all channels are `kw·ci`
/// contiguous bytes of the NHWC image, so K is `kh` runs of `kw·ci` values, each padded to the
/// K-group (`run_padded`): a 1-channel 3×3 conv has K = 3 × 4 = 12, not 9 taps × 4. Otherwise
/// each tap is its own run of `ci` values padded to the group.
#[derive(Debug, Clone, Copy)]
pub(super) struct ConvLayout {
    /// Runs per output pixel (kh, or kh·kw per tap).
    pub(super) runs: usize,
    /// Values per run after padding to the K-group.
    pub(super) run_padded: usize,
    /// Whether runs span whole kernel rows.
    pub(super) row_runs: bool,
}

impl ConvLayout {
    pub(super) fn new(ci: usize, geometry: &ConvGeometry, kernel: Int8Kernel) -> Self {
        let g = kernel.group();
        let [kh, kw] = geometry.kernel;
        let row_runs = geometry.dilation[1] == 1;
        let (runs, run) = if row_runs {
            (kh, kw * ci)
        } else {
            (kh * kw, ci)
        };
        ConvLayout {
            runs,
            run_padded: run.div_ceil(g) * g,
            row_runs,
        }
    }

    pub(super) fn cols(&self) -> usize {
        self.runs * self.run_padded
    }
}

/// Packs conv weights `[co][ci][kh][kw]` for [`QuantizedActivations::for_conv`]: K reordered
/// to the NHWC runs of `ConvLayout` (zeros in the padding, so over-read bytes contribute 0).
pub fn pack_conv_weights(
    w: &QuantWeight,
    ci: usize,
    geometry: &ConvGeometry,
    kernel: Int8Kernel,
) -> PackedWeights {
    let [kh, kw] = geometry.kernel;
    let layout = ConvLayout::new(ci, geometry, kernel);
    let cols = layout.cols();
    let mut values = vec![0i8; w.rows * cols];
    for co in 0..w.rows {
        for c in 0..ci {
            for ky in 0..kh {
                for kx in 0..kw {
                    let k = if layout.row_runs {
                        ky * layout.run_padded + kx * ci + c
                    } else {
                        (ky * kw + kx) * layout.run_padded + c
                    };
                    values[co * cols + k] = w.values[((co * ci + c) * kh + ky) * kw + kx];
                }
            }
        }
    }
    let reordered = QuantWeight {
        rows: w.rows,
        cols,
        values,
        scales: w.scales.clone(),
    };
    PackedWeights::new(&reordered, kernel)
}
