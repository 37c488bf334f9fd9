//! Helpers shared by the integration tests (each test binary uses a subset).
#![allow(dead_code)]

use kiln::burn::tensor::Device;
use kiln::datasets::{Split, bundled};
use kiln::guard::{GuardOptions, GuardPolicy};
use kiln::observe::{
    BatchAdaptedEvent, Event, GuardEvent, MemorySink, Profiler, SpanRecord, WatermarkEvent, timed,
};
use kiln::train::TrainOptions;
use kiln::zoo::ModelKind;
use tracing_subscriber::layer::SubscriberExt;

mod test_dir;
pub use test_dir::TestDir;

/// A fresh [`TestDir`] named after the test.
pub fn tempdir(prefix: &str, name: &str) -> TestDir {
    TestDir::new(&format!("{prefix}-{name}"))
}

/// Real MNIST samples, except the listed indices, whose pixels are NaN.
pub struct Poisoned {
    /// The real samples.
    pub inner: kiln::data::ImageDataset,
    /// The indices made NaN.
    pub bad: Vec<usize>,
}

impl kiln::data::Dataset for Poisoned {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn item_shape(&self) -> [usize; 3] {
        self.inner.item_shape()
    }
    fn fill(&self, index: usize, out: &mut [f32]) -> kiln::Result<usize> {
        let label = self.inner.fill(index, out)?;
        if self.bad.contains(&index) {
            out.fill(f32::NAN);
        }
        Ok(label)
    }
}

/// The events of one kind a run reported, in order (`pick` keeps its kind).
fn events_of<T>(sink: &MemorySink, pick: impl Fn(&Event) -> Option<&T>) -> Vec<T>
where
    T: Clone,
{
    sink.events.iter().filter_map(pick).cloned().collect()
}

/// The guard events a run reported, in order.
pub fn guard_events(sink: &MemorySink) -> Vec<GuardEvent> {
    events_of(sink, |e| match e {
        Event::Guard(g) => Some(g),
        _ => None,
    })
}

/// The micro-batch changes a run reported (OOM-adaptive halving), in order.
pub fn batch_adaptations(sink: &MemorySink) -> Vec<BatchAdaptedEvent> {
    events_of(sink, |e| match e {
        Event::BatchAdapted(b) => Some(b),
        _ => None,
    })
}

/// The memory-watermark crossings a run reported, in order.
pub fn watermark_events(sink: &MemorySink) -> Vec<WatermarkEvent> {
    events_of(sink, |e| match e {
        Event::MemoryWatermark(w) => Some(w),
        _ => None,
    })
}

/// How many weights differ bit for bit, and the largest absolute difference.
pub fn bitwise_differences(a: &[f32], b: &[f32]) -> (usize, f32) {
    assert_eq!(a.len(), b.len(), "models of different sizes");
    let differing = a
        .iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    let max_diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    (differing, max_diff)
}

/// One epoch of batch 32 in order, a checkpoint after every step, and a strict guard
/// (3 bad steps in a row abort, parameters checked, snapshots every 2 steps).
pub fn guard_test_options(policy: GuardPolicy, dir: &std::path::Path) -> TrainOptions {
    TrainOptions {
        epochs: 1,
        batch_size: 32,
        shuffle: false,
        checkpoint_dir: Some(dir.to_path_buf()),
        checkpoint_every_steps: Some(1),
        guard: GuardOptions {
            policy,
            max_consecutive: 3,
            check_params: true,
            snapshot_every: 2,
        },
        ..TrainOptions::default()
    }
}

/// Trains W1 for `steps` steps (batch 32) under a profiler; returns its spans and the events.
pub fn profiled_run(steps: u64, options: TrainOptions) -> (Vec<SpanRecord>, MemorySink) {
    let data = bundled(Split::Train).unwrap().take(640);
    let profiler = Profiler::new();
    let mut sink = MemorySink::default();
    let subscriber = tracing_subscriber::registry().with(profiler.layer());
    tracing::subscriber::with_default(subscriber, || {
        kiln::Trainer::new(
            TrainOptions {
                batch_size: 32,
                max_steps: Some(steps),
                eval_every_epochs: 0,
                ..options
            },
            Device::flex(),
            &mut sink,
        )
        .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
        .unwrap();
        timed("user-code", || {
            std::thread::sleep(std::time::Duration::from_millis(2))
        });
    });
    (profiler.spans(), sink)
}

/// A small, valid checkpoint (an MLP at global step 9, placeholder record bytes): the seed of
/// the checkpoint round-trip and fuzz tests.
pub fn sample_checkpoint() -> kiln::train::Checkpoint {
    kiln::train::Checkpoint {
        state: kiln::train::CheckpointState {
            model: "mlp".into(),
            epoch: 1,
            step_in_epoch: 3,
            global_step: 9,
            fingerprint: vec![("train.lr".into(), "0.001".into())],
            epoch_loss_sum: 12.5,
            epoch_samples: 96,
            scaler: None,
        },
        model: vec![1, 2, 3, 4],
        optimizer: vec![9; 100],
    }
}
