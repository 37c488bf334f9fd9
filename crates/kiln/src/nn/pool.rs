//! [`MaxPool2d`]: Burn's 2-D max pooling through Kiln's kernel.

use burn::module::Module;
use burn::nn::PaddingConfig2d;
use burn::tensor::Tensor;

/// Configuration of a [`MaxPool2d`] layer: Burn's [`burn::nn::pool::MaxPool2dConfig`] (same
/// fields, same defaults, same setters) whose `init` builds the Kiln layer.
#[derive(Debug, Clone)]
pub struct MaxPool2dConfig(pub burn::nn::pool::MaxPool2dConfig);

impl MaxPool2dConfig {
    /// A `[height, width]` window (stride = window by default, as in Burn).
    pub fn new(kernel_size: [usize; 2]) -> Self {
        MaxPool2dConfig(burn::nn::pool::MaxPool2dConfig::new(kernel_size))
    }

    /// Stride per spatial axis.
    pub fn with_strides(self, strides: [usize; 2]) -> Self {
        MaxPool2dConfig(self.0.with_strides(strides))
    }

    /// Padding.
    pub fn with_padding(self, padding: PaddingConfig2d) -> Self {
        MaxPool2dConfig(self.0.with_padding(padding))
    }

    /// Dilation per spatial axis.
    pub fn with_dilation(self, dilation: [usize; 2]) -> Self {
        MaxPool2dConfig(self.0.with_dilation(dilation))
    }

    /// Ceil instead of floor rounding of the output size.
    pub fn with_ceil_mode(self, ceil_mode: bool) -> Self {
        MaxPool2dConfig(self.0.with_ceil_mode(ceil_mode))
    }

    /// The layer.
    pub fn init(&self) -> MaxPool2d {
        self.0.init().into()
    }
}

impl From<burn::nn::pool::MaxPool2dConfig> for MaxPool2dConfig {
    fn from(config: burn::nn::pool::MaxPool2dConfig) -> Self {
        MaxPool2dConfig(config)
    }
}

impl std::ops::Deref for MaxPool2dConfig {
    type Target = burn::nn::pool::MaxPool2dConfig;

    fn deref(&self) -> &Self::Target {
        &self.0
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
    /// without padding, dilation or ceil rounding; Burn's op otherwise.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        if self.padding != PaddingConfig2d::Valid || self.dilation != [1, 1] || self.ceil_mode {
            return burn::nn::pool::MaxPool2d::from(self.clone()).forward(x);
        }
        crate::kernels::max_pool2d(x, self.kernel_size, self.stride)
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
