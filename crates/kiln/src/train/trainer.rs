//! The trainer: settings, the run's setup (model, optimizer, resume, workers) and its end.
//! The step loop itself is [`super::run`].

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Device;

use super::contract::TrainStep;
use super::metrics::Metric;
use super::restore::{Snapshot, restore};
use super::run::{Position, Run, Totals};
use super::step::resolve_sync_every;
use super::{Evaluation, TrainOptions, build_optimizer, evaluate_source};
use crate::data::{
    Batch, BatchContext, BatchSource, DataLoader, Dataset, ImageBatches, Transform, choose_workers,
};
use crate::distributed::batch_norm::{batch_norm_layers, sync_scope};
use crate::distributed::{Collective, SingleProcess, broadcast_params, check_same_settings};
use crate::error::{KilnError, Result};
use crate::guard::{Guard, GuardPolicy, param_paths};
use crate::observe::{EpochSummary, Event, EventSink, RunSummary, Watermark};
use crate::precision::autocast;

/// Evaluation batch size on the CPU: large enough to amortize per-batch overhead, small
/// enough to keep activations modest — and at most [`EVAL_BATCH_PER_TRAIN`] training batches,
/// so a model whose training batch barely fits (ResNet-18 on 224-pixel images: 500 at once
/// took 23 GiB) evaluates within what training proved it has.
const EVAL_BATCH: usize = 500;
/// The evaluation batch's bound in training batches (a forward without autodiff keeps far
/// less per sample than a training step).
const EVAL_BATCH_PER_TRAIN: usize = 4;

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

/// Trains any model that implements [`TrainStep`] on any [`BatchSource`]: exact gradient
/// accumulation, global-norm clipping, f32 or bf16/f16 mixed precision with dynamic loss
/// scaling, the stability guard, warm-up + cosine schedules, evaluation on a held-out split
/// with pluggable metrics, atomic checkpoints and bit-for-bit resume, OOM-adaptive
/// micro-batching, data parallelism across ranks ([`Trainer::with_collective`]), and events
/// for every step.
pub struct Trainer<'s> {
    pub(super) options: TrainOptions,
    base: Device,
    pub(super) sink: &'s mut dyn EventSink,
    plan: Option<serde_json::Value>,
    resume: Option<PathBuf>,
    metrics: Vec<Box<dyn Metric>>,
    pub(super) collective: Arc<dyn Collective>,
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
            metrics: Vec::new(),
            collective: Arc::new(SingleProcess),
        }
    }

    /// Trains as one rank of a data-parallel group: every rank runs the same model, options
    /// and data with its own member of the group (a [`crate::distributed::ThreadGroup`]
    /// member, or MPI's world with the `mpi` feature). Rank 0's initial parameters are
    /// broadcast; each rank loads its part of every batch (`batch_size` is per rank, the
    /// global batch is `batch_size × ranks`); the gradients are summed once per optimizer
    /// step, so N ranks train exactly the model one process trains with batch N × b (to f32
    /// rounding). Only rank 0 emits events, evaluates and writes checkpoints; every rank can
    /// resume from them. BatchNorm is synchronized (Kiln's [`crate::nn::BatchNorm`] sums its
    /// statistics over the ranks); a BatchNorm that cannot (Burn's own) stops the run after
    /// the first micro-batch with the fix.
    pub fn with_collective(mut self, collective: Arc<dyn Collective>) -> Self {
        self.collective = collective;
        self
    }

    /// This trainer's rank (0 without data parallelism).
    pub fn rank(&self) -> usize {
        self.collective.rank()
    }

    /// Reports `event` to the sink; under data parallelism only rank 0 reports.
    pub(super) fn emit(&mut self, event: &Event) {
        if self.collective.rank() == 0 {
            self.sink.emit(event);
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

    /// Evaluates with these metrics instead of the defaults (loss, accuracy, MSE: each where
    /// the step's output has what it needs).
    pub fn with_metrics(mut self, metrics: Vec<Box<dyn Metric>>) -> Self {
        self.metrics = metrics;
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

    /// Trains the model that `init` builds on Kiln's labelled image datasets (the zoo's path;
    /// `data.augment` applies to `train`).
    pub fn fit<M: TrainStep<Batch> + 'static>(
        &mut self,
        model_name: &str,
        init: impl FnOnce(&Device) -> M,
        train: &dyn Dataset,
        test: Option<&dyn Dataset>,
    ) -> Result<TrainOutcome<M>> {
        let augment = self.options.augment.build(train.item_shape());
        let transform = augment.as_ref().map(|t| t as &dyn Transform);
        let train = ImageBatches::new(train).with_transform(transform);
        let test = test.map(ImageBatches::new);
        self.fit_source(
            model_name,
            init,
            &train,
            test.as_ref().map(|t| t as &dyn BatchSource<Batch = Batch>),
        )
    }

    /// Trains the model that `init` builds (on the training device) on `train`, evaluating on
    /// `valid`: the general entry point, for any batch type (a Burn `Dataset` + `Batcher`
    /// through [`crate::data::BurnBatches`], or a [`BatchSource`] of your own). `model_name`
    /// is stored in checkpoints; a resume refuses a checkpoint of another name.
    ///
    /// Under data parallelism a rank whose run fails releases the others
    /// ([`Collective::abandon`]): with threads they stop with [`crate::KilnError::PeerLost`]
    /// carrying this rank's error; under MPI the job is aborted after the error is printed.
    pub fn fit_source<B: Send, M: TrainStep<B> + 'static>(
        &mut self,
        model_name: &str,
        init: impl FnOnce(&Device) -> M,
        train: &dyn BatchSource<Batch = B>,
        valid: Option<&dyn BatchSource<Batch = B>>,
    ) -> Result<TrainOutcome<M>> {
        let result = self.fit_rank(model_name, init, train, valid);
        if let Err(e) = &result
            && self.collective.size() > 1
            && !matches!(e, KilnError::PeerLost(_))
        {
            self.collective.abandon(&e.to_string());
        }
        result
    }

    /// [`Trainer::fit_source`] on this rank, without releasing the others on failure.
    fn fit_rank<B: Send, M: TrainStep<B> + 'static>(
        &mut self,
        model_name: &str,
        init: impl FnOnce(&Device) -> M,
        train: &dyn BatchSource<Batch = B>,
        valid: Option<&dyn BatchSource<Batch = B>>,
    ) -> Result<TrainOutcome<M>> {
        let opts = self.options.clone();
        // The kernel switch holds for this run on this thread (the step, evaluation and
        // checkpoints run here; loader workers run no model ops).
        let _kernels = crate::kernels::Scope::enter(opts.kiln_kernels);
        validate(&opts, train, valid)?;
        let device = self.training_device();
        let model = seeded_init(&device, opts.seed, init);
        let world = self.collective.size();
        if world > 1 {
            tracing::info!(
                rank = self.collective.rank(),
                ranks = world,
                engine = self.collective.engine(),
                "data parallel"
            );
            check_same_settings(&rank_settings(&opts, train.len()), &*self.collective)?;
        }
        // SyncBatchNorm: the BatchNorm kernels of this thread sum their statistics over the
        // ranks; the first micro-batch shows whether every BatchNorm layer did.
        let batch_norms = if world > 1 {
            batch_norm_layers(&model)
        } else {
            Vec::new()
        };
        let _stats_sync = (!batch_norms.is_empty()).then(|| sync_scope(self.collective.clone()));
        self.check_first_batch(&model, train)?;
        let optim = build_optimizer(&opts);

        let n = train.len();
        // Under data parallelism a step takes `batch_size` samples per rank and micro-batch.
        let steps_per_epoch = opts
            .last_batch
            .epoch_len(n, opts.batch_size * world)
            .div_ceil(opts.batch_size * world)
            .div_ceil(opts.grad_accum_steps);
        let planned = (opts.epochs * steps_per_epoch) as u64;
        let total_steps = opts.max_steps.map_or(planned, |m| m.min(planned));

        let mut scaler = opts.scaler.build(opts.precision);
        let (mut model, mut optim, mut pos) = (model, optim, Position::default());
        if let Some(path) = self.resume.clone() {
            let restored = restore(&path, model, optim, model_name, &opts, world)?;
            (model, optim, pos) = (restored.model, restored.optim, restored.position);
            if let Some(state) = restored.scaler {
                scaler.restore(state);
            }
            tracing::info!(step = pos.global_step, "resumed from {}", path.display());
        }
        // The worker probe trains a few steps with local BatchNorm statistics (the running
        // statistics move with them): it comes before the broadcast that makes every replica
        // rank 0's, so the replicas agree whatever the probe did on each rank.
        let workers = match opts.workers {
            Some(w) => w,
            None => self.choose_workers(&model, train, &device)?,
        };
        // Every rank starts from rank 0's parameters and running statistics (a resume loads
        // the same file on all).
        model = broadcast_params(model, &*self.collective)?;
        let snapshot = if opts.guard.policy == GuardPolicy::Rollback {
            Some(Snapshot::take(&model, &optim, pos.global_step)?)
        } else {
            None
        };
        self.emit(&Event::RunStarted {
            model: model_name.to_string(),
            train_samples: n,
            total_steps,
            start_step: pos.global_step,
            plan: self.plan.clone(),
        });

        let wall = Instant::now();
        let loader_options = opts.loader_options(workers);
        // Rank 0 evaluates for everyone: the replicas are equal.
        let rank = self.collective.rank();
        let mut run = Run {
            trainer: self,
            model_name: model_name.to_string(),
            valid: valid.filter(|_| rank == 0),
            n,
            steps_per_epoch,
            planned,
            total_steps,
            pos,
            device_scaler: scaler.to_device(&device),
            scaler,
            pending: Vec::new(),
            sync_every: resolve_sync_every(opts.sync_every, &device),
            param_paths: param_paths(&model),
            guard: Guard::new(opts.guard.clone()),
            snapshot,
            micro_batch: opts.batch_size,
            accum_steps: opts.grad_accum_steps,
            watermark: opts.memory_watermark.map(Watermark::new),
            totals: Totals::default(),
            first_step_ms: None,
            epochs_done: Vec::new(),
            last_checkpoint: None,
            last_eval: None,
            last_train_loss: 0.0,
            skipped_samples: 0,
            batch_norms,
        };
        let device = run.device();
        // The loader's workers persist across epochs; its body is the whole epoch loop.
        let (model, _optim, stats) =
            DataLoader::run_source(train, &device, loader_options, |loader| {
                let (model, optim) = run.train_epochs(loader, model, optim)?;
                Ok::<_, KilnError>((model, optim, loader.stats()))
            })??;
        tracing::debug!(
            workers,
            batches = stats.batches,
            wait_ms = stats.wait.as_secs_f64() * 1e3,
            max_outstanding = stats.max_outstanding,
            "data loader"
        );
        let summary = run.finish(&model, wall)?;
        Ok(TrainOutcome {
            model,
            summary,
            epochs: run.epochs_done,
        })
    }

    /// Checks the first training sample against the model before anything runs: the model's
    /// own [`TrainStep::check_batch`], then one inference-mode step whose panic (a shape Burn
    /// rejects) or non-scalar loss becomes an error naming the cause. Inference mode draws
    /// nothing from the RNG, so the run's trajectory is unchanged.
    fn check_first_batch<B: Send, M: TrainStep<B>>(
        &self,
        model: &M,
        train: &dyn BatchSource<Batch = B>,
    ) -> Result<()> {
        let ctx = BatchContext {
            epoch: 0,
            seed: self.options.seed,
        };
        let probe = train.batch(&[0], ctx, &self.base)?;
        model
            .check_batch(&probe)
            .map_err(|e| KilnError::Shape(format!("the data does not fit the model: {e}")))?;
        let valid = model.valid();
        let step = catch_unwind(AssertUnwindSafe(|| {
            let _amp = autocast(self.options.precision);
            valid.valid_step(probe).loss.dims()
        }));
        match step {
            Ok([1]) => Ok(()),
            Ok(dims) => Err(super::run::loss_not_scalar(&dims)),
            Err(payload) => Err(KilnError::Shape(format!(
                "the model's step failed on the first batch (does the batch match the model?): {}",
                crate::data::panic_text(&*payload)
            ))),
        }
    }

    /// Resolves `data.workers = auto`: a few forward+backward passes of the model per
    /// candidate worker count (the real trajectory is untouched: no optimizer step), the
    /// fewest workers that keep data wait under 5% of step time. The choice and every trial go
    /// into the run's plan.
    fn choose_workers<B: Send, M: TrainStep<B>>(
        &mut self,
        model: &M,
        train: &dyn BatchSource<Batch = B>,
        device: &Device,
    ) -> Result<usize> {
        // The probe's steps are this rank's alone (their number may differ between ranks).
        let _local_stats = crate::kernels::stats_sync::StatsSync::pause();
        let opts = &self.options;
        let base = opts.loader_options(0);
        let max_workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        let precision = opts.precision;
        let mut step = |batch: B| -> Result<()> {
            let loss = {
                let _amp = autocast(precision);
                model.step(batch).loss
            };
            // The gradients are dropped: only the time matters here.
            let _ = loss.backward();
            Ok(())
        };
        let choice = choose_workers(train, device, &base, max_workers, 4, &mut step)?;
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

    /// Evaluates the model in inference mode on `data`, in the run's precision (what it will
    /// be served in), with the trainer's metrics.
    pub(super) fn evaluate_on<B: Send, M: TrainStep<B>>(
        &mut self,
        model: &M,
        data: &dyn BatchSource<Batch = B>,
    ) -> Result<Evaluation> {
        let _amp = autocast(self.options.precision);
        let _s = tracing::info_span!("eval", samples = data.len()).entered();
        // On a GPU, evaluate at the training batch: its forward kernels are compiled
        // already (a 500-sample batch would compile and autotune a shape of its own).
        let batch = if crate::kernels::is_flex(&self.base) {
            EVAL_BATCH.min(self.options.batch_size.max(1) * EVAL_BATCH_PER_TRAIN)
        } else {
            self.options.batch_size
        };
        evaluate_source(&model.valid(), data, batch, &self.base, &mut self.metrics)
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
    let _guard = backend_rng_guard();
    device.seed(seed);
    let model = init(device);
    model.visit(&mut Touch);
    model
}

/// Holds the lock under which trainers seed and initialize their models. Burn's backends draw
/// every random tensor and every lazily initialized parameter from one process-wide RNG, so
/// code that draws (random inputs, modules it builds and runs) while trainers start on other
/// threads holds this guard meanwhile: otherwise its draws can land between a trainer's seed
/// and its weights, and two runs with one seed train different models. Not reentrant: drop it
/// before starting a trainer on the same thread.
pub fn backend_rng_guard() -> std::sync::MutexGuard<'static, ()> {
    // A poisoned lock only means another holder panicked mid-draw; the guard protects no data.
    INIT_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// What every rank of a data-parallel run must agree on: the trajectory, the data's size, and
/// the settings that decide which collectives a step calls.
fn rank_settings(opts: &TrainOptions, samples: usize) -> String {
    let mut s: Vec<String> = opts
        .trajectory_fingerprint()
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    s.push(format!("samples={samples}"));
    s.push(format!("train.max_steps={:?}", opts.max_steps));
    s.push(format!("watermark={}", opts.memory_watermark.is_some()));
    s.push(format!("train.oom_adaptive={}", opts.oom_adaptive));
    s.push(format!("guard={:?}", opts.guard));
    s.join(", ")
}

fn validate<B: Send>(
    opts: &TrainOptions,
    train: &dyn BatchSource<Batch = B>,
    valid: Option<&dyn BatchSource<Batch = B>>,
) -> Result<()> {
    if train.is_empty() {
        return Err(KilnError::Shape(
            "the training set is empty (0 samples); point data.dir at files with samples, or \
             check the dataset you pass"
                .into(),
        ));
    }
    if valid.is_some_and(|v| v.is_empty()) {
        return Err(KilnError::Shape(
            "the evaluation set is empty (0 samples); pass None to skip evaluation, or split \
             off some samples"
                .into(),
        ));
    }
    if opts.batch_size == 0 || opts.grad_accum_steps == 0 || opts.epochs == 0 {
        return Err(KilnError::Inconsistent(
            "train.batch_size, train.grad_accum_steps and train.epochs must be at least 1".into(),
        ));
    }
    Ok(())
}
