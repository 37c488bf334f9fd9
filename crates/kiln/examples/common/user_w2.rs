//! W2 as a user writes it in their own crate: `kiln::nn` drop-in layers, the user's own batch
//! type, a Burn `Dataset` + `Batcher`. Shared by the `w2_side_by_side` benchmark example and
//! the integration tests (which check it trains exactly like the zoo's W2).

use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln::data::Dataset;
use kiln::train::{StepOutput, TrainStep};

/// W2 as a user would write it in their own crate, with the drop-in layers.
#[derive(Module, Debug)]
pub struct UserCnn {
    conv1: kiln::nn::Conv2d,
    conv2: kiln::nn::Conv2d,
    pool: kiln::nn::MaxPool2d,
    fc1: kiln::nn::Linear,
    fc2: kiln::nn::Linear,
}

impl UserCnn {
    /// A fresh model (Burn's initialization, in W2's layer order).
    pub fn new(device: &Device) -> Self {
        use kiln::nn::{Conv2dConfig, LinearConfig, MaxPool2dConfig};
        UserCnn {
            conv1: Conv2dConfig::new([1, 32], [3, 3]).init(device),
            conv2: Conv2dConfig::new([32, 64], [3, 3]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            fc1: LinearConfig::new(64 * 12 * 12, 128).init(device),
            fc2: LinearConfig::new(128, 10).init(device),
        }
    }

    /// Logits `[B, 10]` of images `[B, 1, 28, 28]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = relu(self.conv1.forward(x));
        let x = relu(self.conv2.forward(x));
        let x: Tensor<2> = self.pool.forward(x).flatten(1, 3);
        self.fc2.forward(relu(self.fc1.forward(x)))
    }
}

/// The same network with Burn's own layers: the user's model before the one-line change.
#[derive(Module, Debug)]
pub struct BurnCnn {
    conv1: burn::nn::conv::Conv2d,
    conv2: burn::nn::conv::Conv2d,
    pool: burn::nn::pool::MaxPool2d,
    fc1: burn::nn::Linear,
    fc2: burn::nn::Linear,
}

impl BurnCnn {
    /// A fresh model (the same draws as [`UserCnn::new`]).
    pub fn new(device: &Device) -> Self {
        use burn::nn::LinearConfig;
        use burn::nn::conv::Conv2dConfig;
        use burn::nn::pool::MaxPool2dConfig;
        BurnCnn {
            conv1: Conv2dConfig::new([1, 32], [3, 3]).init(device),
            conv2: Conv2dConfig::new([32, 64], [3, 3]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            fc1: LinearConfig::new(64 * 12 * 12, 128).init(device),
            fc2: LinearConfig::new(128, 10).init(device),
        }
    }

    /// Logits `[B, 10]` of images `[B, 1, 28, 28]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = relu(self.conv1.forward(x));
        let x = relu(self.conv2.forward(x));
        let x: Tensor<2> = self.pool.forward(x).flatten(1, 3);
        self.fc2.forward(relu(self.fc1.forward(x)))
    }
}

impl TrainStep<Digits> for BurnCnn {
    fn step(&self, batch: Digits) -> StepOutput {
        StepOutput::classification(self.forward(batch.images), batch.labels)
    }
}

/// The user's own batch type.
#[derive(Debug, Clone)]
pub struct Digits {
    images: Tensor<4>,
    labels: Tensor<1, Int>,
}

impl TrainStep<Digits> for UserCnn {
    fn step(&self, batch: Digits) -> StepOutput {
        StepOutput::classification(self.forward(batch.images), batch.labels)
    }
}

/// One sample.
#[derive(Debug, Clone)]
pub struct Digit {
    pixels: Vec<f32>,
    label: i64,
}

/// Stacks [`Digit`]s into [`Digits`].
#[derive(Debug, Clone)]
pub struct DigitBatcher;

impl Batcher<Digit, Digits> for DigitBatcher {
    fn batch(&self, items: Vec<Digit>, device: &Device) -> Digits {
        let n = items.len();
        let pixels: Vec<f32> = items.iter().flat_map(|d| d.pixels.clone()).collect();
        let labels: Vec<i64> = items.iter().map(|d| d.label).collect();
        Digits {
            images: Tensor::from_data(TensorData::new(pixels, [n, 1, 28, 28]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// The bundled MNIST samples as plain Burn dataset items (the same normalized pixels Kiln's
/// own dataset hands the zoo).
pub fn digits(data: &dyn Dataset) -> Vec<Digit> {
    (0..data.len())
        .map(|i| {
            let mut pixels = vec![0f32; 28 * 28];
            let label = data.fill(i, &mut pixels).unwrap() as i64;
            Digit { pixels, label }
        })
        .collect()
}
