//! Per-frame stream models: an ONNX segmenter, enhancer or detector served over the KServe
//! sequence extension, each sequence a [`FrameStream`] with Kiln's video techniques.
//!
//! A model whose `[sequence_batching]` says `output = "mask" | "image" | "boxes"` takes one
//! frame `[C, H, W]` per request (the sequence parameters as for a classifier stream). Per
//! sequence, temporal coherence reuses the last result while no tile of the frame's
//! thumbnail changed (`frame_gate`), and regions of interest (`tiles`) run the model only on
//! each group of changed tiles, pasting the crop's mask, image or boxes into the sequence's
//! last result. The answer is the whole frame's result plus how it was made:
//!
//! | output | type | shape per frame |
//! |---|---|---|
//! | `mask` | INT64 | `[H', W']`, the class of each pixel of the model's output |
//! | `image` | FP32 | `[C', H', W']` |
//! | `boxes` | FP32 | `[max_detections, 6]`: x1, y1, x2, y2, score, class; zero rows after `count` |
//! | `count` | INT64 | `[1]`: detections in `boxes` |
//! | `path` | INT64 | `[1]`: 0 reused, 1 partial (crops), 2 full |
//! | `pixels_run` | INT64 | `[1]`: input pixels the model ran on for this frame |
//!
//! The output's size is read off one run of the model on a zero frame at load.

use std::sync::MutexGuard;

use burn::tensor::Device;
use kiln::onnx::OnnxModel;
use kiln::stream::{
    Frame, FrameModel, FramePath, FrameResult, FrameStep, OnnxFrameModel, OutputKind, Thumb,
};

use crate::backend::{Backend, SequenceState, SequenceStream};
use crate::config::{PerFrameConfig, SequenceConfig};
use crate::error::{Result, ServeError};
use crate::sequence::lock;
use crate::signature::{ModelSpec, Postprocess};
use crate::tensor::{DataType, TensorSpec, Values};

/// One instance of a per-frame stream model.
pub struct FrameBackend {
    name: String,
    model: OnnxFrameModel,
    frame_dims: [usize; 3],
    config: PerFrameConfig,
}

/// Loads `instances` copies of the ONNX model at `path` as per-frame stream backends for
/// `sequence`, and the signature they serve. An error names what does not fit: an output
/// read as another kind, a fixed-size model with tiles, a model that fails on a frame of
/// `frame_dims`.
pub fn frame_backends(
    name: &str,
    path: &std::path::Path,
    sequence: &SequenceConfig,
    per_frame: &PerFrameConfig,
    instances: usize,
    device: &Device,
    kiln_kernels: bool,
) -> Result<(Vec<Box<dyn Backend>>, ModelSpec)> {
    let fail = |message: String| ServeError::Load {
        model: name.to_string(),
        message,
    };
    let mut backends: Vec<Box<dyn Backend>> = Vec::with_capacity(instances);
    let mut spec = None;
    for _ in 0..instances.max(1) {
        let onnx = OnnxModel::load(path, device)
            .map_err(|e| fail(e.to_string()))?
            .with_kiln_kernels(kiln_kernels);
        let input = onnx
            .inputs()
            .first()
            .map(|p| p.name.clone())
            .unwrap_or_else(|| "frames".into());
        let model =
            OnnxFrameModel::new(onnx, Some(per_frame.kind)).map_err(|e| fail(e.to_string()))?;
        per_frame
            .techniques
            .check(&model)
            .map_err(|e| fail(format!("sequence_batching: {e}")))?;
        if model.channels() != sequence.frame_dims[0] {
            return Err(fail(format!(
                "frame_dims {:?} have {} channels but the model takes {}",
                sequence.frame_dims,
                sequence.frame_dims[0],
                model.channels()
            )));
        }
        if spec.is_none() {
            let [c, h, w] = sequence.frame_dims;
            let probe = Frame::new(sequence.frame_dims, vec![0.0; c * h * w])
                .map_err(|e| fail(e.to_string()))?;
            let result = model
                .run(&[&probe], false)
                .map_err(|e| fail(format!("running a {c}×{h}×{w} frame: {e}")))?
                .into_iter()
                .next()
                .ok_or_else(|| fail("the model returned no result".into()))?;
            spec = Some(frame_spec(&input, sequence.frame_dims, &result, per_frame));
        }
        backends.push(Box::new(FrameBackend {
            name: name.to_string(),
            model,
            frame_dims: sequence.frame_dims,
            config: per_frame.clone(),
        }));
    }
    let spec = spec.ok_or_else(|| fail("no instances".into()))?;
    Ok((backends, spec))
}

/// The wire signature: the frame in; the result (its size as `probe` came out) and how it
/// was made out.
fn frame_spec(
    input: &str,
    frame_dims: [usize; 3],
    probe: &FrameResult,
    config: &PerFrameConfig,
) -> ModelSpec {
    let tensor = |name: &str, datatype, dims: Vec<usize>| TensorSpec {
        name: name.into(),
        datatype,
        dims,
    };
    let mut outputs = match probe {
        FrameResult::Mask { height, width, .. } => {
            vec![tensor("mask", DataType::Int64, vec![*height, *width])]
        }
        FrameResult::Image { shape, .. } => vec![tensor("image", DataType::Fp32, shape.to_vec())],
        FrameResult::Boxes(_) => vec![
            tensor("boxes", DataType::Fp32, vec![config.max_detections, 6]),
            tensor("count", DataType::Int64, vec![1]),
        ],
        FrameResult::Class(_) => vec![tensor("label", DataType::Int64, vec![1])],
    };
    outputs.push(tensor("path", DataType::Int64, vec![1]));
    outputs.push(tensor("pixels_run", DataType::Int64, vec![1]));
    ModelSpec {
        platform: "onnxruntime_onnx".into(),
        inputs: vec![tensor(input, DataType::Fp32, frame_dims.to_vec())],
        outputs,
        postprocess: Postprocess::None,
    }
}

impl FrameBackend {
    /// One frame of one sequence through its stream.
    fn step(&self, frame: &Frame, state: &SequenceState) -> Result<FrameStep> {
        let mut guard: MutexGuard<'_, SequenceStream> = lock(state);
        let SequenceStream::Frames(stream) = &mut *guard else {
            return Err(ServeError::InvalidRequest(
                "a per-frame stream model got a classifier sequence's state".into(),
            ));
        };
        let thumb = Thumb::from_frame(frame, self.config.thumb_block);
        stream
            .process(frame, &thumb, &self.model)
            .map_err(|e| ServeError::Inference {
                model: self.name.clone(),
                message: e.to_string(),
            })
    }
}

impl Backend for FrameBackend {
    fn execute(&mut self, _inputs: Vec<Values>, _batch: usize) -> Result<Vec<Values>> {
        Err(ServeError::InvalidRequest(
            "a stream model runs frames of sequences only".into(),
        ))
    }

    fn execute_sequences(
        &mut self,
        inputs: Vec<Values>,
        batch: usize,
        states: &[SequenceState],
    ) -> Result<Vec<Values>> {
        let Some(Values::F32(pixels)) = inputs.into_iter().next() else {
            return Err(ServeError::InvalidRequest(
                "a stream model takes FP32 frames".into(),
            ));
        };
        let len: usize = self.frame_dims.iter().product();
        if states.len() != batch || pixels.len() != batch * len {
            return Err(ServeError::InvalidRequest(format!(
                "{batch} frames need {batch} sequence states and {} values",
                batch * len
            )));
        }
        // Frames run in arrival order: a sequence's second frame in one batch needs its
        // first one's result.
        let mut results = Vec::with_capacity(batch);
        for (p, state) in pixels.chunks_exact(len).zip(states) {
            let frame = Frame::new(self.frame_dims, p.to_vec())
                .map_err(|e| ServeError::InvalidRequest(e.to_string()))?;
            results.push(self.step(&frame, state)?);
        }
        encode(&results, self.model.kind(), self.config.max_detections)
    }
}

/// The steps' results as the signature's outputs, `batch` rows each.
fn encode(steps: &[FrameStep], kind: OutputKind, max_detections: usize) -> Result<Vec<Values>> {
    let mut main_i = Vec::new();
    let mut main_f = Vec::new();
    let mut count = Vec::new();
    let mut path = Vec::new();
    let mut pixels = Vec::new();
    for s in steps {
        match (&s.result, kind) {
            (FrameResult::Mask { labels, .. }, OutputKind::Mask) => {
                main_i.extend(labels.iter().map(|&l| i64::from(l)));
            }
            (FrameResult::Image { values, .. }, OutputKind::Image) => {
                main_f.extend_from_slice(values);
            }
            (FrameResult::Boxes(all), OutputKind::Boxes) => {
                let mut sorted = all.clone();
                sorted.sort_by(|a, b| b.score.total_cmp(&a.score));
                sorted.truncate(max_detections);
                count.push(sorted.len() as i64);
                for d in &sorted {
                    main_f.extend_from_slice(&d.bbox);
                    main_f.extend([d.score, d.class as f32]);
                }
                main_f.extend(std::iter::repeat_n(
                    0.0,
                    (max_detections - sorted.len()) * 6,
                ));
            }
            _ => {
                return Err(ServeError::InvalidRequest(
                    "the model's result is not of its configured kind".into(),
                ));
            }
        }
        path.push(match s.path {
            FramePath::Reused => 0,
            FramePath::Partial => 1,
            FramePath::Full => 2,
        });
        pixels.push(s.pixels_run as i64);
    }
    let mut out = match kind {
        OutputKind::Mask => vec![Values::I64(main_i)],
        OutputKind::Boxes => vec![Values::F32(main_f), Values::I64(count)],
        _ => vec![Values::F32(main_f)],
    };
    out.push(Values::I64(path));
    out.push(Values::I64(pixels));
    Ok(out)
}
