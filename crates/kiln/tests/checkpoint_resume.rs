//! Checkpoints round-trip, are verified on load, and a resumed run continues bit for bit.

mod common;

use burn::tensor::Device;
use kiln::datasets::{Split, bundled};
use kiln::observe::{MemorySink, NullSink};
use kiln::train::{
    Checkpoint, OptimizerKind, Schedule, TrainOptions, flatten_params, latest_checkpoint,
};
use kiln::zoo::ModelKind;
use kiln::{KilnError, Trainer, burn};

fn options(dir: Option<std::path::PathBuf>) -> TrainOptions {
    TrainOptions {
        epochs: 2,
        batch_size: 32,
        grad_accum_steps: 2,
        optimizer: OptimizerKind::Adam,
        schedule: Schedule::Cosine,
        warmup_steps: 3,
        grad_clip_norm: Some(1.0),
        seed: 11,
        checkpoint_dir: dir,
        ..TrainOptions::default()
    }
}

#[test]
fn checkpoint_bytes_round_trip_and_detect_corruption() {
    let ckpt = common::sample_checkpoint();
    let dir = common::tempdir("ckpt", "bytes");
    let path = dir.join(Checkpoint::file_name(9));
    ckpt.save(&path).unwrap();
    let back = Checkpoint::load(&path).unwrap();
    assert_eq!(back.state, ckpt.state);
    assert_eq!(back.model, ckpt.model);
    assert_eq!(back.optimizer, ckpt.optimizer);
    // No temp files are left behind by the atomic write.
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(names.len(), 1);

    let mut bytes = std::fs::read(&path).unwrap();
    bytes[20] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let err = Checkpoint::load(&path).unwrap_err();
    assert!(matches!(err, KilnError::BadCheckpoint { .. }));
    assert!(err.to_string().contains("checksum mismatch"), "{err}");

    bytes[20] ^= 0x40;
    std::fs::write(&path, &bytes[..bytes.len() - 7]).unwrap();
    assert!(
        Checkpoint::load(&path)
            .unwrap_err()
            .to_string()
            .contains("checksum")
    );
    std::fs::write(&path, b"hello").unwrap();
    assert!(
        Checkpoint::load(&path)
            .unwrap_err()
            .to_string()
            .contains("not a Kiln checkpoint")
    );
}

/// Train 2 epochs straight; separately, stop mid-epoch via max_steps, then resume from the
/// checkpoint in a fresh trainer. Final weights must be identical bit for bit.
#[test]
fn resume_continues_bit_for_bit() {
    let data = bundled(Split::Train).unwrap().take(320);
    let kind = ModelKind::Mlp;

    let mut sink = NullSink;
    let straight = Trainer::new(options(None), Device::flex(), &mut sink)
        .fit(kind.name(), |d| kind.init(d), &data, None)
        .unwrap();
    assert_eq!(straight.summary.steps, 10);

    let dir = common::tempdir("ckpt", "resume");
    let mut first_half = MemorySink::default();
    let stopped = Trainer::new(
        TrainOptions {
            max_steps: Some(7),
            ..options(Some(dir.to_path_buf()))
        },
        Device::flex(),
        &mut first_half,
    )
    .fit(kind.name(), |d| kind.init(d), &data, None)
    .unwrap();
    assert_eq!(stopped.summary.steps, 7);
    let ckpt = latest_checkpoint(&dir).unwrap().unwrap();
    assert!(ckpt.ends_with("step-00000007.kiln"), "{}", ckpt.display());
    let state = Checkpoint::load(&ckpt).unwrap().state;
    assert_eq!((state.epoch, state.step_in_epoch), (1, 2));

    let mut second_half = MemorySink::default();
    let resumed = Trainer::new(
        options(Some(dir.to_path_buf())),
        Device::flex(),
        &mut second_half,
    )
    .resume_from(&ckpt)
    .fit(kind.name(), |d| kind.init(d), &data, None)
    .unwrap();
    assert_eq!(resumed.summary.steps, 10);
    let steps: Vec<u64> = second_half.steps().map(|s| s.step).collect();
    assert_eq!(steps, vec![8, 9, 10]);
    let (a, b) = (
        flatten_params(&straight.model),
        flatten_params(&resumed.model),
    );
    let (differing, max_diff) = common::bitwise_differences(&a, &b);
    assert_eq!(
        differing,
        0,
        "{differing} of {} resumed weights differ from the uninterrupted run (max {max_diff})",
        a.len()
    );
    // The epoch mean loss spans the interruption exactly.
    assert_eq!(
        straight.epochs.last().unwrap().train_loss,
        resumed.epochs.last().unwrap().train_loss
    );
}

#[test]
fn resume_with_other_settings_or_model_is_refused() {
    let data = bundled(Split::Train).unwrap().take(64);
    let dir = common::tempdir("ckpt", "refuse");
    let mut sink = NullSink;
    Trainer::new(
        TrainOptions {
            epochs: 1,
            ..options(Some(dir.to_path_buf()))
        },
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap();
    let ckpt = latest_checkpoint(&dir).unwrap().unwrap();

    let err = Trainer::new(
        TrainOptions {
            epochs: 1,
            lr: 0.5,
            ..options(None)
        },
        Device::flex(),
        &mut sink,
    )
    .resume_from(&ckpt)
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap_err();
    assert!(
        err.to_string().contains("train.lr was 0.001, now 0.5"),
        "{err}"
    );

    let err = Trainer::new(
        TrainOptions {
            epochs: 1,
            ..options(None)
        },
        Device::flex(),
        &mut sink,
    )
    .resume_from(&ckpt)
    .fit("cnn", |d| ModelKind::Cnn.init(d), &data, None)
    .unwrap_err();
    assert!(err.to_string().contains("holds model `mlp`"), "{err}");
}

/// A diverging run stops with a clear error and leaves the last good checkpoint intact.
#[test]
fn divergence_is_an_error_and_keeps_the_last_checkpoint() {
    let data = bundled(Split::Train).unwrap().take(256);
    let dir = common::tempdir("ckpt", "diverge");
    let mut sink = NullSink;
    let result = Trainer::new(
        TrainOptions {
            epochs: 40,
            batch_size: 64,
            optimizer: OptimizerKind::Sgd,
            lr: 10.0,
            momentum: 0.99,
            checkpoint_dir: Some(dir.to_path_buf()),
            checkpoint_every_steps: Some(1),
            ..TrainOptions::default()
        },
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None);
    let err = result.unwrap_err();
    assert!(matches!(err, KilnError::Diverged { .. }), "{err}");
    assert!(err.to_string().contains("lower the learning rate"));
    let last = latest_checkpoint(&dir).unwrap().unwrap();
    Checkpoint::load(&last).expect("the last checkpoint must still verify");
}

/// `keep_checkpoints`: a run that checkpoints every step keeps only the newest N (each older
/// one deleted after a newer one is on disk), the newest resumes, and 0 keeps every one.
#[test]
fn retention_keeps_the_newest_checkpoints() {
    use kiln::train::checkpoints_in;
    let data = bundled(Split::Train).unwrap().take(320);
    let kind = ModelKind::Mlp;
    let run = |dir: &std::path::Path, keep: usize| {
        let mut sink = MemorySink::default();
        Trainer::new(
            TrainOptions {
                max_steps: Some(7),
                checkpoint_every_steps: Some(1),
                keep_checkpoints: keep,
                ..options(Some(dir.to_path_buf()))
            },
            Device::flex(),
            &mut sink,
        )
        .fit(kind.name(), |d| kind.init(d), &data, None)
        .unwrap();
        let written = sink
            .events
            .iter()
            .filter(|e| matches!(e, kiln::observe::Event::Checkpoint { .. }))
            .count();
        let steps: Vec<u64> = checkpoints_in(dir)
            .unwrap()
            .into_iter()
            .map(|c| c.0)
            .collect();
        (written, steps)
    };
    let kept = common::tempdir("ckpt", "keep3");
    let (written, steps) = run(&kept, 3);
    assert!(written >= 7, "{written} checkpoints written");
    assert_eq!(steps, vec![5, 6, 7]);
    // The survivors verify, and the newest resumes.
    for (_, path) in checkpoints_in(&kept).unwrap() {
        Checkpoint::load(&path).unwrap();
    }
    let mut sink = NullSink;
    let resumed = Trainer::new(options(Some(kept.to_path_buf())), Device::flex(), &mut sink)
        .resume_from(latest_checkpoint(&kept).unwrap().unwrap())
        .fit(kind.name(), |d| kind.init(d), &data, None)
        .unwrap();
    assert_eq!(resumed.summary.steps, 10);
    let all = common::tempdir("ckpt", "keepall");
    let (_, steps) = run(&all, 0);
    assert_eq!(steps, (1..=7).collect::<Vec<u64>>());
}

/// A checkpoint write that fails (here: a directory squats on the file name, as a full disk
/// or a dead mount would fail the write) stops the run with an error naming the file, leaves
/// the last good checkpoint intact and no temp file behind, and that checkpoint resumes.
#[test]
fn a_failed_checkpoint_write_stops_with_a_clear_error_and_keeps_the_last_good_one() {
    use kiln::train::checkpoints_in;
    let data = bundled(Split::Train).unwrap().take(320);
    let kind = ModelKind::Mlp;
    let dir = common::tempdir("ckpt", "write-error");
    std::fs::create_dir_all(dir.join(Checkpoint::file_name(3))).unwrap();
    let opts = TrainOptions {
        checkpoint_every_steps: Some(1),
        ..options(Some(dir.to_path_buf()))
    };
    let mut sink = NullSink;
    let Err(err) = Trainer::new(opts.clone(), Device::flex(), &mut sink).fit(
        kind.name(),
        |d| kind.init(d),
        &data,
        None,
    ) else {
        panic!("the write at step 3 must fail the run");
    };
    let msg = err.to_string();
    assert!(msg.contains("step-00000003.kiln"), "{msg}");
    let files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !files.iter().any(|f| f.contains(".tmp")),
        "temp file left behind: {files:?}"
    );
    let kept: Vec<u64> = checkpoints_in(&dir)
        .unwrap()
        .into_iter()
        .filter(|(_, p)| p.is_file())
        .map(|(s, _)| s)
        .collect();
    assert_eq!(kept, vec![1, 2]);
    let last = dir.join(Checkpoint::file_name(2));
    assert_eq!(Checkpoint::load(&last).unwrap().state.global_step, 2);
    // Once the obstacle is gone, the run resumes from it.
    std::fs::remove_dir(dir.join(Checkpoint::file_name(3))).unwrap();
    let resumed = Trainer::new(opts, Device::flex(), &mut sink)
        .resume_from(last)
        .fit(kind.name(), |d| kind.init(d), &data, None)
        .unwrap();
    assert_eq!(resumed.summary.steps, 10);
}
