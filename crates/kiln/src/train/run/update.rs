//! Guard and step: unscale the gradients, check them (one fused scalar read), clip by the
//! global norm, step the optimizer, check the parameters, and roll back or abort by policy.

use burn::optim::ModuleOptimizer;

use super::Run;
use super::accumulate::Accumulated;
use crate::error::{KilnError, Result};
use crate::guard::{
    GuardAction, GuardEvent, GuardPolicy, Trouble, nonfinite_grad_names, nonfinite_param_names,
    probe_grads, probe_params,
};
use crate::observe::Event;
use crate::train::contract::TrainStep;
use crate::train::restore::Snapshot;
use crate::train::{build_optimizer, clip_global_norm, learning_rate, scale_grads};

/// What the update did.
pub(in crate::train) struct StepOutcome {
    /// What was non-finite, if anything (the step was then skipped or rolled back).
    pub trouble: Option<Trouble>,
    /// Learning rate of the step.
    pub lr: f64,
    /// Global gradient norm before clipping, when clipping ran.
    pub grad_norm: Option<f32>,
    /// Loss scale in force during the step.
    pub loss_scale: f32,
}

impl<B: Send, M: TrainStep<B> + 'static> Run<'_, '_, '_, B, M> {
    /// Applies one step's gradients to `model`; see the module documentation.
    pub(super) fn guard_and_step(
        &mut self,
        mut model: M,
        mut optim: ModuleOptimizer,
        acc: &mut Accumulated,
    ) -> Result<(M, ModuleOptimizer, StepOutcome)> {
        let mean_loss = acc.mean_loss();
        let mut grads = acc
            .grads
            .take()
            .ok_or_else(|| KilnError::Loader("internal: the step's gradients were taken".into()))?;
        if self.scaler.enabled() {
            // Unscale once, before the guard's check and before clipping.
            let _s = tracing::info_span!("unscale").entered();
            grads = scale_grads(&model, grads, self.scaler.inverse_scale());
        }
        let step_no = self.pos.global_step + 1;
        let loss_scale = self.scaler.scale();
        let trouble = {
            let _s = tracing::info_span!("guard_check").entered();
            if !mean_loss.is_finite() {
                Some(Trouble::Loss)
            } else if probe_grads(&model, &grads).is_some_and(|p| !finite(p)) {
                Some(Trouble::Gradients)
            } else {
                None
            }
        };
        // An overflow in the gradients alone is the scaler's business (skip, halve the scale)
        // while the scale is still >= 1; below that, scaling no longer explains it and the
        // guard's policy applies.
        let scaler_owns = trouble == Some(Trouble::Gradients)
            && self.scaler.enabled()
            && self.scaler.scale() >= 1.0;
        self.scaler.update(trouble.is_some());
        // The schedule spans the planned epochs, not max_steps: a run stopped early and
        // resumed must see the same learning rates as one that never stopped.
        let lr = learning_rate(&self.trainer.options, self.pos.global_step, self.planned);
        let mut outcome = StepOutcome {
            trouble,
            lr,
            grad_norm: None,
            loss_scale,
        };
        if let Some(trouble) = trouble {
            let tensors = match trouble {
                Trouble::Gradients => nonfinite_grad_names(&model, &grads),
                _ => Vec::new(),
            };
            let action = if scaler_owns {
                GuardAction::ScaleBackoff
            } else {
                self.guard.decide(trouble, self.snapshot.is_some())
            };
            self.guard_event(GuardEvent {
                step: step_no,
                trouble,
                tensors,
                loss: mean_loss,
                loss_scale,
                action,
                restored_step: None,
            })?;
            return Ok((model, optim, outcome));
        }
        if let Some(max_norm) = self.trainer.options.grad_clip_norm {
            let _s = tracing::info_span!("clip").entered();
            let (clipped, norm) = clip_global_norm(&model, grads, max_norm);
            grads = clipped;
            outcome.grad_norm = Some(norm);
        }
        model = {
            let _s = tracing::info_span!("optimizer").entered();
            optim.step(lr, model, grads)
        };
        let params_bad = self.trainer.options.guard.check_params && {
            let _s = tracing::info_span!("guard_check").entered();
            probe_params(&model).is_some_and(|p| !finite(p))
        };
        if params_bad {
            let tensors = nonfinite_param_names(&model);
            let action = self
                .guard
                .decide(Trouble::Parameters, self.snapshot.is_some());
            let mut restored_step = None;
            if let (GuardAction::RolledBack, Some(snap)) = (action, &self.snapshot) {
                (model, optim) = snap.restore(build_optimizer(&self.trainer.options))?;
                restored_step = Some(snap.step);
            }
            self.guard_event(GuardEvent {
                step: step_no,
                trouble: Trouble::Parameters,
                tensors,
                loss: mean_loss,
                loss_scale,
                action,
                restored_step,
            })?;
        } else {
            self.guard.clean_step();
            let due = self
                .snapshot
                .as_ref()
                .is_none_or(|s| step_no - s.step >= self.trainer.options.guard.snapshot_every);
            if self.trainer.options.guard.policy == GuardPolicy::Rollback && due {
                self.snapshot = Some(Snapshot::take(&model, &optim, step_no)?);
            }
        }
        Ok((model, optim, outcome))
    }

    /// Reports a guard event to the sink and keeps it for the run summary; an `Aborted`
    /// action ends the run with an error saying what the guard saw.
    fn guard_event(&mut self, event: GuardEvent) -> Result<()> {
        if event.action == GuardAction::ScaleBackoff {
            // Routine for f16: worth a line in the log, not a warning.
            tracing::info!(
                step = event.step,
                scale = event.loss_scale,
                "gradients overflowed {:?}: step skipped, loss scale halved",
                event.tensors
            );
        } else {
            tracing::warn!(
                step = event.step,
                scale = event.loss_scale,
                "non-finite {:?} {:?}: {:?}",
                event.trouble,
                event.tensors,
                event.action
            );
        }
        self.trainer.emit(&Event::Guard(event.clone()));
        let (aborted, step, loss) = (event.action == GuardAction::Aborted, event.step, event.loss);
        self.guard.events.push(event);
        if aborted {
            return Err(self.diverged(step, loss));
        }
        Ok(())
    }

    /// The error that ends a run the guard gave up on, with what it saw.
    fn diverged(&self, step: u64, loss: f32) -> KilnError {
        let guard = &self.guard;
        let what = guard.events.last().map_or("a value".to_string(), |e| {
            let place = if e.tensors.is_empty() {
                String::new()
            } else {
                format!(" in {}", e.tensors.join(", "))
            };
            format!("non-finite {:?}{place}", e.trouble).to_lowercase()
        });
        KilnError::Diverged {
            step,
            loss,
            detail: format!(
                "{what} (loss {loss}); {} non-finite step(s) in a row, {} guard event(s) in total",
                guard.consecutive(),
                guard.events.len()
            ),
        }
    }
}

/// Whether a fused probe read back as finite (0 means every tensor was finite).
fn finite(probe: burn::tensor::Tensor<1>) -> bool {
    probe.into_scalar::<f32>().is_finite()
}
