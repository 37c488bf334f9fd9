//! [`LayerNorm`]: Burn's LayerNorm whose forward and backward run Kiln's one-pass kernels
//! (each row's statistics kept for the backward) for f32 on the CPU.

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

use crate::kernels::transformer::layer_norm;

/// Configuration of a [`LayerNorm`] layer: Burn's [`burn::nn::LayerNormConfig`] (same
/// fields, same defaults, same setters) whose `init` builds the Kiln layer.
#[derive(Debug, Clone)]
pub struct LayerNormConfig(pub burn::nn::LayerNormConfig);

wraps_burn_config!(LayerNormConfig, burn::nn::LayerNormConfig, {
    /// Added to the variance before its square root.
    with_epsilon(epsilon: f64),
    /// Whether the layer adds a shift β.
    with_bias(bias: bool),
});

impl LayerNormConfig {
    /// Normalization over the last axis of `d_model` features (ε = 1e-5, with a shift:
    /// Burn's defaults).
    pub fn new(d_model: usize) -> Self {
        LayerNormConfig(burn::nn::LayerNormConfig::new(d_model))
    }

    /// The layer: γ = 1, β = 0 (as Burn's).
    pub fn init(&self, device: &Device) -> LayerNorm {
        let layer = self.0.init(device);
        LayerNorm {
            gamma: layer.gamma,
            beta: layer.beta,
            epsilon: self.0.epsilon,
        }
    }
}

/// Layer normalization over the last axis, `(x − mean)/√(var + ε)·γ + β`, like
/// [`burn::nn::LayerNorm`] and with its record (γ, the optional β, ε). Burn keeps its
/// layer's ε private, so a Burn layer converts with [`LayerNorm::from_burn`] and its ε.
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// Scale γ `[d_model]`.
    pub gamma: Param<Tensor<1>>,
    /// Shift β `[d_model]`, when the layer has one.
    pub beta: Option<Param<Tensor<1>>>,
    /// Added to the variance before its square root.
    pub epsilon: f64,
}

impl LayerNorm {
    /// The forward pass on `[..., d_model]`: Kiln's kernels for f32 on the CPU, Burn's op
    /// elsewhere (half precision is normalized in f32 and cast back, as Burn's layer does).
    ///
    /// # Panics
    /// Like Burn's layer, if the last axis of `x` is not `d_model`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let gamma = self.gamma.val();
        let [d_model] = gamma.dims();
        let last = x.dims()[D - 1];
        assert_eq!(
            last, d_model,
            "LayerNorm expects inputs whose last axis is {d_model}, got {last}"
        );
        let beta = self.beta.as_ref().map(|b| b.val());
        let dtype = x.dtype();
        if dtype == burn::tensor::DType::F32 {
            return layer_norm(x, gamma, beta, self.epsilon);
        }
        // The sum of squares needs f32's range (Burn's layer widens the same way).
        let wide = burn::tensor::DType::F32;
        layer_norm(
            x.cast(wide),
            gamma.cast(wide),
            beta.map(|b| b.cast(wide)),
            self.epsilon,
        )
        .cast(dtype)
    }

    /// Burn's layer as Kiln's, with the `epsilon` it was configured with (Burn's field is
    /// private).
    pub fn from_burn(layer: burn::nn::LayerNorm, epsilon: f64) -> Self {
        LayerNorm {
            gamma: layer.gamma,
            beta: layer.beta,
            epsilon,
        }
    }
}
