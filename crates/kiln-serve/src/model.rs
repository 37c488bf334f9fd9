//! What executes a batch: a [`Backend`] per model instance, and the model's wire signature.

use std::time::Duration;

use burn::tensor::{Device, Tensor, TensorData};
use kiln::infer::{InferenceSession, Pass, import_onnx, load_graph, load_model, lower, run_passes};
use kiln::zoo::ModelKind;

use crate::config::BackendConfig;
use crate::error::{Result, ServeError};
use crate::tensor::{DataType, NamedTensor, TensorSpec, Values};

/// A model's signature as the protocol's metadata and config endpoints report it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// Triton "platform" string.
    pub platform: String,
    /// The one input.
    pub input: TensorSpec,
    /// Outputs, in the order they are returned.
    pub outputs: Vec<TensorSpec>,
    /// What the postprocess stage derives from the backend's raw output.
    pub postprocess: Postprocess,
}

/// Work the postprocess stage does per request after the batch is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Postprocess {
    /// Outputs are the backend's outputs unchanged.
    None,
    /// A classifier: the backend returns logits; `label` (INT64 `[1]`) is their arg-max.
    ArgmaxLabel,
}

/// One model instance: runs a batch of samples.
pub trait Backend: Send {
    /// Runs `batch` samples (`input` is row-major `[batch, ..input dims]`) and returns the
    /// backend's outputs, each row-major with `batch` rows.
    fn execute(&mut self, input: Values, batch: usize) -> Result<Vec<Values>>;
}

/// Builds `instances` copies of the configured backend and reports the model's signature.
/// Weights are read, lowered and optimized once; each instance gets its own session over a
/// copy of the resulting graph.
pub fn build_backends(
    name: &str,
    config: &BackendConfig,
    instances: usize,
) -> Result<(Vec<Box<dyn Backend>>, ModelSpec)> {
    let fail = |e: kiln::KilnError| ServeError::Load {
        model: name.to_string(),
        message: e.to_string(),
    };
    let graph = match config {
        BackendConfig::Identity {
            dims,
            datatype,
            execute_delay,
        } => {
            let datatype = DataType::parse(datatype)?;
            let tensor = |name: &str| TensorSpec {
                name: name.into(),
                datatype,
                dims: dims.clone(),
            };
            let spec = ModelSpec {
                platform: "kiln_identity".into(),
                input: tensor("INPUT0"),
                outputs: vec![tensor("OUTPUT0")],
                postprocess: Postprocess::None,
            };
            let backends = (0..instances)
                .map(|_| {
                    Box::new(Identity {
                        delay: *execute_delay,
                    }) as Box<dyn Backend>
                })
                .collect();
            return Ok((backends, spec));
        }
        BackendConfig::Zoo {
            model,
            checkpoint,
            passes,
            input_shape,
        } => {
            let kind = ModelKind::from_name(model).map_err(fail)?;
            let passes = Pass::parse_list(passes).map_err(fail)?;
            let zoo =
                load_model(kind, input_shape[0], checkpoint, &Device::flex()).map_err(fail)?;
            let mut graph = lower(&zoo, kind.name(), *input_shape).map_err(fail)?;
            run_passes(&mut graph, &passes).map_err(fail)?;
            graph
        }
        BackendConfig::Onnx { path, passes } => {
            let passes = Pass::parse_list(passes).map_err(fail)?;
            let bytes = std::fs::read(path).map_err(|e| ServeError::Load {
                model: name.to_string(),
                message: format!("cannot read {}: {e}", path.display()),
            })?;
            let mut graph = import_onnx(&bytes, name).map_err(fail)?;
            run_passes(&mut graph, &passes).map_err(fail)?;
            graph
        }
        BackendConfig::Graph { path } => load_graph(path).map_err(fail)?,
    };
    let mut backends = Vec::with_capacity(instances);
    let mut spec = None;
    for _ in 0..instances {
        let device = Device::flex();
        let session = InferenceSession::from_graph(graph.clone(), &device).map_err(fail)?;
        let (backend, s) = classifier(name, session, device)?;
        backends.push(backend);
        spec = Some(s);
    }
    let spec = spec.ok_or_else(|| ServeError::Config {
        path: name.into(),
        message: "instances must be at least 1".into(),
    })?;
    Ok((backends, spec))
}

/// A Kiln inference session serving `images` → `logits` + `label`. One warm-up batch finds
/// the class count (and pays first-call costs before the first request).
fn classifier(
    name: &str,
    session: InferenceSession,
    device: Device,
) -> Result<(Box<dyn Backend>, ModelSpec)> {
    let shape = session.graph().input_shape;
    let mut backend = Classifier {
        name: name.to_string(),
        session,
        device,
        shape,
    };
    let probe = backend.execute(Values::F32(vec![0.0; shape.iter().product()]), 1)?;
    let classes = probe[0].len();
    let spec = ModelSpec {
        platform: "kiln".into(),
        input: TensorSpec {
            name: "images".into(),
            datatype: DataType::Fp32,
            dims: shape.to_vec(),
        },
        outputs: vec![
            TensorSpec {
                name: "logits".into(),
                datatype: DataType::Fp32,
                dims: vec![classes],
            },
            TensorSpec {
                name: "label".into(),
                datatype: DataType::Int64,
                dims: vec![1],
            },
        ],
        postprocess: Postprocess::ArgmaxLabel,
    };
    Ok((Box::new(backend), spec))
}

struct Identity {
    delay: Duration,
}

impl Backend for Identity {
    fn execute(&mut self, input: Values, _batch: usize) -> Result<Vec<Values>> {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        Ok(vec![input])
    }
}

struct Classifier {
    name: String,
    session: InferenceSession,
    device: Device,
    shape: [usize; 3],
}

impl Backend for Classifier {
    fn execute(&mut self, input: Values, batch: usize) -> Result<Vec<Values>> {
        let fail = |message: String| ServeError::Inference {
            model: self.name.clone(),
            message,
        };
        let Values::F32(pixels) = input else {
            return Err(fail("the classifier takes FP32 images".into()));
        };
        let [c, h, w] = self.shape;
        let images: Tensor<4> = Tensor::from_data(
            TensorData::new(pixels.clone(), [batch, c, h, w]),
            &self.device,
        );
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

/// Applies the model's postprocessing to one request's slice of the raw outputs.
pub fn postprocess(spec: &ModelSpec, batch: usize, raw: Vec<Values>) -> Vec<NamedTensor> {
    let mut out: Vec<NamedTensor> = spec
        .outputs
        .iter()
        .zip(raw)
        .map(|(s, values)| NamedTensor {
            name: s.name.clone(),
            shape: std::iter::once(batch)
                .chain(s.dims.iter().copied())
                .collect(),
            values,
        })
        .collect();
    if spec.postprocess == Postprocess::ArgmaxLabel
        && let Some(Values::F32(logits)) = out.first().map(|t| &t.values)
    {
        let classes = spec.outputs[0].sample_len().max(1);
        let labels = logits
            .chunks(classes)
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| {
                        if v > best.1 { (i, v) } else { best }
                    })
                    .0 as i64
            })
            .collect();
        out.push(NamedTensor {
            name: spec.outputs[1].name.clone(),
            shape: vec![batch, 1],
            values: Values::I64(labels),
        });
    }
    out
}
