//! Data parallelism's step: the gradients and the step's statistics summed over the ranks,
//! once per optimizer step (after the last micro-batch, never per micro-batch).

use super::Run;
use super::accumulate::Accumulated;
use crate::distributed::{GradReducer, ReduceStats};
use crate::error::{KilnError, Result};
use crate::train::contract::TrainStep;
use crate::train::step::host_read::read_to_host;
use burn::tensor::Tensor;

impl<B: Send, M: TrainStep<B> + 'static> Run<'_, '_, '_, B, M> {
    /// Replaces this rank's gradients, loss sum and sample count by their sums over all
    /// ranks (nothing to do in a world of one, except on a device group, whose collective
    /// runs even for one device). Everything after it (unscaling, the guard's
    /// check, clipping, the optimizer) then sees the same values on every rank, so the ranks
    /// take the same decisions: a NaN on one rank makes the sum NaN and skips the step on all.
    pub(super) fn reduce(&mut self, model: &M, acc: &mut Accumulated) -> Result<()> {
        let collective = self.trainer.collective.clone();
        if collective.size() <= 1 && collective.device_group().is_none() {
            return Ok(());
        }
        let _s = tracing::info_span!("all_reduce", ranks = collective.size()).entered();
        let started = std::time::Instant::now();
        let grads = acc
            .grads
            .take()
            .ok_or_else(|| KilnError::Loader("internal: the step's gradients were taken".into()))?;
        acc.grads = Some(GradReducer::default().reduce(model, grads, &*collective)?);
        // The host collectives sum the loss with the step's statistics: one counted read per
        // step under data parallelism (the gradients cross the host here anyway).
        let device = self.device();
        let loss_sum = match acc.loss_total.take() {
            Some(t) => read_to_host(t).first().copied().unwrap_or(f32::NAN) as f64,
            None => 0.0,
        };
        let stats = ReduceStats::reduce(&*collective, loss_sum, acc.samples, acc.compute_ms)?;
        acc.loss_total = Some(Tensor::full([1], stats.loss_sum as f32, &device));
        acc.samples = stats.samples;
        acc.rank_compute_ms = Some(stats.rank_compute_ms);
        acc.reduce_ms = Some(started.elapsed().as_secs_f64() * 1e3);
        Ok(())
    }
}
