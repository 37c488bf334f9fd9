//! Real-time inference on your own Burn model: a small CNN with an early exit head, written as
//! any Burn model is, trained by Kiln on digits seen as the camera shows them, then run on a
//! video stream with regions of interest (only changed regions run) and early exit (a region
//! the early head is sure of skips the deep layers), against the full model on every region
//! of every frame. `cargo run --release -p kiln --example stream_own_model`

use burn::module::Module;
use burn::nn::PaddingConfig2d;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use kiln::data::{Augment, Batch};
use kiln::datasets::{Split, bundled};
use kiln::nn::{Conv2d, Conv2dConfig, Linear, LinearConfig, MaxPool2d, MaxPool2dConfig};
use kiln::observe::NullSink;
use kiln::stream::{
    EarlyExit, FullDepth, GateConfig, MultiExit, StreamConfig, StreamLike, StreamRun,
    SyntheticVideo, VideoSpec, run_stream,
};
use kiln::train::{StepOutput, TrainOptions, TrainStep, Trainer};

/// Two stages, a head after each: 28×28 → conv 8 → pool → head 0; → conv 16 → pool → head 1.
#[derive(Module, Debug)]
pub struct TwoExitNet {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: MaxPool2d,
    head0: Linear,
    head1: Linear,
}

impl TwoExitNet {
    /// A fresh model.
    pub fn new(device: &Device) -> Self {
        let same = PaddingConfig2d::Same;
        TwoExitNet {
            conv1: Conv2dConfig::new([1, 8], [3, 3])
                .with_padding(same.clone())
                .init(device),
            conv2: Conv2dConfig::new([8, 16], [3, 3])
                .with_padding(same)
                .init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            head0: LinearConfig::new(8 * 14 * 14, 10).init(device),
            head1: LinearConfig::new(16 * 7 * 7, 10).init(device),
        }
    }
}

/// The contract `kiln::stream` needs: the forward split at the heads.
impl MultiExit for TwoExitNet {
    fn input_shape(&self) -> [usize; 3] {
        [1, 28, 28]
    }

    fn num_exits(&self) -> usize {
        2
    }

    fn stage(&self, k: usize, x: Tensor<4>) -> (Tensor<4>, Tensor<2>) {
        let (conv, head) = if k == 0 {
            (&self.conv1, &self.head0)
        } else {
            (&self.conv2, &self.head1)
        };
        let features = self.pool.forward(relu(conv.forward(x)));
        let logits = head.forward(features.clone().flatten(1, 3));
        (features, logits)
    }

    fn forward_full(&self, images: Tensor<4>) -> Tensor<2> {
        let f = self.pool.forward(relu(self.conv1.forward(images)));
        let f = self.pool.forward(relu(self.conv2.forward(f)));
        self.head1.forward(f.flatten(1, 3))
    }
}

/// Both heads learn: the early one's loss counts half.
impl TrainStep<Batch> for TwoExitNet {
    fn step(&self, batch: Batch) -> StepOutput {
        let (features, early) = self.stage(0, batch.images);
        let (_, last) = self.stage(1, features);
        let ce = CrossEntropyLossConfig::new().init(&last.device());
        let loss = ce.forward(early, batch.labels.clone()).mul_scalar(0.5)
            + ce.forward(last.clone(), batch.labels.clone());
        StepOutput::new(loss).with_classes(last, batch.labels)
    }
}

/// The full model and the stream techniques, measured on the same video.
pub struct Runs {
    /// Held-out accuracy of the trained model's last exit.
    pub test_accuracy: f64,
    /// The full model on every region of every frame.
    pub full: StreamRun,
    /// Regions of interest + early exit.
    pub fast: StreamRun,
}

fn run() -> kiln::Result<Runs> {
    let device = Device::flex();
    let spec = VideoSpec {
        frames: 300,
        ..VideoSpec::default()
    };
    // Train on other backgrounds than the video's (another seed), as the camera shows digits.
    let look = VideoSpec {
        seed: spec.seed + 1,
        ..spec.clone()
    };
    let train = StreamLike::new(bundled(Split::Train)?, &look);
    let test = StreamLike::new(bundled(Split::Test)?, &look);
    let options = TrainOptions {
        epochs: 2,
        augment: Augment::Crop,
        lr: 2e-3,
        ..TrainOptions::default()
    };
    let mut sink = NullSink;
    let outcome = Trainer::new(options, device.clone(), &mut sink).fit(
        "two-exit",
        TwoExitNet::new,
        &train,
        Some(&test),
    )?;
    let test_accuracy = outcome.summary.test_accuracy.unwrap_or(0.0);
    // The inference copy: off the autodiff device.
    let model = outcome.model.valid();

    let video = SyntheticVideo::generate(&bundled(Split::Test)?, &spec)?;
    let grid = StreamConfig {
        regions: Some(video.regions.clone()),
        ..StreamConfig::default()
    };
    let roi = StreamConfig {
        region_gate: Some(GateConfig {
            threshold: 0.08,
            max_reuse_age: 30,
        }),
        ..grid.clone()
    };
    let full = run_stream(
        "full",
        &video,
        &grid,
        &FullDepth(model.clone()),
        &device,
        None,
    )?;
    let early = EarlyExit::new(model, vec![0.95])?;
    let fast = run_stream(
        "roi+early-exit",
        &video,
        &roi,
        &early,
        &device,
        Some(&full.predictions),
    )?;
    Ok(Runs {
        test_accuracy,
        full,
        fast,
    })
}

#[cfg_attr(test, allow(dead_code))]
fn main() -> kiln::Result<()> {
    let runs = run()?;
    println!("held-out accuracy {:.4}", runs.test_accuracy);
    for r in [&runs.full, &runs.fast] {
        println!(
            "{:<16} {:>7.0} frames/s  accuracy {:.4}  agreement {}  regions: {}",
            r.name,
            r.fps,
            r.accuracy,
            r.agreement.map_or("-".into(), |a| format!("{a:.4}")),
            r.region_summary()
        );
    }
    println!("speed-up {:.2}x", runs.fast.fps / runs.full.fps);
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_stream_techniques_keep_accuracy_on_a_users_model() {
        let runs = super::run().expect("the example runs");
        assert!(
            runs.test_accuracy > 0.85,
            "held-out accuracy {}",
            runs.test_accuracy
        );
        let agreement = runs.fast.agreement.unwrap();
        assert!(
            agreement >= 0.98,
            "agreement with the full model {agreement}"
        );
        assert!(runs.fast.accuracy >= runs.full.accuracy - 0.01);
        let total: usize = runs.fast.region_paths.values().sum();
        let reused = runs.fast.region_paths.get("reused").copied().unwrap_or(0);
        assert!(
            reused * 2 > total,
            "most regions reused: {:?}",
            runs.fast.region_paths
        );
        assert!(
            runs.fast.region_paths.contains_key("exit0"),
            "some regions exit early"
        );
    }
}
