//! After a step: the position, the step event, the memory watermark (and OOM-adaptive
//! micro-batch halving) and periodic checkpoints.

use std::time::Instant;

use burn::optim::ModuleOptimizer;
use burn::tensor::Tensor;

use super::Run;
use super::accumulate::Accumulated;
use super::sync::PendingStep;
use crate::error::Result;
use crate::observe::{BatchAdaptedEvent, Event, StepEvent, WatermarkEvent, memory};
use crate::train::contract::TrainStep;

impl<B: Send, M: TrainStep<B> + 'static> Run<'_, '_, '_, B, M> {
    /// Advances the position, queues the step's event (its device values are read at the
    /// next sync point), checks the memory watermark and syncs and checkpoints when due.
    /// Returns the model and optimizer (a sync may roll them back) and whether the
    /// micro-batch was halved.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn after_step(
        &mut self,
        model: M,
        optim: ModuleOptimizer,
        epoch: usize,
        s: usize,
        acc: &Accumulated,
        (record, lr): (Tensor<1>, f64),
        t0: Instant,
    ) -> Result<(M, ModuleOptimizer, bool)> {
        self.pos.global_step += 1;
        self.pos.step_in_epoch = s + 1;
        let step_ms = t0.elapsed().as_secs_f64() * 1e3;
        self.first_step_ms.get_or_insert(step_ms);
        self.totals.step_seconds += step_ms / 1e3;
        self.totals.data_seconds += acc.data_ms / 1e3;
        self.totals.samples += acc.samples as u64;
        let report_span = tracing::info_span!("report").entered();
        self.pending.push(PendingStep {
            record,
            event: StepEvent {
                step: self.pos.global_step,
                epoch,
                // The device values (loss, norm, scale, skipped) come at the sync point.
                loss: f32::NAN,
                lr,
                grad_norm: None,
                samples: acc.samples,
                step_ms,
                data_ms: acc.data_ms,
                compute_ms: step_ms - acc.data_ms,
                samples_per_s: acc.samples as f64 / (step_ms / 1e3).max(1e-9),
                peak_rss_bytes: memory::peak_rss_bytes(),
                skipped: false,
                loss_scale: None,
                rank_compute_ms: acc.rank_compute_ms.clone(),
                reduce_ms: acc.reduce_ms,
            },
        });
        let adapted = self.check_watermark()?;
        drop(report_span);
        let checkpoint_due = self
            .trainer
            .options
            .checkpoint_every_steps
            .is_some_and(|k| self.pos.global_step.is_multiple_of(k));
        let (model, optim) = if checkpoint_due || self.sync_due() {
            self.sync(model, optim)?
        } else {
            (model, optim)
        };
        if checkpoint_due {
            self.last_checkpoint = self.checkpoint(&model, &optim)?;
        }
        Ok((model, optim, adapted))
    }

    /// Reads memory in use against the watermark; on a crossing reports it and, with
    /// `oom_adaptive`, halves the micro-batch. Returns whether it halved.
    ///
    /// After a halving the watermark re-arms at once: the reading after the next step (the
    /// step's heap peak where the heap is counted) shows whether half was enough, and a
    /// reading still above halves again, down to what fits or to a micro-batch of 1.
    ///
    /// Under data parallelism the ranks agree: a crossing on any rank halves on all (one
    /// small all-reduce per step), so their micro-batches never differ.
    fn check_watermark(&mut self) -> Result<bool> {
        let step = self.pos.global_step;
        let device = self.device();
        let Some(mark) = self.watermark.as_mut() else {
            return Ok(false);
        };
        let threshold = mark.threshold();
        let reading = memory::in_use_reading_on(&device);
        let crossed_here = reading.is_some_and(|in_use| mark.check(in_use));
        // The crossing reported: under data parallelism the rank that is furthest over its
        // watermark (every rank's reading and threshold are gathered), so rank 0's event
        // names real figures even when only another rank crossed.
        let mine = match reading {
            Some(in_use) if crossed_here => [1.0, in_use as f64, threshold as f64],
            _ => [0.0; 3],
        };
        let crossing = self
            .trainer
            .collective
            .all_gather_f64(&mine)?
            .chunks_exact(3)
            .enumerate()
            .filter(|(_, s)| s[0] > 0.0)
            .max_by(|(_, a), (_, b)| (a[1] / a[2]).total_cmp(&(b[1] / b[2])))
            .map(|(rank, s)| (rank, s[1] as u64, s[2] as u64));
        let Some((rank, in_use, threshold)) = crossing else {
            return Ok(false);
        };
        if crossed_here {
            tracing::warn!(
                step,
                "memory in use {} crossed the watermark {}",
                memory::human_bytes(reading.unwrap_or(0)),
                memory::human_bytes(mark.threshold())
            );
        } else {
            tracing::warn!(
                step,
                "rank {rank}'s memory in use {} crossed its watermark {}: halving with it",
                memory::human_bytes(in_use),
                memory::human_bytes(threshold)
            );
        }
        self.trainer.emit(&Event::MemoryWatermark(WatermarkEvent {
            step,
            in_use_bytes: in_use,
            threshold_bytes: threshold,
        }));
        let halved = self.trainer.options.oom_adaptive && self.halve_micro_batch(step);
        if halved && let Some(mark) = self.watermark.as_mut() {
            mark.rearm();
            // A device pool keeps the larger micro-batch's pages: release them, so the next
            // reading is what the halved one needs.
            memory::release_device_pages(&device);
        }
        Ok(halved)
    }

    /// Halves the micro-batch and doubles accumulation (same effective batch, about half the
    /// activation memory); reports it. Returns whether it changed anything: an odd
    /// micro-batch cannot be halved exactly, and 1 cannot be halved.
    fn halve_micro_batch(&mut self, step: u64) -> bool {
        let micro = self.micro_batch;
        if micro < 2 || !micro.is_multiple_of(2) {
            tracing::warn!(
                step,
                micro_batch = micro,
                "memory watermark crossed but micro-batch {micro} cannot be halved exactly"
            );
            return false;
        }
        self.micro_batch /= 2;
        self.accum_steps *= 2;
        tracing::warn!(
            step,
            "memory watermark: micro-batch halved to {} with {} accumulation steps (effective \
             batch unchanged)",
            self.micro_batch,
            self.accum_steps
        );
        self.trainer.emit(&Event::BatchAdapted(BatchAdaptedEvent {
            step,
            micro_batch: self.micro_batch,
            grad_accum_steps: self.accum_steps,
            effective_batch: self.micro_batch * self.accum_steps,
        }));
        true
    }
}
