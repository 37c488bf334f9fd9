//! The micro-batches of one optimizer step: forward, loss weighting and scaling, backward,
//! and gradient accumulation.

use std::time::Instant;

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Tensor;

use super::{Run, loss_not_scalar};
use crate::data::EpochBatches;
use crate::distributed::batch_norm::check_synchronized;
use crate::error::{KilnError, Result};
use crate::kernels::stats_sync;
use crate::precision::autocast;
use crate::train::contract::TrainStep;

/// The gradients of one optimizer step and what was measured while producing them.
pub(in crate::train) struct Accumulated {
    /// The summed gradients, still multiplied by the loss scale when scaling is on.
    pub grads: Option<GradientsParams>,
    /// Sum over the micro-batches of mean loss × samples, on the device (`[1]`); `None`
    /// when this rank had no samples in the step.
    pub loss_total: Option<Tensor<1>>,
    /// Samples in the step.
    pub samples: usize,
    /// Time spent waiting for the loader, ms.
    pub data_ms: f64,
    /// Forward + backward time, ms.
    pub compute_ms: f64,
    /// Under data parallelism, after the reduction: each rank's `compute_ms`.
    pub rank_compute_ms: Option<Vec<f64>>,
    /// Under data parallelism: the reduction's milliseconds on this rank.
    pub reduce_ms: Option<f64>,
}

impl<B: Send, M: TrainStep<B> + 'static> Run<'_, '_, '_, B, M> {
    /// Runs the micro-batches of sizes `sizes` through `model` and sums their gradients.
    /// Each micro-batch's mean loss is weighted by its share of the step's `group` samples
    /// (on all ranks, under data parallelism), so N micro-batches give exactly the gradient
    /// of one batch of N·b samples, and the ranks' gradients sum to the step's. A size of 0
    /// (a rank without a part of the epoch's last, short batch) loads and runs nothing.
    pub(super) fn accumulate(
        &mut self,
        model: &M,
        batches: &mut EpochBatches<'_, '_, B>,
        sizes: &[usize],
        group: usize,
    ) -> Result<Accumulated> {
        let local: usize = sizes.iter().sum();
        let started = Instant::now();
        let mut data_ms = 0f64;
        let mut accum = GradientsAccumulator::<M>::new();
        let mut loss_total: Option<Tensor<1>> = None;
        for &size in sizes {
            if size == 0 {
                // Nothing to run here, but the other ranks' synchronized BatchNorm statistics
                // need this rank's (zero) part.
                stats_sync::replay_with_zeros()?;
                continue;
            }
            stats_sync::begin_micro_batch();
            let td = Instant::now();
            let batch = {
                let _s = tracing::info_span!("data_wait").entered();
                batches.next().ok_or_else(|| {
                    KilnError::Loader("the epoch ended before its last step".into())
                })??
            };
            data_ms += td.elapsed().as_secs_f64() * 1e3;
            let forward_span = tracing::info_span!("forward").entered();
            let loss = {
                let _amp = autocast(self.trainer.options.precision);
                model.step(batch).loss
            };
            let dims = loss.dims();
            if dims != [1] {
                return Err(loss_not_scalar(&dims));
            }
            // Kept on the device and read at the loop's next sync point: a read here would
            // stall an asynchronous backend (CUDA) between micro-batches.
            let weighted = loss.clone().detach().mul_scalar(size as f64);
            loss_total = Some(match loss_total.take() {
                Some(t) => t + weighted,
                None => weighted,
            });
            let loss = if size == group {
                loss
            } else {
                loss.mul_scalar(size as f64 / group as f64)
            };
            let loss = match &self.device_scaler {
                Some(scaler) => loss.mul(scaler.scale.clone()),
                None => loss,
            };
            drop(forward_span);
            let _backward = tracing::info_span!("backward").entered();
            let grads = GradientsParams::from_grads(loss.backward(), model);
            accum.accumulate(model, grads);
            stats_sync::end_micro_batch()?;
            if !self.batch_norms.is_empty() {
                check_synchronized(&self.batch_norms)?;
                self.batch_norms.clear();
            }
        }
        Ok(Accumulated {
            grads: Some(accum.grads()),
            loss_total,
            samples: local,
            data_ms,
            compute_ms: started.elapsed().as_secs_f64() * 1e3 - data_ms,
            rank_compute_ms: None,
            reduce_ms: None,
        })
    }
}
