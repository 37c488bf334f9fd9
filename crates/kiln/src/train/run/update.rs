//! The update, on the device: unscale the gradients, the guard's verdict (a finite loss and
//! finite gradients), the global-norm clipping coefficient, the optimizer step — applied or
//! skipped by a device-side select ([`crate::train::step::context`]) — and the loss scale's
//! update. Nothing here reads a value back: the step's loss, norm, scale and probes go into a
//! [`PendingStep`] that the loop reads at its next sync point (`sync.rs`), where the guard's
//! policy, the events and the host's copy of the scaler catch up.

use burn::optim::ModuleOptimizer;
use burn::tensor::Tensor;

use super::Run;
use super::accumulate::Accumulated;
use crate::error::{KilnError, Result};
use crate::guard::{probe_grads_each, probe_params};
use crate::train::contract::TrainStep;
use crate::train::step::context::{self, StepContext};
use crate::train::{global_norm, learning_rate, scale_grads_by};

/// Record layout of a pending step (`sync.rs`): loss sum, gradient norm (0 without clipping), the loss
/// scale in force (1 without scaling), the parameters' probe (0 without the check), then one
/// gradient probe per parameter.
pub(super) const RECORD_HEAD: usize = 4;

impl<B: Send, M: TrainStep<B> + 'static> Run<'_, '_, '_, B, M> {
    /// Applies one step's gradients to `model` on the device; see the module documentation.
    pub(super) fn guard_and_step(
        &mut self,
        mut model: M,
        mut optim: ModuleOptimizer,
        acc: &mut Accumulated,
    ) -> Result<(M, ModuleOptimizer, Tensor<1>, f64)> {
        let device = self.device();
        let mut grads = acc
            .grads
            .take()
            .ok_or_else(|| KilnError::Loader("internal: the step's gradients were taken".into()))?;
        let scale = self.device_scaler.as_ref().map(|s| s.scale.clone());
        if let Some(scale) = &scale {
            // Unscale once, before the guard's check and before clipping.
            let _s = tracing::info_span!("unscale").entered();
            grads = scale_grads_by(&model, grads, &scale.clone().recip());
        }
        let (apply, probes) = {
            let _s = tracing::info_span!("guard_check").entered();
            // No samples on this rank this step (data parallelism's short last batch): it adds
            // nothing to the loss.
            let loss = acc
                .loss_total
                .clone()
                .unwrap_or_else(|| Tensor::zeros([1], &device));
            let probes = probe_grads_each(&model, &grads);
            // 0·loss is 0 for a finite loss and NaN otherwise; each probe is 0 or NaN.
            let mut check = loss.mul_scalar(0.0);
            if let Some(p) = &probes {
                check = check + p.clone().sum();
            }
            (check.equal_elem(0.0).float(), probes)
        };
        // The schedule spans the planned epochs, not max_steps: a run stopped early and
        // resumed must see the same learning rates as one that never stopped.
        let lr = learning_rate(&self.trainer.options, self.pos.global_step, self.planned);
        let (norm, grad_factor) = match self.trainer.options.grad_clip_norm {
            Some(max_norm) => {
                let _s = tracing::info_span!("clip").entered();
                match global_norm(&model, &grads) {
                    // torch's coefficient `max_norm / (norm + 1e-6)`, capped at 1.
                    Some(norm) => {
                        let coef = Tensor::<1>::full([1], max_norm as f32, &device)
                            .div(norm.clone().add_scalar(1e-6))
                            .clamp_max(1.0);
                        (Some(norm), Some(coef))
                    }
                    None => (None, None),
                }
            }
            None => (None, None),
        };
        model = {
            let _s = tracing::info_span!("optimizer").entered();
            let _ctx = context::enter(StepContext {
                apply: apply.clone(),
                grad_factor,
            });
            optim.step(lr, model, grads)
        };
        let params_probe = if self.trainer.options.guard.check_params {
            let _s = tracing::info_span!("guard_check").entered();
            probe_params(&model)
        } else {
            None
        };
        if let Some(scaler) = self.device_scaler.as_mut() {
            scaler.update(&apply);
        }
        let zero = || Tensor::<1>::zeros([1], &device);
        let mut parts = vec![
            acc.loss_total
                .take()
                .unwrap_or_else(|| Tensor::zeros([1], &device)),
            norm.unwrap_or_else(zero),
            scale.unwrap_or_else(|| Tensor::ones([1], &device)),
            params_probe.map(|p| p.reshape([1])).unwrap_or_else(zero),
        ];
        parts.extend(probes);
        Ok((model, optim, Tensor::cat(parts, 0), lr))
    }
}
