//! [`Linear`]: Burn's fully connected layer through Kiln's kernel and autocast.

use burn::module::{Module, Param};
use burn::nn::{Initializer, LinearLayout};
use burn::tensor::{Device, Tensor};

use crate::precision::linear_weights;

/// Configuration of a [`Linear`] layer: Burn's [`burn::nn::LinearConfig`] (same fields, same
/// defaults, same setters) whose `init` builds the Kiln layer.
#[derive(Debug, Clone)]
pub struct LinearConfig(pub burn::nn::LinearConfig);

wraps_burn_config!(LinearConfig, burn::nn::LinearConfig, {
    /// Whether the layer adds a bias.
    with_bias(bias: bool),
    /// How the parameters are initialized.
    with_initializer(initializer: Initializer),
    /// How the weight is stored (Burn's row or column layout).
    with_layout(layout: LinearLayout),
});

impl LinearConfig {
    /// `d_input` → `d_output` features, with bias (Burn's defaults).
    pub fn new(d_input: usize, d_output: usize) -> Self {
        LinearConfig(burn::nn::LinearConfig::new(d_input, d_output))
    }

    /// A freshly initialized layer: exactly Burn's initialization (same draws, same order).
    pub fn init(&self, device: &Device) -> Linear {
        self.0.init(device).into()
    }
}

/// `y = x · W + b` over the last dimension, like [`burn::nn::Linear`] and with its record.
#[derive(Module, Debug)]
pub struct Linear {
    /// Weight `[d_input, d_output]`.
    pub weight: Param<Tensor<2>>,
    /// Bias `[d_output]`.
    pub bias: Option<Param<Tensor<1>>>,
}

impl Linear {
    /// The forward pass on `[..., d_input]`: Kiln's kernel in f32 on the CPU, the autocast
    /// precision inside a bf16/f16 scope, Burn's op elsewhere.
    ///
    /// # Panics
    /// Like Burn's layer, if the last axis of `x` is not `d_input` (the trainer turns a panic
    /// in the first step into an error naming the mismatch).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let weight = self.weight.val();
        let [d_input, _] = weight.dims();
        let last = x.dims()[D - 1];
        assert_eq!(
            last, d_input,
            "Linear expects inputs whose last axis is {d_input}, got {last}"
        );
        linear_weights(x, weight, self.bias.as_ref().map(|b| b.val()))
    }
}

impl From<burn::nn::Linear> for Linear {
    fn from(layer: burn::nn::Linear) -> Self {
        Linear {
            weight: layer.weight,
            bias: layer.bias,
        }
    }
}

impl From<Linear> for burn::nn::Linear {
    fn from(layer: Linear) -> Self {
        burn::nn::Linear {
            weight: layer.weight,
            bias: layer.bias,
        }
    }
}
