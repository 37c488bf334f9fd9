//! README's "Use Kiln from your own Burn code", verbatim (it also runs as a test).
use burn::data::{dataloader::batcher::Batcher, dataset::InMemDataset};
use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData, activation::relu};
use kiln::nn::{Linear, LinearConfig}; // was: burn::nn::{Linear, LinearConfig}
use kiln::train::{StepOutput, TrainOptions, TrainStep, Trainer};

#[derive(Module, Debug)]
struct Net {
    hidden: Linear,
    out: Linear,
}

impl TrainStep<(Tensor<2>, Tensor<2>)> for Net {
    fn step(&self, (x, y): (Tensor<2>, Tensor<2>)) -> StepOutput {
        StepOutput::regression(self.out.forward(relu(self.hidden.forward(x))), y)
    }
}

struct Squares;
impl Batcher<f32, (Tensor<2>, Tensor<2>)> for Squares {
    fn batch(&self, xs: Vec<f32>, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let x = Tensor::<2>::from_data(TensorData::new(xs.clone(), [xs.len(), 1]), device);
        (x.clone(), x.clone() * x)
    }
}

fn main() -> kiln::Result<()> {
    let xs = (0..1024).map(|i| i as f32 / 512.0 - 1.0).collect();
    let data = kiln::data::BurnBatches::new(InMemDataset::new(xs), Squares);
    let mut opts = TrainOptions::default();
    (opts.epochs, opts.lr, opts.precision) = (10, 0.01, kiln::precision::Precision::Bf16);
    let (hidden, out) = (LinearConfig::new(1, 32), LinearConfig::new(32, 1));
    let net = |d: &Device| Net {
        hidden: hidden.init(d),
        out: out.init(d),
    };
    let mut sink = kiln::observe::NullSink;
    let mut trainer = Trainer::new(opts, Device::flex(), &mut sink);
    let run = trainer.fit_source("net", net, &data, Some(&data))?;
    assert!(run.summary.test_metrics["mse"] < 0.01, "{:?}", run.summary);
    Ok(())
}

#[test]
fn the_readme_example_learns_the_parabola() {
    main().unwrap();
}
