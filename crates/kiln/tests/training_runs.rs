//! Real training on the bundled MNIST subset must reach a stated accuracy, and every zoo
//! model must train (loss falls) on real data.

use burn::tensor::Device;
use kiln::datasets::{Split, bundled};
use kiln::observe::{Event, MemorySink};
use kiln::train::{Schedule, TrainOptions};
use kiln::zoo::{ModelKind, ResNetConfig, ZooModel};
use kiln::{Trainer, burn};

/// W1 (MLP) on the full 4,000-image training split for 2 epochs must beat 90% on the 1,000
/// held-out images (it reaches about 93%; chance is 10%).
#[test]
fn mlp_reaches_90_percent_on_held_out_mnist() {
    let train = bundled(Split::Train).unwrap();
    let test = bundled(Split::Test).unwrap();
    let mut sink = MemorySink::default();
    let out = Trainer::new(
        TrainOptions {
            epochs: 2,
            batch_size: 64,
            schedule: Schedule::Cosine,
            warmup_steps: 20,
            grad_clip_norm: Some(1.0),
            ..TrainOptions::default()
        },
        Device::flex(),
        &mut sink,
    )
    .fit("mlp", |d| ModelKind::Mlp.init(d), &train, Some(&test))
    .unwrap();
    let acc = out.summary.test_accuracy.unwrap();
    assert!(acc >= 0.90, "test accuracy {acc}");
    assert_eq!(out.summary.steps, 2 * 63);
    // Events: one start, a step per optimizer step, an epoch end per epoch, one finish.
    let count = |f: fn(&Event) -> bool| sink.events.iter().filter(|e| f(e)).count();
    assert_eq!(count(|e| matches!(e, Event::RunStarted { .. })), 1);
    assert_eq!(count(|e| matches!(e, Event::Step(_))), 126);
    assert_eq!(count(|e| matches!(e, Event::EpochEnd(_))), 2);
    assert_eq!(count(|e| matches!(e, Event::RunFinished(_))), 1);
    let steps: Vec<_> = sink
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) => Some(s.clone()),
            _ => None,
        })
        .collect();
    assert!(steps.iter().all(|s| s.compute_ms > 0.0 && s.data_ms >= 0.0));
    assert!(steps.iter().all(|s| s.grad_norm.is_some()));
    assert!(out.summary.peak_rss_bytes.unwrap_or(0) > 0);
    assert!(out.summary.data_wait_share > 0.0 && out.summary.data_wait_share < 1.0);
    let first = steps[..10].iter().map(|s| s.loss).sum::<f32>();
    let last = steps[steps.len() - 10..]
        .iter()
        .map(|s| s.loss)
        .sum::<f32>();
    assert!(last < first * 0.5, "loss did not fall: {first} -> {last}");
}

fn loss_falls(kind: &str, init: impl FnOnce(&Device) -> ZooModel, steps: u64, lr: f64) {
    let train = bundled(Split::Train).unwrap().take(512);
    let mut sink = MemorySink::default();
    Trainer::new(
        TrainOptions {
            epochs: 4,
            batch_size: 32,
            lr,
            max_steps: Some(steps),
            shuffle: true,
            ..TrainOptions::default()
        },
        Device::flex(),
        &mut sink,
    )
    .fit(kind, init, &train, None)
    .unwrap();
    let losses: Vec<f32> = sink.steps().map(|s| s.loss).collect();
    let k = 5;
    let first: f32 = losses[..k].iter().sum::<f32>() / k as f32;
    let last: f32 = losses[losses.len() - k..].iter().sum::<f32>() / k as f32;
    assert!(last < first * 0.7, "{kind}: loss {first} -> {last}");
}

#[test]
fn transformer_trains_on_mnist_rows() {
    loss_falls("transformer", |d| ModelKind::Transformer.init(d), 40, 1e-3);
}

#[test]
fn resnet_with_batchnorm_trains() {
    // A narrow ResNet-18 (same topology, widths /8) keeps the test fast on 2 cores.
    let narrow = ResNetConfig {
        in_channels: 1,
        widths: [8, 16, 32, 64],
    };
    loss_falls("resnet", |d| ZooModel::ResNet(narrow.init(d)), 40, 3e-3);
}

/// A user's pre-LN encoder over the 28 image rows, written with `kiln::nn`'s transformer
/// drop-ins (LayerNorm, `qkv_attention`, GELU) as a user writes one.
mod user_encoder {
    use burn::module::{Module, Param};
    use burn::tensor::{Device, Tensor};
    use kiln::burn;
    use kiln::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig, gelu, qkv_attention};

    const D: usize = 64;
    const HEADS: usize = 4;

    #[derive(Module, Debug)]
    pub struct Block {
        norm_attn: LayerNorm,
        qkv: Linear,
        proj: Linear,
        norm_ff: LayerNorm,
        ff_in: Linear,
        ff_out: Linear,
    }

    impl Block {
        fn new(device: &Device) -> Self {
            Block {
                norm_attn: LayerNormConfig::new(D).init(device),
                qkv: LinearConfig::new(D, 3 * D).init(device),
                proj: LinearConfig::new(D, D).init(device),
                norm_ff: LayerNormConfig::new(D).init(device),
                ff_in: LinearConfig::new(D, 2 * D).init(device),
                ff_out: LinearConfig::new(2 * D, D).init(device),
            }
        }

        fn forward(&self, x: Tensor<3>) -> Tensor<3> {
            let qkv = self.qkv.forward(self.norm_attn.forward(x.clone()));
            let context = qkv_attention(qkv, HEADS, None, None, Default::default());
            let x = x + self.proj.forward(context);
            x.clone()
                + self
                    .ff_out
                    .forward(gelu(self.ff_in.forward(self.norm_ff.forward(x))))
        }
    }

    #[derive(Module, Debug)]
    pub struct Encoder {
        embed: Linear,
        pos: Param<Tensor<3>>,
        blocks: Vec<Block>,
        norm: LayerNorm,
        head: Linear,
    }

    impl Encoder {
        pub fn new(device: &Device) -> Self {
            Encoder {
                embed: LinearConfig::new(28, D).init(device),
                pos: Param::from_tensor(Tensor::zeros([1, 28, D], device)),
                blocks: (0..2).map(|_| Block::new(device)).collect(),
                norm: LayerNormConfig::new(D).init(device),
                head: LinearConfig::new(D, 10).init(device),
            }
        }
    }

    impl kiln::zoo::Classifier for Encoder {
        fn forward(&self, images: Tensor<4>) -> Tensor<2> {
            let [b, _, _, _] = images.dims();
            let mut x = self.embed.forward(images.reshape([b, 28, 28])) + self.pos.val();
            for block in &self.blocks {
                x = block.forward(x);
            }
            self.head
                .forward(self.norm.forward(x).mean_dim(1).reshape([b, D]))
        }
    }
}

/// The user's encoder trains on MNIST rows through Kiln's transformer kernels (LayerNorm,
/// packed attention, GELU, forward and backward) to the accuracy it reaches on Burn's ops
/// (Kiln's kernels switched off), same data, order and initial weights: both above 75% on
/// the 1,000 held-out images after 2 epochs over the 4,000 (measured: 80.6% both ways on the
/// AVX-512 Xeon; chance is 10%), within 3 points of each other.
#[test]
fn a_user_encoder_on_the_transformer_kernels_trains_like_on_burns_ops() {
    let train = bundled(Split::Train).unwrap();
    let test = bundled(Split::Test).unwrap();
    let accuracy = |kernels: bool| {
        let out = Trainer::new(
            TrainOptions {
                epochs: 2,
                batch_size: 32,
                lr: 2e-3,
                schedule: Schedule::Cosine,
                warmup_steps: 20,
                kiln_kernels: kernels,
                ..TrainOptions::default()
            },
            Device::flex(),
            &mut MemorySink::default(),
        )
        .fit(
            "user-encoder",
            user_encoder::Encoder::new,
            &train,
            Some(&test),
        )
        .unwrap();
        out.summary.test_accuracy.unwrap()
    };
    let (ours, burns) = (accuracy(true), accuracy(false));
    eprintln!("held-out accuracy: Kiln's kernels {ours}, Burn's ops {burns}");
    assert!(
        ours >= 0.75 && burns >= 0.75,
        "kernels {ours}, Burn's ops {burns}"
    );
    assert!(
        (ours - burns).abs() <= 0.03,
        "kernels {ours}, Burn's ops {burns}"
    );
}
