//! The loop's sync points: the one read of the steps since the last one, and everything the
//! host does with what it reads — the epoch's loss, the step and guard events, the guard's
//! policy (abort, roll back), the host's copy of the loss scaler, rollback snapshots.
//!
//! Why deferred: each step keeps its loss, guard verdict, gradient norm and loss scale on the
//! device (`update.rs`), so between sync points the host only queues work and an
//! asynchronous device (CUDA) never waits for it. A sync point comes every
//! `train.sync_every` steps and before anything that needs the values: a checkpoint, the
//! end of an epoch (evaluation, the epoch summary), the end of the run. With
//! `train.sync_every = 1` every step is read at its end, and the trajectory is the same bit
//! for bit at any interval: skipping a non-finite step is the device's select, not the
//! host's decision. What an interval delays is the guard's *policy*: an abort or a rollback
//! comes at the sync point after the step that caused it.

use burn::optim::ModuleOptimizer;
use burn::tensor::Tensor;

use super::Run;
use crate::error::{KilnError, Result};
use crate::guard::{GuardAction, GuardEvent, GuardPolicy, Trouble, nonfinite_param_names};
use crate::observe::{Event, StepEvent};
use crate::train::build_optimizer;
use crate::train::contract::TrainStep;
use crate::train::restore::Snapshot;
use crate::train::step::host_read::read_to_host;

/// A step whose values are still on the device, with what the host measured of it.
pub(in crate::train) struct PendingStep {
    /// The step's device values ([`StepValues::record`]).
    pub record: Tensor<1>,
    /// The step's event, but for what the record holds (loss, norm, scale, skipped).
    pub event: StepEvent,
}

/// A step's device values as the host reads them back; [`StepValues::record`] lays them out
/// on the device, [`StepValues::parse`] reads them, so the layout is written once.
pub(super) struct StepValues<'a> {
    /// Σ mean loss × samples over the step's micro-batches.
    loss_sum: f32,
    /// The global gradient norm (0 without clipping).
    grad_norm: f32,
    /// The loss scale in force (1 without scaling).
    loss_scale: f32,
    /// 0, or NaN when a parameter is not finite after the update (0 without the check).
    params_probe: f32,
    /// Per parameter, in [`crate::guard::param_paths`] order: 0, or NaN for a non-finite
    /// gradient.
    grad_probes: &'a [f32],
}

impl StepValues<'_> {
    /// The values before the per-parameter probes.
    const HEAD: usize = 4;

    /// The step's values as one device tensor (each part `[1]`, the probes `[parameters]`;
    /// `None` for a part the step does not compute).
    pub fn record(
        loss_sum: Tensor<1>,
        grad_norm: Option<Tensor<1>>,
        loss_scale: Option<Tensor<1>>,
        params_probe: Option<Tensor<1>>,
        grad_probes: Option<Tensor<1>>,
    ) -> Tensor<1> {
        let device = loss_sum.device();
        let zero = || Tensor::zeros([1], &device);
        let mut parts = vec![
            loss_sum,
            grad_norm.unwrap_or_else(zero),
            loss_scale.unwrap_or_else(|| Tensor::ones([1], &device)),
            params_probe.unwrap_or_else(zero),
        ];
        parts.extend(grad_probes);
        Tensor::cat(parts, 0)
    }

    /// The values of one step's record as read back.
    fn parse(record: &[f32]) -> StepValues<'_> {
        StepValues {
            loss_sum: record[0],
            grad_norm: record[1],
            loss_scale: record[2],
            params_probe: record[3],
            grad_probes: &record[Self::HEAD..],
        }
    }
}

impl<B: Send, M: TrainStep<B> + 'static> Run<'_, '_, '_, B, M> {
    /// Whether enough steps are pending for a sync point.
    pub(super) fn sync_due(&self) -> bool {
        self.pending.len() >= self.sync_every.max(1)
    }

    /// Reads every pending step in one transfer and catches the host up; see the module
    /// documentation. Returns the model and optimizer (rolled back when the guard says so).
    pub(super) fn sync(
        &mut self,
        mut model: M,
        mut optim: ModuleOptimizer,
    ) -> Result<(M, ModuleOptimizer)> {
        if self.pending.is_empty() {
            return Ok((model, optim));
        }
        let pending = std::mem::take(&mut self.pending);
        let widths: Vec<usize> = pending.iter().map(|p| p.record.dims()[0]).collect();
        let values = read_to_host(Tensor::cat(
            pending.iter().map(|p| p.record.clone()).collect(),
            0,
        ));
        if values.len() != widths.iter().sum::<usize>() {
            return Err(KilnError::Loader(format!(
                "internal: read {} step values back, expected {}",
                values.len(),
                widths.iter().sum::<usize>()
            )));
        }
        let count = pending.len();
        let mut offset = 0;
        let mut last_clean = false;
        for (i, (p, width)) in pending.into_iter().zip(widths).enumerate() {
            let record = &values[offset..offset + width];
            offset += width;
            let (rolled_back, clean) = self.replay(&mut model, &mut optim, p, record)?;
            last_clean = clean;
            if rolled_back {
                let dropped = count - i - 1;
                if dropped > 0 {
                    tracing::warn!(
                        dropped,
                        "rolled back: the {dropped} step(s) queued after the bad one ran on \
                         non-finite parameters and are discarded (train.sync_every = 1 rolls \
                         back at the step itself)"
                    );
                }
                // The device's scaler went on with those steps: take the host's again.
                self.device_scaler = self.scaler.to_device(&self.device());
                last_clean = false;
                break;
            }
        }
        let step_no = self.pos.global_step;
        let due = self
            .snapshot
            .as_ref()
            .is_none_or(|s| step_no - s.step >= self.trainer.options.guard.snapshot_every);
        if last_clean && self.trainer.options.guard.policy == GuardPolicy::Rollback && due {
            self.snapshot = Some(Snapshot::take(&model, &optim, step_no)?);
        }
        Ok((model, optim))
    }

    /// One step's values: its share of the epoch's loss, the host scaler, the guard, its
    /// events. Returns whether the model was rolled back and whether the step was clean.
    fn replay(
        &mut self,
        model: &mut M,
        optim: &mut ModuleOptimizer,
        p: PendingStep,
        record: &[f32],
    ) -> Result<(bool, bool)> {
        let StepValues {
            loss_sum,
            grad_norm,
            loss_scale: scale,
            params_probe,
            grad_probes,
        } = StepValues::parse(record);
        let mut event = p.event;
        let mean_loss = (loss_sum as f64 / event.samples.max(1) as f64) as f32;
        let bad_grads: Vec<String> = grad_probes
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_finite())
            .map(|(j, _)| {
                self.param_paths
                    .get(j)
                    .cloned()
                    .unwrap_or_else(|| format!("parameter {j}"))
            })
            .collect();
        let trouble = if !mean_loss.is_finite() {
            Some(Trouble::Loss)
        } else if !bad_grads.is_empty() {
            Some(Trouble::Gradients)
        } else {
            None
        };
        if mean_loss.is_finite() {
            // A non-finite loss would poison the epoch mean (and the checkpoint's JSON): the
            // mean is over finite ones.
            self.pos.epoch_loss_sum += loss_sum as f64;
            self.pos.epoch_samples += event.samples as u64;
        }
        // An overflow in the gradients alone is the scaler's business (skip, halve the scale)
        // while the scale is still >= 1; below that, scaling no longer explains it and the
        // guard's policy applies.
        let scaler_owns = trouble == Some(Trouble::Gradients)
            && self.scaler.enabled()
            && self.scaler.scale() >= 1.0;
        self.scaler.update(trouble.is_some());
        event.loss = mean_loss;
        event.skipped = trouble.is_some();
        let clipped = self.trainer.options.grad_clip_norm.is_some();
        event.grad_norm = (clipped && trouble.is_none()).then_some(grad_norm);
        event.loss_scale = self.scaler.enabled().then_some(scale);
        let mut rolled_back = false;
        let mut clean = false;
        if let Some(trouble) = trouble {
            let tensors = match trouble {
                Trouble::Gradients => bad_grads,
                _ => Vec::new(),
            };
            let action = if scaler_owns {
                GuardAction::ScaleBackoff
            } else {
                self.guard.decide(trouble, self.snapshot.is_some())
            };
            self.guard_event(GuardEvent {
                step: event.step,
                trouble,
                tensors,
                loss: mean_loss,
                loss_scale: scale,
                action,
                restored_step: None,
            })?;
        } else if !params_probe.is_finite() {
            let tensors = nonfinite_param_names(model);
            let action = self
                .guard
                .decide(Trouble::Parameters, self.snapshot.is_some());
            let mut restored_step = None;
            if let (GuardAction::RolledBack, Some(snap)) = (action, &self.snapshot) {
                (*model, *optim) = snap.restore(build_optimizer(&self.trainer.options))?;
                restored_step = Some(snap.step);
                rolled_back = true;
            }
            self.guard_event(GuardEvent {
                step: event.step,
                trouble: Trouble::Parameters,
                tensors,
                loss: mean_loss,
                loss_scale: scale,
                action,
                restored_step,
            })?;
        } else {
            self.guard.clean_step();
            clean = true;
        }
        self.trainer.emit(&Event::Step(event));
        Ok((rolled_back, clean))
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
