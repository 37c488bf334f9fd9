//! [`MaxPool2d`]: Burn's 2-D max pooling through Kiln's kernel.

use burn::module::Module;
use burn::nn::PaddingConfig2d;
use burn::tensor::Tensor;

/// Configuration of a [`MaxPool2d`] layer: Burn's [`burn::nn::pool::MaxPool2dConfig`] (same
/// fields, same defaults, same setters) whose `init` builds the Kiln layer.
#[derive(Debug, Clone)]
pub struct MaxPool2dConfig(pub burn::nn::pool::MaxPool2dConfig);

wraps_burn_config!(MaxPool2dConfig, burn::nn::pool::MaxPool2dConfig, {
    /// Stride per spatial axis.
    with_strides(strides: [usize; 2]),
    /// Padding.
    with_padding(padding: PaddingConfig2d),
    /// Dilation per spatial axis.
    with_dilation(dilation: [usize; 2]),
    /// Ceil instead of floor rounding of the output size.
    with_ceil_mode(ceil_mode: bool),
});

impl MaxPool2dConfig {
    /// A `[height, width]` window (stride = window by default, as in Burn).
    pub fn new(kernel_size: [usize; 2]) -> Self {
        MaxPool2dConfig(burn::nn::pool::MaxPool2dConfig::new(kernel_size))
    }

    /// The layer.
    pub fn init(&self) -> MaxPool2d {
        self.0.init().into()
    }
}

/// 2-D max pooling over `[B, C, H, W]`, like [`burn::nn::pool::MaxPool2d`] and with its
/// record (it has no parameters).
#[derive(Module, Debug)]
pub struct MaxPool2d {
    /// Stride per spatial axis.
    pub stride: [usize; 2],
    /// Window height and width.
    pub kernel_size: [usize; 2],
    /// Padding.
    #[module(skip)]
    pub padding: PaddingConfig2d,
    /// Dilation per spatial axis.
    pub dilation: [usize; 2],
    /// Ceil instead of floor rounding of the output size.
    pub ceil_mode: bool,
}

impl MaxPool2d {
    /// The forward pass: Kiln's kernel (arg-max indices, scatter backward) in f32 on the CPU
    /// without padding, dilation or ceil rounding; Burn's op otherwise (the choice
    /// [`crate::kernels::max_pool2d_layer`] makes for Burn's layer).
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        crate::kernels::max_pool2d_layer(&self.clone().into(), x)
    }
}

impl From<burn::nn::pool::MaxPool2d> for MaxPool2d {
    fn from(layer: burn::nn::pool::MaxPool2d) -> Self {
        MaxPool2d {
            stride: layer.stride,
            kernel_size: layer.kernel_size,
            padding: layer.padding,
            dilation: layer.dilation,
            ceil_mode: layer.ceil_mode,
        }
    }
}

impl From<MaxPool2d> for burn::nn::pool::MaxPool2d {
    fn from(layer: MaxPool2d) -> Self {
        burn::nn::pool::MaxPool2d {
            stride: layer.stride,
            kernel_size: layer.kernel_size,
            padding: layer.padding,
            dilation: layer.dilation,
            ceil_mode: layer.ceil_mode,
        }
    }
}
