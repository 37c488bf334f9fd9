//! Builds Burn's optimizers from [`TrainOptions`].

use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig};

use super::{OptimizerKind, TrainOptions};

/// The optimizer the options ask for. Clipping is *not* configured here: Kiln clips by the
/// global norm itself (see [`super::clip_global_norm`]).
pub fn build_optimizer(options: &TrainOptions) -> ModuleOptimizer {
    let decay =
        (options.weight_decay > 0.0).then(|| WeightDecayConfig::new(options.weight_decay as f32));
    match options.optimizer {
        // torch's default epsilon, so trajectories are comparable with the PyTorch peer.
        OptimizerKind::Adam => AdamConfig::new()
            .with_epsilon(1e-8)
            .with_weight_decay(decay)
            .init(),
        OptimizerKind::AdamW => AdamWConfig::new()
            .with_epsilon(1e-8)
            .with_weight_decay(options.weight_decay as f32)
            .init(),
        OptimizerKind::Sgd => SgdConfig::new()
            .with_momentum(Some(
                // torch's SGD has no dampening by default; Burn's defaults to 0.1.
                MomentumConfig::new()
                    .with_momentum(options.momentum)
                    .with_dampening(0.0),
            ))
            .with_weight_decay(decay)
            .init(),
    }
}
