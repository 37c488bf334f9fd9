//! The data loader: exactly-once and ordering under worker counts and random delays, bounded
//! prefetch with a slow consumer, failing items reported by index without hangs, resume inside
//! an epoch, and training that is bit-for-bit independent of the worker count.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use burn::tensor::Device;
use kiln::data::{Augment, DataLoader, Dataset, LoaderOptions, RandomCrop, SampleRng, Transform};
use kiln::datasets::{Split, bundled};
use kiln::observe::NullSink;
use kiln::train::{TrainOptions, flatten_params};
use kiln::zoo::ModelKind;
use kiln::{KilnError, Trainer, burn};

/// Sample `i` is the value `i` everywhere, label `i % 10`; reading it takes a pseudo-random
/// 0–1.5 ms (so workers finish out of order); `fail` / `panic` make chosen items misbehave.
struct Probe {
    n: usize,
    fail: Option<usize>,
    panic: Option<usize>,
    fills: AtomicUsize,
    delay: bool,
}

impl Probe {
    fn new(n: usize) -> Self {
        Probe {
            n,
            fail: None,
            panic: None,
            fills: AtomicUsize::new(0),
            delay: true,
        }
    }
}

impl Dataset for Probe {
    fn len(&self) -> usize {
        self.n
    }
    fn item_shape(&self) -> [usize; 3] {
        [1, 2, 2]
    }
    fn fill(&self, index: usize, out: &mut [f32]) -> kiln::Result<usize> {
        self.fills.fetch_add(1, Ordering::SeqCst);
        if self.delay {
            let us = SampleRng::new(9, 0, index).next_u64() % 1500;
            std::thread::sleep(Duration::from_micros(us));
        }
        if self.fail == Some(index) {
            return Err(KilnError::BadData {
                path: "probe.bin".into(),
                problem: "record checksum mismatch".into(),
            });
        }
        if self.panic == Some(index) {
            panic!("decoder blew up on purpose");
        }
        out.fill(index as f32);
        Ok(index % 10)
    }
}

fn options(workers: usize, batch: usize) -> LoaderOptions {
    LoaderOptions {
        batch_size: batch,
        workers,
        prefetch_factor: 2,
        shuffle: true,
        drop_last: false,
        pad_last: false,
        seed: 5,
    }
}

/// The sample indices of each batch of `epoch`, read back from the tensors.
fn epoch_indices(loader: &mut DataLoader<'_>, epoch: usize, start: usize) -> Vec<Vec<usize>> {
    loader
        .epoch(epoch, start)
        .map(|b| {
            let b = b.expect("batch");
            let values = b.images.into_data().try_into_vec_as::<f32>().expect("f32");
            let labels = b.labels.into_data().try_into_vec_as::<i64>().expect("i64");
            let indices: Vec<usize> = values.chunks(4).map(|c| c[0] as usize).collect();
            for (i, l) in indices.iter().zip(&labels) {
                assert_eq!((*i % 10) as i64, *l, "label travels with its sample");
            }
            indices
        })
        .collect()
}

/// Runs `f` on another thread and fails the test if it does not finish within a minute.
fn within_a_minute<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the loader hung (no result within 60 s)")
}

#[test]
fn every_sample_once_in_the_same_order_whatever_the_worker_count() {
    let data = Probe::new(101);
    let device = Device::flex();
    let mut runs = Vec::new();
    for workers in [0, 1, 4] {
        let epochs = DataLoader::run(&data, None, &device, options(workers, 7), |loader| {
            assert_eq!(loader.batches_per_epoch(), 15);
            (0..2)
                .map(|e| epoch_indices(loader, e, 0))
                .collect::<Vec<_>>()
        })
        .unwrap();
        for batches in &epochs {
            let mut seen: Vec<usize> = batches.iter().flatten().copied().collect();
            assert_eq!(batches.len(), 15);
            assert_eq!(
                batches.last().map(Vec::len),
                Some(101 - 14 * 7),
                "short last"
            );
            seen.sort_unstable();
            assert_eq!(seen, (0..101).collect::<Vec<_>>(), "workers={workers}");
        }
        assert_ne!(epochs[0], epochs[1], "each epoch has its own order");
        runs.push(epochs);
    }
    assert_eq!(runs[0], runs[1], "1 worker = inline");
    assert_eq!(runs[0], runs[2], "4 workers = inline");

    // The first epoch's batches of `data` with 3 workers and batches of 7, the last batch as
    // `drop_last` / `pad_last` say.
    let first_epoch = |data: &Probe, drop_last: bool, pad_last: bool| {
        let options = LoaderOptions {
            drop_last,
            pad_last,
            ..options(3, 7)
        };
        DataLoader::run(data, None, &device, options, |loader| {
            epoch_indices(loader, 0, 0)
        })
        .unwrap()
    };

    // drop_last: 14 full batches, every sample at most once.
    let dropped = first_epoch(&data, true, false);
    assert_eq!(dropped.len(), 14);
    assert!(dropped.iter().all(|b| b.len() == 7));
    let mut seen: Vec<usize> = dropped.into_iter().flatten().collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 98);

    // pad_last: 15 full batches, the last one filled with the epoch's first 4 samples.
    let padded = first_epoch(&data, false, true);
    assert_eq!(padded.len(), 15);
    assert!(padded.iter().all(|b| b.len() == 7));
    assert_eq!(padded[14][3..], padded[0][..4]);

    // drop_last with fewer samples than one batch keeps them (as the trainer counts its
    // steps, `LastBatch::epoch_len`): one short batch, not an empty epoch.
    let kept = first_epoch(&Probe::new(5), true, false);
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].len(), 5);
}

#[test]
fn resuming_inside_an_epoch_and_abandoning_one_keep_the_order() {
    let data = Probe::new(60);
    let device = Device::flex();
    DataLoader::run(&data, None, &device, options(3, 4), |loader| {
        let full = epoch_indices(loader, 2, 0);
        // Abandon epoch 2 after three batches: nothing stale may leak into what follows.
        let mut partial = loader.epoch(2, 0);
        for _ in 0..3 {
            partial.next().expect("batch").expect("ok");
        }
        drop(partial);
        let resumed = epoch_indices(loader, 2, 6);
        assert_eq!(resumed, full[6..].to_vec());
        let next = epoch_indices(loader, 3, 0);
        assert_eq!(next.len(), 15);
        assert_ne!(next, full);
    })
    .unwrap();
}

#[test]
fn prefetch_is_bounded_when_the_consumer_is_slow() {
    let data = Probe {
        delay: false,
        ..Probe::new(400)
    };
    let device = Device::flex();
    let opts = options(3, 4);
    let depth = opts.depth();
    assert_eq!(depth, 6);
    let stats = DataLoader::run(&data, None, &device, opts, |loader| {
        let mut consumed = 0usize;
        for batch in loader.epoch(0, 0) {
            batch.unwrap();
            consumed += 1;
            // Give the workers every chance to run ahead.
            std::thread::sleep(Duration::from_millis(3));
            let filled = data.fills.load(Ordering::SeqCst);
            assert!(
                filled <= (consumed + depth) * 4,
                "{filled} samples produced with only {consumed} batches consumed (depth {depth})"
            );
        }
        loader.stats()
    })
    .unwrap();
    assert_eq!(stats.batches, 100);
    assert!(stats.max_outstanding <= depth, "{stats:?}");
    assert!(
        stats.max_outstanding >= 2,
        "the workers never ran ahead: {stats:?}"
    );
}

#[test]
fn a_failing_item_is_reported_by_index_and_stops_the_epoch() {
    for workers in [0, 4] {
        let outcome = within_a_minute(move || {
            let data = Probe {
                fail: Some(37),
                ..Probe::new(100)
            };
            let device = Device::flex();
            DataLoader::run(&data, None, &device, options(workers, 8), |loader| {
                let mut ok = 0;
                let mut errors = Vec::new();
                for b in loader.epoch(0, 0) {
                    match b {
                        Ok(_) => ok += 1,
                        Err(e) => errors.push(e),
                    }
                }
                (ok, errors)
            })
            .unwrap()
        });
        let (ok, errors) = outcome;
        assert_eq!(errors.len(), 1, "one error, then the epoch ends");
        assert!(
            ok < 13,
            "the epoch stopped at the bad batch ({ok} good batches)"
        );
        match &errors[0] {
            KilnError::DataItem { index, problem } => {
                assert_eq!(*index, 37);
                assert!(problem.contains("checksum"), "{problem}");
            }
            other => panic!("expected DataItem, got {other}"),
        }
    }
}

#[test]
fn a_panicking_item_is_reported_and_the_loader_shuts_down() {
    for workers in [0, 3] {
        let err = within_a_minute(move || {
            let data = Probe {
                panic: Some(53),
                ..Probe::new(100)
            };
            let device = Device::flex();
            DataLoader::run(&data, None, &device, options(workers, 8), |loader| {
                loader
                    .epoch(1, 0)
                    .find_map(|b| b.err())
                    .expect("the panic surfaces as an error")
            })
            .unwrap()
        });
        let text = err.to_string();
        assert!(
            matches!(err, KilnError::DataItem { index: 53, .. }),
            "{text}"
        );
        assert!(
            text.contains("panicked") && text.contains("on purpose"),
            "{text}"
        );
    }
}

#[test]
fn training_stops_with_the_data_error() {
    struct Broken(kiln::data::ImageDataset);
    impl Dataset for Broken {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn item_shape(&self) -> [usize; 3] {
            self.0.item_shape()
        }
        fn fill(&self, index: usize, out: &mut [f32]) -> kiln::Result<usize> {
            if index == 100 {
                return Err(KilnError::DataItem {
                    index,
                    problem: "image file truncated".into(),
                });
            }
            self.0.fill(index, out)
        }
    }
    let data = Broken(bundled(Split::Train).unwrap().take(256));
    let err = Trainer::new(
        TrainOptions {
            batch_size: 32,
            workers: Some(2),
            ..TrainOptions::default()
        },
        Device::flex(),
        &mut NullSink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .expect_err("the bad sample stops training");
    assert!(
        err.to_string()
            .contains("data item 100: image file truncated"),
        "{err}"
    );
}

#[test]
fn training_is_bitwise_the_same_with_any_worker_count_and_augmentation_applies() {
    let data = bundled(Split::Train).unwrap().take(384);
    let train = |workers: usize, augment: Augment| {
        Trainer::new(
            TrainOptions {
                batch_size: 32,
                grad_accum_steps: 2,
                workers: Some(workers),
                augment,
                ..TrainOptions::default()
            },
            Device::flex(),
            &mut NullSink,
        )
        .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
        .unwrap()
        .model
    };
    let inline = flatten_params(&train(0, Augment::Crop));
    let threaded = flatten_params(&train(3, Augment::Crop));
    let (differing, max) = common::bitwise_differences(&inline, &threaded);
    assert_eq!(
        differing, 0,
        "worker count changed the run (max diff {max})"
    );
    let plain = flatten_params(&train(2, Augment::None));
    let (differing, _) = common::bitwise_differences(&inline, &plain);
    assert!(
        differing > 0,
        "augmentation must change what the model sees"
    );
}

#[test]
fn transforms_run_in_the_workers_seeded_per_sample() {
    // A crop applied by the loader equals the crop applied by hand with the sample's stream.
    let data = bundled(Split::Train).unwrap().take(40);
    let crop = RandomCrop::new(3);
    let device = Device::flex();
    let batches = DataLoader::run(&data, Some(&crop), &device, options(2, 10), |loader| {
        loader
            .epoch(4, 0)
            .map(|b| {
                b.unwrap()
                    .images
                    .into_data()
                    .try_into_vec_as::<f32>()
                    .unwrap()
            })
            .collect::<Vec<_>>()
    })
    .unwrap();
    let order = kiln::data::epoch_order(40, 5, 4, true);
    let mut changed = 0;
    for (k, values) in batches.iter().enumerate() {
        for (j, got) in values.chunks(784).enumerate() {
            let index = order[k * 10 + j];
            let mut want = vec![0f32; 784];
            data.fill(index, &mut want).unwrap();
            let before = want.clone();
            crop.apply(&mut want, [1, 28, 28], &mut SampleRng::new(5, 4, index));
            assert_eq!(got, &want[..], "sample {index}");
            changed += usize::from(before != want);
        }
    }
    assert!(changed > 20, "most samples are shifted ({changed}/40)");
}
