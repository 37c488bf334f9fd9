//! `kiln check`: a few seconds of checks that a device computes what the CPU computes and
//! that training runs there the way Kiln means it to — so a user can see that their setup
//! works, and a GPU lease can run every GPU path from the one `kiln` binary it carries (no
//! separate test build).
//!
//! Each check runs the same work on the device under test and on a reference, and says by
//! how much they differ against a stated tolerance. On `cuda` the reference is the CPU
//! (`flex`, Kiln's kernels on); `kiln check cpu` holds Kiln's CPU kernels to Burn's own ops.
//! `skip-select` runs the trainer's optimizer step on the device with a "skip" verdict and
//! NaN gradients: the device-side select a GPU step relies on.

use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use serde::Serialize;

use crate::data::{MNIST_MEAN_STD, panic_text};
use crate::datasets::{Split, bundled};
use crate::kernels;
use crate::observe::{NullSink, memory};
use crate::plan::{Backend, Hardware};
use crate::precision::Precision;
use crate::train::step::context::{self, StepContext};
use crate::train::{
    OptimizerKind, TrainOptions, Trainer, build_optimizer, flatten_params, host_reads, seeded_init,
};
use crate::zoo::{Classifier, ModelKind, ZooModel};

/// What one check found.
#[derive(Debug, Clone, Serialize)]
pub struct CheckResult {
    /// Short name (`matmul`, `train-steps`, …).
    pub name: &'static str,
    /// Whether it passed.
    pub passed: bool,
    /// What was compared and by how much it differed, or why it could not run.
    pub detail: String,
    /// Wall time of the check.
    pub seconds: f64,
}

/// The device under test and its reference: which device, with Kiln's kernels on or off.
struct Sides {
    device: Device,
    kiln: bool,
    reference: Device,
    reference_kiln: bool,
}

impl Sides {
    /// Runs `f` on the device under test and on the reference, each with its kernel switch.
    fn both<T>(&self, f: impl Fn(&Device) -> T) -> (T, T) {
        let ours = {
            let _k = kernels::Scope::enter(self.kiln);
            f(&self.device)
        };
        let theirs = {
            let _k = kernels::Scope::enter(self.reference_kiln);
            f(&self.reference)
        };
        (ours, theirs)
    }
}

/// Runs every check on `backend` (cuda: against the CPU; flex: Kiln's kernels against
/// Burn's ops). A cuda check on a machine or build without CUDA returns one failed check
/// that says what is missing.
pub fn run_checks(backend: Backend) -> Vec<CheckResult> {
    let hardware = Hardware::probe();
    let started = Instant::now();
    let sides = match backend {
        Backend::Cuda => {
            let missing = match hardware.ensure_runs(Backend::Cuda, "kiln check gpu") {
                Err(e) => Some(e.to_string()),
                Ok(()) if hardware.gpu_count == 0 => {
                    Some("the NVIDIA driver reports no CUDA device".to_string())
                }
                Ok(()) => None,
            };
            if let Some(why) = missing {
                return vec![CheckResult {
                    name: "device",
                    passed: false,
                    detail: why,
                    seconds: started.elapsed().as_secs_f64(),
                }];
            }
            Sides {
                device: Backend::Cuda.device(),
                kiln: true,
                reference: Device::flex(),
                reference_kiln: true,
            }
        }
        Backend::Flex => Sides {
            device: Device::flex(),
            kiln: true,
            reference: Device::flex(),
            reference_kiln: false,
        },
    };
    let mut results = vec![CheckResult {
        name: "device",
        passed: true,
        detail: match backend {
            Backend::Cuda => format!(
                "{} CUDA device(s), {} of memory on the first",
                hardware.gpu_count,
                hardware
                    .gpu_memory
                    .map_or("unknown".into(), memory::human_bytes)
            ),
            Backend::Flex => format!("{} CPU core(s)", hardware.cores),
        },
        seconds: started.elapsed().as_secs_f64(),
    }];
    type Check = fn(&Sides) -> (bool, String);
    let checks: [(&'static str, Check); 6] = [
        ("matmul", matmul),
        ("inference", inference),
        ("skip-select", skip_select),
        ("train-steps", train_steps),
        ("bf16-steps", bf16_steps),
        ("memory", memory_reading),
    ];
    for (name, check) in checks {
        let t0 = Instant::now();
        // A check that panics inside a backend fails alone, with the panic's message.
        let (passed, detail) =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&sides)))
                .unwrap_or_else(|p| (false, format!("panicked: {}", panic_text(&*p))));
        results.push(CheckResult {
            name,
            passed,
            detail,
            seconds: t0.elapsed().as_secs_f64(),
        });
    }
    results
}

/// The largest difference between two value lists relative to the largest reference value
/// (∞ when their lengths differ or a value is not finite).
fn relative_difference(ours: &[f32], theirs: &[f32]) -> f32 {
    if ours.len() != theirs.len() || ours.iter().chain(theirs).any(|v| !v.is_finite()) {
        return f32::INFINITY;
    }
    let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    let worst = ours
        .iter()
        .zip(theirs)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    worst / scale
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default()
}

/// Verdict and detail of a comparison against `tolerance`.
fn within(what: &str, difference: f32, tolerance: f32) -> (bool, String) {
    (
        difference <= tolerance,
        format!(
            "{what}: max difference {difference:.2e} of the largest value (tolerance {tolerance:.0e})"
        ),
    )
}

/// A matmul of the W4 shapes. TF32 on a GPU keeps 10 mantissa bits: 2e-3 holds it.
fn matmul(sides: &Sides) -> (bool, String) {
    let a = Tensor::<2>::random([128, 256], Distribution::Normal(0.0, 1.0), &Device::flex());
    let b = Tensor::<2>::random([256, 192], Distribution::Normal(0.0, 1.0), &Device::flex());
    let (ours, theirs) =
        sides.both(|d| values(a.clone().to_device(d).matmul(b.clone().to_device(d))));
    within(
        "[128,256]×[256,192]",
        relative_difference(&ours, &theirs),
        2e-3,
    )
}

/// The W2 CNN's forward on a batch of real digits, same weights on both sides.
fn inference(sides: &Sides) -> (bool, String) {
    let model = seeded_init(&Device::flex(), 7, |d| ModelKind::Cnn.init(d));
    let Ok(data) = bundled(Split::Test) else {
        return (false, "the bundled test digits did not load".into());
    };
    // The first 32 digits, normalized as the loader does.
    let (pixels, _) = data.raw();
    let (mean, std) = MNIST_MEAN_STD;
    let floats: Vec<f32> = pixels[..32 * 28 * 28]
        .iter()
        .map(|&p| (p as f32 / 255.0 - mean) / std)
        .collect();
    let images = Tensor::<4>::from_data(TensorData::new(floats, [32, 1, 28, 28]), &Device::flex());
    let (ours, theirs) = sides.both(|d| {
        let m = model.clone().to_device(d);
        values(m.forward(images.clone().to_device(d)))
    });
    within(
        "W2 CNN logits, batch 32",
        relative_difference(&ours, &theirs),
        2e-3,
    )
}

/// The optimizer step the trainer takes, on the device, with the guard's verdict "skip" and
/// NaN gradients: Adam and SGD must leave every parameter as it was (the device-side select),
/// then an applied step must move them.
fn skip_select(sides: &Sides) -> (bool, String) {
    let device = sides.device.clone().autodiff();
    let _k = kernels::Scope::enter(sides.kiln);
    let mut report = Vec::new();
    let mut ok = true;
    for optimizer in [OptimizerKind::Adam, OptimizerKind::Sgd] {
        let model = seeded_init(&device, 3, |d| ModelKind::Mlp.init(d));
        let grads_for = |model: &ZooModel, fill: f32| {
            let x = Tensor::<4>::full([4, 1, 28, 28], fill, &device);
            let loss = model.forward(x).mean();
            GradientsParams::from_grads(loss.backward(), model)
        };
        let mut optim = build_optimizer(&TrainOptions {
            optimizer,
            ..TrainOptions::default()
        });
        let before = flatten_params(&model);
        let skipped = {
            let _ctx = context::enter(StepContext {
                apply: Tensor::zeros([1], &device.clone().without_autodiff()),
                grad_factor: None,
            });
            let grads = grads_for(&model, f32::NAN);
            optim.step(1e-2, model, grads)
        };
        let after_skip = flatten_params(&skipped);
        let grads = grads_for(&skipped, 0.5);
        let applied = optim.step(1e-2, skipped, grads);
        let after_step = flatten_params(&applied);
        let unchanged = after_skip == before;
        let moved = after_step != before && after_step.iter().all(|v| v.is_finite());
        ok &= unchanged && moved;
        report.push(format!(
            "{optimizer:?}: skipped step {}, applied step {}",
            if unchanged {
                "left every parameter"
            } else {
                "CHANGED parameters"
            },
            if moved {
                "moved them"
            } else {
                "did NOT move them (or made them non-finite)"
            }
        ));
    }
    (ok, report.join("; "))
}

/// Options of the checks' short training runs.
fn short_run(precision: Precision, sync_every: usize) -> TrainOptions {
    TrainOptions {
        epochs: 1,
        batch_size: 32,
        max_steps: Some(6),
        shuffle: false,
        lr: 3e-3,
        grad_clip_norm: Some(1.0),
        precision,
        sync_every,
        eval_every_epochs: 0,
        workers: Some(0),
        ..TrainOptions::default()
    }
}

/// Six steps of W1 (clipping on): the losses and weights against the reference, and the
/// step's reads: with a sync point every 3 steps, 2 reads in 6 steps — none between.
fn train_steps(sides: &Sides) -> (bool, String) {
    let Ok(data) = bundled(Split::Train) else {
        return (false, "the bundled training digits did not load".into());
    };
    let data = data.take(192);
    let run = |d: &Device| {
        let mut sink = NullSink;
        let before = host_reads();
        let out = Trainer::new(short_run(Precision::F32, 3), d.clone(), &mut sink).fit(
            "mlp",
            |d| ModelKind::Mlp.init(d),
            &data,
            None,
        );
        out.map(|o| {
            (
                flatten_params(&o.model),
                o.summary.train_loss,
                host_reads() - before,
            )
        })
    };
    let (ours, theirs) = sides.both(run);
    let (Ok(ours), Ok(theirs)) = (ours, theirs) else {
        return (false, "a training run failed".into());
    };
    let difference = relative_difference(&ours.0, &theirs.0);
    let loss = (ours.1 - theirs.1).abs() / theirs.1.abs().max(1e-6);
    let (ok, detail) = within("W1 weights after 6 steps", difference, 1e-2);
    (
        ok && loss <= 1e-2 && ours.2 == 2,
        format!(
            "{detail}; train loss {} vs {} ({loss:.1e}); {} device read(s) in 6 steps with a sync point every 3 (expected 2)",
            ours.1, theirs.1, ours.2
        ),
    )
}

/// Six steps of W1 in bf16 autocast: finite, and the loss near the reference's f32 run.
fn bf16_steps(sides: &Sides) -> (bool, String) {
    let Ok(data) = bundled(Split::Train) else {
        return (false, "the bundled training digits did not load".into());
    };
    let data = data.take(192);
    let loss = |d: &Device, precision| {
        let mut sink = NullSink;
        Trainer::new(short_run(precision, 0), d.clone(), &mut sink)
            .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
            .map(|o| o.summary.train_loss)
    };
    let bf16 = {
        let _k = kernels::Scope::enter(sides.kiln);
        loss(&sides.device, Precision::Bf16)
    };
    let f32 = {
        let _k = kernels::Scope::enter(sides.reference_kiln);
        loss(&sides.reference, Precision::F32)
    };
    match (bf16, f32) {
        (Ok(b), Ok(f)) => {
            let gap = (b - f).abs() / f.abs().max(1e-6);
            (
                b.is_finite() && gap <= 5e-2,
                format!("train loss bf16 {b} vs f32 {f}: {gap:.1e} apart (tolerance 5e-2)"),
            )
        }
        (Err(e), _) | (_, Err(e)) => (false, format!("a training run failed: {e}")),
    }
}

/// The memory reading the watermark uses (the device pool's on a GPU).
fn memory_reading(sides: &Sides) -> (bool, String) {
    match memory::in_use_reading_on(&sides.device) {
        Some(bytes) => (true, format!("{} in use", memory::human_bytes(bytes))),
        None => (false, "the device reports no memory reading".into()),
    }
}
