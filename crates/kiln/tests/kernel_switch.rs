//! `device.kiln_kernels` travels with the work, not through the process: the trainer applies
//! `TrainOptions::kiln_kernels` on its thread, an inference session or ONNX model applies its
//! own on whichever thread runs it (a batch-8 forward hops onto the rayon pool), and a
//! `kernels::Scope` on one thread leaves every other thread alone. What ran is read from the
//! `kiln.*` spans each Kiln kernel call opens (the op-level profile sees the same spans).
//!
//! One test in this binary: the span counter is process-wide.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::{Device, Distribution, Tensor, TensorData};
use kiln::burn;
use kiln::datasets::{Split, bundled};
use kiln::infer::InferenceSession;
use kiln::kernels;
use kiln::observe::NullSink;
use kiln::onnx::OnnxModel;
use kiln::train::{TrainOptions, Trainer};
use kiln::zoo::ModelKind;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;

/// Kiln kernel calls seen, on any thread.
static KERNEL_CALLS: AtomicUsize = AtomicUsize::new(0);

/// Counts the spans Kiln's kernels open.
struct CountKernelCalls;

impl<S: tracing::Subscriber> Layer<S> for CountKernelCalls {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name().starts_with("kiln.") {
            KERNEL_CALLS.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Kernel calls made while `f` runs.
fn kernel_calls(f: impl FnOnce()) -> usize {
    let before = KERNEL_CALLS.load(Ordering::Relaxed);
    f();
    KERNEL_CALLS.load(Ordering::Relaxed) - before
}

#[test]
fn the_kernel_switch_travels_with_the_work_and_stays_on_its_thread() {
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(CountKernelCalls))
        .unwrap();
    let data = bundled(Split::Train).unwrap().take(64);

    // The trainer: two steps of W2 with and without Kiln's kernels.
    let train = |kiln_kernels: bool| {
        kernel_calls(|| {
            let options = TrainOptions {
                batch_size: 32,
                max_steps: Some(2),
                eval_every_epochs: 0,
                kiln_kernels,
                ..TrainOptions::default()
            };
            Trainer::new(options, Device::flex(), &mut NullSink)
                .fit("cnn", |d| ModelKind::Cnn.init(d), &data, None)
                .unwrap();
        })
    };
    assert!(
        train(true) > 0,
        "W2 with kiln_kernels = true ran no Kiln kernel"
    );
    assert_eq!(
        train(false),
        0,
        "kiln_kernels = false still ran Kiln kernels"
    );
    // The run's switch ended with the run.
    assert!(kernels::enabled());

    // An inference session: batch 8 runs on a rayon pool thread, where the caller's thread
    // setting would not reach; the session's own setting must.
    let device = Device::flex();
    let model = ModelKind::Cnn.init(&device);
    let images = Tensor::<4>::random([8, 1, 28, 28], Distribution::Default, &device);
    let session = |on: bool| {
        InferenceSession::new(&model, "cnn", [1, 28, 28], &[], &device)
            .unwrap()
            .with_kiln_kernels(on)
    };
    let (on, off) = (session(true), session(false));
    let mut logits = Vec::new();
    for (s, expect_calls) in [(&on, true), (&off, false)] {
        let calls = kernel_calls(|| logits.push(s.forward(images.clone()).unwrap()));
        assert_eq!(
            calls > 0,
            expect_calls,
            "session kiln_kernels = {expect_calls}"
        );
    }
    // A caller's scope does not override the session's own setting.
    let _off_here = kernels::Scope::enter(false);
    assert!(kernel_calls(|| drop(on.forward(images.clone()).unwrap())) > 0);
    drop(_off_here);
    // Either way the same logits (to f32 rounding): the switch changes speed only.
    let diff = (logits[0].clone() - logits[1].clone())
        .abs()
        .max()
        .into_scalar::<f32>();
    assert!(diff < 1e-4, "logits differ by {diff}");

    // An imported ONNX model (`opmix`: convolutions among its operators).
    let onnx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx/opmix.onnx");
    let input = |m: &OnnxModel| {
        let port = &m.inputs()[0];
        let dims: Vec<usize> = port.dims.iter().map(|d| d.unwrap_or(8)).collect();
        let len = dims.iter().product();
        TensorData::new(vec![0.5f32; len], dims)
    };
    for on in [true, false] {
        let model = OnnxModel::load(&onnx, &device)
            .unwrap()
            .with_kiln_kernels(on);
        let x = input(&model);
        let calls = kernel_calls(|| drop(model.run_data(vec![x]).unwrap()));
        assert_eq!(
            calls > 0,
            on,
            "ONNX model kiln_kernels = {on}: {calls} calls"
        );
    }

    // A scope on another thread leaves this one alone, and ends with its thread's work.
    std::thread::scope(|s| {
        s.spawn(|| {
            let _off = kernels::Scope::enter(false);
            assert!(!kernels::enabled());
        });
    });
    assert!(kernels::enabled());
}
