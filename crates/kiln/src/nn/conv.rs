//! [`Conv2d`]: Burn's 2-D convolution through Kiln's kernel and autocast.

use burn::module::{Module, Param};
use burn::nn::{Initializer, PaddingConfig2d};
use burn::tensor::{Device, Tensor};

use crate::precision::{ConvGeometry, conv2d_weights};

/// Configuration of a [`Conv2d`] layer: Burn's [`burn::nn::conv::Conv2dConfig`] (same fields,
/// same defaults, same setters) whose `init` builds the Kiln layer.
#[derive(Debug, Clone)]
pub struct Conv2dConfig(pub burn::nn::conv::Conv2dConfig);

wraps_burn_config!(Conv2dConfig, burn::nn::conv::Conv2dConfig, {
    /// Stride per spatial axis.
    with_stride(stride: [usize; 2]),
    /// Dilation per spatial axis.
    with_dilation(dilation: [usize; 2]),
    /// Channel groups.
    with_groups(groups: usize),
    /// Padding.
    with_padding(padding: PaddingConfig2d),
    /// Whether the layer adds a bias.
    with_bias(bias: bool),
    /// How the parameters are initialized.
    with_initializer(initializer: Initializer),
});

impl Conv2dConfig {
    /// `[in, out]` channels and a `[height, width]` kernel (Burn's defaults otherwise).
    pub fn new(channels: [usize; 2], kernel_size: [usize; 2]) -> Self {
        Conv2dConfig(burn::nn::conv::Conv2dConfig::new(channels, kernel_size))
    }

    /// A freshly initialized layer: exactly Burn's initialization (same draws, same order).
    pub fn init(&self, device: &Device) -> Conv2d {
        self.0.init(device).into()
    }
}

/// A 2-D convolution over `[B, C, H, W]`, like [`burn::nn::conv::Conv2d`] and with its
/// record.
#[derive(Module, Debug)]
pub struct Conv2d {
    /// Weight `[out, in / groups, kh, kw]`.
    pub weight: Param<Tensor<4>>,
    /// Bias `[out]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// Stride per spatial axis.
    pub stride: [usize; 2],
    /// Kernel height and width.
    pub kernel_size: [usize; 2],
    /// Dilation per spatial axis.
    pub dilation: [usize; 2],
    /// Channel groups.
    pub groups: usize,
    /// Padding.
    #[module(skip)]
    pub padding: PaddingConfig2d,
}

impl Conv2d {
    /// The forward pass: Kiln's kernels in f32 on the CPU (the GEMM kernel ungrouped, the
    /// depthwise kernel with one filter per channel), the autocast precision inside a
    /// bf16/f16 scope, Burn's op elsewhere (other groupings, other devices).
    ///
    /// # Panics
    /// Like Burn's layer, if `x` does not have the layer's input channels.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let weight = self.weight.val();
        let expected = weight.dims()[1] * self.groups;
        let channels = x.dims()[1];
        assert_eq!(
            channels,
            expected,
            "Conv2d expects {expected} input channels, got {channels} (input {:?})",
            x.dims()
        );
        let geometry = ConvGeometry {
            kernel_size: self.kernel_size,
            stride: self.stride,
            dilation: self.dilation,
            groups: self.groups,
            padding: &self.padding,
        };
        conv2d_weights(x, weight, self.bias.as_ref().map(|b| b.val()), &geometry)
    }
}

impl From<burn::nn::conv::Conv2d> for Conv2d {
    fn from(layer: burn::nn::conv::Conv2d) -> Self {
        Conv2d {
            weight: layer.weight,
            bias: layer.bias,
            stride: layer.stride,
            kernel_size: layer.kernel_size,
            dilation: layer.dilation,
            groups: layer.groups,
            padding: layer.padding,
        }
    }
}

impl From<Conv2d> for burn::nn::conv::Conv2d {
    fn from(layer: Conv2d) -> Self {
        burn::nn::conv::Conv2d {
            weight: layer.weight,
            bias: layer.bias,
            stride: layer.stride,
            kernel_size: layer.kernel_size,
            dilation: layer.dilation,
            groups: layer.groups,
            padding: layer.padding,
        }
    }
}
