//! Builds the optimizers from [`TrainOptions`]: Adam, AdamW and SGD with momentum whose every
//! per-step decision lives on the device.
//!
//! Why Kiln's own rather than Burn's: Burn's optimizers keep Adam's step count on the host
//! and are skipped by not calling them, so a non-finite step would need a host branch — a
//! device→host read, which on CUDA waits for the whole queued step. Here the step count is a
//! device tensor, and the [`StepContext`](super::step::context::StepContext) the trainer
//! enters carries the guard's verdict and the clipping coefficient as device tensors: a
//! skipped step is a select that keeps the parameter and its state (torch's fused Adam with
//! `found_inf` does the same). The arithmetic is Burn's, operation for operation, and the
//! records keep Burn's layout (`momentum.time`, `momentum.moment_1`, …), so checkpoints
//! written before load unchanged. On `flex` with Kiln's kernels, Adam's update is one fused
//! pass ([`kernels::adam_step`]) that reads the verdict and the step count as its inputs.

use burn::optim::{LearningRate, ModuleOptimizer, Optimizer, RecordState, StateSink, StateSource};
use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_pack::Scalar;

use super::step::context::{self, StepContext};
use super::{OptimizerKind, TrainOptions};
use kiln_kernels::adam::AdamConfigScalars;

use crate::kernels;

/// torch's default epsilon, so trajectories are comparable with the PyTorch peer.
const ADAM_EPSILON: f32 = 1e-8;
/// Burn's and torch's default moment decays.
const ADAM_BETAS: [f32; 2] = [0.9, 0.999];

/// The optimizer the options ask for. Clipping is *not* configured here: Kiln clips by the
/// global norm itself (see [`super::clip_global_norm`]).
pub fn build_optimizer(options: &TrainOptions) -> ModuleOptimizer {
    let decay = options.weight_decay as f32;
    match options.optimizer {
        OptimizerKind::Adam | OptimizerKind::AdamW => ModuleOptimizer::from(DeviceAdam {
            betas: ADAM_BETAS,
            epsilon: ADAM_EPSILON,
            weight_decay: decay,
            decoupled: options.optimizer == OptimizerKind::AdamW,
        }),
        OptimizerKind::Sgd => ModuleOptimizer::from(DeviceSgd {
            momentum: options.momentum as f32,
            weight_decay: decay,
        }),
    }
}

/// Adam (L2 penalty added to the gradient, Burn's `Adam`) or AdamW (decoupled decay, Burn's
/// `AdamW`), with the step count on the device; see the module documentation.
#[derive(Clone, Debug)]
pub struct DeviceAdam {
    betas: [f32; 2],
    epsilon: f32,
    /// Adam: L2 penalty added to the gradient; AdamW: decoupled decay rate. 0 for none.
    weight_decay: f32,
    /// AdamW's decoupled weight decay instead of Adam's L2 penalty.
    decoupled: bool,
}

/// Adam's state for one parameter: Burn's `AdaptiveMomentumState`, with the number of
/// applied steps as a 1-element f32 device tensor (exact up to 2²⁴ steps).
#[derive(Clone)]
pub struct DeviceAdamState<const D: usize> {
    /// Applied steps so far.
    pub time: Tensor<1>,
    /// First moment.
    pub moment_1: Tensor<D>,
    /// Second moment.
    pub moment_2: Tensor<D>,
}

/// SGD with momentum (no dampening, as torch) and an L2 penalty, Burn's `Sgd` arithmetic.
#[derive(Clone, Debug)]
pub struct DeviceSgd {
    momentum: f32,
    weight_decay: f32,
}

/// SGD's state for one parameter: the velocity (zeros before the first applied step, which
/// makes the first update `v = g`, as torch and Burn start it).
#[derive(Clone)]
pub struct DeviceSgdState<const D: usize> {
    /// The momentum buffer.
    pub velocity: Tensor<D>,
}

/// The step's context, or one that applies every step with the gradients as given (an
/// optimizer used outside the trainer).
fn step_context(device: &Device) -> StepContext {
    context::current().unwrap_or_else(|| StepContext {
        apply: Tensor::ones([1], device),
        grad_factor: None,
    })
}

/// The gradient an update uses: multiplied by the step's factor (clipping), plus an L2
/// penalty `decay · param` when `l2_decay` is not 0 (Burn's `WeightDecay::transform`).
fn prepared_grad<const D: usize>(
    ctx: &StepContext,
    tensor: &Tensor<D>,
    grad: Tensor<D>,
    l2_decay: f32,
) -> Tensor<D> {
    let grad = match &ctx.grad_factor {
        Some(f) => grad.mul(scalar_as::<D>(f)),
        None => grad,
    };
    if l2_decay != 0.0 {
        tensor.clone().mul_scalar(l2_decay).add(grad)
    } else {
        grad
    }
}

/// A 1-element tensor shaped to broadcast against rank `D`.
fn scalar_as<const D: usize>(t: &Tensor<1>) -> Tensor<D> {
    t.clone().reshape([1; D])
}

/// `new` where the step applies, `old` where it is skipped (a select: a NaN in `new` never
/// reaches the result of a skipped step).
fn select<const D: usize>(skip: &Tensor<1, Bool>, new: Tensor<D>, old: Tensor<D>) -> Tensor<D> {
    let mask = skip.clone().reshape([1; D]).expand(new.dims());
    new.mask_where(mask, old)
}

impl Optimizer for DeviceAdam {
    type State<const D: usize> = DeviceAdamState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let device = tensor.device();
        let ctx = step_context(&device);
        let (time, moment_1, moment_2) = match state {
            Some(s) => (s.time, s.moment_1, s.moment_2),
            None => {
                let zeros = Tensor::<D>::zeros(tensor.dims(), &device);
                (Tensor::zeros([1], &device), zeros.clone(), zeros)
            }
        };
        let time_next = time.clone() + ctx.apply.clone();
        if !self.decoupled && kernels::adam_serves(&tensor, &grad) {
            let config = AdamConfigScalars {
                lr: lr as f32,
                betas: self.betas,
                epsilon: self.epsilon,
                weight_decay: self.weight_decay,
            };
            let (tensor, moment_1, moment_2) = kernels::adam_step(
                tensor,
                grad,
                (moment_1, moment_2),
                (time_next.clone(), ctx.apply, ctx.grad_factor),
                config,
            );
            let state = DeviceAdamState {
                time: time_next,
                moment_1,
                moment_2,
            };
            return (tensor, Some(state));
        }
        let l2_decay = if self.decoupled {
            0.0
        } else {
            self.weight_decay
        };
        let grad = prepared_grad(&ctx, &tensor, grad, l2_decay);
        let [beta_1, beta_2] = self.betas;
        let m = moment_1
            .clone()
            .mul_scalar(beta_1)
            .add(grad.clone().mul_scalar(1.0 - beta_1));
        let v = moment_2
            .clone()
            .mul_scalar(beta_2)
            .add(grad.square().mul_scalar(1.0 - beta_2));
        // βᵗ from the device's step count. A skipped first step computes 1 − β⁰ = 0 and
        // divides by it; the select below discards that.
        let power = |beta: f32| {
            Tensor::<1>::full([1], beta, &device)
                .powf(time_next.clone())
                .neg()
                .add_scalar(1.0)
        };
        let (correction_1, correction_2) = (power(beta_1), power(beta_2));
        let updated = if self.decoupled {
            // Burn's `AdaptiveMomentumW`, then the decoupled decay.
            let m_hat = m.clone().div(scalar_as::<D>(&correction_1));
            let v_hat = v.clone().div(scalar_as::<D>(&correction_2));
            let delta = m_hat.div(v_hat.sqrt().add_scalar(self.epsilon));
            let decay_rate = lr * self.weight_decay as f64;
            let decayed = if decay_rate == 0.0 {
                tensor.clone()
            } else {
                tensor.clone().mul_scalar(1.0 - decay_rate)
            };
            decayed - delta.mul_scalar(lr)
        } else {
            // Burn's `AdaptiveMomentum`: both corrections folded into one factor.
            let sqrt_2 = correction_2.sqrt();
            let combined = sqrt_2.clone().div(correction_1);
            let delta = m.clone().mul(scalar_as::<D>(&combined)).div(
                v.clone()
                    .sqrt()
                    .add(scalar_as::<D>(&sqrt_2.mul_scalar(self.epsilon))),
            );
            tensor.clone() - delta.mul_scalar(lr)
        };
        let skip = ctx.apply.equal_elem(0.0);
        let state = DeviceAdamState {
            time: time_next,
            moment_1: select(&skip, m, moment_1),
            moment_2: select(&skip, v, moment_2),
        };
        (select(&skip, updated, tensor), Some(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        DeviceAdamState {
            time: state.time.to_device(device),
            moment_1: state.moment_1.to_device(device),
            moment_2: state.moment_2.to_device(device),
        }
    }
}

impl Optimizer for DeviceSgd {
    type State<const D: usize> = DeviceSgdState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let device = tensor.device();
        let ctx = step_context(&device);
        let velocity = match state {
            Some(s) => s.velocity,
            None => Tensor::zeros(tensor.dims(), &device),
        };
        let grad = prepared_grad(&ctx, &tensor, grad, self.weight_decay);
        // Burn's `Momentum::transform` without dampening; from zeros the first step is `g`.
        let v = grad.add(velocity.clone().mul_scalar(self.momentum));
        let updated = tensor.clone() - v.clone().mul_scalar(lr);
        let skip = ctx.apply.equal_elem(0.0);
        let state = DeviceSgdState {
            velocity: select(&skip, v, velocity),
        };
        (select(&skip, updated, tensor), Some(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        DeviceSgdState {
            velocity: state.velocity.to_device(device),
        }
    }
}

/// Burn's `AdamState`/`AdamWState` record layout: `{prefix}.momentum.{time, moment_1,
/// moment_2}`. Writing the step count reads it from the device: records are written at
/// checkpoints and snapshots, which are sync points anyway.
impl<const D: usize> RecordState for DeviceAdamState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        let momentum = burn::optim::join_path(prefix, "momentum");
        let time = self.time.clone().into_scalar::<f32>().max(0.0) as usize;
        out.push_scalar(&momentum, "time", Scalar::from(time));
        out.push_tensor(&momentum, "moment_1", self.moment_1.clone().into_data());
        out.push_tensor(&momentum, "moment_2", self.moment_2.clone().into_data());
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let momentum = burn::optim::join_path(prefix, "momentum");
        let time = usize::try_from(src.take_scalar(&momentum, "time")?).ok()?;
        let moment_1 = Tensor::from_data(src.take_tensor(&momentum, "moment_1")?, device);
        let moment_2 = Tensor::from_data(src.take_tensor(&momentum, "moment_2")?, device);
        Some(DeviceAdamState {
            time: Tensor::from_data(TensorData::new(vec![time as f32], [1]), device),
            moment_1,
            moment_2,
        })
    }
}

/// Burn's `SgdState` record layout: `{prefix}.momentum.velocity`.
impl<const D: usize> RecordState for DeviceSgdState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        let momentum = burn::optim::join_path(prefix, "momentum");
        out.push_tensor(&momentum, "velocity", self.velocity.clone().into_data());
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let momentum = burn::optim::join_path(prefix, "momentum");
        let velocity = Tensor::from_data(src.take_tensor(&momentum, "velocity")?, device);
        Some(DeviceSgdState { velocity })
    }
}

#[cfg(test)]
mod tests;
