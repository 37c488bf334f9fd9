//! A sequence model on integer token ids: embedding → a small transformer encoder → mean over
//! tokens → classification, trained by Kiln.
//!
//! The encoder is Burn's own `TransformerEncoder`; the classification head is a
//! `kiln::nn::Linear`. bf16 mixed precision, accumulation, clipping, and a stop-and-resume
//! from a checkpoint halfway. `cargo run --release -p kiln --example token_classifier`

#[allow(dead_code)] // each example uses part of the shared helpers
mod common;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Embedding, EmbeddingConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln::data::BurnBatches;
use kiln::nn::{Linear, LinearConfig};
use kiln::precision::Precision;
use kiln::train::{StepOutput, TrainOptions, TrainStep};
use rand::Rng;

const VOCAB: usize = 16;
const LENGTH: usize = 13;
const D_MODEL: usize = 32;

/// Token and position embeddings, one encoder layer, a linear head.
#[derive(Module, Debug)]
pub struct TokenClassifier {
    tokens: Embedding,
    positions: Embedding,
    encoder: TransformerEncoder,
    head: Linear,
}

impl TokenClassifier {
    /// A fresh model.
    pub fn new(device: &Device) -> Self {
        TokenClassifier {
            tokens: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            positions: EmbeddingConfig::new(LENGTH, D_MODEL).init(device),
            encoder: TransformerEncoderConfig::new(D_MODEL, 64, 4, 1)
                .with_dropout(0.0)
                .init(device),
            head: LinearConfig::new(D_MODEL, 2).init(device),
        }
    }

    /// Logits `[B, 2]` of token ids `[B, LENGTH]`.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<2> {
        let [batch, length] = ids.dims();
        let device = ids.device();
        let positions = Tensor::<1, Int>::arange(0..length as i64, &device)
            .reshape([1, length])
            .repeat_dim(0, batch);
        let x = self.tokens.forward(ids) + self.positions.forward(positions);
        let x = self.encoder.forward(TransformerEncoderInput::new(x));
        let pooled: Tensor<2> = x.mean_dim(1).reshape([batch, D_MODEL]);
        self.head.forward(pooled)
    }
}

/// A batch of token sequences and labels.
#[derive(Debug, Clone)]
pub struct Sequences {
    ids: Tensor<2, Int>,
    labels: Tensor<1, Int>,
}

impl TrainStep<Sequences> for TokenClassifier {
    fn step(&self, batch: Sequences) -> StepOutput {
        StepOutput::classification(self.forward(batch.ids), batch.labels)
    }

    fn check_batch(&self, batch: &Sequences) -> Result<(), String> {
        let [_, length] = batch.ids.dims();
        if length > LENGTH {
            return Err(format!(
                "sequences of {length} tokens; the position table has {LENGTH}"
            ));
        }
        Ok(())
    }
}

/// One sequence.
#[derive(Debug, Clone)]
pub struct Sequence {
    ids: [i64; LENGTH],
    label: i64,
}

#[derive(Debug, Clone)]
struct SequenceBatcher;

impl Batcher<Sequence, Sequences> for SequenceBatcher {
    fn batch(&self, items: Vec<Sequence>, device: &Device) -> Sequences {
        let n = items.len();
        let ids: Vec<i64> = items.iter().flat_map(|s| s.ids).collect();
        let labels: Vec<i64> = items.iter().map(|s| s.label).collect();
        Sequences {
            ids: Tensor::from_data(TensorData::new(ids, [n, LENGTH]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// Random sequences labelled 1 when most of their tokens come from the lower half of the
/// vocabulary (the length is odd: no ties).
fn sequences(n: usize, seed: u64) -> Vec<Sequence> {
    let mut rng = common::rng(seed);
    (0..n)
        .map(|_| {
            let mut ids = [0i64; LENGTH];
            for id in &mut ids {
                *id = rng.random_range(0..VOCAB) as i64;
            }
            let low = ids.iter().filter(|&&t| t < (VOCAB / 2) as i64).count();
            Sequence {
                ids,
                label: i64::from(low * 2 > LENGTH),
            }
        })
        .collect()
}

/// Trains the classifier and returns the run.
fn run() -> kiln::Result<common::Trained<TokenClassifier>> {
    let train = BurnBatches::new(InMemDataset::new(sequences(2048, 1)), SequenceBatcher);
    let valid = BurnBatches::new(InMemDataset::new(sequences(512, 2)), SequenceBatcher);
    let options = TrainOptions {
        epochs: 6,
        batch_size: 32,
        grad_accum_steps: 2,
        grad_clip_norm: Some(1.0),
        lr: 2e-3,
        precision: Precision::Bf16,
        ..TrainOptions::default()
    };
    common::train_with_resume(
        "token-classifier",
        options,
        TokenClassifier::new,
        &train,
        &valid,
    )
}

#[cfg_attr(test, allow(dead_code))]
fn main() -> kiln::Result<()> {
    println!("{} (chance 0.5)", run()?.summary("accuracy"));
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn trains_resumes_and_beats_chance() {
        let trained = super::run().expect("the example trains");
        trained.assert_loss_fell(0.7);
        let accuracy = trained.metric("accuracy");
        assert!(accuracy > 0.8, "held-out accuracy {accuracy} (chance 0.5)");
    }
}
