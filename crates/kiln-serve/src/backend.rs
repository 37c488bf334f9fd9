//! What executes a batch: the [`Backend`] contract of a model instance, and the backends
//! Kiln serves (an identity backend for tests, a zoo classifier's inference session, an ONNX
//! model). How they are built from a model's configuration is [`crate::loader`]'s job.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::{Device, Tensor, TensorData};
use kiln::infer::InferenceSession;
use kiln::onnx::OnnxModel;
use kiln::stream::{FrameStream, StreamProcessor};

use crate::error::{Result, ServeError};
use crate::tensor::{TensorSpec, Values};

/// One stream sequence's state (its gates' reference frames and its regions' last results),
/// shared by the request that carries it and the instance that runs its frame.
pub type SequenceState = Arc<Mutex<SequenceStream>>;

/// What a sequence remembers, by the kind of stream model.
#[derive(Debug)]
pub enum SequenceStream {
    /// A classifier over fixed regions ([`crate::sequence::StreamBackend`]).
    Regions(StreamProcessor),
    /// A per-frame model (masks, images, boxes) with temporal coherence and changed-tile
    /// regions ([`crate::per_frame::FrameBackend`]).
    Frames(FrameStream),
}

/// One model instance: runs a batch of samples.
pub trait Backend: Send {
    /// Runs `batch` samples (each input row-major `[batch, ..its dims]`, in the spec's
    /// order) and returns the backend's outputs, each row-major with `batch` rows.
    fn execute(&mut self, inputs: Vec<Values>, batch: usize) -> Result<Vec<Values>>;

    /// Runs `batch` frames of stream sequences, `states[i]` the sequence of frame `i` (only
    /// stream models, [`crate::sequence::StreamBackend`], take them).
    fn execute_sequences(
        &mut self,
        inputs: Vec<Values>,
        batch: usize,
        states: &[SequenceState],
    ) -> Result<Vec<Values>> {
        let _ = (inputs, batch, states);
        Err(ServeError::InvalidRequest(
            "this model is not a stream model; send requests without sequence parameters".into(),
        ))
    }
}

pub(crate) struct Identity {
    pub(crate) delay: Duration,
}

impl Backend for Identity {
    fn execute(&mut self, inputs: Vec<Values>, _batch: usize) -> Result<Vec<Values>> {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        Ok(inputs)
    }
}

pub(crate) struct Classifier {
    pub(crate) name: String,
    pub(crate) session: InferenceSession,
    pub(crate) device: Device,
    pub(crate) shape: [usize; 3],
}

impl Backend for Classifier {
    fn execute(&mut self, inputs: Vec<Values>, batch: usize) -> Result<Vec<Values>> {
        let fail = |message: String| ServeError::Inference {
            model: self.name.clone(),
            message,
        };
        let Some(Values::F32(pixels)) = inputs.into_iter().next() else {
            return Err(fail("the classifier takes FP32 images".into()));
        };
        let [c, h, w] = self.shape;
        let images: Tensor<4> =
            Tensor::from_data(TensorData::new(pixels, [batch, c, h, w]), &self.device);
        let logits = self
            .session
            .forward(images)
            .map_err(|e| fail(e.to_string()))?;
        let values = logits
            .into_data()
            .try_into_vec_as::<f32>()
            .map_err(|e| fail(format!("reading logits: {e:?}")))?;
        Ok(vec![Values::F32(values)])
    }
}

pub(crate) struct OnnxBackend {
    pub(crate) name: String,
    pub(crate) model: OnnxModel,
    pub(crate) inputs: Vec<TensorSpec>,
    /// `Some(1)`: the file fixes batch 1, so a batch runs one sample at a time.
    pub(crate) fixed_batch: Option<usize>,
}

impl OnnxBackend {
    fn fail(&self, message: String) -> ServeError {
        ServeError::Inference {
            model: self.name.clone(),
            message,
        }
    }

    /// The model's outputs for `batch` samples, with their shapes.
    pub(crate) fn run_data(&self, inputs: Vec<Values>, batch: usize) -> Result<Vec<TensorData>> {
        let data = inputs
            .into_iter()
            .zip(&self.inputs)
            .map(|(values, spec)| {
                let shape: Vec<usize> = std::iter::once(batch)
                    .chain(spec.dims.iter().copied())
                    .collect();
                match values {
                    Values::F32(v) => TensorData::new(v, shape),
                    Values::I64(v) => TensorData::new(v, shape),
                }
            })
            .collect();
        self.model
            .run_data(data)
            .map_err(|e| self.fail(e.to_string()))
    }

    fn run(&self, inputs: Vec<Values>, batch: usize) -> Result<Vec<Values>> {
        self.run_data(inputs, batch)?
            .into_iter()
            .map(|d| {
                if d.dtype().is_float() {
                    d.convert::<f32>().try_into_vec::<f32>().map(Values::F32)
                } else {
                    d.convert::<i64>().try_into_vec::<i64>().map(Values::I64)
                }
                .map_err(|e| self.fail(format!("reading an output: {e:?}")))
            })
            .collect()
    }
}

impl Backend for OnnxBackend {
    fn execute(&mut self, inputs: Vec<Values>, batch: usize) -> Result<Vec<Values>> {
        if self.fixed_batch.is_none() || batch == 1 {
            return self.run(inputs, batch);
        }
        let mut joined: Vec<Values> = Vec::new();
        for row in 0..batch {
            let one: Vec<Values> = inputs
                .iter()
                .zip(&self.inputs)
                .map(|(v, s)| v.slice(row * s.sample_len(), (row + 1) * s.sample_len()))
                .collect();
            let outs = self.run(one, 1)?;
            if joined.is_empty() {
                joined = outs;
            } else {
                for (all, part) in joined.iter_mut().zip(&outs) {
                    all.extend_from(part);
                }
            }
        }
        Ok(joined)
    }
}
