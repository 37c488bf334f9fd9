//! Mixed precision: the autocast ops against f32, gradients reaching the f32 master weights,
//! accuracy bands on real MNIST, loss scaling under forced overflows, an overflowing f16
//! run under each guard policy, and bit-for-bit resume of a scaled run.

mod common;

use burn::module::Module;
use burn::nn::conv::Conv2dConfig;
use burn::nn::{LinearConfig, PaddingConfig2d};
use burn::tensor::{DType, Device, Distribution, Tensor};
use kiln::data::{Dataset, ImageDataset};
use kiln::datasets::{Split, bundled};
use kiln::guard::{GuardAction, GuardOptions, GuardPolicy, Trouble};
use kiln::observe::{MemorySink, NullSink};
use kiln::precision::{self as amp, Precision, ScalerOptions, ScalingMode};
use kiln::train::{Checkpoint, TrainOptions, backend_rng_guard, flatten_params, latest_checkpoint};
use kiln::zoo::{Classifier, EncoderClassifier, ModelKind};
use kiln::{KilnError, Trainer, burn};

/// ‖a − b‖ / ‖b‖ over all elements.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// Tolerance of one autocast op against f32: bf16 keeps 8 mantissa bits (ε = 2⁻⁸), f16 keeps
/// 11 (ε = 2⁻¹¹); inputs, weights and the output are each rounded once, so a few ε.
fn op_tolerance(p: Precision) -> f64 {
    match p {
        Precision::Bf16 => 1e-2,
        _ => 2e-3,
    }
}

#[test]
fn autocast_ops_match_f32_within_the_precision_tolerance() {
    // Draws from the backend's shared RNG beside tests whose trainers must init identically.
    let _rng = backend_rng_guard();
    let device = Device::flex();
    let x = Tensor::<3>::random([4, 7, 96], Distribution::Normal(0.0, 1.0), &device);
    let fc = LinearConfig::new(96, 40).init(&device);
    let img = Tensor::<4>::random([2, 3, 10, 9], Distribution::Normal(0.0, 1.0), &device);
    // Every padding kind, including `Same` with an even kernel (asymmetric) and a stride.
    let convs = [
        Conv2dConfig::new([3, 8], [3, 3]).init(&device),
        Conv2dConfig::new([3, 8], [4, 4])
            .with_padding(PaddingConfig2d::Same)
            .init(&device),
        Conv2dConfig::new([3, 8], [3, 3])
            .with_stride([2, 2])
            .with_padding(PaddingConfig2d::Same)
            .init(&device),
        Conv2dConfig::new([3, 8], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 0, 2, 1))
            .with_bias(false)
            .init(&device),
    ];
    let a = Tensor::<3>::random([3, 17, 64], Distribution::Normal(0.0, 1.0), &device);
    let b = Tensor::<3>::random([3, 64, 9], Distribution::Normal(0.0, 1.0), &device);

    let lin_ref = values(fc.forward(x.clone()));
    let mm_ref = values(a.clone().matmul(b.clone()));
    for p in [Precision::F32, Precision::Bf16, Precision::F16] {
        let _scope = amp::autocast(p);
        let tol = if p == Precision::F32 {
            0.0
        } else {
            op_tolerance(p)
        };
        let out = amp::linear(&fc, x.clone());
        assert_eq!(out.dtype(), DType::F32, "autocast ops return f32");
        let err = rel_err(&values(out), &lin_ref);
        assert!(err <= tol, "{p:?} linear: relative error {err} > {tol}");

        let out = amp::matmul(a.clone(), b.clone());
        let err = rel_err(&values(out), &mm_ref);
        assert!(err <= tol, "{p:?} matmul: relative error {err} > {tol}");

        for (i, conv) in convs.iter().enumerate() {
            let reference = conv.forward(img.clone());
            let out = amp::conv2d(conv, img.clone());
            assert_eq!(
                out.dims(),
                reference.dims(),
                "{p:?} conv {i}: padding differs"
            );
            let err = rel_err(&values(out), &values(reference));
            // In f32 the convolution runs Kiln's GEMM kernel (kiln::kernels), which sums in a
            // different order than Burn's: equal to f32 rounding, not bit for bit.
            let tol = if p == Precision::F32 { 1e-6 } else { tol };
            assert!(err <= tol, "{p:?} conv {i}: relative error {err} > {tol}");
        }
    }
}

/// Kiln's autocast-aware W4 forward is Burn's encoder forward, to f32 rounding.
#[test]
fn w4_forward_matches_burns_encoder_in_f32() {
    // Draws from the backend's shared RNG beside tests whose trainers must init identically.
    let _rng = backend_rng_guard();
    let device = Device::flex();
    let model = EncoderClassifier::new(&device);
    let x = Tensor::<4>::random([5, 1, 28, 28], Distribution::Normal(0.0, 1.0), &device);
    let ours = values(model.forward(x.clone()));
    let burns = values(model.forward_with_burn_encoder(x));
    let err = rel_err(&ours, &burns);
    assert!(err < 1e-6, "relative error {err}");
}

/// In bf16 and f16 the gradients that reach the parameters are f32 and agree with the f32
/// gradients of the same batch: cosine similarity ≥ 0.999 in f16 (11-bit mantissa), ≥ 0.99
/// in bf16 (8 bits; measured 0.998 on W2, 0.99996 on W4).
#[test]
fn low_precision_gradients_reach_f32_master_weights() {
    // Draws from the backend's shared RNG beside tests whose trainers must init identically.
    let _rng = backend_rng_guard();
    let device = Device::flex().autodiff();
    let batch = kiln::data::collate(
        &bundled(Split::Train).unwrap().take(64),
        &(0..64).collect::<Vec<_>>(),
        &device,
    )
    .unwrap();
    for kind in [ModelKind::Cnn, ModelKind::Transformer] {
        let model = kind.init(&device);
        let grads_in = |p: Precision| -> Vec<f32> {
            let logits = {
                let _scope = amp::autocast(p);
                model.forward(batch.images.clone())
            };
            let loss = burn::nn::loss::CrossEntropyLossConfig::new()
                .init(&device)
                .forward(logits, batch.labels.clone());
            let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
            let mut flat = Vec::new();
            let mut dtypes = Vec::new();
            model.visit(&mut GradCollector {
                grads: &grads,
                flat: &mut flat,
                dtypes: &mut dtypes,
            });
            assert!(dtypes.iter().all(|d| *d == DType::F32), "{p:?}: {dtypes:?}");
            flat
        };
        let reference = grads_in(Precision::F32);
        for p in [Precision::Bf16, Precision::F16] {
            let g = grads_in(p);
            let dot: f64 = g
                .iter()
                .zip(&reference)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            let cosine = dot / (norm(&g) * norm(&reference));
            let floor = if p == Precision::Bf16 { 0.99 } else { 0.999 };
            assert!(cosine >= floor, "{kind:?} {p:?}: cosine {cosine}");
        }
    }
}

/// Collects every parameter's gradient, flattened, and its dtype.
struct GradCollector<'a> {
    grads: &'a burn::optim::GradientsParams,
    flat: &'a mut Vec<f32>,
    dtypes: &'a mut Vec<DType>,
}

impl burn::module::ModuleVisitor for GradCollector<'_> {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
        if let Some(g) = self.grads.get::<D>(param.id) {
            self.dtypes.push(g.dtype());
            self.flat.extend(values(g));
        }
    }
}

fn final_accuracy(kind: ModelKind, precision: Precision) -> f64 {
    let train = bundled(Split::Train).unwrap();
    let test = bundled(Split::Test).unwrap();
    let mut sink = NullSink;
    let out = Trainer::new(
        TrainOptions {
            epochs: 1,
            batch_size: 64,
            seed: 5,
            precision,
            ..TrainOptions::default()
        },
        Device::flex(),
        &mut sink,
    )
    .fit(kind.name(), |d| kind.init(d), &train, Some(&test))
    .unwrap();
    // A scaled f16 run may skip a few overflowed steps, but not many.
    let skipped = out.summary.guard_events.len();
    assert!(
        skipped <= 3,
        "{kind:?} {precision:?}: {skipped} skipped steps"
    );
    out.summary.test_accuracy.unwrap()
}

/// One epoch on the bundled MNIST (4,000 images, 63 steps, same seed) in bf16 and in f16 +
/// dynamic scaling: the held-out accuracy must be within 1.5 points of the f32 run's. The
/// issue's 0.5-point band is for full-length runs (5 epochs: recorded in BENCHMARKS.md); after
/// one epoch the models are still moving, so one epoch's band is wider.
fn assert_in_f32_band(kind: ModelKind) {
    let f32_acc = final_accuracy(kind, Precision::F32);
    assert!(f32_acc > 0.6, "{kind:?} f32 did not learn: {f32_acc}");
    for p in [Precision::Bf16, Precision::F16] {
        let acc = final_accuracy(kind, p);
        let delta = (acc - f32_acc).abs() * 100.0;
        assert!(
            delta <= 1.5,
            "{kind:?} {p:?}: {:.2}% vs f32 {:.2}% ({delta:.2} points)",
            acc * 100.0,
            f32_acc * 100.0
        );
    }
}

#[test]
fn w2_in_bf16_and_f16_ends_in_the_f32_accuracy_band() {
    assert_in_f32_band(ModelKind::Cnn);
}

#[test]
fn w4_in_bf16_and_f16_ends_in_the_f32_accuracy_band() {
    assert_in_f32_band(ModelKind::Transformer);
}

/// A loss scale far too large overflows the f16 gradients: each overflowed step is skipped and
/// the scale halves (reported, with the tensors), until the gradients fit; training then goes
/// on and learns. Under the `abort` policy too: scaler overflows are not faults.
#[test]
fn forced_gradient_overflows_back_off_the_scale_and_training_continues() {
    let data = bundled(Split::Train).unwrap().take(1024);
    let mut sink = MemorySink::default();
    let out = Trainer::new(
        TrainOptions {
            epochs: 1,
            batch_size: 32,
            precision: Precision::F16,
            scaler: ScalerOptions {
                mode: ScalingMode::Dynamic,
                init_scale: 16_777_216.0, // 2^24
                growth_interval: 1_000,
            },
            guard: GuardOptions {
                policy: GuardPolicy::Abort,
                ..GuardOptions::default()
            },
            ..TrainOptions::default()
        },
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap();
    let events = common::guard_events(&sink);
    assert!(events.len() >= 2, "expected overflows at 2^24: {events:?}");
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.action, GuardAction::ScaleBackoff);
        assert_eq!(e.trouble, Trouble::Gradients);
        assert!(e.loss.is_finite());
        assert!(!e.tensors.is_empty(), "overflowed tensors are named");
        // Each overflow halves the scale (no growth within 1,000 steps).
        assert_eq!(e.loss_scale, 16_777_216.0 / 2f32.powi(i as i32));
    }
    assert_eq!(events[0].step, 1, "2^24 overflows at once");
    for pair in events.windows(2) {
        assert!(pair[0].step < pair[1].step);
    }
    let skipped: Vec<u64> = sink.steps().filter(|s| s.skipped).map(|s| s.step).collect();
    assert_eq!(skipped.len(), events.len());
    assert_eq!(out.summary.steps, 32);
    let losses: Vec<f32> = sink
        .steps()
        .filter(|s| !s.skipped)
        .map(|s| s.loss)
        .collect();
    let head = losses[..5].iter().sum::<f32>();
    let tail = losses[losses.len() - 5..].iter().sum::<f32>();
    assert!(tail < head * 0.7, "loss did not fall: {head} -> {tail}");
    assert!(flatten_params(&out.model).iter().all(|v| v.is_finite()));
}

/// Real MNIST with pixels multiplied by 10⁶ (unnormalized sensor data, say): fine in f32, but
/// beyond f16's largest finite value (65,504), so the f16 forward overflows. Loss scaling
/// cannot help with that: only the guard can.
struct Amplified(ImageDataset);

impl Dataset for Amplified {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn item_shape(&self) -> [usize; 3] {
        self.0.item_shape()
    }
    fn fill(&self, index: usize, out: &mut [f32]) -> kiln::Result<usize> {
        let label = self.0.fill(index, out)?;
        out.iter_mut().for_each(|v| *v *= 1e6);
        Ok(label)
    }
}

fn overflow_options(
    precision: Precision,
    policy: GuardPolicy,
    dir: &std::path::Path,
) -> TrainOptions {
    TrainOptions {
        precision,
        ..common::guard_test_options(policy, dir)
    }
}

#[test]
fn an_overflowing_f16_run_ends_the_way_the_policy_says() {
    let data = Amplified(bundled(Split::Train).unwrap().take(256));

    // The same data in f32 trains without a single guard event: the overflow is f16's.
    let dir = common::tempdir("amp", "overflow-f32");
    let mut sink = MemorySink::default();
    Trainer::new(
        overflow_options(Precision::F32, GuardPolicy::Abort, &dir),
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap();
    assert!(common::guard_events(&sink).is_empty());

    // skip: every step's loss is non-finite; skipped until the limit, then abort.
    let dir = common::tempdir("amp", "overflow-skip");
    let mut sink = MemorySink::default();
    let err = Trainer::new(
        overflow_options(Precision::F16, GuardPolicy::Skip, &dir),
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap_err();
    assert!(matches!(err, KilnError::Diverged { step: 4, .. }), "{err}");
    let events = common::guard_events(&sink);
    let actions: Vec<GuardAction> = events.iter().map(|e| e.action).collect();
    use GuardAction::{Aborted, Skipped};
    assert_eq!(actions, vec![Skipped, Skipped, Skipped, Aborted]);
    assert!(events.iter().all(|e| e.trouble == Trouble::Loss));
    // The scale in force is reported, and it backed off after each overflowed step.
    let scales: Vec<f32> = events.iter().map(|e| e.loss_scale).collect();
    assert_eq!(scales, vec![65_536.0, 32_768.0, 16_384.0, 8_192.0]);
    // Checkpoints after skipped steps hold the last good (initial) weights and verify.
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        Checkpoint::load(&entry.path()).expect("checkpoint must verify");
    }

    // abort: stops at the first bad step, the last good checkpoint stays intact.
    let dir = common::tempdir("amp", "overflow-abort");
    let clean = bundled(Split::Train).unwrap().take(64);
    let mut sink = NullSink;
    // Two good steps on ordinary data first, so there is a checkpoint to protect...
    Trainer::new(
        TrainOptions {
            max_steps: Some(2),
            ..overflow_options(Precision::F16, GuardPolicy::Abort, &dir)
        },
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &clean, None)
    .unwrap();
    let good = latest_checkpoint(&dir).unwrap().unwrap();
    let before = std::fs::read(&good).unwrap();
    // ...then an overflowing run writing to the same directory aborts at its first step.
    let mut sink = MemorySink::default();
    let err = Trainer::new(
        overflow_options(Precision::F16, GuardPolicy::Abort, &dir),
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap_err();
    assert!(matches!(err, KilnError::Diverged { step: 1, .. }), "{err}");
    assert!(err.to_string().contains("non-finite loss"), "{err}");
    assert_eq!(common::guard_events(&sink).len(), 1);
    assert_eq!(latest_checkpoint(&dir).unwrap().unwrap(), good);
    assert_eq!(std::fs::read(&good).unwrap(), before);
    Checkpoint::load(&good).expect("the last good checkpoint verifies");
}

/// An f16 run whose scale changes often (grows every 2 clean steps, so it overflows and backs
/// off along the way), stopped mid-run and resumed, ends bit for bit where the uninterrupted
/// run ends: the scaler state travels in the checkpoint.
#[test]
fn a_scaled_f16_run_resumes_bit_for_bit() {
    let data = bundled(Split::Train).unwrap().take(480);
    let options = |dir: Option<std::path::PathBuf>| TrainOptions {
        epochs: 1,
        batch_size: 32,
        seed: 3,
        precision: Precision::F16,
        scaler: ScalerOptions {
            mode: ScalingMode::Auto,
            init_scale: 1_048_576.0,
            growth_interval: 2,
        },
        guard: GuardOptions {
            max_consecutive: 100,
            ..GuardOptions::default()
        },
        checkpoint_dir: dir,
        ..TrainOptions::default()
    };
    let mut sink = MemorySink::default();
    let straight = Trainer::new(options(None), Device::flex(), &mut sink)
        .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
        .unwrap();
    assert_eq!(straight.summary.steps, 15);

    let dir = common::tempdir("amp", "resume");
    let mut sink = NullSink;
    Trainer::new(
        TrainOptions {
            max_steps: Some(8),
            ..options(Some(dir.to_path_buf()))
        },
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
    .unwrap();
    let ckpt = latest_checkpoint(&dir).unwrap().unwrap();
    let saved = Checkpoint::load(&ckpt)
        .unwrap()
        .state
        .scaler
        .expect("scaler state saved");
    assert_ne!(saved.scale, 1_048_576.0, "the scale moved before the stop");

    let mut sink = NullSink;
    let resumed = Trainer::new(options(Some(dir.to_path_buf())), Device::flex(), &mut sink)
        .resume_from(&ckpt)
        .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
        .unwrap();
    let (a, b) = (
        flatten_params(&straight.model),
        flatten_params(&resumed.model),
    );
    let (differing, _) = common::bitwise_differences(&a, &b);
    assert_eq!(differing, 0, "{differing} of {} weights differ", a.len());
}

/// `valid()` strips autodiff; the eval path under autocast still returns f32 logits.
#[test]
fn inference_under_autocast_returns_f32_logits() {
    // Draws from the backend's shared RNG beside tests whose trainers must init identically.
    let _rng = backend_rng_guard();
    let device = Device::flex();
    let model = ModelKind::ResNet
        .init_for_channels(3, &device.clone().autodiff())
        .valid();
    let x = Tensor::<4>::random([2, 3, 16, 16], Distribution::Normal(0.0, 1.0), &device);
    let reference = values(model.forward(x.clone()));
    let _scope = amp::autocast(Precision::Bf16);
    let out = model.forward(x);
    assert_eq!(out.dtype(), DType::F32);
    // Eighteen layers of bf16 rounding: a looser, still meaningful bound.
    let err = rel_err(&values(out), &reference);
    assert!(err < 5e-2, "relative error {err}");
}

/// Clipping must see the *unscaled* gradient. Scaling by a power of two is exact in binary
/// floating point, so an f32 run whose loss is scaled by 2¹⁶ (and unscaled before the clip)
/// must make the same clipped updates as an unscaled one. Clipping the scaled gradient
/// instead would shrink every update by the scale (a norm 2¹⁶× too large clipped to the
/// threshold, then divided by 2¹⁶).
#[test]
fn clipping_acts_on_the_unscaled_gradient() {
    let data = bundled(Split::Train).unwrap().take(96);
    let run = |mode: ScalingMode, clip: Option<f64>| {
        let options = TrainOptions {
            batch_size: 32,
            grad_clip_norm: clip,
            precision: Precision::F32,
            scaler: ScalerOptions {
                mode,
                ..ScalerOptions::default()
            },
            ..TrainOptions::default()
        };
        let mut sink = MemorySink::default();
        let out = Trainer::new(options, Device::flex(), &mut sink)
            .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
            .unwrap();
        let norms: Vec<f32> = sink.steps().filter_map(|s| s.grad_norm).collect();
        let scales: Vec<Option<f32>> = sink.steps().map(|s| s.loss_scale).collect();
        (flatten_params(&out.model), norms, scales)
    };
    let clip = 0.05;
    let (plain, plain_norms, plain_scales) = run(ScalingMode::Off, Some(clip));
    let (scaled, scaled_norms, scaled_scales) = run(ScalingMode::Dynamic, Some(clip));
    assert!(plain_scales.iter().all(Option::is_none));
    assert!(
        scaled_scales.iter().all(|s| *s == Some(65_536.0)),
        "{scaled_scales:?}"
    );
    // Clipping is active: the reported norm (of the unscaled gradient) is over the threshold.
    assert_eq!(plain_norms.len(), 3);
    assert!(
        plain_norms.iter().all(|n| *n as f64 > clip),
        "{plain_norms:?}"
    );
    for (a, b) in plain_norms.iter().zip(&scaled_norms) {
        assert!(
            (a - b).abs() <= 1e-5 * a,
            "norms {plain_norms:?} vs {scaled_norms:?}"
        );
    }
    let err = rel_err(&scaled, &plain);
    assert!(err < 1e-6, "scaled and unscaled clipped runs differ: {err}");
    // And the clip mattered: without it the weights move elsewhere.
    let (unclipped, _, _) = run(ScalingMode::Off, None);
    assert!(rel_err(&unclipped, &plain) > 1e-4);
}
