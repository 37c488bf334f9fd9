//! What keeps a GPU busy, tested on the CPU (issue 49). A training step that never waits for
//! the host: between the loop's sync points the host reads nothing back from the device, and
//! the trajectory — losses, skipped steps, clipping norms, loss scales, final weights — is
//! the same bit for bit whether it reads every step or every N. And one shape per epoch: the
//! last, short batch padded or dropped (`data.last_batch`).

mod common;

use burn::tensor::Device;
use kiln::data::LastBatch;
use kiln::datasets::{Split, bundled};
use kiln::guard::{GuardOptions, GuardPolicy};
use kiln::observe::MemorySink;
use kiln::observe::{Event, EventSink, StepEvent};
use kiln::precision::{Precision, ScalerOptions, ScalingMode};
use kiln::train::{OptimizerKind, Schedule, TrainOptions, flatten_params, host_reads};
use kiln::zoo::ModelKind;
use kiln::{Trainer, burn};

/// Keeps each step event with the loop's read count at the moment it was reported.
#[derive(Default)]
struct ReadCounting {
    steps: Vec<(StepEvent, u64)>,
}

impl EventSink for ReadCounting {
    fn emit(&mut self, event: &Event) {
        if let Event::Step(s) = event {
            // The sink runs on the training thread, where the count is kept.
            self.steps.push((s.clone(), host_reads()));
        }
    }
}

/// What a run did: its steps (with the read count at each report), reads in all, weights.
struct Trajectory {
    steps: Vec<(StepEvent, u64)>,
    reads: u64,
    weights: Vec<f32>,
}

/// Two epochs of 8 steps over real digits with two poisoned samples (steps 2, 7, 10 and 15
/// are skipped by the guard), global-norm clipping that binds, warm-up and cosine decay, and
/// Adam or SGD, in f32 or f16 with dynamic loss scaling.
fn train(
    sync_every: usize,
    optimizer: OptimizerKind,
    precision: Precision,
    kiln: bool,
) -> Trajectory {
    let data = common::Poisoned {
        inner: bundled(Split::Train).unwrap().take(256),
        bad: vec![40, 214],
    };
    let options = TrainOptions {
        epochs: 2,
        batch_size: 32,
        shuffle: false,
        optimizer,
        lr: 3e-3,
        schedule: Schedule::Cosine,
        warmup_steps: 3,
        grad_clip_norm: Some(0.5),
        precision,
        scaler: ScalerOptions {
            mode: if precision == Precision::F16 {
                ScalingMode::Dynamic
            } else {
                ScalingMode::Off
            },
            init_scale: 1024.0,
            growth_interval: 3,
        },
        guard: GuardOptions {
            policy: GuardPolicy::Skip,
            max_consecutive: 3,
            check_params: true,
            snapshot_every: 2,
        },
        sync_every,
        kiln_kernels: kiln,
        ..TrainOptions::default()
    };
    let mut sink = ReadCounting::default();
    let before = host_reads();
    let out = Trainer::new(options, Device::flex(), &mut sink)
        .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
        .expect("training runs");
    Trajectory {
        steps: sink
            .steps
            .into_iter()
            .map(|(s, r)| (s, r - before))
            .collect(),
        reads: host_reads() - before,
        weights: flatten_params(&out.model),
    }
}

/// The device values of a step event, as bits (NaN compares equal to itself).
fn device_values(s: &StepEvent) -> (u64, u32, bool, Option<u32>, Option<u32>) {
    (
        s.step,
        s.loss.to_bits(),
        s.skipped,
        s.grad_norm.map(f32::to_bits),
        s.loss_scale.map(f32::to_bits),
    )
}

fn same_trajectory(a: &Trajectory, b: &Trajectory, what: &str) {
    let va: Vec<_> = a.steps.iter().map(|(s, _)| device_values(s)).collect();
    let vb: Vec<_> = b.steps.iter().map(|(s, _)| device_values(s)).collect();
    assert_eq!(va, vb, "{what}: step values differ");
    assert!(a.weights == b.weights, "{what}: final weights differ");
}

#[test]
fn reads_only_at_sync_points_with_the_same_trajectory() {
    for (optimizer, precision, kiln) in [
        (OptimizerKind::Adam, Precision::F32, true),
        (OptimizerKind::Adam, Precision::F32, false),
        (OptimizerKind::Sgd, Precision::F32, true),
        (OptimizerKind::AdamW, Precision::F16, true),
    ] {
        let what = format!("{optimizer:?} {precision:?} kiln kernels {kiln}");
        let every = train(1, optimizer, precision, kiln);
        let deferred = train(5, optimizer, precision, kiln);
        assert_eq!(every.steps.len(), 16, "{what}");
        same_trajectory(&every, &deferred, &what);
        // Every step is read at its own end with sync_every = 1 ...
        assert_eq!(every.reads, 16, "{what}");
        // ... and with 5: at steps 5 and 8 of each epoch (the epoch's end is a sync point).
        assert_eq!(deferred.reads, 4, "{what}");
        let reads_at: Vec<u64> = deferred.steps.iter().map(|(_, r)| *r).collect();
        assert_eq!(
            reads_at,
            [1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4, 4],
            "{what}: the reads between sync points are not zero"
        );
        // The guard skipped the two poisoned steps on the device, and clipping bound.
        let skipped: Vec<u64> = every
            .steps
            .iter()
            .filter(|(s, _)| s.skipped)
            .map(|(s, _)| s.step)
            .collect();
        assert!(
            skipped.contains(&2) && skipped.contains(&15),
            "{what}: {skipped:?}"
        );
        assert!(
            every
                .steps
                .iter()
                .any(|(s, _)| s.grad_norm.is_some_and(|n| n > 0.5)),
            "{what}: clipping never bound"
        );
        assert!(every.weights.iter().all(|w| w.is_finite()), "{what}");
    }
}

/// 100 samples in batches of 32: kept, the last batch has 4 samples; padded, every batch
/// has 32 (the epoch's first 28 samples again); dropped, three batches of 32. Under
/// accumulation the micro-batches follow the same rule.
#[test]
fn every_batch_has_one_shape_when_the_last_is_padded_or_dropped() {
    let data = bundled(Split::Train).unwrap().take(100);
    let samples = |last_batch, accum| {
        let mut sink = MemorySink::default();
        let out = Trainer::new(
            TrainOptions {
                epochs: 2,
                batch_size: 32 / accum,
                grad_accum_steps: accum,
                last_batch,
                ..TrainOptions::default()
            },
            Device::flex(),
            &mut sink,
        )
        .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
        .expect("training runs");
        assert!(out.summary.first_step_ms.is_some_and(|ms| ms > 0.0));
        sink.steps().map(|s| s.samples).collect::<Vec<usize>>()
    };
    assert_eq!(samples(LastBatch::Keep, 1), [32, 32, 32, 4, 32, 32, 32, 4]);
    assert_eq!(samples(LastBatch::Pad, 1), [32; 8]);
    assert_eq!(samples(LastBatch::Drop, 1), [32; 6]);
    // Micro-batches of 16, two per step: padding fills the last micro-batch.
    assert_eq!(samples(LastBatch::Pad, 2), [32, 32, 32, 16, 32, 32, 32, 16]);
}
