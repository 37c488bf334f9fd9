//! The numerical-stability guard: injected NaN in data, an exploding learning rate, and
//! each policy ending the way it says, with the report, without corrupting checkpoints.

mod common;

use burn::tensor::Device;
use kiln::datasets::{Split, bundled};
use kiln::guard::{GuardAction, GuardOptions, GuardPolicy, Trouble};
use kiln::observe::{Event, MemorySink};
use kiln::train::{Checkpoint, OptimizerKind, TrainOptions, flatten_params, latest_checkpoint};
use kiln::zoo::ModelKind;
use kiln::{KilnError, Trainer, burn};

fn poisoned() -> common::Poisoned {
    // Batches of 32 in order: samples 40 and 200 fall in steps 2 and 7.
    common::Poisoned {
        inner: bundled(Split::Train).unwrap().take(256),
        bad: vec![40, 200],
    }
}

#[test]
fn skip_policy_skips_poisoned_batches_and_finishes() {
    let dir = common::tempdir("guard", "skip");
    let data = poisoned();
    let mut sink = MemorySink::default();
    let out = Trainer::new(
        common::guard_test_options(GuardPolicy::Skip, &dir),
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap();
    let events = common::guard_events(&sink);
    let steps: Vec<u64> = events.iter().map(|e| e.step).collect();
    assert_eq!(steps, vec![2, 7], "{events:?}");
    assert!(events.iter().all(|e| e.trouble == Trouble::Loss));
    assert!(events.iter().all(|e| e.action == GuardAction::Skipped));
    assert!(
        events
            .iter()
            .all(|e| e.loss.is_nan() && e.loss_scale == 1.0)
    );
    // Reported in the run summary too, and the step events say which steps were skipped.
    let summary_steps: Vec<u64> = out.summary.guard_events.iter().map(|e| e.step).collect();
    assert_eq!(summary_steps, steps);
    assert!(out.summary.train_loss.is_finite());
    let skipped: Vec<u64> = sink
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) if s.skipped => Some(s.step),
            _ => None,
        })
        .collect();
    assert_eq!(skipped, vec![2, 7]);
    assert_eq!(out.summary.steps, 8);
    assert!(flatten_params(&out.model).iter().all(|v| v.is_finite()));
    // Every checkpoint written along the way verifies and holds finite weights.
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        Checkpoint::load(&entry.path()).expect("checkpoint must verify");
    }
}

#[test]
fn abort_policy_stops_with_the_report_and_keeps_the_last_checkpoint() {
    let dir = common::tempdir("guard", "abort");
    let data = poisoned();
    let mut sink = MemorySink::default();
    let err = Trainer::new(
        common::guard_test_options(GuardPolicy::Abort, &dir),
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap_err();
    match &err {
        KilnError::Diverged { step, detail, .. } => {
            assert_eq!(*step, 2);
            assert!(detail.contains("non-finite loss"), "{detail}");
        }
        other => panic!("expected Diverged, got {other}"),
    }
    let events = common::guard_events(&sink);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].action, GuardAction::Aborted);
    let last = latest_checkpoint(&dir).unwrap().unwrap();
    assert!(last.ends_with("step-00000001.kiln"), "{}", last.display());
    Checkpoint::load(&last).expect("the last good checkpoint must verify");
}

/// An exploding learning rate drives the parameters to infinity after an update whose
/// gradients were finite: rollback restores the last snapshot each time, then gives up
/// after `max_consecutive` in a row.
#[test]
fn rollback_policy_restores_snapshots_then_gives_up_on_an_exploding_lr() {
    let dir = common::tempdir("guard", "rollback");
    let data = bundled(Split::Train).unwrap().take(256);
    let mut sink = MemorySink::default();
    let err = Trainer::new(
        TrainOptions {
            optimizer: OptimizerKind::Sgd,
            momentum: 0.0,
            lr: 1e39, // beyond f32: every update overflows
            ..common::guard_test_options(GuardPolicy::Rollback, &dir)
        },
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap_err();
    let events = common::guard_events(&sink);
    assert_eq!(events.len(), 4, "{events:?}");
    for e in &events[..3] {
        assert_eq!(e.trouble, Trouble::Parameters);
        assert_eq!(e.action, GuardAction::RolledBack);
        assert_eq!(e.restored_step, Some(0));
        assert!(
            !e.tensors.is_empty() && e.tensors[0].contains("weight"),
            "{:?}",
            e.tensors
        );
    }
    assert_eq!(events[3].action, GuardAction::Aborted);
    assert!(err.to_string().contains("non-finite parameters"), "{err}");
    assert!(
        err.to_string().contains("4 non-finite step(s) in a row"),
        "{err}"
    );
    // Checkpoints written after a rollback hold the restored state and verify.
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        Checkpoint::load(&entry.path()).expect("checkpoint must verify");
    }
}

/// With skip, an exploding learning rate ends after `max_consecutive` skipped steps.
#[test]
fn skip_policy_gives_up_after_consecutive_bad_steps() {
    let dir = common::tempdir("guard", "explode");
    let data = bundled(Split::Train).unwrap().take(512);
    let mut sink = MemorySink::default();
    let err = Trainer::new(
        TrainOptions {
            optimizer: OptimizerKind::Sgd,
            momentum: 0.0,
            lr: 1e39,
            guard: GuardOptions {
                check_params: false,
                ..common::guard_test_options(GuardPolicy::Skip, &dir).guard
            },
            ..common::guard_test_options(GuardPolicy::Skip, &dir)
        },
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap_err();
    assert!(matches!(err, KilnError::Diverged { .. }), "{err}");
    let events = common::guard_events(&sink);
    assert!(events.len() >= 2);
    assert_eq!(events.last().unwrap().action, GuardAction::Aborted);
    assert!(
        events[..events.len() - 1]
            .iter()
            .all(|e| e.action == GuardAction::Skipped)
    );
    // The checkpoints that were written all verify.
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        Checkpoint::load(&entry.path()).expect("checkpoint must verify");
    }
}
