//! The data loader: persistent worker threads that collate (and augment) batches ahead of
//! the consumer into a bounded window, handed out strictly in order.
//!
//! Why this shape:
//! - **Order never depends on timing.** Workers claim batch numbers in order and results are
//!   re-sequenced before they are handed out, so batch `k` of an epoch is the same whatever the
//!   worker count, and a sample's augmentation is seeded by `(seed, epoch, index)`.
//! - **Back-pressure.** A worker may only claim batch `k` while `k < consumed + depth` with
//!   `depth = prefetch_factor × workers`: at most `depth` batches exist ahead of the consumer
//!   (being built or ready), however slow the consumer is.
//! - **Persistent workers.** The threads live for the whole [`DataLoader::run`] body (all epochs
//!   of a training run); an epoch is a new job for the same threads.
//! - **Failures stop cleanly.** A sample that errors or panics becomes
//!   [`KilnError::DataItem`] naming its index; the iterator yields that error and then ends, the
//!   other workers abandon the epoch, and nothing hangs.
//! - **Scoped threads.** Workers borrow the source (`std::thread::scope`), so any `&dyn
//!   BatchSource` works without `Arc` or `'static`.
//! - **Any batch type.** The loader moves sample indices; a [`BatchSource`] turns them into
//!   the batch the model takes: Kiln's image [`Batch`] or a Burn `Batcher`'s output.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use super::source::{BatchContext, BatchSource, ImageBatches, panic_text};
use super::transform::Transform;
use super::{Batch, Dataset, LastBatch, Shard, epoch_order};
use crate::error::{KilnError, Result};

/// How a [`DataLoader`] batches and prefetches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderOptions {
    /// Samples per batch.
    pub batch_size: usize,
    /// Worker threads; 0 builds batches on the consumer's thread when asked.
    pub workers: usize,
    /// Batches each worker may have ready or in progress ahead of the consumer.
    pub prefetch_factor: usize,
    /// Shuffle each epoch (seeded by `seed` and the epoch).
    pub shuffle: bool,
    /// Drop the last batch of an epoch when it is short ([`LastBatch::Drop`]: an epoch with
    /// fewer samples than one batch keeps them).
    pub drop_last: bool,
    /// Fill the last batch of an epoch with the epoch's first samples when it is short
    /// ([`LastBatch::Pad`]), so every batch has one shape.
    #[serde(default)]
    pub pad_last: bool,
    /// Seed for the order and the augmentation.
    pub seed: u64,
}

impl Default for LoaderOptions {
    fn default() -> Self {
        LoaderOptions {
            batch_size: 64,
            workers: 0,
            prefetch_factor: 2,
            shuffle: true,
            drop_last: false,
            pad_last: false,
            seed: 42,
        }
    }
}

impl LoaderOptions {
    /// Batches ahead of the consumer the loader may hold (ready or being built).
    pub fn depth(&self) -> usize {
        (self.prefetch_factor * self.workers).max(1)
    }

    /// Batches in an epoch over `n` samples.
    pub fn batches_per_epoch(&self, n: usize) -> usize {
        let b = self.batch_size.max(1);
        self.last_batch().epoch_len(n, b).div_ceil(b)
    }

    /// The last-batch policy these options say ([`LastBatch`]).
    pub fn last_batch(&self) -> LastBatch {
        match (self.drop_last, self.pad_last) {
            (true, _) => LastBatch::Drop,
            (false, true) => LastBatch::Pad,
            (false, false) => LastBatch::Keep,
        }
    }
}

/// What the loader did so far, across epochs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoaderStats {
    /// Batches handed to the consumer.
    pub batches: u64,
    /// Samples handed to the consumer.
    pub samples: u64,
    /// Time the consumer spent blocked waiting for a batch (or, with 0 workers, building it).
    pub wait: Duration,
    /// The most batches that were ever ahead of the consumer (ready or being built): bounded
    /// by [`LoaderOptions::depth`].
    pub max_outstanding: usize,
}

/// The epoch job the workers share.
struct State<T> {
    shutdown: bool,
    /// Bumped at every epoch start and cancel: results of an older job are discarded.
    generation: u64,
    epoch: usize,
    order: Arc<Vec<usize>>,
    /// Batch size of the current epoch job (it can change between jobs).
    batch_size: usize,
    /// This rank's share of each batch (data parallelism).
    shard: Shard,
    next_claim: usize,
    end: usize,
    consumed: usize,
    ready: BTreeMap<usize, Result<T>>,
    max_outstanding: usize,
}

struct Shared<'d, T> {
    source: &'d dyn BatchSource<Batch = T>,
    device: Device,
    options: LoaderOptions,
    state: Mutex<State<T>>,
    /// Workers wait here for claimable work.
    work: Condvar,
    /// The consumer waits here for the next batch.
    done: Condvar,
}

impl<T: Send> Shared<'_, T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Batch building runs outside the lock and under catch_unwind, so a poisoned lock can
        // only come from a panic between two plain field updates: the state is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Builds this rank's part of batch `k` of `order` through the source; a panic becomes
    /// an error.
    fn build(&self, epoch: usize, order: &[usize], b: usize, shard: Shard, k: usize) -> Result<T> {
        let indices = &order[shard.range(order.len(), b, k)];
        let ctx = BatchContext {
            epoch,
            seed: self.options.seed,
        };
        catch_unwind(AssertUnwindSafe(|| {
            self.source.batch(indices, ctx, &self.device)
        }))
        .unwrap_or_else(|payload| {
            Err(KilnError::Loader(format!(
                "building batch {k} panicked: {}",
                panic_text(&*payload)
            )))
        })
    }

    fn worker_loop(&self) {
        let depth = self.options.depth();
        let mut st = self.lock();
        loop {
            if st.shutdown {
                return;
            }
            if st.next_claim < st.end && st.next_claim < st.consumed + depth {
                let k = st.next_claim;
                st.next_claim += 1;
                st.max_outstanding = st.max_outstanding.max(st.next_claim - st.consumed);
                let (generation, epoch, order, b, shard) = (
                    st.generation,
                    st.epoch,
                    st.order.clone(),
                    st.batch_size,
                    st.shard,
                );
                drop(st);
                let result = self.build(epoch, &order, b, shard, k);
                st = self.lock();
                if st.generation == generation {
                    st.ready.insert(k, result);
                    self.done.notify_all();
                }
                continue;
            }
            st = self.work.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn stop(&self) {
        self.lock().shutdown = true;
        self.work.notify_all();
    }
}

/// Stops the workers when the body returns or unwinds, so the scope can join them.
struct StopOnDrop<'a, 'd, T: Send>(&'a Shared<'d, T>);

impl<T: Send> Drop for StopOnDrop<'_, '_, T> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// A running loader; see the module documentation. Obtain one with [`DataLoader::run`].
pub struct DataLoader<'s, T: Send = Batch> {
    shared: &'s Shared<'s, T>,
    stats: LoaderStats,
    /// The batch size of the next epoch job (see [`DataLoader::set_batch_size`]).
    batch_size: usize,
    /// This rank's share of each batch (see [`DataLoader::set_shard`]).
    shard: Shard,
}

impl DataLoader<'_, Batch> {
    /// Starts `options.workers` persistent workers over Kiln's image `dataset` (with an
    /// optional per-sample `transform`), runs `body` with the loader, then stops and joins the
    /// workers; [`DataLoader::run_source`] for any [`BatchSource`].
    pub fn run<'d, R>(
        dataset: &'d dyn Dataset,
        transform: Option<&'d dyn Transform>,
        device: &Device,
        options: LoaderOptions,
        body: impl FnOnce(&mut DataLoader<'_, Batch>) -> R,
    ) -> Result<R> {
        let source = ImageBatches::new(dataset).with_transform(transform);
        DataLoader::run_source(&source, device, options, body)
    }
}

impl<'s, T: Send> DataLoader<'s, T> {
    /// Starts `options.workers` persistent workers over `source`, runs `body` with the loader,
    /// then stops and joins the workers. Batches are uploaded to `device` by the worker that
    /// built them.
    pub fn run_source<R>(
        source: &dyn BatchSource<Batch = T>,
        device: &Device,
        options: LoaderOptions,
        body: impl FnOnce(&mut DataLoader<'_, T>) -> R,
    ) -> Result<R> {
        if options.batch_size == 0 || options.prefetch_factor == 0 {
            return Err(KilnError::Loader(format!(
                "batch_size ({}) and prefetch_factor ({}) must be at least 1",
                options.batch_size, options.prefetch_factor
            )));
        }
        let workers = options.workers;
        let first_batch = options.batch_size;
        let shared = Shared {
            source,
            device: device.clone(),
            options,
            state: Mutex::new(State {
                shutdown: false,
                generation: 0,
                epoch: 0,
                order: Arc::new(Vec::new()),
                batch_size: first_batch,
                shard: Shard::WHOLE,
                next_claim: 0,
                end: 0,
                consumed: 0,
                ready: BTreeMap::new(),
                max_outstanding: 0,
            }),
            work: Condvar::new(),
            done: Condvar::new(),
        };
        std::thread::scope(|scope| {
            // Created before any worker so that a failed spawn still stops the started ones.
            let _stop = StopOnDrop(&shared);
            for w in 0..workers {
                std::thread::Builder::new()
                    .name(format!("kiln-data-{w}"))
                    .spawn_scoped(scope, || shared.worker_loop())
                    .map_err(|e| KilnError::Loader(format!("cannot start worker {w}: {e}")))?;
            }
            let mut loader = DataLoader {
                shared: &shared,
                stats: LoaderStats::default(),
                batch_size: shared.options.batch_size,
                shard: Shard::WHOLE,
            };
            Ok(body(&mut loader))
        })
    }

    /// The options the loader runs with.
    pub fn options(&self) -> &LoaderOptions {
        &self.shared.options
    }

    /// Batches per epoch at the current batch size (this rank's, under a [`Shard`]).
    pub fn batches_per_epoch(&self) -> usize {
        let n = (self.shared.options.last_batch())
            .epoch_len(self.shared.source.len(), self.global_batch());
        self.shard.batches(n, self.batch_size)
    }

    /// Samples of one batch over all ranks.
    fn global_batch(&self) -> usize {
        self.batch_size * self.shard.world.max(1)
    }

    /// The current batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Changes the batch size from the next [`DataLoader::epoch`] call on (OOM-adaptive
    /// batching halves it mid-epoch and restarts the epoch at the same sample position).
    pub fn set_batch_size(&mut self, batch_size: usize) {
        self.batch_size = batch_size.max(1);
    }

    /// Loads only `shard`'s part of each batch from the next [`DataLoader::epoch`] call on:
    /// with `world` ranks and batch size `b`, rank `r` gets its part of each global batch of
    /// `b × world` samples (see [`Shard`]).
    pub fn set_shard(&mut self, shard: Shard) {
        self.shard = shard;
    }

    /// Samples the source left out of their batches since the last call (unreadable files
    /// under a skip policy), drained.
    pub fn take_skipped(&self) -> Vec<crate::observe::SkippedSample> {
        self.shared.source.take_skipped()
    }

    /// What the loader did so far.
    pub fn stats(&self) -> LoaderStats {
        let mut s = self.stats;
        s.max_outstanding = s.max_outstanding.max(self.shared.lock().max_outstanding);
        s
    }

    /// The batches of `epoch`, starting at batch `start` (to resume inside an epoch). Dropping
    /// the iterator early abandons the rest of the epoch.
    pub fn epoch(&mut self, epoch: usize, start: usize) -> EpochBatches<'_, 's, T> {
        let opts = &self.shared.options;
        let n = self.shared.source.len();
        let own = opts
            .shuffle
            .then(|| self.shared.source.epoch_order(opts.seed, epoch));
        let order = match own.flatten() {
            Some(order) if order.len() == n => order,
            _ => epoch_order(n, opts.seed, epoch, opts.shuffle),
        };
        let order = Arc::new(opts.last_batch().apply(order, self.global_batch()));
        let end = self.batches_per_epoch();
        let batch_size = self.batch_size;
        let shard = self.shard;
        let start = start.min(end);
        if opts.workers > 0 {
            let mut st = self.shared.lock();
            st.generation += 1;
            st.epoch = epoch;
            st.order = order.clone();
            st.batch_size = batch_size;
            st.shard = shard;
            st.next_claim = start;
            st.consumed = start;
            st.end = end;
            st.ready.clear();
            drop(st);
            self.shared.work.notify_all();
        }
        EpochBatches {
            loader: self,
            epoch,
            batch_size,
            shard,
            order,
            next: start,
            end,
            finished: false,
        }
    }
}

/// The batches of one epoch, in order; see [`DataLoader::epoch`].
pub struct EpochBatches<'l, 's, T: Send = Batch> {
    loader: &'l mut DataLoader<'s, T>,
    epoch: usize,
    batch_size: usize,
    shard: Shard,
    order: Arc<Vec<usize>>,
    next: usize,
    end: usize,
    finished: bool,
}

impl<T: Send> EpochBatches<'_, '_, T> {
    /// Batches left in this epoch.
    pub fn remaining(&self) -> usize {
        if self.finished {
            0
        } else {
            self.end - self.next
        }
    }

    fn take_ready(&mut self) -> Result<T> {
        let shared = self.loader.shared;
        let mut st = shared.lock();
        loop {
            if let Some(result) = st.ready.remove(&self.next) {
                st.consumed = self.next + 1;
                drop(st);
                shared.work.notify_all();
                return result;
            }
            st = shared.done.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn cancel(&mut self) {
        if self.loader.shared.options.workers > 0 {
            let mut st = self.loader.shared.lock();
            st.generation += 1;
            st.end = st.next_claim;
            st.ready.clear();
        }
    }
}

impl<T: Send> Iterator for EpochBatches<'_, '_, T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        if self.finished || self.next >= self.end {
            self.finished = true;
            return None;
        }
        let t = Instant::now();
        let result = if self.loader.shared.options.workers == 0 {
            self.loader.shared.build(
                self.epoch,
                &self.order,
                self.batch_size,
                self.shard,
                self.next,
            )
        } else {
            self.take_ready()
        };
        let stats = &mut self.loader.stats;
        stats.wait += t.elapsed();
        let samples = self
            .shard
            .range(self.order.len(), self.batch_size, self.next)
            .len();
        self.next += 1;
        match &result {
            Ok(_) => {
                stats.batches += 1;
                stats.samples += samples as u64;
            }
            Err(_) => {
                // Stop the epoch: the error is reported once, nothing after it is handed out.
                self.finished = true;
                self.cancel();
            }
        }
        Some(result)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining()))
    }
}

impl<T: Send> Drop for EpochBatches<'_, '_, T> {
    fn drop(&mut self) {
        if !self.finished && self.next < self.end {
            self.cancel();
        }
    }
}
