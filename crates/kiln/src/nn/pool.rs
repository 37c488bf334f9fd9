//! [`MaxPool2d`]: Burn's 2-D max pooling through Kiln's kernel; [`AdaptiveAvgPool2d`] and
//! [`global_avg_pool`]: a CNN head's global average pooling through Kiln's (forward and
//! gradient one pass each).

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

/// Global average pooling, `[B, C, H, W]` → `[B, C]`: what a CNN head writes as
/// `x.flatten::<3>(2, 3).mean_dim(2)` (PyTorch's `x.mean(dim=(2, 3))`), through Kiln's kernel
/// in f32 on the CPU — forward and gradient one pass over memory each, where Burn's gradient
/// of the mean broadcasts, divides and reshapes (0.65 → 0.45 ms for 64×256×8×8, BENCHMARKS.md
/// run 61) — and Burn's mean elsewhere.
pub fn global_avg_pool(x: Tensor<4>) -> Tensor<2> {
    crate::kernels::global_avg_pool2d(x)
}

/// Configuration of an [`AdaptiveAvgPool2d`] layer: Burn's
/// [`burn::nn::pool::AdaptiveAvgPool2dConfig`] whose `init` builds the Kiln layer.
#[derive(Debug, Clone)]
pub struct AdaptiveAvgPool2dConfig(pub burn::nn::pool::AdaptiveAvgPool2dConfig);

wraps_burn_config!(
    AdaptiveAvgPool2dConfig,
    burn::nn::pool::AdaptiveAvgPool2dConfig,
    {}
);

impl AdaptiveAvgPool2dConfig {
    /// Pooling to `output_size` (`[1, 1]`: global average pooling).
    pub fn new(output_size: [usize; 2]) -> Self {
        AdaptiveAvgPool2dConfig(burn::nn::pool::AdaptiveAvgPool2dConfig::new(output_size))
    }

    /// The layer.
    pub fn init(&self) -> AdaptiveAvgPool2d {
        self.0.init().into()
    }
}

/// Adaptive average pooling over `[B, C, H, W]`, like [`burn::nn::pool::AdaptiveAvgPool2d`]
/// and with its record: to `[1, 1]` (the global pooling of a CNN head, torchvision's
/// `AdaptiveAvgPool2d(1)`) through [`global_avg_pool`], any other output size through Burn's
/// op.
#[derive(Module, Debug)]
pub struct AdaptiveAvgPool2d {
    /// The size of the output.
    pub output_size: [usize; 2],
}

impl AdaptiveAvgPool2d {
    /// The forward pass: `[B, C, H, W]` → `[B, C, out_h, out_w]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        if self.output_size != [1, 1] {
            return burn::tensor::module::adaptive_avg_pool2d(x, self.output_size);
        }
        let [b, c, _, _] = x.dims();
        global_avg_pool(x).reshape([b, c, 1, 1])
    }
}

impl From<burn::nn::pool::AdaptiveAvgPool2d> for AdaptiveAvgPool2d {
    fn from(layer: burn::nn::pool::AdaptiveAvgPool2d) -> Self {
        AdaptiveAvgPool2d {
            output_size: layer.output_size,
        }
    }
}

impl From<AdaptiveAvgPool2d> for burn::nn::pool::AdaptiveAvgPool2d {
    fn from(layer: AdaptiveAvgPool2d) -> Self {
        burn::nn::pool::AdaptiveAvgPool2d {
            output_size: layer.output_size,
        }
    }
}
