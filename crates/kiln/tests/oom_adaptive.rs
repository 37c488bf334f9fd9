//! OOM-adaptive batching under a tight memory budget, with the heap counted as the `kiln`
//! binary counts it: the trainer halves its micro-batch more than once, stops halving once a
//! step fits under the watermark, and keeps the effective batch. Its own test binary (and a
//! single test), because the heap count is process-wide.

mod common;

use burn::tensor::Device;
use kiln::Trainer;
use kiln::burn;
use kiln::datasets::{Split, bundled};
use kiln::observe::MemorySink;
use kiln::observe::heap::{CountingAlloc, take_peak_bytes};
use kiln::train::TrainOptions;
use kiln::zoo::ModelKind;

#[global_allocator]
static ALLOC: CountingAlloc<std::alloc::System> = CountingAlloc::new(std::alloc::System);

const BATCH: usize = 512;

/// Trains the MLP for `steps` optimizer steps of `micro` samples (accumulated to
/// [`BATCH`]), returning the events and the heap peak over the run.
fn run(micro: usize, steps: u64, watermark: Option<u64>) -> (MemorySink, u64) {
    let data = bundled(Split::Train).unwrap().take(BATCH * 4);
    let mut sink = MemorySink::default();
    take_peak_bytes();
    Trainer::new(
        TrainOptions {
            batch_size: micro,
            grad_accum_steps: BATCH / micro,
            epochs: 1,
            max_steps: Some(steps),
            eval_every_epochs: 0,
            workers: Some(0),
            memory_watermark: watermark,
            oom_adaptive: true,
            ..TrainOptions::default()
        },
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap();
    (sink, take_peak_bytes().expect("the heap is counted"))
}

#[test]
fn a_tight_budget_halves_until_the_step_fits_and_keeps_the_effective_batch() {
    // What a step needs at the full micro-batch and at an eighth of it.
    let (_, full) = run(BATCH, 2, None);
    let (_, eighth) = run(BATCH / 8, 2, None);
    assert!(
        full > eighth,
        "peak {full} at {BATCH} vs {eighth} at {}",
        BATCH / 8
    );
    // A budget between them, nearer the small end: 512 and 256 do not fit, 128 should.
    let watermark = eighth + (full - eighth) / 4;
    let (sink, _) = run(BATCH, 4, Some(watermark));
    let changes: Vec<_> = common::batch_adaptations(&sink)
        .iter()
        .map(|b| (b.micro_batch, b.effective_batch))
        .collect();
    let readings: Vec<_> = common::watermark_events(&sink)
        .iter()
        .map(|m| m.in_use_bytes)
        .collect();
    let context = format!(
        "peaks: {full} at {BATCH}, {eighth} at {}; watermark {watermark}; crossings {readings:?}; \
         changes {changes:?}",
        BATCH / 8
    );
    eprintln!("{context}");
    assert!(changes.len() >= 2, "adapts more than once: {context}");
    assert!(
        changes.iter().all(|&(_, effective)| effective == BATCH),
        "effective batch unchanged: {context}"
    );
    let micros: Vec<usize> = changes.iter().map(|c| c.0).collect();
    assert!(micros.windows(2).all(|w| w[1] * 2 == w[0]), "{context}");
    // It stopped because the step fit, not because it reached 1.
    assert!(*micros.last().unwrap() >= BATCH / 8, "{context}");
    let samples: Vec<usize> = sink.steps().map(|s| s.samples).collect();
    assert_eq!(
        samples,
        vec![BATCH; 4],
        "every step trained the whole batch: {context}"
    );
}
