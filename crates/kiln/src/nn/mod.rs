//! Drop-in replacements for Burn's layers that run through Kiln: `use kiln::nn::{Linear,
//! LinearConfig}` instead of `use burn::nn::{Linear, LinearConfig}` and the model gets Kiln's
//! f32 CPU kernels (GEMM convolution and linear layers, max pooling with arg-max backward,
//! BatchNorm's training forward and backward in two passes each, LayerNorm's in one) and
//! the trainer's bf16/f16 autocast policy, with nothing else changed. A transformer's
//! functions have drop-ins too, with Burn's arguments: [`gelu`], [`relu`] and [`softmax`]
//! for `burn::tensor::activation`'s, [`activation`] for a `burn::nn` layer's `Activation`
//! field, [`attention`] and [`layer_norm`] for
//! `burn::tensor::module`'s (forward and backward through Kiln's kernels), and
//! [`qkv_attention`] for the split–attend–merge of a packed QKV projection in one op.
//!
//! Each layer has Burn's fields under Burn's names, so its record is Burn's record: weights
//! saved from a `burn::nn` model load into the `kiln::nn` one and back. Each config has
//! Burn's constructor and `with_*` setters (it wraps Burn's config, reachable through
//! `Deref`), and `From` converts between the Burn and Kiln layer types. Off the CPU, or for a
//! case a kernel does not cover (grouped convolution, padded pooling), the layer calls Burn's
//! own op, so the replacement never changes what a model computes beyond f32 rounding.
//!
//! Why layers and not a rewrite of the user's forward: Burn 0.22 has no op-level hook that
//! could route `burn::nn::Linear::forward` elsewhere, and a backend wrapper would see every
//! matmul without knowing which are layers (autocast must leave softmax and norms in f32).
//! Swapping the type at the `use` line is the least a user has to change.

/// Makes `$kiln`, a newtype over Burn's config `$burn`, a drop-in for it: Burn's `with_*`
/// setters forwarded (each listed with its doc), `From` Burn's config, and `Deref` to it for
/// reading fields.
macro_rules! wraps_burn_config {
    ($kiln:ident, $burn:ty, { $( $(#[$doc:meta])* $setter:ident($arg:ident: $ty:ty) ),* $(,)? }) => {
        impl $kiln {
            $(
                $(#[$doc])*
                pub fn $setter(self, $arg: $ty) -> Self {
                    $kiln(self.0.$setter($arg))
                }
            )*
        }

        impl From<$burn> for $kiln {
            fn from(config: $burn) -> Self {
                $kiln(config)
            }
        }

        impl std::ops::Deref for $kiln {
            type Target = $burn;

            fn deref(&self) -> &Self::Target {
                &self.0
            }
        }
    };
}

mod activation;
mod attention;
mod conv;
mod layer_norm;
mod linear;
mod norm;
mod pool;

pub use crate::kernels::transformer::{gelu, layer_norm, relu, softmax};
pub use crate::precision::attention;
pub use activation::activation;
pub use attention::qkv_attention;
pub use conv::{Conv2d, Conv2dConfig};
pub use layer_norm::{LayerNorm, LayerNormConfig};
pub use linear::{Linear, LinearConfig};
pub use norm::{BatchNorm, BatchNormConfig};
pub use pool::{
    AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d, MaxPool2dConfig, global_avg_pool,
};
