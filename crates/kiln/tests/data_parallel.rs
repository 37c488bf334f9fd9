//! Data parallelism with ranks as threads ([`ThreadGroup`]): N ranks with micro-batch b train
//! the model one process trains with batch N·b, with accumulation, clipping, a short last
//! batch that leaves a rank without samples, a NaN on one rank, checkpoints and resume.
//! The MPI engine runs the same trainer code across processes (kiln-cli's `tests/mpi.rs`).

mod common;

use std::sync::Arc;

use burn::tensor::Device;
use kiln::data::{BatchContext, BatchSource, DataLoader, Dataset, LoaderOptions, Shard};
use kiln::datasets::{Split, bundled};
use kiln::distributed::{Collective, ThreadGroup};
use kiln::guard::{GuardOptions, GuardPolicy};
use kiln::observe::{Event, MemorySink, NullSink};
use kiln::train::{OptimizerKind, Schedule, TrainOptions, flatten_params, latest_checkpoint};
use kiln::zoo::ModelKind;
use kiln::{KilnError, Trainer, burn};

/// Runs `f` on each member of a new group of `size` ranks, one thread each.
fn on_ranks<T: Send>(size: usize, f: impl Fn(Arc<dyn Collective>) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadGroup::new(size)
            .into_iter()
            .map(|g| {
                let f = &f;
                s.spawn(move || f(Arc::new(g)))
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

#[test]
fn batch_norm_models_are_refused_with_the_reason() {
    let data = data();
    let errors = on_ranks(2, |c| {
        Trainer::new(options(8), Device::flex(), &mut NullSink)
            .with_collective(c)
            .fit(
                "resnet",
                |d| ModelKind::ResNet.init_for_channels(1, d),
                &data,
                None,
            )
            .map(|_| ())
            .unwrap_err()
    });
    for e in errors {
        assert!(matches!(e, KilnError::Inconsistent(_)), "{e}");
        assert!(e.to_string().contains("BatchNorm"), "{e}");
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
