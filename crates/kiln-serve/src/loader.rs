//! Builds a model's instances from its configuration: the device each runs on, the weights
//! read, lowered and optimized once, one [`Backend`] per instance, and the signature the
//! server reports.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use burn::tensor::Device;
use kiln::infer::{InferenceSession, Pass, load_graph, lower, run_passes};
use kiln::onnx::{OnnxModel, OnnxPass, Port, ValueKind};
use kiln::plan::Hardware;
use kiln::zoo::{ModelKind, load_model};

use crate::backend::{Backend, Classifier, Identity, OnnxBackend};
use crate::config::{BackendConfig, InstanceKind, ModelConfig};
use crate::error::{Result, ServeError};
use crate::signature::{ModelSpec, Postprocess};
use crate::tensor::{DataType, TensorSpec, Values};

/// The device for a model's instances of `kind` on this machine (`KIND_AUTO`: a GPU when
/// this kiln is built with CUDA and a driver loads, else the CPU), with the kind it resolved
/// to; a GPU this build or machine lacks is a load error that says why.
pub fn instance_device(name: &str, kind: InstanceKind) -> Result<(InstanceKind, Device)> {
    use kiln::plan::Backend;
    let hardware = Hardware::probe();
    let backend = match kind {
        InstanceKind::Auto => hardware.best_backend(),
        InstanceKind::Cpu => Backend::Flex,
        InstanceKind::Gpu => Backend::Cuda,
    };
    hardware
        .ensure_runs(backend, &format!("kind = \"{}\"", kind.name()))
        .map_err(|e| ServeError::Load {
            model: name.to_string(),
            message: e.to_string(),
        })?;
    let resolved = match backend {
        Backend::Flex => InstanceKind::Cpu,
        Backend::Cuda => InstanceKind::Gpu,
    };
    Ok((resolved, backend.device()))
}

/// Builds `config.instances` copies of the configured backend on `device` and reports the
/// model's signature. Weights are read, lowered and optimized once; each instance gets its
/// own session over a copy of the resulting graph, running on Kiln's kernels if
/// `config.kiln_kernels`.
pub fn build_backends(
    name: &str,
    config: &ModelConfig,
    device: &Device,
) -> Result<(Vec<Box<dyn Backend>>, ModelSpec)> {
    let Some(sequence) = &config.sequence else {
        return classifier_backends(name, config, device);
    };
    if let Some(per_frame) = &sequence.per_frame {
        // A per-frame model: the ONNX file's instances, each running its sequences' frames
        // through their FrameStreams.
        let BackendConfig::Onnx { path, .. } = &config.backend else {
            return Err(ServeError::Load {
                model: name.to_string(),
                message: "sequence_batching.output needs backend = \"onnx\" (a per-frame \
                          ONNX model with dynamic height and width)"
                    .into(),
            });
        };
        return crate::per_frame::frame_backends(
            name,
            path,
            sequence,
            per_frame,
            config.instances,
            device,
            config.kiln_kernels,
        );
    }
    // A stream model: the classifier's instances, each wrapped with the sequences' gates and
    // its own copies of the cascade's stages.
    let (inner, inner_spec) = classifier_backends(name, config, device)?;
    let spec = crate::sequence::stream_spec(name, &inner_spec, sequence)?;
    let backends = inner
        .into_iter()
        .map(|b| {
            let stages = crate::sequence::load_stages(name, sequence, device, config.kiln_kernels)?;
            let backend = crate::sequence::StreamBackend::new(
                name,
                b,
                &inner_spec,
                sequence,
                stages,
                device,
            )?;
            Ok(Box::new(backend) as Box<dyn Backend>)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((backends, spec))
}

/// [`build_backends`] for the model as a plain classifier (no sequence state).
fn classifier_backends(
    name: &str,
    config: &ModelConfig,
    device: &Device,
) -> Result<(Vec<Box<dyn Backend>>, ModelSpec)> {
    let (instances, kiln_kernels) = (config.instances, config.kiln_kernels);
    let fail = |e: kiln::KilnError| ServeError::Load {
        model: name.to_string(),
        message: e.to_string(),
    };
    let graph = match &config.backend {
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
                inputs: vec![tensor("INPUT0")],
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
            let zoo = load_model(kind, input_shape[0], checkpoint, device).map_err(fail)?;
            let mut graph = lower(&zoo, kind.name(), *input_shape).map_err(fail)?;
            run_passes(&mut graph, &passes).map_err(fail)?;
            graph
        }
        BackendConfig::Onnx {
            path,
            passes,
            input_dims,
            int8_layers,
            winograd_layers,
        } => {
            let set = |l: &Option<Vec<String>>| -> Option<BTreeSet<String>> {
                l.as_ref().map(|l| l.iter().cloned().collect())
            };
            let (int8_only, winograd_only) = (set(int8_layers), set(winograd_layers));
            let onnx = OnnxLoad {
                path,
                passes,
                input_dims,
                int8_only: int8_only.as_ref(),
                winograd_only: winograd_only.as_ref(),
            };
            return onnx_backends(name, &onnx, config, device);
        }
        BackendConfig::Graph { path } => load_graph(path).map_err(fail)?,
    };
    let mut backends = Vec::with_capacity(instances);
    let mut spec = None;
    for _ in 0..instances {
        let session = InferenceSession::from_graph(graph.clone(), device)
            .map_err(fail)?
            .with_kiln_kernels(kiln_kernels);
        let (backend, s) = classifier(name, session, device.clone())?;
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
    let probe = backend.execute(vec![Values::F32(vec![0.0; shape.iter().product()])], 1)?;
    let classes = probe[0].len();
    let spec = ModelSpec {
        platform: "kiln".into(),
        inputs: vec![TensorSpec {
            name: "images".into(),
            datatype: DataType::Fp32,
            dims: shape.to_vec(),
        }],
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

/// `config.instances` copies of the ONNX model in `path`, each loaded through `kiln::onnx`
/// with `passes` applied and `config.kiln_kernels`. The signature comes from the file: inputs
/// as declared (their non-batch dynamic axes fixed by `input_dims`), outputs measured by one
/// warm-up batch of zeros.
/// What an ONNX model directory's config asks the loader for.
struct OnnxLoad<'a> {
    path: &'a Path,
    passes: &'a str,
    input_dims: &'a BTreeMap<String, Vec<usize>>,
    /// The `int8_layers` key: the int8 pass on these layers only.
    int8_only: Option<&'a BTreeSet<String>>,
    /// The `winograd_layers` key: Winograd on these layers only.
    winograd_only: Option<&'a BTreeSet<String>>,
}

fn onnx_backends(
    name: &str,
    onnx: &OnnxLoad,
    config: &ModelConfig,
    device: &Device,
) -> Result<(Vec<Box<dyn Backend>>, ModelSpec)> {
    let (path, passes, input_dims) = (onnx.path, onnx.passes, onnx.input_dims);
    let (instances, kiln_kernels) = (config.instances, config.kiln_kernels);
    let load_error = |message: String| ServeError::Load {
        model: name.to_string(),
        message,
    };
    let passes = OnnxPass::parse_list(passes).map_err(|e| load_error(e.to_string()))?;
    let bytes = std::fs::read(path)
        .map_err(|e| load_error(format!("cannot read {}: {e}", path.display())))?;
    let mut backends: Vec<Box<dyn Backend>> = Vec::with_capacity(instances);
    let mut spec = None;
    for _ in 0..instances.max(1) {
        let mut model = OnnxModel::from_bytes(&bytes, name, device)
            .map_err(|e| load_error(e.to_string()))?
            .with_kiln_kernels(kiln_kernels);
        for &pass in &passes {
            let only = match pass {
                OnnxPass::Int8 => onnx.int8_only,
                OnnxPass::Winograd => onnx.winograd_only,
                OnnxPass::Fold | OnnxPass::ChannelsLast => None,
            };
            let report = model
                .apply_to(pass, only)
                .map_err(|e| load_error(e.to_string()))?;
            tracing::info!(model = name, pass = pass.name(), changes = ?report.changes, "pass applied");
        }
        let (inputs, fixed_batch) = onnx_inputs(model.inputs(), input_dims).map_err(load_error)?;
        let backend = OnnxBackend {
            name: name.to_string(),
            model,
            inputs: inputs.clone(),
            fixed_batch,
        };
        if spec.is_none() {
            let probe: Vec<Values> = inputs
                .iter()
                .map(|i| Values::with_len(i.datatype, i.sample_len()))
                .collect();
            // Dynamic output axes (a segmentation map's size) are what the probe makes.
            let outs = backend.run_data(probe, 1)?;
            let outputs = backend
                .model
                .outputs()
                .iter()
                .zip(&outs)
                .map(|(port, data)| TensorSpec {
                    name: port.name.clone(),
                    datatype: if data.dtype().is_float() {
                        DataType::Fp32
                    } else {
                        DataType::Int64
                    },
                    dims: data.shape().iter().skip(1).copied().collect(),
                })
                .collect();
            spec = Some(ModelSpec {
                platform: "kiln_onnx".into(),
                inputs,
                outputs,
                postprocess: Postprocess::None,
            });
        }
        backends.push(Box::new(backend));
    }
    let spec = spec.ok_or_else(|| load_error("instances must be at least 1".into()))?;
    Ok((backends, spec))
}

/// The server's view of an ONNX model's inputs: the first axis is the batch; other dynamic
/// axes must be fixed in the config. Returns the specs and the batch the file fixes, if any.
fn onnx_inputs(
    ports: &[Port],
    input_dims: &BTreeMap<String, Vec<usize>>,
) -> std::result::Result<(Vec<TensorSpec>, Option<usize>), String> {
    if let Some(stray) = input_dims
        .keys()
        .find(|k| !ports.iter().any(|p| &p.name == *k))
    {
        return Err(format!(
            "input_dims names `{stray}`, which the model does not have; its inputs are {:?}",
            ports.iter().map(|p| p.name.as_str()).collect::<Vec<_>>()
        ));
    }
    let mut fixed_batch = None;
    let mut specs = Vec::with_capacity(ports.len());
    for port in ports {
        let datatype = match port.kind {
            ValueKind::Float => DataType::Fp32,
            ValueKind::Int => DataType::Int64,
            ValueKind::Bool => {
                return Err(format!(
                    "input `{}` is {}; kiln-serve takes FP32 and INT64 inputs",
                    port.name, port.dtype
                ));
            }
        };
        let Some((batch, rest)) = port.dims.split_first() else {
            return Err(format!(
                "input `{}` is a scalar; kiln-serve needs a batch axis first",
                port.name
            ));
        };
        if let Some(b) = batch {
            fixed_batch = Some(*b);
        }
        let dims: Vec<usize> = match input_dims.get(&port.name) {
            Some(given) => {
                let fits = given.len() == rest.len()
                    && given
                        .iter()
                        .zip(rest)
                        .all(|(g, r)| r.is_none_or(|r| r == *g));
                if !fits || given.contains(&0) {
                    return Err(format!(
                        "input_dims for `{}` is {given:?}; the model declares {} after the batch",
                        port.name,
                        kiln::onnx::show_dims(rest)
                    ));
                }
                given.clone()
            }
            None => rest
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    d.ok_or_else(|| {
                        format!(
                            "input `{}` has a dynamic axis {} ({}); give its size in config.toml, \
                             e.g. input_dims = {{ {} = [..] }}, since the server batches \
                             fixed-shape samples",
                            port.name,
                            i + 1,
                            kiln::onnx::show_dims(&port.dims),
                            port.name
                        )
                    })
                })
                .collect::<std::result::Result<_, _>>()?,
        };
        specs.push(TensorSpec {
            name: port.name.clone(),
            datatype,
            dims,
        });
    }
    match fixed_batch {
        Some(b) if b != 1 => Err(format!(
            "the model's batch axis is fixed at {b}; re-export it with a dynamic batch \
             (torch.onnx.export(..., dynamic_axes={{name: {{0: \"batch\"}}}})) or with batch 1"
        )),
        _ => Ok((specs, fixed_batch)),
    }
}
