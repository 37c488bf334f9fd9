//! [`BatchNorm`]: Burn's BatchNorm whose training-mode forward and backward run Kiln's kernels
//! (two passes over the activation each way instead of Burn's composed ops), with an optional
//! fused ReLU ([`BatchNorm::forward_relu`]).

use std::rc::Rc;

use burn::module::{Flag, Module, Param, RunningState};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};

use crate::kernels::stats_sync;

/// Configuration of a [`BatchNorm`] layer: Burn's [`burn::nn::BatchNormConfig`] (same fields,
/// same defaults, same setters) whose `init` builds the Kiln layer.
#[derive(Debug, Clone)]
pub struct BatchNormConfig(pub burn::nn::BatchNormConfig);

wraps_burn_config!(BatchNormConfig, burn::nn::BatchNormConfig, {
    /// Added to the variance before its square root.
    with_epsilon(epsilon: f64),
    /// Weight of the batch statistics in the running statistics' update.
    with_momentum(momentum: f64),
});

impl BatchNormConfig {
    /// Normalization over `num_features` channels.
    pub fn new(num_features: usize) -> Self {
        BatchNormConfig(burn::nn::BatchNormConfig::new(num_features))
    }

    /// The layer (γ = 1, β = 0, running mean 0, running variance 1, as Burn's).
    pub fn init(&self, device: &burn::tensor::Device) -> BatchNorm {
        self.0.init(device).into()
    }
}

/// Batch normalization over channel axis 1, like [`burn::nn::BatchNorm`] and with its record:
/// training mode (an autodiff device and the layer's training flag) normalizes with the batch
/// statistics and updates the running ones; inference mode uses the running statistics.
#[derive(Module, Debug)]
pub struct BatchNorm {
    /// Scale γ.
    pub gamma: Param<Tensor<1>>,
    /// Shift β.
    pub beta: Param<Tensor<1>>,
    /// Whether the layer trains (Burn's flag).
    pub training: Param<Flag>,
    /// Running mean.
    pub running_mean: RunningState<Tensor<1>>,
    /// Running (biased) variance.
    pub running_var: RunningState<Tensor<1>>,
    /// Weight of the batch statistics in the running statistics' update.
    pub momentum: f64,
    /// Added to the variance before its square root.
    pub epsilon: f64,
}

impl BatchNorm {
    /// The forward pass, as Burn's layer computes it; in training mode on the CPU for f32
    /// `[N, C, H, W]` through Kiln's kernels.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.run(input, false)
    }

    /// `relu(self.forward(input))` with the ReLU fused into the normalization's pass (and its
    /// mask into the backward's) where Kiln's kernels run.
    pub fn forward_relu<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.run(input, true)
    }

    fn run<const D: usize>(&self, input: Tensor<D>, with_relu: bool) -> Tensor<D> {
        let device = input.device();
        if !(device.is_autodiff() && self.training.is_enabled()) {
            let out = burn::tensor::module::batch_norm(
                input,
                self.gamma.val(),
                self.beta.val(),
                self.running_mean.value().to_device(&device),
                self.running_var.value().to_device(&device),
                self.epsilon,
            );
            return if with_relu { relu(out) } else { out };
        }
        let dims = input.dims();
        let sums_before = stats_sync::calls();
        let kiln = if D == 4 {
            let x: Tensor<4> = input.clone().reshape([dims[0], dims[1], dims[2], dims[3]]);
            crate::kernels::batch_norm_train(
                x,
                self.gamma.val(),
                self.beta.val(),
                self.epsilon,
                with_relu,
            )
        } else {
            None
        };
        // Under data parallelism the trainer checks that every BatchNorm synchronized, and a
        // rank without samples in a later micro-batch updates the running statistics from
        // the replayed global sums as this one does below.
        if stats_sync::calls() > sums_before {
            stats_sync::mark_synced(self.gamma.id);
            let (running_mean, running_var) = (self.running_mean.clone(), self.running_var.clone());
            let (momentum, device) = (self.momentum, device.clone());
            stats_sync::on_replay(Rc::new(move |summed: &[f64]| {
                let (mean, var) = kiln_kernels::norm::stats_from_summed(summed);
                let c = mean.len();
                let batch = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [c]), &device);
                update_running(&running_mean, batch(mean), momentum, &device);
                update_running(&running_var, batch(var), momentum, &device);
            }));
        }
        let (out, mean, var) = match kiln {
            Some((out, mean, var)) => (out.reshape(dims), mean, var),
            None => {
                let r = burn::tensor::module::batch_norm_train(
                    input,
                    self.gamma.val(),
                    self.beta.val(),
                    self.epsilon,
                );
                let out = if with_relu { relu(r.output) } else { r.output };
                (out, r.mean, r.variance)
            }
        };
        update_running(&self.running_mean, mean, self.momentum, &device);
        update_running(&self.running_var, var, self.momentum, &device);
        out
    }
}

/// The running statistics' update, as Burn's layer does it: running · (1 − m) + batch · m,
/// outside the graph.
fn update_running(running: &RunningState<Tensor<1>>, batch: Tensor<1>, m: f64, device: &Device) {
    let blended = running
        .value_sync()
        .to_device(device)
        .mul_scalar(1.0 - m)
        .add(batch.detach().mul_scalar(m))
        .detach();
    running.update(blended);
}

impl From<burn::nn::BatchNorm> for BatchNorm {
    fn from(layer: burn::nn::BatchNorm) -> Self {
        BatchNorm {
            gamma: layer.gamma,
            beta: layer.beta,
            training: layer.training,
            running_mean: layer.running_mean,
            running_var: layer.running_var,
            momentum: layer.momentum,
            epsilon: layer.epsilon,
        }
    }
}

impl From<BatchNorm> for burn::nn::BatchNorm {
    fn from(layer: BatchNorm) -> Self {
        burn::nn::BatchNorm {
            gamma: layer.gamma,
            beta: layer.beta,
            training: layer.training,
            running_mean: layer.running_mean,
            running_var: layer.running_var,
            momentum: layer.momentum,
            epsilon: layer.epsilon,
        }
    }
}
