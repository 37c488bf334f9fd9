//! The step loop.

use std::path::PathBuf;
use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::store::ModuleRecord;
use burn::tensor::{Bytes, Device};

use super::{
    Checkpoint, CheckpointState, Evaluation, TrainOptions, build_optimizer, clip_global_norm,
    evaluate, learning_rate, scale_grads,
};
use crate::data::{Batch, DataLoader, Dataset, Transform, choose_workers};
use crate::error::{KilnError, Result};
use crate::guard::{
    Guard, GuardAction, GuardEvent, GuardPolicy, Trouble, nonfinite_grad_names,
    nonfinite_param_names, probe_grads, probe_params,
};
use crate::observe::{
    BatchAdaptedEvent, EpochSummary, Event, EventSink, RunSummary, StepEvent, Watermark,
    WatermarkEvent, memory,
};
use crate::precision::{LossScaler, autocast};
use crate::zoo::Classifier;

/// A known-good model and optimizer state to roll back to.
struct Snapshot<M> {
    model: M,
    optimizer: Vec<u8>,
    step: u64,
}

/// Evaluation batch size: large enough to amortize per-batch overhead, small enough to keep
/// activations modest.
const EVAL_BATCH: usize = 500;

/// What a finished [`Trainer::fit`] returns.
#[derive(Debug)]
pub struct TrainOutcome<M> {
    /// The trained model (on the training device).
    pub model: M,
    /// The run summary (also emitted as [`Event::RunFinished`]).
    pub summary: RunSummary,
    /// Per-epoch results of this process.
    pub epochs: Vec<EpochSummary>,
}

/// Runs training: f32 steps with exact gradient accumulation, global-norm clipping,
/// warm-up + cosine schedules, per-epoch evaluation, atomic checkpoints and exact resume.
pub struct Trainer<'s> {
    options: TrainOptions,
    base: Device,
    sink: &'s mut dyn EventSink,
    plan: Option<serde_json::Value>,
    resume: Option<PathBuf>,
}

impl<'s> Trainer<'s> {
    /// A trainer on `device` (a plain device; autodiff is added here) reporting to `sink`.
    pub fn new(options: TrainOptions, device: Device, sink: &'s mut dyn EventSink) -> Self {
        Trainer {
            options,
            base: device.without_autodiff(),
            sink,
            plan: None,
            resume: None,
        }
    }

    /// Attaches the resolved plan, reported in [`Event::RunStarted`].
    pub fn with_plan(mut self, plan: serde_json::Value) -> Self {
        self.plan = Some(plan);
        self
    }

    /// Continues from a checkpoint instead of starting fresh.
    pub fn resume_from(mut self, checkpoint: impl Into<PathBuf>) -> Self {
        self.resume = Some(checkpoint.into());
        self
    }

    /// The device models are trained on: autodiff, with checkpointing if enabled.
    pub fn training_device(&self) -> Device {
        let device = self.base.clone().autodiff();
        if self.options.activation_checkpointing {
            device.gradient_checkpointing()
        } else {
            device
        }
    }

    /// Trains the model that `init` builds on the training device.
    pub fn fit<M: Classifier + 'static>(
        &mut self,
        model_name: &str,
        init: impl FnOnce(&Device) -> M,
        train: &dyn Dataset,
        test: Option<&dyn Dataset>,
    ) -> Result<TrainOutcome<M>> {
        let opts = self.options.clone();
        validate(&opts, train)?;
        let device = self.training_device();
        let mut model = seeded_init(&device, opts.seed, init);
        model
            .check_input(train.item_shape())
            .map_err(KilnError::Shape)?;
        let mut optim = build_optimizer(&opts);

        let n = train.len();
        let micro_per_epoch = n.div_ceil(opts.batch_size);
        let steps_per_epoch = micro_per_epoch.div_ceil(opts.grad_accum_steps);
        let planned = (opts.epochs * steps_per_epoch) as u64;
        let total_steps = opts.max_steps.map_or(planned, |m| m.min(planned));

        let mut pos = Position::default();
        let mut scaler = opts.scaler.build(opts.precision);
        if let Some(path) = self.resume.clone() {
            let (m, o, p, s) = restore(&path, model, optim, model_name, &opts)?;
            (model, optim, pos) = (m, o, p);
            if let Some(state) = s {
                scaler.restore(state);
            }
            tracing::info!(step = pos.global_step, "resumed from {}", path.display());
        }
        let mut guard = Guard::new(opts.guard.clone());
        let mut snapshot = None;
        if opts.guard.policy == GuardPolicy::Rollback {
            snapshot = Some(take_snapshot(&model, &optim, pos.global_step)?);
        }

        let loss_fn = CrossEntropyLossConfig::new().init(&device);
        let augment = opts.augment.build(train.item_shape());
        let transform = augment.as_ref().map(|t| t as &dyn Transform);
        let workers = match opts.workers {
            Some(w) => w,
            None => self.choose_workers(&model, &loss_fn, train, transform, &device)?,
        };
        let loader_options = opts.loader_options(workers);

        self.sink.emit(&Event::RunStarted {
            model: model_name.to_string(),
            train_samples: n,
            total_steps,
            start_step: pos.global_step,
            plan: self.plan.clone(),
        });

        let run_start = Instant::now();
        let (mut step_time, mut data_time, mut samples_done) = (0f64, 0f64, 0u64);
        let mut epochs_done = Vec::new();
        let mut last_checkpoint = None;
        let mut last_eval = None;
        let mut last_train_loss = 0f32;

        // The loader's workers persist across epochs; its body is the whole epoch loop. The
        // model and optimizer are moved through it (the step replaces them by value).
        let mut carried = Some((model, optim));
        // The micro-batch and accumulation the loop runs with: OOM-adaptive batching halves
        // the one and doubles the other, keeping the effective batch.
        let (mut micro_batch, mut accum_steps) = (opts.batch_size, opts.grad_accum_steps);
        let mut watermark = opts.memory_watermark.map(Watermark::new);
        let mut loader_stats = None;
        DataLoader::run(
            train,
            transform,
            &device,
            loader_options,
            |loader| -> Result<()> {
                let (mut model, mut optim) = carried.take().ok_or_else(|| {
                    KilnError::Loader("internal: the training state was already taken".into())
                })?;
                'epochs: for epoch in pos.epoch..opts.epochs {
                    let epoch_start = Instant::now();
                    // `pos` is always at the start of this epoch or, after a resume, inside it: each
                    // epoch's end resets it to the next epoch's first step.
                    // An OOM-adaptive halving restarts the epoch's batches at the same sample
                    // position with the new micro-batch size.
                    'restart: loop {
                        let micro_per_epoch = n.div_ceil(micro_batch);
                        loader.set_batch_size(micro_batch);
                        let mut batches = loader.epoch(epoch, pos.step_in_epoch * accum_steps);
                        let mut adapted = false;
                        for s in pos.step_in_epoch..steps_per_epoch {
                            if pos.global_step >= total_steps {
                                // Stopped early by max_steps: leave a checkpoint to continue from.
                                last_train_loss = pos.epoch_mean_loss();
                                last_checkpoint =
                                    self.checkpoint(&model, &optim, model_name, &pos, &scaler)?;
                                break 'epochs;
                            }
                            let micro =
                                s * accum_steps..((s + 1) * accum_steps).min(micro_per_epoch);
                            let sizes: Vec<usize> = micro
                                .map(|m| ((m + 1) * micro_batch).min(n) - m * micro_batch)
                                .collect();
                            let group: usize = sizes.iter().sum();

                            let t0 = Instant::now();
                            // Spans around every phase: free without a subscriber, the profiler's
                            // trace and table with one (`kiln profile`).
                            let _step_span =
                                tracing::info_span!("step", step = pos.global_step + 1).entered();
                            let mut data_ms = 0f64;
                            let mut accum = GradientsAccumulator::<M>::new();
                            let mut loss_total: Option<burn::tensor::Tensor<1>> = None;
                            for &size in &sizes {
                                let td = Instant::now();
                                let batch = {
                                    let _s = tracing::info_span!("data_wait").entered();
                                    batches.next().ok_or_else(|| {
                                        KilnError::Loader(
                                            "the epoch ended before its last step".into(),
                                        )
                                    })??
                                };
                                data_ms += td.elapsed().as_secs_f64() * 1e3;
                                debug_assert_eq!(batch.len, size);
                                let forward_span = tracing::info_span!("forward").entered();
                                let logits = {
                                    let _amp = autocast(opts.precision);
                                    model.forward(batch.images)
                                };
                                // Logits come out of the autocast ops in f32: log-softmax and the loss
                                // run in f32.
                                let loss = loss_fn.forward(logits, batch.labels);
                                // Kept on the device and read once per step: a read per micro-batch would
                                // stall an asynchronous backend (CUDA) between micro-batches.
                                let weighted = loss.clone().detach().mul_scalar(size as f64);
                                loss_total = Some(match loss_total.take() {
                                    Some(t) => t + weighted,
                                    None => weighted,
                                });
                                // Weight each micro-batch's mean loss by its share of the group so that
                                // N micro-batches give exactly the gradient of one batch of N·b samples.
                                let weight = size as f64 / group as f64;
                                let loss = if sizes.len() == 1 {
                                    loss
                                } else {
                                    loss.mul_scalar(weight)
                                };
                                let loss = if scaler.enabled() {
                                    loss.mul_scalar(scaler.scale())
                                } else {
                                    loss
                                };
                                drop(forward_span);
                                let _backward = tracing::info_span!("backward").entered();
                                let grads = GradientsParams::from_grads(loss.backward(), &model);
                                accum.accumulate(&model, grads);
                            }
                            let loss_sum = {
                                // The one device→host read of the step: on an asynchronous backend
                                // this is where the queued work is waited for.
                                let _s = tracing::info_span!("sync").entered();
                                loss_total.map_or(f64::NAN, |t| t.into_scalar::<f32>() as f64)
                            };
                            let mean_loss = (loss_sum / group as f64) as f32;
                            let mut grads = accum.grads();
                            if scaler.enabled() {
                                // Unscale once, before the guard's check and before clipping.
                                let _s = tracing::info_span!("unscale").entered();
                                grads = scale_grads(&model, grads, scaler.inverse_scale());
                            }
                            let step_no = pos.global_step + 1;
                            let loss_scale = scaler.scale();
                            // The guard's fused check: one scalar read for all gradients.
                            let guard_span = tracing::info_span!("guard_check").entered();
                            let trouble = if !mean_loss.is_finite() {
                                Some(Trouble::Loss)
                            } else if probe_grads(&model, &grads).is_some_and(|p| !finite(p)) {
                                Some(Trouble::Gradients)
                            } else {
                                None
                            };
                            drop(guard_span);
                            // An overflow in the gradients alone is the scaler's business (skip, halve the
                            // scale) while the scale is still >= 1; below that, scaling no longer explains
                            // it and the guard's policy applies.
                            let scaler_owns = trouble == Some(Trouble::Gradients)
                                && scaler.enabled()
                                && scaler.scale() >= 1.0;
                            scaler.update(trouble.is_some());
                            // The schedule spans the planned epochs, not max_steps: a run stopped early and resumed
                            // must see the same learning rates as one that never stopped.
                            let lr = learning_rate(&opts, pos.global_step, planned);
                            let mut grad_norm = None;
                            if let Some(trouble) = trouble {
                                let tensors = match trouble {
                                    Trouble::Gradients => nonfinite_grad_names(&model, &grads),
                                    _ => Vec::new(),
                                };
                                let action = if scaler_owns {
                                    GuardAction::ScaleBackoff
                                } else {
                                    guard.decide(trouble, snapshot.is_some())
                                };
                                self.guard_event(
                                    &mut guard,
                                    GuardEvent {
                                        step: step_no,
                                        trouble,
                                        tensors,
                                        loss: mean_loss,
                                        loss_scale,
                                        action,
                                        restored_step: None,
                                    },
                                );
                                if action == GuardAction::Aborted {
                                    return Err(diverged(&guard, step_no, mean_loss));
                                }
                            } else {
                                if let Some(max_norm) = opts.grad_clip_norm {
                                    let _s = tracing::info_span!("clip").entered();
                                    let (clipped, norm) = clip_global_norm(&model, grads, max_norm);
                                    grads = clipped;
                                    grad_norm = Some(norm);
                                }
                                model = {
                                    let _s = tracing::info_span!("optimizer").entered();
                                    optim.step(lr, model, grads)
                                };
                                let params_bad = opts.guard.check_params && {
                                    let _s = tracing::info_span!("guard_check").entered();
                                    probe_params(&model).is_some_and(|p| !finite(p))
                                };
                                if params_bad {
                                    let tensors = nonfinite_param_names(&model);
                                    let action =
                                        guard.decide(Trouble::Parameters, snapshot.is_some());
                                    let mut restored_step = None;
                                    if let (GuardAction::RolledBack, Some(snap)) =
                                        (action, &snapshot)
                                    {
                                        model = snap.model.clone();
                                        optim = build_optimizer(&opts)
                                            .from_bytes(Bytes::from_bytes_vec(
                                                snap.optimizer.clone(),
                                            ))
                                            .map_err(|e| KilnError::Record {
                                                what: "optimizer snapshot",
                                                message: e.to_string(),
                                            })?;
                                        restored_step = Some(snap.step);
                                    }
                                    self.guard_event(
                                        &mut guard,
                                        GuardEvent {
                                            step: step_no,
                                            trouble: Trouble::Parameters,
                                            tensors,
                                            loss: mean_loss,
                                            loss_scale,
                                            action,
                                            restored_step,
                                        },
                                    );
                                    if action == GuardAction::Aborted {
                                        return Err(diverged(&guard, step_no, mean_loss));
                                    }
                                } else {
                                    guard.clean_step();
                                    let due = snapshot.as_ref().is_none_or(|s| {
                                        step_no - s.step >= opts.guard.snapshot_every
                                    });
                                    if opts.guard.policy == GuardPolicy::Rollback && due {
                                        snapshot = Some(take_snapshot(&model, &optim, step_no)?);
                                    }
                                }
                            }
                            pos.global_step += 1;
                            pos.step_in_epoch = s + 1;
                            if mean_loss.is_finite() {
                                // A non-finite loss would poison the epoch mean (and the checkpoint's
                                // JSON): the mean is over finite ones.
                                pos.epoch_loss_sum += loss_sum;
                                pos.epoch_samples += group as u64;
                            }

                            let step_ms = t0.elapsed().as_secs_f64() * 1e3;
                            step_time += step_ms / 1e3;
                            data_time += data_ms / 1e3;
                            samples_done += group as u64;
                            let report_span = tracing::info_span!("report").entered();
                            self.sink.emit(&Event::Step(StepEvent {
                                step: pos.global_step,
                                epoch,
                                loss: mean_loss,
                                lr,
                                grad_norm,
                                samples: group,
                                step_ms,
                                data_ms,
                                compute_ms: step_ms - data_ms,
                                samples_per_s: group as f64 / (step_ms / 1e3).max(1e-9),
                                peak_rss_bytes: memory::peak_rss_bytes(),
                                skipped: trouble.is_some(),
                                loss_scale: scaler.enabled().then_some(loss_scale),
                            }));
                            if let Some(mark) = watermark.as_mut()
                                && let Some(rss) = memory::current_rss_bytes()
                                && mark.check(rss)
                            {
                                tracing::warn!(
                                    step = pos.global_step,
                                    "resident memory {} crossed the watermark {}",
                                    memory::human_bytes(rss),
                                    memory::human_bytes(mark.threshold())
                                );
                                self.sink.emit(&Event::MemoryWatermark(WatermarkEvent {
                                    step: pos.global_step,
                                    rss_bytes: rss,
                                    threshold_bytes: mark.threshold(),
                                }));
                                if opts.oom_adaptive {
                                    adapted = self.halve_micro_batch(
                                        pos.global_step,
                                        &mut micro_batch,
                                        &mut accum_steps,
                                    );
                                }
                            }
                            drop(report_span);
                            if opts
                                .checkpoint_every_steps
                                .is_some_and(|k| pos.global_step % k == 0)
                            {
                                last_checkpoint =
                                    self.checkpoint(&model, &optim, model_name, &pos, &scaler)?;
                            }
                            if adapted {
                                break;
                            }
                        }
                        // Release the epoch's prefetch window before evaluating.
                        drop(batches);
                        if !adapted {
                            break 'restart;
                        }
                    }

                    // Epoch finished.
                    last_train_loss = pos.epoch_mean_loss();
                    let is_last = epoch + 1 == opts.epochs;
                    let due =
                        opts.eval_every_epochs > 0 && (epoch + 1) % opts.eval_every_epochs == 0;
                    let eval = match test {
                        Some(t) if due || is_last => Some(self.evaluate(&model, t)?),
                        _ => None,
                    };
                    if eval.is_some() {
                        last_eval = eval;
                    }
                    let summary = EpochSummary {
                        epoch,
                        train_loss: last_train_loss,
                        test_accuracy: eval.map(|e| e.accuracy),
                        test_loss: eval.map(|e| e.loss),
                        seconds: epoch_start.elapsed().as_secs_f64(),
                    };
                    self.sink.emit(&Event::EpochEnd(summary.clone()));
                    epochs_done.push(summary);
                    pos = Position {
                        epoch: epoch + 1,
                        step_in_epoch: 0,
                        global_step: pos.global_step,
                        epoch_loss_sum: 0.0,
                        epoch_samples: 0,
                    };
                    last_checkpoint = self
                        .checkpoint(&model, &optim, model_name, &pos, &scaler)?
                        .or(last_checkpoint.take());
                }
                loader_stats = Some(loader.stats());
                carried = Some((model, optim));
                Ok(())
            },
        )??;
        let (model, _optim) = carried.ok_or_else(|| {
            KilnError::Loader("internal: the training state was not returned".into())
        })?;
        if let Some(stats) = loader_stats {
            tracing::debug!(
                workers,
                batches = stats.batches,
                wait_ms = stats.wait.as_secs_f64() * 1e3,
                max_outstanding = stats.max_outstanding,
                "data loader"
            );
        }

        if last_eval.is_none()
            && let Some(t) = test
        {
            last_eval = Some(self.evaluate(&model, t)?);
        }
        let summary = RunSummary {
            model: model_name.to_string(),
            steps: pos.global_step,
            epochs: pos.epoch.min(opts.epochs),
            test_accuracy: last_eval.map(|e| e.accuracy),
            train_loss: last_train_loss,
            samples_per_s: samples_done as f64 / step_time.max(1e-9),
            data_wait_share: data_time / step_time.max(1e-9),
            wall_seconds: run_start.elapsed().as_secs_f64(),
            peak_rss_bytes: memory::peak_rss_bytes(),
            last_checkpoint: last_checkpoint.map(|p: PathBuf| p.display().to_string()),
            guard_events: guard.events.clone(),
        };
        self.sink.emit(&Event::RunFinished(summary.clone()));
        Ok(TrainOutcome {
            model,
            summary,
            epochs: epochs_done,
        })
    }

    /// Resolves `data.workers = auto`: a few forward+backward passes of a copy of the model
    /// per candidate worker count (the real trajectory is untouched: no optimizer step), the
    /// fewest workers that keep data wait under 5% of step time. The choice and every trial go
    /// into the run's plan.
    fn choose_workers<M: Classifier + 'static>(
        &mut self,
        model: &M,
        loss_fn: &CrossEntropyLoss,
        train: &dyn Dataset,
        transform: Option<&dyn Transform>,
        device: &Device,
    ) -> Result<usize> {
        let opts = &self.options;
        let base = opts.loader_options(0);
        let max_workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        let precision = opts.precision;
        let mut step = |batch: Batch| -> Result<()> {
            let logits = {
                let _amp = autocast(precision);
                model.forward(batch.images)
            };
            // The gradients are dropped: only the time matters here.
            let _ = loss_fn.forward(logits, batch.labels).backward();
            Ok(())
        };
        let choice = choose_workers(train, transform, device, &base, max_workers, 4, &mut step)?;
        tracing::info!("data.workers = auto: {}", choice.reason);
        if let Some(plan) = self.plan.as_mut().and_then(|p| p.as_object_mut()) {
            if let Some(settings) = plan.get_mut("settings").and_then(|s| s.as_object_mut()) {
                settings.insert(
                    "data.workers".into(),
                    serde_json::json!({
                        "value": choice.workers,
                        "source": format!("probe: {}", choice.reason),
                    }),
                );
            }
            plan.insert(
                "data_workers_trials".into(),
                serde_json::to_value(&choice.trials).unwrap_or_default(),
            );
        }
        Ok(choice.workers)
    }

    /// Halves the micro-batch and doubles accumulation (same effective batch, about half the
    /// activation memory) after a memory watermark crossing; reports it. Returns whether it
    /// changed anything: an odd micro-batch cannot be halved exactly, and 1 cannot be halved.
    fn halve_micro_batch(&mut self, step: u64, micro: &mut usize, accum: &mut usize) -> bool {
        if *micro < 2 || !(*micro).is_multiple_of(2) {
            tracing::warn!(
                step,
                micro_batch = *micro,
                "memory watermark crossed but micro-batch {} cannot be halved exactly",
                *micro
            );
            return false;
        }
        *micro /= 2;
        *accum *= 2;
        tracing::warn!(
            step,
            "memory watermark: micro-batch halved to {} with {} accumulation steps (effective \
             batch unchanged)",
            *micro,
            *accum
        );
        self.sink.emit(&Event::BatchAdapted(BatchAdaptedEvent {
            step,
            micro_batch: *micro,
            grad_accum_steps: *accum,
            effective_batch: *micro * *accum,
        }));
        true
    }

    /// Evaluates the model in inference mode, in the run's precision (what it will be served
    /// in).
    fn evaluate<M: Classifier>(&self, model: &M, data: &dyn Dataset) -> Result<Evaluation> {
        let _amp = autocast(self.options.precision);
        let _s = tracing::info_span!("eval", samples = data.len()).entered();
        evaluate(&model.valid(), data, EVAL_BATCH, &self.base)
    }

    /// Reports a guard event to the sink and keeps it for the run summary.
    fn guard_event(&mut self, guard: &mut Guard, event: GuardEvent) {
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
        self.sink.emit(&Event::Guard(event.clone()));
        guard.events.push(event);
    }

    /// Writes a checkpoint at `pos` if a checkpoint directory is configured.
    fn checkpoint<M: Module>(
        &mut self,
        model: &M,
        optim: &ModuleOptimizer,
        model_name: &str,
        pos: &Position,
        scaler: &LossScaler,
    ) -> Result<Option<PathBuf>> {
        let Some(dir) = &self.options.checkpoint_dir else {
            return Ok(None);
        };
        let _s = tracing::info_span!("checkpoint", step = pos.global_step).entered();
        let record_err = |what| {
            move |e: burn::store::RecordError| KilnError::Record {
                what,
                message: e.to_string(),
            }
        };
        let model_bytes = model
            .clone()
            .into_record()
            .into_bytes()
            .map_err(record_err("model weights"))?;
        let optim_bytes = optim.into_bytes().map_err(record_err("optimizer state"))?;
        let ckpt = Checkpoint {
            state: CheckpointState {
                model: model_name.to_string(),
                epoch: pos.epoch,
                step_in_epoch: pos.step_in_epoch,
                global_step: pos.global_step,
                fingerprint: fingerprint(&self.options),
                epoch_loss_sum: pos.epoch_loss_sum,
                epoch_samples: pos.epoch_samples,
                scaler: scaler.enabled().then(|| scaler.state()),
            },
            model: model_bytes.to_vec(),
            optimizer: optim_bytes.to_vec(),
        };
        let path = dir.join(Checkpoint::file_name(pos.global_step));
        let bytes = ckpt.save(&path)?;
        self.sink.emit(&Event::Checkpoint {
            step: pos.global_step,
            path: path.display().to_string(),
            bytes,
        });
        Ok(Some(path))
    }
}

/// Backends keep one global RNG and Burn initializes parameters lazily, so two trainers
/// initializing at once would interleave their draws. Serializing seed + init + first touch
/// makes a seed mean the same weights even with concurrent trainers in one process.
static INIT_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Builds a model with `init` from `seed`, reproducibly even while other threads initialize
/// models: the device's RNG is seeded, the model built and every parameter materialized under
/// one process-wide lock (Burn's backends share one RNG and initialize lazily). Code that
/// seeds and builds models itself alongside a [`Trainer`] (tests, tuners) should use this,
/// or its draws can land between the trainer's seed and its weights.
pub fn seeded_init<M: Module>(device: &Device, seed: u64, init: impl FnOnce(&Device) -> M) -> M {
    struct Touch;
    impl burn::module::ModuleVisitor for Touch {
        fn visit_float<const D: usize>(
            &mut self,
            param: &burn::module::Param<burn::tensor::Tensor<D>>,
        ) {
            let _ = param.val();
        }
    }
    // A poisoned lock only means another trainer panicked mid-init; the guard protects no data.
    let _guard = INIT_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    device.seed(seed);
    let model = init(device);
    model.visit(&mut Touch);
    model
}

/// Where the loop stands.
#[derive(Debug, Default, Clone)]
struct Position {
    epoch: usize,
    step_in_epoch: usize,
    global_step: u64,
    epoch_loss_sum: f64,
    epoch_samples: u64,
}

impl Position {
    /// Mean training loss over the epoch's clean steps so far.
    fn epoch_mean_loss(&self) -> f32 {
        (self.epoch_loss_sum / self.epoch_samples.max(1) as f64) as f32
    }
}

/// Whether a fused probe read back as finite (0 means every tensor was finite).
fn finite(probe: burn::tensor::Tensor<1>) -> bool {
    probe.into_scalar::<f32>().is_finite()
}

fn take_snapshot<M: Module>(model: &M, optim: &ModuleOptimizer, step: u64) -> Result<Snapshot<M>> {
    let optimizer = optim.into_bytes().map_err(|e| KilnError::Record {
        what: "optimizer snapshot",
        message: e.to_string(),
    })?;
    Ok(Snapshot {
        model: model.clone(),
        optimizer: optimizer.to_vec(),
        step,
    })
}

/// The error that ends a run the guard gave up on, with what it saw.
fn diverged(guard: &Guard, step: u64, loss: f32) -> KilnError {
    let last = guard.events.last();
    let what = last.map_or("a value".to_string(), |e| {
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

fn fingerprint(options: &TrainOptions) -> Vec<(String, String)> {
    options
        .trajectory_fingerprint()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn validate(opts: &TrainOptions, train: &dyn Dataset) -> Result<()> {
    if train.is_empty() {
        return Err(KilnError::Shape(
            "the training set is empty; point data.dir at IDX files with samples".into(),
        ));
    }
    if opts.batch_size == 0 || opts.grad_accum_steps == 0 || opts.epochs == 0 {
        return Err(KilnError::Inconsistent(
            "train.batch_size, train.grad_accum_steps and train.epochs must be at least 1".into(),
        ));
    }
    Ok(())
}

/// Loads a checkpoint into a fresh model and optimizer, refusing one from another run.
fn restore<M: Module>(
    path: &std::path::Path,
    model: M,
    optim: ModuleOptimizer,
    model_name: &str,
    opts: &TrainOptions,
) -> Result<(
    M,
    ModuleOptimizer,
    Position,
    Option<crate::precision::ScalerState>,
)> {
    let ckpt = Checkpoint::load(path)?;
    let bad = |problem: String| KilnError::BadCheckpoint {
        path: path.to_path_buf(),
        problem,
    };
    if ckpt.state.model != model_name {
        return Err(bad(format!(
            "it holds model `{}`, not `{model_name}`; pass --model {}",
            ckpt.state.model, ckpt.state.model
        )));
    }
    let ours = fingerprint(opts);
    let diffs: Vec<String> = ckpt
        .state
        .fingerprint
        .iter()
        .filter(|(k, v)| ours.iter().any(|(k2, v2)| k2 == k && v2 != v))
        .map(|(k, v)| {
            let now = ours.iter().find(|(k2, _)| k2 == k).map(|(_, v)| v.as_str());
            format!("{k} was {v}, now {}", now.unwrap_or("?"))
        })
        .collect();
    if !diffs.is_empty() {
        return Err(bad(format!(
            "it was written with other settings ({}); resume with the same settings or start a new run",
            diffs.join("; ")
        )));
    }
    let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(ckpt.model))
        .map_err(|e| bad(format!("unreadable model weights: {e}")))?;
    let model = model
        .try_load_record(record)
        .map_err(|e| bad(format!("weights do not fit model `{model_name}`: {e}")))?;
    let optim = optim
        .from_bytes(Bytes::from_bytes_vec(ckpt.optimizer))
        .map_err(|e| bad(format!("unreadable optimizer state: {e}")))?;
    Ok((
        model,
        optim,
        Position {
            epoch: ckpt.state.epoch,
            step_in_epoch: ckpt.state.step_in_epoch,
            global_step: ckpt.state.global_step,
            epoch_loss_sum: ckpt.state.epoch_loss_sum,
            epoch_samples: ckpt.state.epoch_samples,
        },
        ckpt.state.scaler,
    ))
}
