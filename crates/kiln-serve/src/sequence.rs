//! Stateful stream models: the KServe v2 sequence extension (Triton's sequence batcher) with
//! Kiln's real-time techniques ([`kiln::stream`]).
//!
//! A model whose `config.toml` has `[sequence_batching]` takes one frame per request, with the
//! `sequence_id`, `sequence_start` and `sequence_end` parameters. Each sequence keeps a
//! [`StreamProcessor`] (the gates' reference frames, the last result of every region):
//! temporal coherence reuses a whole frame's results, regions of interest run only the
//! regions that changed. The regions that must run, from all the frames of a dynamic batch
//! (many sequences), go through the wrapped classifier as **one** batch, so streams share the
//! model's throughput.
//!
//! ```text
//! admit (handler thread)          instance thread
//! ─────────────────────           ──────────────────────────────────────────────────
//! sequence table: start / known?  per frame: lock its sequence, gates → regions to run
//! → the sequence's state handle   all frames' regions → one inner batch → softmax top-1
//!   travels with the request      per frame: results → label / confidence / fresh [R]
//! ```
//!
//! Errors are per request and leave other sequences alone: a request without a sequence id,
//! a sequence id never started (or ended, or idled out), a start for an active id, a frame of
//! the wrong shape (the codec's shape check) — each an HTTP 400 / gRPC INVALID_ARGUMENT.
//! Frames of one sequence run in arrival order when the client sends each after the previous
//! answer (as tritonclient's sequence examples do); with one instance they always do.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use kiln::infer::{InferenceSession, load_graph};
use kiln::onnx::OnnxModel;
use kiln::stream::{
    Cascade, Frame, FrameClassifier, OnnxClassifier, Prediction, Route, Stage, StreamProcessor,
    crop_resize, top1_rows,
};

use crate::backend::{Backend, SequenceState, SequenceStream};
use crate::codec::{InferRequest, SequenceId};
use crate::config::{SequenceConfig, StageSource};
use crate::error::{Result, ServeError};
use crate::signature::{ModelSpec, Postprocess};
use crate::tensor::{DataType, TensorSpec, Values};

/// Locks a sequence's state; a panic elsewhere while it was held does not make it unusable
/// (the state is gates and results, valid after any partial update).
pub(crate) fn lock(state: &SequenceState) -> MutexGuard<'_, SequenceStream> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

struct Entry {
    state: SequenceState,
    last_seen: Instant,
}

/// A stream model's table of active sequences.
pub struct Sequences {
    model: String,
    config: SequenceConfig,
    table: Mutex<HashMap<SequenceId, Entry>>,
}

impl std::fmt::Debug for Sequences {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequences")
            .field("model", &self.model)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Sequences {
    /// An empty table for `model`.
    pub fn new(model: &str, config: SequenceConfig) -> Self {
        Sequences {
            model: model.to_string(),
            config,
            table: Mutex::new(HashMap::new()),
        }
    }

    /// Active sequences.
    pub fn active(&self) -> usize {
        self.table.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Checks a decoded request against the table and returns its sequence's state: a start
    /// creates it, an end removes it from the table (the request in flight keeps it), and
    /// sequences idle for longer than the configured time are dropped first.
    pub fn admit(&self, request: &InferRequest) -> Result<SequenceState> {
        let bad = |m: String| ServeError::InvalidRequest(m);
        let control = request.sequence.as_ref().ok_or_else(|| {
            bad(format!(
                "model `{}` is a stream model: every request needs the `sequence_id` parameter \
                 (and `sequence_start` = true on a sequence's first frame)",
                self.model
            ))
        })?;
        if request.batch != 1 {
            return Err(bad(format!(
                "model `{}` takes one frame per request (shape [1, {}]), got {}",
                self.model,
                self.config
                    .frame_dims
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                request.batch
            )));
        }
        let now = Instant::now();
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let idle = self.config.max_idle;
        let before = table.len();
        table.retain(|_, e| now.duration_since(e.last_seen) <= idle);
        if table.len() < before {
            tracing::info!(
                model = %self.model,
                dropped = before - table.len(),
                "sequences idle for over {idle:?} dropped"
            );
        }
        let id = &control.id;
        if control.start {
            if table.len() >= self.config.max_active && !table.contains_key(id) {
                return Err(ServeError::SequencesFull {
                    model: self.model.clone(),
                    limit: self.config.max_active,
                });
            }
            if table.contains_key(id) {
                return Err(bad(format!(
                    "sequence {id} of model `{}` is already active; end it (sequence_end) \
                     before starting it again, or use another id",
                    self.model
                )));
            }
            let state = match &self.config.per_frame {
                Some(p) => SequenceStream::Frames(
                    kiln::stream::FrameStream::for_output(p.techniques.clone(), p.kind, None)
                        .map_err(|e| bad(e.to_string()))?,
                ),
                None => SequenceStream::Regions(
                    StreamProcessor::new(
                        self.config.frame_dims,
                        &self.config.stream,
                        &Device::flex(),
                    )
                    .map_err(|e| bad(e.to_string()))?,
                ),
            };
            table.insert(
                id.clone(),
                Entry {
                    state: Arc::new(Mutex::new(state)),
                    last_seen: now,
                },
            );
        }
        let Some(entry) = table.get_mut(id) else {
            return Err(bad(format!(
                "sequence {id} of model `{}` is not active: it was never started, has ended, \
                 or was idle for over {idle:?}; send its first frame with sequence_start = true",
                self.model
            )));
        };
        entry.last_seen = now;
        let state = Arc::clone(&entry.state);
        if control.end {
            table.remove(id);
        }
        Ok(state)
    }
}

/// The wire signature of a stream model over a classifier with signature `inner`: the frame
/// in, and per region the class, its softmax confidence, and whether it was computed on this
/// frame (1) or reused (0).
pub fn stream_spec(name: &str, inner: &ModelSpec, config: &SequenceConfig) -> Result<ModelSpec> {
    let input = match inner.inputs.as_slice() {
        [one] if one.datatype == DataType::Fp32 && one.dims.len() == 3 => one,
        _ => {
            return Err(ServeError::Load {
                model: name.to_string(),
                message: "sequence_batching needs a classifier with one FP32 image input \
                          [C, H, W]; this model's inputs differ"
                    .into(),
            });
        }
    };
    if inner.outputs.first().map(|o| o.datatype) != Some(DataType::Fp32) {
        return Err(ServeError::Load {
            model: name.to_string(),
            message: "sequence_batching needs a classifier whose first output is FP32 logits"
                .into(),
        });
    }
    if input.dims[0] != config.frame_dims[0] {
        return Err(ServeError::Load {
            model: name.to_string(),
            message: format!(
                "frame_dims {:?} have {} channels but the model takes {}",
                config.frame_dims, config.frame_dims[0], input.dims[0]
            ),
        });
    }
    let regions = config.stream.regions.as_ref().map_or(1, Vec::len);
    let tensor = |name: &str, datatype| TensorSpec {
        name: name.into(),
        datatype,
        dims: vec![regions],
    };
    Ok(ModelSpec {
        platform: inner.platform.clone(),
        inputs: vec![TensorSpec {
            name: input.name.clone(),
            datatype: DataType::Fp32,
            dims: config.frame_dims.to_vec(),
        }],
        outputs: {
            let mut outputs = vec![
                tensor("label", DataType::Int64),
                tensor("confidence", DataType::Fp32),
                tensor("fresh", DataType::Int64),
            ];
            if !config.cascade.is_empty() {
                // Which cascade stage answered (the model is the last index); -1 = reused.
                outputs.push(tensor("exit", DataType::Int64));
            }
            outputs
        },
        postprocess: Postprocess::None,
    })
}

/// Loads a stream model's cascade stages on `device` (one copy per instance).
pub fn load_stages(
    name: &str,
    config: &SequenceConfig,
    device: &Device,
    kiln_kernels: bool,
) -> Result<Vec<Stage>> {
    let fail = |k: usize, message: String| ServeError::Load {
        model: name.to_string(),
        message: format!("sequence_batching.cascade[{k}]: {message}"),
    };
    config
        .cascade
        .iter()
        .enumerate()
        .map(|(k, stage)| {
            let model: Box<dyn FrameClassifier + Send> = match &stage.source {
                StageSource::Graph(path) => {
                    let graph = load_graph(path).map_err(|e| fail(k, e.to_string()))?;
                    Box::new(
                        InferenceSession::from_graph(graph, device)
                            .map_err(|e| fail(k, e.to_string()))?
                            .with_kiln_kernels(kiln_kernels),
                    )
                }
                StageSource::Onnx(path) => {
                    let model = OnnxModel::load(path, device)
                        .map_err(|e| fail(k, e.to_string()))?
                        .with_kiln_kernels(kiln_kernels);
                    Box::new(OnnxClassifier::new(model).map_err(|e| fail(k, e.to_string()))?)
                }
            };
            Ok(Stage {
                model,
                threshold: stage.threshold,
            })
        })
        .collect()
}

/// A server backend instance as the cascade's last stage: crops in as a tensor, the
/// backend's logits out as predictions.
struct BackendClassifier {
    inner: RefCell<Box<dyn Backend>>,
    input_dims: [usize; 3],
    classes: usize,
}

impl FrameClassifier for BackendClassifier {
    fn input_shape(&self) -> [usize; 3] {
        self.input_dims
    }

    fn classify(&self, images: Tensor<4>) -> kiln::Result<Vec<Prediction>> {
        let rows = images.dims()[0];
        let pixels = images
            .into_data()
            .try_into_vec_as::<f32>()
            .map_err(|e| kiln::KilnError::Stream(format!("reading crops: {e:?}")))?;
        let outputs = self
            .inner
            .borrow_mut()
            .execute(vec![Values::F32(pixels)], rows)
            .map_err(|e| kiln::KilnError::Stream(e.to_string()))?;
        match outputs.into_iter().next() {
            Some(Values::F32(logits)) => Ok(top1_rows(&logits, self.classes, Route::Full)),
            _ => Err(kiln::KilnError::Stream(
                "the classifier's first output is not FP32 logits".into(),
            )),
        }
    }
}

/// A classifier instance serving stream frames: gates per sequence, the changed regions of
/// every frame in a batch through the cascade (or the classifier alone) as one batch.
pub struct StreamBackend {
    model: String,
    /// The cascade's stages and, last, the classifier; its input shape is what each region is
    /// resized to, and a cascade with stages adds the `exit` output.
    cascade: Cascade,
    frame_dims: [usize; 3],
    device: Device,
}

impl StreamBackend {
    /// Wraps one classifier instance whose signature is `inner_spec`, with its own copies of
    /// the cascade's `stages`; regions are cropped on `device`.
    pub fn new(
        model: &str,
        inner: Box<dyn Backend>,
        inner_spec: &ModelSpec,
        config: &SequenceConfig,
        stages: Vec<Stage>,
        device: &Device,
    ) -> Result<Self> {
        let dims = &inner_spec.inputs[0].dims;
        let input_dims = [dims[0], dims[1], dims[2]];
        let last = BackendClassifier {
            inner: RefCell::new(inner),
            input_dims,
            classes: inner_spec.outputs[0].sample_len(),
        };
        let cascade = Cascade::new(stages, Box::new(last)).map_err(|e| ServeError::Load {
            model: model.to_string(),
            message: e.to_string(),
        })?;
        Ok(StreamBackend {
            model: model.to_string(),
            cascade,
            frame_dims: config.frame_dims,
            device: device.clone(),
        })
    }

    /// Runs the frames of `rows` (indices into `frames`) whose sequences are all different:
    /// gates, one cascade batch, results stored in `out` at each row.
    fn wave(
        &mut self,
        frames: &[Frame],
        states: &[SequenceState],
        rows: &[usize],
        out: &mut [Option<kiln::stream::FrameOutcome>],
    ) -> Result<()> {
        let mut locked: Vec<MutexGuard<'_, SequenceStream>> =
            rows.iter().map(|&r| lock(&states[r])).collect();
        let mut guards = locked
            .iter_mut()
            .map(|g| match &mut **g {
                SequenceStream::Regions(p) => Ok(p),
                SequenceStream::Frames(_) => Err(ServeError::InvalidRequest(
                    "a classifier stream model got a per-frame sequence's state".into(),
                )),
            })
            .collect::<Result<Vec<&mut StreamProcessor>>>()?;
        let mut runs = Vec::with_capacity(rows.len());
        let [c, h, w] = self.cascade.input_shape();
        let mut crops = Vec::new();
        for (guard, &r) in guards.iter_mut().zip(rows) {
            let run = guard.begin(&frames[r]).map_err(invalid)?;
            for &i in &run {
                crops.extend(crop_resize(&frames[r], guard.regions()[i], h, w).map_err(invalid)?);
            }
            runs.push(run);
        }
        let total: usize = runs.iter().map(Vec::len).sum();
        let predictions = if total == 0 {
            Ok(Vec::new())
        } else {
            let batch: Tensor<4> =
                Tensor::from_data(TensorData::new(crops, [total, c, h, w]), &self.device);
            self.cascade.classify(batch)
        };
        let predictions = match predictions {
            Ok(p) => p,
            Err(e) => {
                for (guard, run) in guards.iter_mut().zip(&runs) {
                    guard.forget(run);
                }
                return Err(ServeError::Inference {
                    model: self.model.clone(),
                    message: e.to_string(),
                });
            }
        };
        let mut next = predictions.into_iter();
        for ((guard, run), &r) in guards.iter_mut().zip(&runs).zip(rows) {
            let mine: Vec<_> = next.by_ref().take(run.len()).collect();
            out[r] = Some(guard.finish(run, mine).map_err(invalid)?);
        }
        Ok(())
    }
}

fn invalid(e: kiln::KilnError) -> ServeError {
    ServeError::InvalidRequest(e.to_string())
}

impl Backend for StreamBackend {
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
        let frames = pixels
            .chunks_exact(len)
            .map(|p| Frame::new(self.frame_dims, p.to_vec()))
            .collect::<kiln::Result<Vec<_>>>()
            .map_err(invalid)?;
        // Frames of distinct sequences share one inner batch; a second frame of a sequence
        // already in the wave waits for the next, as it needs the first one's results.
        let mut out = vec![None; batch];
        let mut pending: Vec<usize> = (0..batch).collect();
        while !pending.is_empty() {
            let mut wave = Vec::new();
            let mut later = Vec::new();
            for r in pending {
                if wave
                    .iter()
                    .any(|&q: &usize| Arc::ptr_eq(&states[q], &states[r]))
                {
                    later.push(r);
                } else {
                    wave.push(r);
                }
            }
            self.wave(&frames, states, &wave, &mut out)?;
            pending = later;
        }
        let mut label = Vec::new();
        let mut confidence = Vec::new();
        let mut fresh = Vec::new();
        let mut exit = Vec::new();
        for outcome in out.into_iter().flatten() {
            for region in outcome.regions {
                label.push(region.prediction.class as i64);
                confidence.push(region.prediction.confidence);
                fresh.push(i64::from(region.fresh));
                exit.push(match (region.fresh, region.prediction.route) {
                    (true, Route::Exit(k)) => k as i64,
                    _ => -1,
                });
            }
        }
        let mut outputs = vec![
            Values::I64(label),
            Values::F32(confidence),
            Values::I64(fresh),
        ];
        if !self.cascade.is_empty() {
            outputs.push(Values::I64(exit));
        }
        Ok(outputs)
    }
}
