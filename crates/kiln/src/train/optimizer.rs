//! Builds the optimizers from [`TrainOptions`]: Burn's, with Adam's update fused into one
//! pass on the CPU ([`FusedAdam`]).

use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    Adam, AdamConfig, AdamState, AdamWConfig, AdaptiveMomentumState, LearningRate, ModuleOptimizer,
    Optimizer, SgdConfig,
};
use burn::tensor::{Device, Tensor};

use super::{OptimizerKind, TrainOptions};
use crate::kernels::{self, adam::AdamStep};

/// torch's default epsilon, so trajectories are comparable with the PyTorch peer.
const ADAM_EPSILON: f32 = 1e-8;
/// Burn's and torch's default moment decays.
const ADAM_BETAS: [f32; 2] = [0.9, 0.999];

/// The optimizer the options ask for. Clipping is *not* configured here: Kiln clips by the
/// global norm itself (see [`super::clip_global_norm`]).
pub fn build_optimizer(options: &TrainOptions) -> ModuleOptimizer {
    let decay =
        (options.weight_decay > 0.0).then(|| WeightDecayConfig::new(options.weight_decay as f32));
    match options.optimizer {
        OptimizerKind::Adam => {
            let config = AdamConfig::new()
                .with_beta_1(ADAM_BETAS[0])
                .with_beta_2(ADAM_BETAS[1])
                .with_epsilon(ADAM_EPSILON)
                .with_weight_decay(decay);
            ModuleOptimizer::from(FusedAdam {
                burn: config.build(),
                weight_decay: options.weight_decay as f32,
            })
        }
        OptimizerKind::AdamW => AdamWConfig::new()
            .with_epsilon(ADAM_EPSILON)
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

/// Burn's Adam, with the update of an f32 parameter on `flex` run by Kiln's fused kernel
/// ([`kernels::adam_step`]: one pass instead of about ten tensor ops) and Burn's own code
/// everywhere else (other devices and dtypes, Kiln's kernels switched off). The state is
/// Burn's [`AdamState`], so checkpoints are the same whichever path ran, and the arithmetic
/// is Burn's operation for operation (a test holds the two to the same bits).
#[derive(Clone)]
pub struct FusedAdam {
    burn: Adam,
    /// L2 penalty added to the gradient (Burn's Adam `weight_decay`); 0 for none.
    weight_decay: f32,
}

impl Optimizer for FusedAdam {
    type State<const D: usize> = AdamState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let amsgrad = state
            .as_ref()
            .is_some_and(|s| s.momentum.max_moment_2.is_some());
        if amsgrad || !kernels::adam_serves(&tensor, &grad) {
            return self.burn.step(lr, tensor, grad, state);
        }
        let (time, moments) = match state {
            Some(s) => (
                s.momentum.time + 1,
                Some((s.momentum.moment_1, s.momentum.moment_2)),
            ),
            None => (1, None),
        };
        let step = AdamStep::new(lr, ADAM_BETAS, ADAM_EPSILON, self.weight_decay, time as i32);
        let (tensor, moment_1, moment_2) = kernels::adam_step(tensor, grad, moments, step);
        let momentum = AdaptiveMomentumState::new(time, moment_1, moment_2);
        (tensor, Some(AdamState::new(momentum)))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        <Adam as Optimizer>::to_device(state, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, TensorData};

    fn values(t: &Tensor<2>) -> Vec<f32> {
        t.to_data().try_to_vec::<f32>().expect("f32 values")
    }

    /// Runs `steps` updates of a parameter large enough to split over the threads, with
    /// Kiln's fused path and with Burn's Adam, and returns both parameters and moments.
    fn both(decay: f32) -> [(Vec<f32>, Vec<f32>, Vec<f32>); 2] {
        let device = Device::flex();
        let decay_config = (decay > 0.0).then(|| WeightDecayConfig::new(decay));
        let config = AdamConfig::new()
            .with_epsilon(ADAM_EPSILON)
            .with_weight_decay(decay_config);
        let fused = FusedAdam {
            burn: config.build(),
            weight_decay: decay,
        };
        let burn = config.build();
        let shape = [300, 700];
        let init = Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let grads: Vec<Tensor<2>> = (0..3)
            .map(|_| Tensor::random(shape, Distribution::Normal(0.0, 0.1), &device))
            .collect();
        assert!(
            kernels::adam_serves(&init, &grads[0]),
            "the fused path must run"
        );
        let mut fused_run = (init.clone(), None);
        let mut burn_run = (init, None);
        for (i, g) in grads.into_iter().enumerate() {
            let lr = 1e-3 * (i + 1) as f64;
            fused_run = fused.step(lr, fused_run.0, g.clone(), fused_run.1);
            burn_run = burn.step(lr, burn_run.0, g, burn_run.1);
        }
        [fused_run, burn_run].map(|(p, state): (Tensor<2>, Option<AdamState<2>>)| {
            let state = state.expect("a state after a step").momentum;
            assert_eq!(state.time, 3);
            (values(&p), values(&state.moment_1), values(&state.moment_2))
        })
    }

    #[test]
    fn fused_adam_matches_burns_adam_to_the_bit() {
        for decay in [0.0, 0.01] {
            let [fused, burn] = both(decay);
            assert!(fused.0 == burn.0, "decay {decay}: parameters differ");
            assert!(fused.1 == burn.1, "decay {decay}: first moments differ");
            assert!(fused.2 == burn.2, "decay {decay}: second moments differ");
        }
    }

    #[test]
    fn fused_adam_hands_other_cases_to_burn() {
        let device = Device::flex();
        let p = Tensor::<1>::from_data(TensorData::from([1.0f32, 2.0]), &device);
        let g = Tensor::<1>::from_data(TensorData::from([0.5f32, -0.5]), &device);
        let _burn_only = kernels::Scope::enter(false);
        assert!(!kernels::adam_serves(&p, &g));
        let fused = FusedAdam {
            burn: AdamConfig::new().with_epsilon(ADAM_EPSILON).build(),
            weight_decay: 0.0,
        };
        let (p, state) = fused.step(0.1, p, g, None);
        let p = p.to_data().try_to_vec::<f32>().expect("f32 values");
        // Adam's first step moves each value by the learning rate against its gradient's sign.
        assert!(
            (p[0] - 0.9).abs() < 1e-6 && (p[1] - 2.1).abs() < 1e-6,
            "{p:?}"
        );
        assert_eq!(state.expect("a state").momentum.time, 1);
    }
}
