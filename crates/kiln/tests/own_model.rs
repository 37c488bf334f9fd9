//! Kiln's training API on a user's own Burn model: a user-written copy of W2 (drop-in
//! `kiln::nn` layers, a Burn `Dataset` + `Batcher`) trains exactly like the zoo's W2; the
//! drop-in layers equal Burn's (outputs, gradients, records); resume is bit for bit with
//! mixed precision and loss scaling; bad input is a clear error.

mod common;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::PaddingConfig2d;
use burn::store::ModuleRecord;
use burn::tensor::activation::relu;
use burn::tensor::{Bytes, Device, Distribution, Tensor, TensorData};
use kiln::KilnError;
use kiln::data::{BatchSource, BurnBatches, DataLoader, LoaderOptions};
use kiln::datasets::{Split, bundled};
use kiln::observe::{MemorySink, NullSink};
use kiln::precision::Precision;
use kiln::train::{
    Metric, StepOutput, Targets, TrainOptions, TrainStep, Trainer, flatten_params,
    latest_checkpoint,
};
use kiln::zoo::ModelKind;

use common::{bitwise_differences, tempdir};

// ---------------------------------------------------------------- a user's copy of W2

#[path = "../examples/common/user_w2.rs"]
mod user_w2;

use user_w2::{BurnCnn, DigitBatcher, UserCnn, digits};

fn w2_options() -> TrainOptions {
    TrainOptions {
        epochs: 1,
        batch_size: 32,
        grad_accum_steps: 2,
        grad_clip_norm: Some(1.0),
        max_steps: Some(4),
        workers: Some(2),
        ..TrainOptions::default()
    }
}

#[test]
fn a_user_copy_of_w2_trains_exactly_like_the_zoo_w2() {
    let data = bundled(Split::Train).unwrap().take(256);
    let mut zoo_sink = MemorySink::default();
    let zoo = Trainer::new(w2_options(), Device::flex(), &mut zoo_sink)
        .fit("cnn", |d| ModelKind::Cnn.init(d), &data, None)
        .unwrap();
    let source = BurnBatches::new(InMemDataset::new(digits(&data)), DigitBatcher);
    let mut user_sink = MemorySink::default();
    let user = Trainer::new(w2_options(), Device::flex(), &mut user_sink)
        .fit_source("user-cnn", UserCnn::new, &source, None)
        .unwrap();
    let zoo_losses: Vec<f32> = zoo_sink.steps().map(|s| s.loss).collect();
    let user_losses: Vec<f32> = user_sink.steps().map(|s| s.loss).collect();
    assert_eq!(zoo_losses.len(), 4);
    assert_eq!(
        zoo_losses, user_losses,
        "the same model, data and seed give the same losses"
    );
    let (differing, max) =
        bitwise_differences(&flatten_params(&zoo.model), &flatten_params(&user.model));
    assert_eq!(differing, 0, "weights differ (max {max})");
}

// ---------------------------------------------------------------- drop-in layers = Burn's

/// Gradient of every trainable float parameter, in visiting order (a BatchNorm's running
/// statistics are visited too, as tensors that take no gradient).
fn param_grads<M: Module>(model: &M, grads: &burn::optim::GradientsParams) -> Vec<Vec<f32>> {
    struct Collect<'g>(&'g burn::optim::GradientsParams, Vec<Vec<f32>>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.val().is_require_grad() {
                return;
            }
            let g = self
                .0
                .get::<D>(param.id)
                .expect("a gradient for every parameter");
            self.1.push(g.into_data().try_to_vec::<f32>().unwrap());
        }
    }
    let mut c = Collect(grads, Vec::new());
    model.visit(&mut c);
    c.1
}

fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: sizes differ");
    let scale = b.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= tol * scale,
        "{what}: max difference {worst} (scale {scale}, tolerance {tol})"
    );
}

/// Output, input gradient and parameter gradients of `kiln` and `burn` forward passes of the
/// same weights on the same input.
fn compare<MK: Module, MB: Module>(
    what: &str,
    kiln_layer: MK,
    burn_layer: MB,
    input: Tensor<4>,
    kiln_fwd: impl Fn(&MK, Tensor<4>) -> Tensor<4>,
    burn_fwd: impl Fn(&MB, Tensor<4>) -> Tensor<4>,
) {
    let run = |fwd: &dyn Fn(Tensor<4>) -> Tensor<4>| {
        let x = input.clone().require_grad();
        let y = fwd(x.clone());
        // A weighted sum so every output element has its own gradient.
        let w = Tensor::<4>::ones(y.dims(), &y.device()).cumsum(3);
        let grads = (y.clone() * w).sum().backward();
        let dx = x
            .grad(&grads)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        (y.into_data().try_to_vec::<f32>().unwrap(), dx, grads)
    };
    let (yk, dxk, gk) = run(&|x| kiln_fwd(&kiln_layer, x));
    let (yb, dxb, gb) = run(&|x| burn_fwd(&burn_layer, x));
    assert_close(&format!("{what} output"), &yk, &yb, 1e-5);
    assert_close(&format!("{what} input gradient"), &dxk, &dxb, 1e-5);
    let gk = param_grads(
        &kiln_layer,
        &burn::optim::GradientsParams::from_grads(gk, &kiln_layer),
    );
    let gb = param_grads(
        &burn_layer,
        &burn::optim::GradientsParams::from_grads(gb, &burn_layer),
    );
    assert_eq!(gk.len(), gb.len());
    for (i, (a, b)) in gk.iter().zip(&gb).enumerate() {
        assert_close(&format!("{what} parameter {i} gradient"), a, b, 1e-5);
    }
}

#[test]
fn drop_in_layers_give_burns_outputs_and_gradients() {
    // Draws from the backend's shared RNG beside tests whose trainers must init identically.
    let _rng = kiln::train::backend_rng_guard();
    let device = Device::flex().autodiff();
    let x = |shape: [usize; 4]| Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
    let convs = [
        burn::nn::conv::Conv2dConfig::new([3, 8], [3, 3]),
        burn::nn::conv::Conv2dConfig::new([3, 6], [3, 3])
            .with_stride([2, 2])
            .with_padding(PaddingConfig2d::Same),
        burn::nn::conv::Conv2dConfig::new([4, 8], [3, 3])
            .with_groups(2)
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1)),
        burn::nn::conv::Conv2dConfig::new([3, 4], [5, 3])
            .with_dilation([2, 1])
            .with_bias(false),
    ];
    for (i, config) in convs.iter().enumerate() {
        let burn_conv = config.init(&device);
        let kiln_conv = kiln::nn::Conv2d::from(burn_conv.clone());
        let input = x([2, config.channels[0], 11, 10]);
        compare(
            &format!("conv {i}"),
            kiln_conv,
            burn_conv,
            input,
            |l, x| l.forward(x),
            |l, x| l.forward(x),
        );
    }
    let pools = [
        burn::nn::pool::MaxPool2dConfig::new([2, 2]),
        burn::nn::pool::MaxPool2dConfig::new([3, 3]).with_strides([2, 2]),
        burn::nn::pool::MaxPool2dConfig::new([3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .with_ceil_mode(true),
    ];
    for (i, config) in pools.iter().enumerate() {
        let burn_pool = config.init();
        let kiln_pool = kiln::nn::MaxPool2d::from(burn_pool.clone());
        compare(
            &format!("max pool {i}"),
            kiln_pool,
            burn_pool,
            x([2, 3, 9, 8]),
            |l, x| l.forward(x),
            |l, x| l.forward(x),
        );
    }
    // BatchNorm in training mode (batch statistics), plain and with the fused ReLU, on a
    // shifted, scaled input (statistics far from 0 / 1) and random γ, β.
    let norm = || {
        let mut bn = burn::nn::BatchNormConfig::new(5).init(&device);
        bn.gamma = Param::from_tensor(Tensor::random([5], Distribution::Normal(1.0, 0.5), &device));
        bn.beta = Param::from_tensor(Tensor::random([5], Distribution::Normal(0.0, 0.5), &device));
        bn
    };
    let shifted = || x([4, 5, 6, 7]).mul_scalar(3.0).add_scalar(2.0);
    let burn_bn = norm();
    compare(
        "batch norm",
        kiln::nn::BatchNorm::from(burn_bn.clone()),
        burn_bn.clone(),
        shifted(),
        |l, x| l.forward(x),
        |l, x| l.forward(x),
    );
    compare(
        "batch norm + relu",
        kiln::nn::BatchNorm::from(burn_bn.clone()),
        burn_bn,
        shifted(),
        |l, x| l.forward_relu(x),
        |l, x| burn::tensor::activation::relu(l.forward(x)),
    );
    // The running statistics move the same way.
    let (burn_bn, input) = (norm(), shifted());
    let kiln_bn = kiln::nn::BatchNorm::from(norm());
    let _ = burn_bn.forward(input.clone());
    let _ = kiln_bn.forward(input);
    for (a, b) in [
        (kiln_bn.running_mean.value(), burn_bn.running_mean.value()),
        (kiln_bn.running_var.value(), burn_bn.running_var.value()),
    ] {
        assert_close(
            "batch norm running statistics",
            &a.into_data().try_to_vec::<f32>().unwrap(),
            &b.into_data().try_to_vec::<f32>().unwrap(),
            1e-5,
        );
    }
    for bias in [true, false] {
        let burn_linear = burn::nn::LinearConfig::new(10, 7)
            .with_bias(bias)
            .init(&device);
        let kiln_linear = kiln::nn::Linear::from(burn_linear.clone());
        // A 4-D input: the layer works over the last axis of any rank.
        compare(
            &format!("linear (bias {bias})"),
            kiln_linear,
            burn_linear,
            x([2, 3, 4, 10]),
            |l, x| l.forward(x),
            |l, x| l.forward(x),
        );
    }
}

#[test]
fn burn_weights_load_into_the_drop_in_layers_and_back() {
    // Draws from the backend's shared RNG beside tests whose trainers must init identically.
    let _rng = kiln::train::backend_rng_guard();
    let device = Device::flex();
    let user = UserCnn::new(&device);
    let burn_model = BurnCnn::new(&device);
    let bytes = burn_model.clone().into_record().into_bytes().unwrap();
    let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(bytes.to_vec())).unwrap();
    let loaded = user
        .try_load_record(record)
        .expect("Burn's record fits the Kiln layers");
    assert_eq!(flatten_params(&loaded), flatten_params(&burn_model));
    let back = loaded.clone().into_record().into_bytes().unwrap();
    let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(back.to_vec())).unwrap();
    let reloaded = burn_model
        .try_load_record(record)
        .expect("and the way back");
    assert_eq!(flatten_params(&reloaded), flatten_params(&loaded));
    // And they compute the same logits.
    let images = Tensor::<4>::random([3, 1, 28, 28], Distribution::Default, &device);
    let burn_logits = reloaded.forward(images.clone());
    assert_close(
        "logits",
        &loaded
            .forward(images)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap(),
        &burn_logits.into_data().try_to_vec::<f32>().unwrap(),
        1e-5,
    );
}

// ---------------------------------------------------------------- a small user regression

#[derive(Module, Debug)]
struct Mlp {
    hidden: kiln::nn::Linear,
    out: kiln::nn::Linear,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Mlp {
            hidden: kiln::nn::LinearConfig::new(4, 16).init(device),
            out: kiln::nn::LinearConfig::new(16, 2).init(device),
        }
    }
}

#[derive(Debug, Clone)]
struct Rows {
    x: Tensor<2>,
    y: Tensor<2>,
}

impl TrainStep<Rows> for Mlp {
    fn step(&self, batch: Rows) -> StepOutput {
        let pred = self.out.forward(relu(self.hidden.forward(batch.x)));
        StepOutput::regression(pred, batch.y)
    }
}

#[derive(Debug, Clone)]
struct RowBatcher {
    width: usize,
}

impl Batcher<[f32; 6], Rows> for RowBatcher {
    fn batch(&self, items: Vec<[f32; 6]>, device: &Device) -> Rows {
        let n = items.len();
        let x: Vec<f32> = items
            .iter()
            .flat_map(|r| r[..self.width].to_vec())
            .collect();
        let y: Vec<f32> = items.iter().flat_map(|r| [r[4], r[5]]).collect();
        Rows {
            x: Tensor::from_data(TensorData::new(x, [n, self.width]), device),
            y: Tensor::from_data(TensorData::new(y, [n, 2]), device),
        }
    }
}

/// Rows `[x0..x3, y0, y1]` with y a fixed linear map of x.
fn rows(n: usize) -> Vec<[f32; 6]> {
    (0..n)
        .map(|i| {
            let t = i as f32 * 0.37;
            let x = [t.sin(), t.cos(), (2.0 * t).sin(), (0.5 * t).cos()];
            [
                x[0],
                x[1],
                x[2],
                x[3],
                x[0] - 0.5 * x[2] + 0.1,
                0.3 * x[1] + x[3],
            ]
        })
        .collect()
}

fn regression_source(n: usize, width: usize) -> BurnBatches<[f32; 6], Rows> {
    BurnBatches::new(InMemDataset::new(rows(n)), RowBatcher { width })
}

fn regression_options(dir: &std::path::Path) -> TrainOptions {
    TrainOptions {
        epochs: 2,
        batch_size: 16,
        grad_accum_steps: 2,
        grad_clip_norm: Some(0.5),
        precision: Precision::F16,
        checkpoint_dir: Some(dir.to_path_buf()),
        workers: Some(1),
        ..TrainOptions::default()
    }
}

#[test]
fn a_user_model_resumes_bit_for_bit_with_f16_and_loss_scaling() {
    let dir = tempdir("own-model", "resume");
    let train = regression_source(200, 4);
    let full = Trainer::new(regression_options(&dir), Device::flex(), &mut NullSink)
        .fit_source("mlp", Mlp::new, &train, None)
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let stopped = TrainOptions {
        max_steps: Some(5),
        ..regression_options(&dir)
    };
    Trainer::new(stopped, Device::flex(), &mut NullSink)
        .fit_source("mlp", Mlp::new, &train, None)
        .unwrap();
    let latest = latest_checkpoint(&dir).unwrap().unwrap();
    let mut sink = MemorySink::default();
    let resumed = Trainer::new(regression_options(&dir), Device::flex(), &mut sink)
        .resume_from(latest)
        .fit_source("mlp", Mlp::new, &train, None)
        .unwrap();
    assert!(
        sink.steps().all(|s| s.loss_scale.is_some()),
        "f16 runs scale the loss"
    );
    let (differing, max) = bitwise_differences(
        &flatten_params(&full.model),
        &flatten_params(&resumed.model),
    );
    assert_eq!(differing, 0, "resumed weights differ (max {max})");
    assert_eq!(full.summary.steps, resumed.summary.steps);
}

/// Sum of absolute errors of the first output column: a metric of the user's own.
#[derive(Default)]
struct FirstColumnMae {
    sum: f64,
    n: usize,
}

impl Metric for FirstColumnMae {
    fn name(&self) -> String {
        "mae0".into()
    }
    fn reset(&mut self) {
        *self = Self::default();
    }
    fn update(&mut self, output: &StepOutput, _samples: usize) {
        if let (Some(pred), Some(Targets::Values(y))) = (&output.output, &output.targets) {
            let [n, _] = pred.dims();
            let d: f32 = (pred.clone().narrow(1, 0, 1) - y.clone().narrow(1, 0, 1))
                .abs()
                .sum()
                .into_scalar();
            self.sum += d as f64;
            self.n += n;
        }
    }
    fn value(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }
}

#[test]
fn evaluation_reports_the_callers_metrics_on_the_held_out_split() {
    let train = regression_source(256, 4);
    let valid = regression_source(64, 4);
    let options = TrainOptions {
        epochs: 3,
        batch_size: 16,
        lr: 1e-2,
        ..TrainOptions::default()
    };
    let metrics: Vec<Box<dyn Metric>> = vec![
        Box::new(FirstColumnMae::default()),
        Box::new(kiln::train::Mse::default()),
    ];
    let outcome = Trainer::new(options, Device::flex(), &mut NullSink)
        .with_metrics(metrics)
        .fit_source("mlp", Mlp::new, &train, Some(&valid))
        .unwrap();
    let m = &outcome.summary.test_metrics;
    assert!(
        m.contains_key("mae0") && m.contains_key("mse") && m.contains_key("loss"),
        "{m:?}"
    );
    assert!(
        !m.contains_key("accuracy"),
        "accuracy was not asked for: {m:?}"
    );
    // The loss of a regression step is its MSE.
    assert!(
        (m["loss"] - m["mse"]).abs() < 1e-4 * m["mse"].max(1e-3),
        "{m:?}"
    );
    assert_eq!(outcome.epochs.len(), 3);
    assert!(
        outcome
            .epochs
            .iter()
            .all(|e| e.test_metrics.contains_key("mae0"))
    );
    assert!(m["mse"] < 0.05, "the linear target is learnt: {m:?}");
}

// ---------------------------------------------------------------- the loader on Burn data

#[derive(Debug, Clone)]
struct Indices;

impl Batcher<usize, Vec<usize>> for Indices {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        items
    }
}

#[test]
fn burn_datasets_go_through_the_loader_exactly_once_per_epoch() {
    let source = BurnBatches::new(InMemDataset::new((0..103).collect::<Vec<usize>>()), Indices);
    let options = LoaderOptions {
        batch_size: 10,
        workers: 3,
        prefetch_factor: 2,
        shuffle: true,
        drop_last: false,
        pad_last: false,
        seed: 5,
    };
    let epochs = DataLoader::run_source(&source, &Device::flex(), options, |loader| {
        (0..2)
            .map(|e| {
                loader
                    .epoch(e, 0)
                    .map(|b| b.unwrap())
                    .collect::<Vec<Vec<usize>>>()
            })
            .collect::<Vec<_>>()
    })
    .unwrap();
    for batches in &epochs {
        assert_eq!(batches.len(), 11);
        let mut seen: Vec<usize> = batches.concat();
        seen.sort_unstable();
        assert_eq!(seen, (0..103).collect::<Vec<_>>());
    }
    assert_ne!(epochs[0], epochs[1], "each epoch is shuffled anew");
}

#[derive(Debug, Clone)]
struct Panicking;

impl Batcher<usize, Vec<usize>> for Panicking {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        assert!(!items.contains(&7), "item 7 is corrupt");
        items
    }
}

#[test]
fn a_panicking_batcher_is_an_error_not_a_hang() {
    let source = BurnBatches::new(
        InMemDataset::new((0..20).collect::<Vec<usize>>()),
        Panicking,
    );
    let options = LoaderOptions {
        batch_size: 4,
        workers: 2,
        shuffle: false,
        ..LoaderOptions::default()
    };
    let results = DataLoader::run_source(&source, &Device::flex(), options, |loader| {
        loader.epoch(0, 0).collect::<Vec<_>>()
    })
    .unwrap();
    let err = results
        .iter()
        .find_map(|r| r.as_ref().err())
        .expect("an error");
    assert!(err.to_string().contains("item 7 is corrupt"), "{err}");
}

// ---------------------------------------------------------------- bad input

fn expect_error<B: Send, M: TrainStep<B> + 'static>(
    init: impl FnOnce(&Device) -> M,
    train: &dyn BatchSource<Batch = B>,
    dir: &std::path::Path,
) -> KilnError {
    let options = TrainOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        ..TrainOptions::default()
    };
    let err = Trainer::new(options, Device::flex(), &mut NullSink)
        .fit_source("mlp", init, train, None)
        .expect_err("the run must refuse");
    assert!(
        std::fs::read_dir(dir).map_or(true, |mut d| d.next().is_none()),
        "nothing may be written for a refused run"
    );
    err
}

/// A model whose loss is per sample, not reduced.
#[derive(Module, Debug)]
struct Unreduced {
    mlp: Mlp,
}

impl TrainStep<Rows> for Unreduced {
    fn step(&self, batch: Rows) -> StepOutput {
        let pred = self.mlp.out.forward(relu(self.mlp.hidden.forward(batch.x)));
        let per_sample: Tensor<1> = (pred - batch.y).square().sum_dim(1).flatten(0, 1);
        StepOutput::new(per_sample)
    }
}

#[test]
fn bad_models_and_data_are_clear_errors_and_write_nothing() {
    let dir = tempdir("own-model", "bad-input");

    let err = expect_error(
        |d| Unreduced { mlp: Mlp::new(d) },
        &regression_source(40, 4),
        &dir,
    );
    assert!(err.to_string().contains("not a scalar"), "{err}");

    // Three features where the model takes four.
    let err = expect_error(Mlp::new, &regression_source(40, 3), &dir);
    let text = err.to_string();
    assert!(
        text.contains("first batch") && text.contains("last axis is 4, got 3"),
        "{text}"
    );

    let err = expect_error(Mlp::new, &regression_source(0, 4), &dir);
    assert!(err.to_string().contains("empty (0 samples)"), "{err}");

    // A checkpoint of another model under the same name, and one under another name.
    let options = TrainOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        max_steps: Some(1),
        ..TrainOptions::default()
    };
    Trainer::new(options, Device::flex(), &mut NullSink)
        .fit_source("mlp", Mlp::new, &regression_source(40, 4), None)
        .unwrap();
    let checkpoint = latest_checkpoint(&dir).unwrap().unwrap();
    #[derive(Module, Debug)]
    struct Wider {
        hidden: kiln::nn::Linear,
        out: kiln::nn::Linear,
    }
    impl TrainStep<Rows> for Wider {
        fn step(&self, batch: Rows) -> StepOutput {
            StepOutput::regression(self.out.forward(self.hidden.forward(batch.x)), batch.y)
        }
    }
    let wider = |d: &Device| Wider {
        hidden: kiln::nn::LinearConfig::new(4, 32).init(d),
        out: kiln::nn::LinearConfig::new(32, 2).init(d),
    };
    for (name, expected) in [("mlp", "do not fit"), ("other", "holds model `mlp`")] {
        let err = Trainer::new(TrainOptions::default(), Device::flex(), &mut NullSink)
            .resume_from(&checkpoint)
            .fit_source(name, wider, &regression_source(40, 4), None)
            .expect_err("a checkpoint of another model is refused");
        assert!(err.to_string().contains(expected), "{name}: {err}");
    }
}

// ---------------------------------------------------------------- the tuners as library calls

#[test]
fn the_tuners_take_a_user_model_and_data() {
    use kiln::tune::batch::{SearchMode, SearchOptions};
    let data = regression_source(512, 4);
    let base = TrainOptions {
        lr: 1e-2,
        ..TrainOptions::default()
    };
    let report =
        kiln::tune::auto::search_source("mlp", &Mlp::new, &data, &base, 32, 3, None).unwrap();
    assert_eq!(report.baseline.candidate.micro_batch, 32);
    assert!(report.decisions.len() >= 3, "{:?}", report.decisions);
    assert!(report.best.samples_per_s >= report.baseline.samples_per_s);
    for d in &report.decisions {
        let c = d.measured.candidate;
        assert_eq!(
            c.micro_batch * c.grad_accum_steps,
            32,
            "effective batch kept"
        );
        assert!(d.measured.mean_loss.is_finite(), "{}", d.reason);
    }

    let roomy = SearchOptions {
        budget: 64 << 30,
        margin: 0.1,
        mode: SearchMode::Power,
        start: 8,
        max_batch: 64,
    };
    let found =
        kiln::tune::batch::search_source(&roomy, "mlp", &Mlp::new, &data, &base, 2).unwrap();
    assert_eq!(found.largest_safe, 64, "{:?}", found.trials);
    assert!(found.trials.iter().all(|t| t.outcome.peak_bytes.is_some()));
    let tiny = SearchOptions {
        budget: 1 << 20,
        ..roomy
    };
    let err = kiln::tune::batch::search_source(&tiny, "mlp", &Mlp::new, &data, &base, 2)
        .expect_err("1 MiB fits no batch");
    assert!(err.to_string().contains("no batch size fits"), "{err}");
}

#[test]
fn the_readme_shows_the_quickstart_example_verbatim() {
    let readme = include_str!("../../../README.md");
    let example = include_str!("../examples/quickstart.rs");
    let start = example.find("use burn::data").unwrap();
    let end = example.find("#[test]").unwrap();
    let code = example[start..end].trim_end();
    assert!(
        readme.contains(code),
        "README's \"Use Kiln from your own Burn code\" must show examples/quickstart.rs as it is"
    );
    let lines = code.lines().filter(|l| !l.trim().is_empty()).count();
    assert!(lines < 40, "the README example has {lines} lines");
}

// ---------------------------------------------------------------- the guard, checkpointing, OOM

/// Rows whose sample `poison` has a NaN target: the step that holds it has a NaN loss.
#[derive(Debug, Clone)]
struct Poisoned {
    poison: usize,
}

impl Batcher<(usize, [f32; 6]), Rows> for Poisoned {
    fn batch(&self, items: Vec<(usize, [f32; 6])>, device: &Device) -> Rows {
        let rows: Vec<[f32; 6]> = items
            .iter()
            .map(|(i, r)| {
                let mut r = *r;
                if *i == self.poison {
                    r[4] = f32::NAN;
                }
                r
            })
            .collect();
        RowBatcher { width: 4 }.batch(rows, device)
    }
}

#[test]
fn the_guard_skips_a_user_models_bad_step_and_training_goes_on() {
    let items: Vec<(usize, [f32; 6])> = rows(128).into_iter().enumerate().collect();
    let data = BurnBatches::new(InMemDataset::new(items), Poisoned { poison: 37 });
    let options = TrainOptions {
        epochs: 2,
        batch_size: 16,
        guard: kiln::guard::GuardOptions {
            policy: kiln::guard::GuardPolicy::Skip,
            ..Default::default()
        },
        ..TrainOptions::default()
    };
    let mut sink = MemorySink::default();
    let outcome = Trainer::new(options, Device::flex(), &mut sink)
        .fit_source("mlp", Mlp::new, &data, None)
        .unwrap();
    // Sample 37 is in one batch per epoch.
    assert_eq!(
        outcome.summary.guard_events.len(),
        2,
        "{:?}",
        outcome.summary.guard_events
    );
    assert_eq!(sink.steps().filter(|s| s.skipped).count(), 2);
    assert_eq!(outcome.summary.steps, 16);
    assert!(flatten_params(&outcome.model).iter().all(|v| v.is_finite()));
}

#[test]
fn activation_checkpointing_trains_a_user_model_the_same_way() {
    let train = regression_source(96, 4);
    let run = |checkpointing: bool| {
        let options = TrainOptions {
            batch_size: 16,
            activation_checkpointing: checkpointing,
            ..TrainOptions::default()
        };
        let mut sink = MemorySink::default();
        Trainer::new(options, Device::flex(), &mut sink)
            .fit_source("mlp", Mlp::new, &train, None)
            .unwrap();
        sink.steps().map(|s| s.loss).collect::<Vec<f32>>()
    };
    let (plain, checkpointed) = (run(false), run(true));
    assert_eq!(plain.len(), 6);
    for (a, b) in plain.iter().zip(&checkpointed) {
        assert!(
            (a - b).abs() <= 1e-6 * a.abs().max(1.0),
            "{plain:?} vs {checkpointed:?}"
        );
    }
}

#[test]
fn a_memory_watermark_halves_a_user_models_micro_batch_and_keeps_the_effective_batch() {
    let train = regression_source(128, 4);
    let options = TrainOptions {
        batch_size: 32,
        // Below any resident size: the first step crosses it.
        memory_watermark: Some(1 << 20),
        oom_adaptive: true,
        ..TrainOptions::default()
    };
    let mut sink = MemorySink::default();
    let outcome = Trainer::new(options, Device::flex(), &mut sink)
        .fit_source("mlp", Mlp::new, &train, None)
        .unwrap();
    let adapted: Vec<_> = sink
        .events
        .iter()
        .filter_map(|e| match e {
            kiln::observe::Event::BatchAdapted(a) => Some(a.clone()),
            _ => None,
        })
        .collect();
    assert!(!adapted.is_empty(), "the watermark must adapt the batch");
    assert!(
        adapted.iter().all(|a| a.effective_batch == 32),
        "{adapted:?}"
    );
    assert_eq!(adapted[0].micro_batch, 16);
    // Every sample is still trained on once: 128 samples in steps of 32.
    assert_eq!(outcome.summary.steps, 4);
    assert_eq!(sink.steps().map(|s| s.samples).sum::<usize>(), 128);
}

#[test]
fn every_level_of_a_resolved_plan_trains_a_user_model() {
    let train = regression_source(128, 4);
    let valid = regression_source(32, 4);
    for level in ["basic", "advanced", "ultra"] {
        let text = format!("level = \"{level}\"\n[train]\nepochs = 2\nbatch_size = 16\n");
        let config = kiln::KilnConfig::from_toml_str(&text, "kiln.toml").unwrap();
        let plan = kiln::plan::resolve(&config, &kiln::plan::Hardware::probe()).unwrap();
        assert_eq!(plan.train.activation_checkpointing, level == "ultra");
        let mut sink = MemorySink::default();
        let outcome = Trainer::new(plan.train.clone(), Device::flex(), &mut sink)
            .with_plan(plan.to_json())
            .fit_source("mlp", Mlp::new, &train, Some(&valid))
            .unwrap();
        assert_eq!(outcome.summary.steps, 16, "{level}");
        assert!(outcome.summary.test_metrics["mse"].is_finite(), "{level}");
        // advanced and ultra measure the loader's worker count on the user's data.
        let plan_json = sink.events.iter().find_map(|e| match e {
            kiln::observe::Event::RunStarted { plan, .. } => plan.clone(),
            _ => None,
        });
        let probed = plan_json.is_some_and(|p| p.get("data_workers_trials").is_some());
        assert_eq!(probed, level != "basic", "{level}");
    }
}
