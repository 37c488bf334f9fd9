//! The update, on the device: unscale the gradients, the guard's verdict (a finite loss and
//! finite gradients), the global-norm clipping coefficient, the optimizer step — applied or
//! skipped by a device-side select ([`crate::train::step::context`]) — and the loss scale's
//! update. Nothing here reads a value back: the step's loss, norm, scale and probes go into
//! one device record ([`StepValues::record`]) that the loop reads at its next sync point
//! (`sync.rs`), where the guard's policy, the events and the host's copy of the scaler catch
//! up.

use burn::optim::ModuleOptimizer;
use burn::tensor::Tensor;

use super::Run;
use super::accumulate::Accumulated;
use super::sync::StepValues;
use crate::error::{KilnError, Result};
use crate::guard::{probe_grads_each, probe_params};
use crate::train::contract::TrainStep;
use crate::train::step::context::{self, StepContext};
use crate::train::{global_norm, learning_rate, scale_grads_by};

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
        // No samples on this rank this step (data parallelism's short last batch): it adds
        // nothing to the loss.
        let loss = acc
            .loss_total
            .take()
            .unwrap_or_else(|| Tensor::zeros([1], &device));
        let (apply, probes) = {
            let _s = tracing::info_span!("guard_check").entered();
            let probes = probe_grads_each(&model, &grads);
            // 0·loss is 0 for a finite loss and NaN otherwise; each probe is 0 or NaN.
            let mut check = loss.clone().mul_scalar(0.0);
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
        let record = StepValues::record(loss, norm, scale, params_probe, probes);
        Ok((model, optim, record, lr))
    }
}
