//! Data parallelism with ranks as threads ([`ThreadGroup`]): N ranks with micro-batch b train
//! the model one process trains with batch N·b, with accumulation, clipping, a short last
//! batch that leaves a rank without samples, a NaN on one rank, checkpoints and resume, and
//! a rank that fails stopping the others with its error, and BatchNorm with statistics
//! synchronized over the ranks (in f32 and under bf16 autocast).
//! The MPI engine runs the same trainer code across processes (kiln-cli's `tests/mpi.rs`).

mod common;

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use kiln::data::{
    BatchContext, BatchSource, BurnBatches, DataLoader, Dataset, LoaderOptions, Shard,
};
use kiln::datasets::{Split, bundled};
use kiln::distributed::{Collective, ReduceOp, ThreadGroup};
use kiln::guard::{GuardOptions, GuardPolicy};
use kiln::observe::{Event, MemorySink, NullSink};
use kiln::precision::{Precision, ScalerOptions, ScalingMode};
use kiln::train::{
    OptimizerKind, Schedule, StepOutput, TrainOptions, TrainStep, flatten_params, latest_checkpoint,
};
use kiln::zoo::ModelKind;
use kiln::{KilnError, Trainer, burn};

/// Runs `f` on each member of a new group of `size` ranks, one thread each.
fn on_ranks<T: Send>(size: usize, f: impl Fn(Arc<dyn Collective>) -> T + Sync) -> Vec<T> {
    on_group(size, |g| f(Arc::new(g)))
}

/// Runs `f` on each member of a new group of `size` ranks, one thread each, with the member
/// itself (to wrap it).
fn on_group<T: Send>(size: usize, f: impl Fn(ThreadGroup) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadGroup::new(size)
            .into_iter()
            .map(|g| {
                let f = &f;
                s.spawn(move || f(g))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Adam with warm-up + cosine, clipping, accumulation 2, two shuffled epochs.
fn options(batch_size: usize) -> TrainOptions {
    TrainOptions {
        epochs: 2,
        batch_size,
        grad_accum_steps: 2,
        optimizer: OptimizerKind::Adam,
        schedule: Schedule::Cosine,
        warmup_steps: 2,
        lr: 3e-3,
        grad_clip_norm: Some(0.5),
        seed: 5,
        eval_every_epochs: 0,
        workers: Some(0),
        ..TrainOptions::default()
    }
}

/// A run's final weights and events.
struct Trained {
    weights: Vec<f32>,
    sink: MemorySink,
}

fn train(
    options: TrainOptions,
    data: &dyn Dataset,
    collective: Option<Arc<dyn Collective>>,
) -> kiln::Result<Trained> {
    let mut sink = MemorySink::default();
    let mut trainer = Trainer::new(options, Device::flex(), &mut sink);
    if let Some(c) = collective {
        trainer = trainer.with_collective(c);
    }
    let outcome = trainer.fit("mlp", |d| ModelKind::Mlp.init(d), data, None)?;
    Ok(Trained {
        weights: flatten_params(&outcome.model),
        sink,
    })
}

fn losses(sink: &MemorySink) -> Vec<f32> {
    sink.steps().map(|s| s.loss).collect()
}

/// Asserts two runs trained the same model: every step's loss and the final weights within
/// f32 rounding of each other (the sums run in another order).
fn assert_same_training(single: &Trained, ranks: &Trained) {
    let (a, b) = (losses(&single.sink), losses(&ranks.sink));
    assert_eq!(a.len(), b.len(), "step counts differ");
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        if x.is_nan() {
            assert!(y.is_nan(), "step {step}: {x} vs {y}");
            continue;
        }
        assert!(
            (x - y).abs() <= 1e-5 * x.abs().max(1.0),
            "step {step}: loss {x} vs {y}"
        );
    }
    let (_, max_diff) = common::bitwise_differences(&single.weights, &ranks.weights);
    let scale = single.weights.iter().fold(0f32, |m, w| m.max(w.abs()));
    eprintln!("max weight difference {max_diff:e} (largest weight {scale})");
    assert!(
        max_diff <= 1e-5 * scale.max(1.0),
        "weights differ by up to {max_diff} (largest weight {scale})"
    );
}

/// 161 samples: with 2 ranks × 8 and accumulation 2 the epoch ends in a global micro-batch
/// of one sample, which rank 0 has no part of (a whole step without samples on rank 0).
fn data() -> impl Dataset {
    bundled(Split::Train).unwrap().take(161)
}

#[test]
fn two_ranks_with_micro_batch_b_train_the_model_of_one_process_with_2b() {
    let data = data();
    let single = train(options(16), &data, None).unwrap();
    let ranks = on_ranks(2, |c| train(options(8), &data, Some(c)).unwrap());
    // The replicas are bit-identical (every rank applies the same reduced gradients).
    assert_eq!(
        common::bitwise_differences(&ranks[0].weights, &ranks[1].weights).0,
        0
    );
    assert_same_training(&single, &ranks[0]);
    // Rank 0 reports for all: step events (with every rank's compute time and the samples
    // of all ranks); the other ranks emit nothing.
    let steps: Vec<_> = ranks[0].sink.steps().collect();
    assert_eq!(steps.len(), 2 * 161usize.div_ceil(16).div_ceil(2));
    assert!(
        steps
            .iter()
            .all(|s| s.rank_compute_ms.as_ref().is_some_and(|t| t.len() == 2)
                && s.reduce_ms.is_some())
    );
    assert_eq!(steps.iter().map(|s| s.samples).sum::<usize>(), 2 * 161);
    assert!(ranks[1].sink.events.is_empty());
    // A world of one changes nothing: the same run with a one-rank group is bit-identical.
    let one = on_ranks(1, |c| train(options(16), &data, Some(c)).unwrap());
    assert_eq!(
        common::bitwise_differences(&single.weights, &one[0].weights).0,
        0
    );
}

#[test]
fn four_ranks_match_one_process_too() {
    let data = bundled(Split::Train).unwrap().take(100);
    let opts = |b| TrainOptions {
        epochs: 1,
        grad_accum_steps: 1,
        ..options(b)
    };
    let single = train(opts(16), &data, None).unwrap();
    let ranks = on_ranks(4, |c| train(opts(4), &data, Some(c)).unwrap());
    assert_same_training(&single, &ranks[0]);
    for r in &ranks[1..] {
        assert_eq!(
            common::bitwise_differences(&r.weights, &ranks[0].weights).0,
            0
        );
    }
}

#[test]
fn a_nan_on_one_rank_skips_the_step_on_every_rank() {
    // In order, batch 2 × 16: sample 40 is in micro-batch 1 of step 2 (and of step 8, in
    // the second epoch), on rank 0 only.
    let data = common::Poisoned {
        inner: bundled(Split::Train).unwrap().take(161),
        bad: vec![40],
    };
    let opts = |b| TrainOptions {
        shuffle: false,
        guard: GuardOptions {
            policy: GuardPolicy::Skip,
            ..GuardOptions::default()
        },
        ..options(b)
    };
    let single = train(opts(16), &data, None).unwrap();
    let ranks = on_ranks(2, |c| train(opts(8), &data, Some(c)).unwrap());
    let skipped: Vec<u64> = ranks[0]
        .sink
        .steps()
        .filter(|s| s.skipped)
        .map(|s| s.step)
        .collect();
    assert_eq!(
        skipped,
        vec![2, 8],
        "the poisoned steps are skipped, once per epoch"
    );
    assert_eq!(common::guard_events(&ranks[0].sink).len(), 2);
    assert_eq!(
        common::bitwise_differences(&ranks[0].weights, &ranks[1].weights).0,
        0,
        "rank 1 (whose samples were clean) skipped the step too"
    );
    assert!(ranks[0].weights.iter().all(|w| w.is_finite()));
    assert_same_training(&single, &ranks[0]);
}

#[test]
fn checkpoints_are_written_once_by_rank_0_and_every_rank_resumes_from_them() {
    let data = data();
    let dir = common::tempdir("dp", "resume");
    let with_dir = |max_steps| TrainOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        checkpoint_every_steps: Some(2),
        keep_checkpoints: 0,
        max_steps,
        ..options(8)
    };
    let uninterrupted = on_ranks(2, |c| train(options(8), &data, Some(c)).unwrap());
    // Stop after 5 of 12 steps: checkpoints at steps 2, 4 and 5 (where it stopped).
    let first = on_ranks(2, |c| train(with_dir(Some(5)), &data, Some(c)).unwrap());
    let written: Vec<u64> = first[0]
        .sink
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Checkpoint { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    assert_eq!(written, vec![2, 4, 5]);
    let files = std::fs::read_dir(&*dir).unwrap().count();
    assert_eq!(files, 3, "one file per checkpoint: rank 1 writes none");

    let latest = latest_checkpoint(&dir).unwrap().unwrap();
    let resumed = on_ranks(2, |c| {
        let mut sink = MemorySink::default();
        let outcome = Trainer::new(with_dir(None), Device::flex(), &mut sink)
            .with_collective(c)
            .resume_from(&latest)
            .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
            .unwrap();
        flatten_params(&outcome.model)
    });
    for weights in &resumed {
        assert_eq!(
            common::bitwise_differences(weights, &uninterrupted[0].weights).0,
            0,
            "a resumed 2-rank run continues bit for bit"
        );
    }
    // The world size is part of the trajectory: one process cannot continue a 2-rank run.
    let err = Trainer::new(with_dir(None), Device::flex(), &mut NullSink)
        .resume_from(&latest)
        .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
        .unwrap_err();
    assert!(err.to_string().contains("data_parallel.ranks"), "{err}");
}

/// A user's small CNN with one normalization layer `N` (Kiln's or Burn's BatchNorm): conv
/// 3×3 stride 2 → BatchNorm → ReLU → linear classifier, on 1×28×28 images.
#[derive(Module, Debug)]
struct NormNet<N> {
    conv: kiln::nn::Conv2d,
    bn: N,
    fc: burn::nn::Linear,
}

impl<N> NormNet<N> {
    fn new(bn: impl Fn(usize, &Device) -> N, d: &Device) -> Self {
        NormNet {
            // No bias before BatchNorm (which removes it): its true gradient is zero, and
            // Adam would turn the rounding noise there into full steps that differ between
            // summation orders.
            conv: kiln::nn::Conv2dConfig::new([1, 6], [3, 3])
                .with_stride([2, 2])
                .with_bias(false)
                .init(d),
            bn: bn(6, d),
            fc: burn::nn::LinearConfig::new(6 * 13 * 13, 10).init(d),
        }
    }
}

impl kiln::zoo::Classifier for NormNet<kiln::nn::BatchNorm> {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.bn.forward_relu(self.conv.forward(images));
        self.fc.forward(x.flatten(1, 3))
    }
}

impl kiln::zoo::Classifier for NormNet<burn::nn::BatchNorm> {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = burn::tensor::activation::relu(self.bn.forward(self.conv.forward(images)));
        self.fc.forward(x.flatten(1, 3))
    }
}

fn kiln_bn(c: usize, d: &Device) -> kiln::nn::BatchNorm {
    kiln::nn::BatchNormConfig::new(c).init(d)
}

/// The trained weights, the BatchNorm's running mean and variance, and the step losses.
fn train_norm_net(
    options: TrainOptions,
    data: &dyn Dataset,
    collective: Option<Arc<dyn Collective>>,
) -> kiln::Result<(Trained, Vec<f32>)> {
    let mut sink = MemorySink::default();
    let mut trainer = Trainer::new(options, Device::flex(), &mut sink);
    if let Some(c) = collective {
        trainer = trainer.with_collective(c);
    }
    // With a test split: only rank 0 evaluates, and evaluation publishes the running
    // statistics' last update on its rank alone (the replica check must not mind).
    let test = bundled(Split::Test)?.take(32);
    let model = trainer
        .fit("bn-net", |d| NormNet::new(kiln_bn, d), data, Some(&test))?
        .model;
    let running = [model.bn.running_mean.value(), model.bn.running_var.value()]
        .into_iter()
        .flat_map(|t| t.into_data().try_to_vec::<f32>().unwrap())
        .collect();
    Ok((
        Trained {
            weights: flatten_params(&model),
            sink,
        },
        running,
    ))
}

#[test]
fn batch_norm_statistics_are_synchronized_so_ranks_train_the_model_of_one_process() {
    // 161 samples: the epoch's last global micro-batch has one sample, so with 2 ranks rank 0
    // (with 4 ranks, three of them) takes part in its statistics with zeros.
    let data = data();
    let (single, single_running) = train_norm_net(options(16), &data, None).unwrap();
    for world in [2, 4] {
        let ranks = on_ranks(world, |c| {
            train_norm_net(options(16 / world), &data, Some(c)).unwrap()
        });
        assert_same_training(&single, &ranks[0].0);
        for (r, (trained, running)) in ranks.iter().enumerate() {
            assert_eq!(
                common::bitwise_differences(&trained.weights, &ranks[0].0.weights).0,
                0,
                "rank {r}'s replica differs"
            );
            // The running statistics come from the global batch's statistics too: the same
            // on every rank, and the single process's.
            assert_eq!(running, &ranks[0].1, "rank {r}'s running statistics");
            let (_, diff) = common::bitwise_differences(&single_running, running);
            assert!(
                diff <= 1e-5,
                "{world} ranks: running statistics differ by {diff}"
            );
        }
    }
    // With Burn's activation checkpointing (recomputed activations in backward) the ranks
    // still train the single process's model; with the loader's worker probe (a few
    // training steps with local statistics before the run, which move the running
    // statistics) the replicas still agree.
    let recompute = |b| TrainOptions {
        activation_checkpointing: true,
        ..options(b)
    };
    let (single_ckpt, _) = train_norm_net(recompute(16), &data, None).unwrap();
    let ranks = on_ranks(2, |c| train_norm_net(recompute(8), &data, Some(c)).unwrap());
    assert_same_training(&single_ckpt, &ranks[0].0);
    let probed = |b| TrainOptions {
        workers: None,
        ..options(b)
    };
    let ranks = on_ranks(2, |c| train_norm_net(probed(8), &data, Some(c)).unwrap());
    assert_eq!(
        ranks[0].1, ranks[1].1,
        "running statistics after the worker probe"
    );
    // Without synchronization (each rank its own statistics) the result would differ: the
    // check above can fail. A model-level witness: one process with batch 8 is another model.
    let (half, _) = train_norm_net(options(8), &data, None).unwrap();
    let (_, diff) = common::bitwise_differences(&single.weights, &half.weights);
    assert!(
        diff > 1e-3,
        "batch 8 and batch 16 should train different models"
    );
}

#[test]
fn batch_norm_stays_synchronized_under_bf16_mixed_precision() {
    // Autocast runs the convolution in bf16 and hands BatchNorm f32 (norms stay in f32), so
    // the statistics are summed over the ranks as in f32 runs.
    let data = data();
    let bf16 = |b| TrainOptions {
        precision: Precision::Bf16,
        ..options(b)
    };
    let (single, single_running) = train_norm_net(bf16(16), &data, None).unwrap();
    let ranks = on_ranks(2, |c| train_norm_net(bf16(8), &data, Some(c)).unwrap());
    assert_eq!(
        common::bitwise_differences(&ranks[0].0.weights, &ranks[1].0.weights).0,
        0,
        "replicas differ"
    );
    assert_eq!(ranks[0].1, ranks[1].1, "running statistics differ");
    // bf16 tolerances: the convolution's bf16 products are summed over 8 samples per rank
    // instead of 16, so the runs differ by bf16 rounding (measured: losses 4.9·10⁻⁴
    // relative, weights 1.3·10⁻⁴, running statistics 1.0·10⁻⁴). With the backward's sums
    // left per rank (forward synchronized) the weights differ by 5.2·10⁻³ and the last loss
    // by 4·10⁻³: caught.
    let (a, b) = (losses(&single.sink), losses(&ranks[0].0.sink));
    assert_eq!(a.len(), b.len(), "step counts differ");
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1.5e-3 * x.abs().max(1.0),
            "step {step}: loss {x} vs {y}"
        );
    }
    let (_, weights) = common::bitwise_differences(&single.weights, &ranks[0].0.weights);
    let (_, running) = common::bitwise_differences(&single_running, &ranks[0].1);
    assert!(weights <= 1e-3, "weights differ by {weights}");
    assert!(running <= 1e-3, "running statistics differ by {running}");
}

#[test]
fn unsynchronizable_batch_norms_are_refused_with_the_fix_before_replicas_drift() {
    let data = data();
    let errors = on_ranks(2, |c| {
        Trainer::new(options(8), Device::flex(), &mut NullSink)
            .with_collective(c)
            .fit(
                "burn-bn",
                |d| NormNet::new(|c, d| burn::nn::BatchNormConfig::new(c).init(d), d),
                &data,
                None,
            )
            .map(|_| ())
            .unwrap_err()
    });
    for e in errors {
        assert!(matches!(e, KilnError::Inconsistent(_)), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("`bn`") && text.contains("kiln::nn::BatchNorm"),
            "{e}"
        );
    }
    // Kiln's BatchNorm with Kiln's kernels off runs Burn's op, which cannot synchronize
    // either: refused, naming the switch.
    let kernels_off = TrainOptions {
        kiln_kernels: false,
        ..options(8)
    };
    let errors = on_ranks(2, |c| {
        train_norm_net(kernels_off.clone(), &data, Some(c))
            .map(|_| ())
            .unwrap_err()
    });
    for e in errors {
        let text = e.to_string();
        assert!(
            matches!(e, KilnError::Inconsistent(_))
                && text.contains("`bn`")
                && text.contains("device.kiln_kernels = true"),
            "{e}"
        );
    }
}

/// Bundled samples with one record that cannot be read.
struct Corrupt {
    inner: kiln::data::ImageDataset,
    bad: usize,
}

impl Dataset for Corrupt {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn item_shape(&self) -> [usize; 3] {
        self.inner.item_shape()
    }
    fn fill(&self, index: usize, out: &mut [f32]) -> kiln::Result<usize> {
        if index == self.bad {
            return Err(KilnError::Loader(format!("record {index} is corrupt")));
        }
        self.inner.fill(index, out)
    }
}

#[test]
fn a_rank_that_fails_stops_the_others_with_its_error_instead_of_a_hang() {
    // In order, 2 ranks × 8 with accumulation 2: step 2's first global micro-batch is
    // samples 32..48, rank 0 reads 32..40 and rank 1 40..48. Each rank fails in turn.
    for (bad, failing) in [(40, 1), (32, 0)] {
        let (tx, rx) = std::sync::mpsc::channel();
        let ranks: Vec<_> = ThreadGroup::new(2)
            .into_iter()
            .map(|g| {
                let tx = tx.clone();
                // Plain threads, not a scope: a hang must fail the test below, not block it.
                std::thread::spawn(move || {
                    let data = Corrupt {
                        inner: bundled(Split::Train).unwrap().take(161),
                        bad,
                    };
                    let opts = TrainOptions {
                        shuffle: false,
                        ..options(8)
                    };
                    let r = train(opts, &data, Some(Arc::new(g))).map(|_| ());
                    let _ = tx.send(());
                    r
                })
            })
            .collect();
        for _ in 0..2 {
            rx.recv_timeout(std::time::Duration::from_secs(120))
                .expect("a rank still waits for the failed one after 120 s: a hang");
        }
        let errors: Vec<KilnError> = ranks
            .into_iter()
            .map(|h| h.join().unwrap().unwrap_err())
            .collect();
        // The failing rank reports its own error; the other one stops with that error as
        // the reason, not a hang and not a generic one.
        let own = errors[failing].to_string();
        assert!(own.contains(&format!("record {bad} is corrupt")), "{own}");
        let other = &errors[1 - failing];
        assert!(matches!(other, KilnError::PeerLost(_)), "{other}");
        let why = other.to_string();
        assert!(
            why.contains(&format!("rank {failing} failed"))
                && why.contains(&format!("record {bad} is corrupt")),
            "{why}"
        );
    }
}

/// Hands out the indices it is asked for, so a test sees which samples each batch has.
struct Indices(usize);

impl BatchSource for Indices {
    type Batch = Vec<usize>;
    fn len(&self) -> usize {
        self.0
    }
    fn batch(&self, indices: &[usize], _: BatchContext, _: &Device) -> kiln::Result<Vec<usize>> {
        Ok(indices.to_vec())
    }
}

#[test]
fn sharded_loaders_split_every_epoch_exactly_once_with_and_without_workers() {
    let (n, batch, world) = (45, 4, 3);
    for workers in [0, 2] {
        let options = LoaderOptions {
            batch_size: batch,
            workers,
            ..LoaderOptions::default()
        };
        let mut whole = Vec::new();
        DataLoader::run_source(&Indices(n), &Device::flex(), options.clone(), |l| {
            l.set_batch_size(batch * world);
            whole = l.epoch(1, 0).map(|b| b.unwrap()).collect::<Vec<_>>();
        })
        .unwrap();
        let mut seen = vec![0; n];
        let mut parts: Vec<Vec<Vec<usize>>> = Vec::new();
        for rank in 0..world {
            DataLoader::run_source(&Indices(n), &Device::flex(), options.clone(), |l| {
                l.set_shard(Shard { rank, world });
                let batches: Vec<_> = l.epoch(1, 0).map(|b| b.unwrap()).collect();
                assert_eq!(batches.len(), l.batches_per_epoch());
                for i in batches.iter().flatten() {
                    seen[*i] += 1;
                }
                parts.push(batches);
            })
            .unwrap();
        }
        assert!(seen.iter().all(|&c| c == 1), "workers {workers}: {seen:?}");
        // The ranks' batch k, in rank order, is one process's batch k of batch × world.
        for (k, global) in whole.iter().enumerate() {
            let joined: Vec<usize> = parts
                .iter()
                .filter_map(|p| p.get(k))
                .flatten()
                .copied()
                .collect();
            assert_eq!(&joined, global, "workers {workers}, batch {k}");
        }
    }
}

/// Counts the all-reduce calls of the collective it wraps.
struct Counting {
    inner: ThreadGroup,
    f32_calls: std::sync::atomic::AtomicUsize,
}

impl Collective for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> kiln::Result<()> {
        self.f32_calls
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.all_reduce_f32(buf, op)
    }
    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> kiln::Result<()> {
        self.inner.all_reduce_f64(buf, op)
    }
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> kiln::Result<()> {
        self.inner.broadcast_f32(buf, root)
    }
    fn barrier(&self) -> kiln::Result<()> {
        self.inner.barrier()
    }
    fn engine(&self) -> &'static str {
        "counting"
    }
}

#[test]
fn gradients_are_reduced_once_per_optimizer_step_not_per_micro_batch() {
    let data = data();
    let opts = TrainOptions {
        grad_accum_steps: 4,
        epochs: 1,
        ..options(4)
    };
    let calls = on_group(2, |g| {
        let counting = Arc::new(Counting {
            inner: g,
            f32_calls: Default::default(),
        });
        let run = train(opts.clone(), &data, Some(counting.clone())).unwrap();
        let steps = run.sink.steps().count();
        (
            steps,
            counting.f32_calls.load(std::sync::atomic::Ordering::SeqCst),
        )
    });
    // Rank 0 reported the steps; every rank made the same calls: per step one bucket (the
    // MLP's gradients and the "has a gradient" flags fit in one 25 MiB bucket), whatever the
    // 4 micro-batches.
    let steps = calls[0].0;
    assert_eq!(steps, 161usize.div_ceil(4 * 2 * 4));
    for (_, f32_calls) in &calls {
        assert_eq!(*f32_calls, steps);
    }
}

#[test]
fn every_rank_starts_from_rank_0s_parameters() {
    let data = data();
    let single = train(options(16), &data, None).unwrap();
    // Each rank initializes differently (an unseeded init in a user's code would): rank 0 as
    // the single process does, the others from another seed.
    let ranks = on_ranks(2, |c| {
        let rank = c.rank();
        let mut sink = MemorySink::default();
        let outcome = Trainer::new(options(8), Device::flex(), &mut sink)
            .with_collective(c)
            .fit(
                "mlp",
                |d| {
                    if rank > 0 {
                        d.seed(1000 + rank as u64);
                    }
                    ModelKind::Mlp.init(d)
                },
                &data,
                None,
            )
            .unwrap();
        Trained {
            weights: flatten_params(&outcome.model),
            sink,
        }
    });
    assert_eq!(
        common::bitwise_differences(&ranks[0].weights, &ranks[1].weights).0,
        0
    );
    assert_same_training(&single, &ranks[0]);
}

#[test]
fn a_watermark_crossing_on_one_rank_halves_the_micro_batch_on_all() {
    let data = data();
    let single = train(options(16), &data, None).unwrap();
    // Rank 1's watermark is 1 byte (every reading crosses it), rank 0's never fires.
    let ranks = on_ranks(2, |c| {
        let watermark = if c.rank() == 1 { 1 } else { u64::MAX };
        let opts = TrainOptions {
            memory_watermark: Some(watermark),
            oom_adaptive: true,
            ..options(8)
        };
        train(opts, &data, Some(c)).unwrap()
    });
    let adapted: Vec<usize> = common::batch_adaptations(&ranks[0].sink)
        .iter()
        .map(|b| b.micro_batch)
        .collect();
    assert_eq!(adapted, vec![4, 2, 1], "rank 0 halved with rank 1");
    // Rank 0's events report rank 1's crossing (its 1-byte watermark and a reading above
    // it), not rank 0's own reading under a watermark it never reached.
    let marks: Vec<(u64, u64)> = common::watermark_events(&ranks[0].sink)
        .iter()
        .map(|w| (w.in_use_bytes, w.threshold_bytes))
        .collect();
    assert!(!marks.is_empty());
    assert!(
        marks
            .iter()
            .all(|&(in_use, threshold)| threshold == 1 && in_use > 1),
        "{marks:?}"
    );
    assert_eq!(
        common::bitwise_differences(&ranks[0].weights, &ranks[1].weights).0,
        0
    );
    // Halving keeps the effective batch: still the single process's model.
    assert_same_training(&single, &ranks[0]);
}

#[test]
fn ranks_started_with_other_settings_are_refused_instead_of_hanging() {
    let data = data();
    let errors = on_ranks(2, |c| {
        let lr = if c.rank() == 1 { 1e-2 } else { 3e-3 };
        train(TrainOptions { lr, ..options(8) }, &data, Some(c))
            .err()
            .map(|e| e.to_string())
    });
    for e in errors {
        let e = e.expect("refused");
        assert!(e.contains("other settings"), "{e}");
    }
}

/// Items are x; the target is 3x + 1 (the crate documentation's example model).
#[derive(Module, Debug)]
struct Line {
    fit: kiln::nn::Linear,
}

impl TrainStep<(Tensor<2>, Tensor<2>)> for Line {
    fn step(&self, (x, y): (Tensor<2>, Tensor<2>)) -> StepOutput {
        StepOutput::regression(self.fit.forward(x), y)
    }
}

struct Points;

impl Batcher<f32, (Tensor<2>, Tensor<2>)> for Points {
    fn batch(&self, xs: Vec<f32>, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let x = Tensor::<2>::from_data(TensorData::new(xs.clone(), [xs.len(), 1]), device);
        (x.clone(), x.mul_scalar(3.0).add_scalar(1.0))
    }
}

#[test]
fn your_own_burn_model_and_batcher_train_data_parallel_too() {
    let xs: Vec<f32> = (0..203).map(|i| i as f32 / 100.0 - 1.0).collect();
    let data = BurnBatches::new(InMemDataset::new(xs), Points);
    let opts = |b| TrainOptions {
        epochs: 3,
        batch_size: b,
        lr: 0.05,
        eval_every_epochs: 0,
        workers: Some(0),
        ..TrainOptions::default()
    };
    let line = |d: &Device| Line {
        fit: kiln::nn::LinearConfig::new(1, 1).init(d),
    };
    let fit = |b, c: Option<Arc<dyn Collective>>| {
        let mut sink = NullSink;
        let mut trainer = Trainer::new(opts(b), Device::flex(), &mut sink);
        if let Some(c) = c {
            trainer = trainer.with_collective(c);
        }
        flatten_params(&trainer.fit_source("line", line, &data, None).unwrap().model)
    };
    let single = fit(24, None);
    let ranks = on_ranks(3, |c| fit(8, Some(c)));
    for r in &ranks {
        let (_, diff) = common::bitwise_differences(&single, r);
        assert!(diff <= 1e-5, "{single:?} vs {r:?}");
    }
}

#[test]
fn f16_loss_scale_backoffs_are_taken_on_every_rank_together() {
    let data = data();
    // 2^24 overflows f16 gradients at once: the scaler backs off, step by step, on all ranks.
    let opts = TrainOptions {
        precision: Precision::F16,
        scaler: ScalerOptions {
            mode: ScalingMode::Dynamic,
            init_scale: 16_777_216.0,
            growth_interval: 1_000,
        },
        ..options(8)
    };
    let ranks = on_ranks(2, |c| train(opts.clone(), &data, Some(c)).unwrap());
    let backoffs = common::guard_events(&ranks[0].sink);
    assert!(!backoffs.is_empty(), "2^24 overflows");
    assert!(
        backoffs
            .iter()
            .all(|e| e.action == kiln::guard::GuardAction::ScaleBackoff)
    );
    let scales: Vec<Option<f32>> = ranks[0].sink.steps().map(|s| s.loss_scale).collect();
    assert!(scales.windows(2).any(|w| w[1] < w[0]), "{scales:?}");
    assert_eq!(
        common::bitwise_differences(&ranks[0].weights, &ranks[1].weights).0,
        0,
        "both ranks skipped the same steps with the same scale"
    );
    assert!(ranks[0].weights.iter().all(|w| w.is_finite()));
}

#[test]
fn the_report_of_a_data_parallel_run_plots_each_rank() {
    let data = data();
    let ranks = on_ranks(2, |c| train(options(8), &data, Some(c)).unwrap());
    let dir = common::tempdir("dp", "report");
    // The report of a run directory holding `sink`'s events.
    let report = |sink: &MemorySink| {
        let lines: Vec<String> = sink
            .events
            .iter()
            .map(|e| serde_json::to_string(e).unwrap())
            .collect();
        std::fs::write(dir.join("events.jsonl"), lines.join("\n")).unwrap();
        kiln::report::render_html(&kiln::report::load_run(&dir).unwrap())
    };
    let html = report(&ranks[0].sink);
    assert!(html.contains("Data-parallel ranks"), "no ranks chart");
    assert!(html.contains("rank 1 forward+backward") && html.contains("all-reduce (rank 0)"));
    // A run of one process has no such chart.
    let single = train(options(16), &data, None).unwrap();
    assert!(!report(&single.sink).contains("Data-parallel ranks"));
}
