//! Requests and responses between the wire (HTTP/JSON, gRPC/protobuf) and the pipeline.
//!
//! Decoding and encoding run on the pipeline's pre- and postprocess threads, not on the
//! async runtime: the handlers only move bytes.

pub mod control;
pub mod grpc;
pub mod http;

use crate::error::{Result, ServeError};
use crate::proto::pb;
use crate::signature::ModelSpec;
use crate::tensor::{DataType, NamedTensor, TensorSpec, Values};

/// A request as it arrived, not yet decoded.
#[derive(Debug)]
pub enum WireRequest {
    /// HTTP/REST: the body and the `Inference-Header-Content-Length` header (binary extension).
    Http {
        /// Request body.
        body: axum::body::Bytes,
        /// Length of the JSON header when binary tensor data follows it.
        header_len: Option<usize>,
    },
    /// gRPC `ModelInfer`.
    Grpc(Box<pb::ModelInferRequest>),
}

impl WireRequest {
    /// Bytes of payload to decode (decides whether decoding is worth a thread hand-off).
    pub fn size(&self) -> usize {
        match self {
            WireRequest::Http { body, .. } => body.len(),
            WireRequest::Grpc(r) => {
                let raw: usize = r.raw_input_contents.iter().map(Vec::len).sum();
                let typed: usize = r
                    .inputs
                    .iter()
                    .filter_map(|i| i.contents.as_ref())
                    .map(|c| 4 * c.fp32_contents.len() + 8 * c.int64_contents.len())
                    .sum();
                raw + typed
            }
        }
    }
}

/// A response ready for the wire.
#[derive(Debug)]
pub enum Encoded {
    /// HTTP body (JSON, then binary outputs when `header_len` is set).
    Http {
        /// Response body.
        body: Vec<u8>,
        /// Length of the JSON part when binary data follows.
        header_len: Option<usize>,
    },
    /// gRPC `ModelInferResponse`.
    Grpc(Box<pb::ModelInferResponse>),
}

/// How the response is to be encoded.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// HTTP; `binary_default` is the request's `binary_data_output` parameter.
    Http {
        /// Outputs without their own `binary_data` parameter use this.
        binary_default: bool,
    },
    /// gRPC (outputs always in `raw_output_contents`).
    Grpc,
}

/// An output the client asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestedOutput {
    /// Output name (checked against the model).
    pub name: String,
    /// HTTP `binary_data` parameter, if given.
    pub binary: Option<bool>,
}

/// A decoded, validated inference request.
#[derive(Debug, Clone, PartialEq)]
pub struct InferRequest {
    /// Client's request id, echoed back.
    pub id: String,
    /// Samples in this request (its first dimension).
    pub batch: usize,
    /// The inputs in the model's order, each row-major `[batch, ..dims]`.
    pub inputs: Vec<Values>,
    /// Outputs to return, in order; empty = all.
    pub outputs: Vec<RequestedOutput>,
    /// Response encoding.
    pub format: ResponseFormat,
    /// The request's own queue timeout (protocol parameter `timeout`, microseconds).
    pub timeout: Option<std::time::Duration>,
    /// The sequence extension's parameters, when the request belongs to a sequence.
    pub sequence: Option<SequenceControl>,
}

/// A sequence's id: Triton takes an unsigned integer (0 = none) or a string.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SequenceId {
    /// A non-zero integer id.
    Number(u64),
    /// A non-empty string id.
    Text(String),
}

impl std::fmt::Display for SequenceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SequenceId::Number(n) => write!(f, "{n}"),
            SequenceId::Text(t) => write!(f, "{t:?}"),
        }
    }
}

/// The KServe sequence extension's parameters of one request (`sequence_id`,
/// `sequence_start`, `sequence_end`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceControl {
    /// Which sequence.
    pub id: SequenceId,
    /// The first request of the sequence.
    pub start: bool,
    /// The last request of the sequence.
    pub end: bool,
}

/// A request parameter's value, as either wire format gives it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Param {
    Bool(bool),
    Int(i64),
    Text(String),
    /// Any other kind (a float, an object), described for the error message.
    Other(String),
}

/// Reads the sequence parameters from `get` (a request's parameter lookup); `None` when the
/// request has none, an error naming the parameter when one has the wrong kind or value.
pub(crate) fn sequence_control(
    get: impl Fn(&str) -> Option<Param>,
) -> Result<Option<SequenceControl>> {
    let flag = |key: &str| -> Result<bool> {
        match get(key) {
            None => Ok(false),
            Some(Param::Bool(b)) => Ok(b),
            Some(other) => Err(ServeError::InvalidRequest(format!(
                "parameter `{key}` must be a boolean, got {other:?}"
            ))),
        }
    };
    let (start, end) = (flag("sequence_start")?, flag("sequence_end")?);
    let id = match get("sequence_id") {
        None if start || end => {
            return Err(ServeError::InvalidRequest(
                "sequence_start / sequence_end need a `sequence_id` parameter".into(),
            ));
        }
        None | Some(Param::Int(0)) => return Ok(None),
        Some(Param::Int(n)) if n > 0 => SequenceId::Number(n as u64),
        Some(Param::Text(t)) if !t.is_empty() => SequenceId::Text(t),
        Some(other) => {
            return Err(ServeError::InvalidRequest(format!(
                "parameter `sequence_id` must be a positive integer or a non-empty string, got {other:?}"
            )));
        }
    };
    Ok(Some(SequenceControl { id, start, end }))
}

/// Decodes and validates a request for a model with signature `spec`.
pub fn decode(wire: WireRequest, spec: &ModelSpec, max_batch: usize) -> Result<InferRequest> {
    match wire {
        WireRequest::Http { body, header_len } => http::decode(&body, header_len, spec, max_batch),
        WireRequest::Grpc(request) => grpc::decode(*request, spec, max_batch),
    }
}

/// Encodes a response in the format the request asked for.
pub fn encode(
    model: &str,
    version: &str,
    request: InferRequest,
    outputs: Vec<NamedTensor>,
) -> Result<Encoded> {
    let selected = select_outputs(outputs, &request.outputs);
    Ok(match request.format {
        ResponseFormat::Http { binary_default } => {
            http::encode(model, version, &request.id, selected, binary_default)?
        }
        ResponseFormat::Grpc => grpc::encode(model, version, request.id, selected),
    })
}

/// The requested outputs in request order with their `binary_data` choice (all, in model
/// order, when none were named).
fn select_outputs(
    outputs: Vec<NamedTensor>,
    requested: &[RequestedOutput],
) -> Vec<(NamedTensor, Option<bool>)> {
    if requested.is_empty() {
        return outputs.into_iter().map(|t| (t, None)).collect();
    }
    let mut outputs: Vec<Option<NamedTensor>> = outputs.into_iter().map(Some).collect();
    requested
        .iter()
        .filter_map(|r| {
            outputs
                .iter_mut()
                .find(|t| t.as_ref().is_some_and(|t| t.name == r.name))
                .and_then(Option::take)
                .map(|t| (t, r.binary))
        })
        .collect()
}

/// Checks one input's name, datatype and shape against the model; returns its position
/// among the model's inputs and the batch size.
pub(crate) fn check_input(
    spec: &ModelSpec,
    name: &str,
    datatype: &str,
    shape: &[i64],
    max_batch: usize,
) -> Result<(usize, usize)> {
    let Some(index) = spec.inputs.iter().position(|i| i.name == name) else {
        let names: Vec<&str> = spec.inputs.iter().map(|i| i.name.as_str()).collect();
        return Err(ServeError::InvalidRequest(format!(
            "unexpected input `{name}`; the model takes {names:?}"
        )));
    };
    let want = &spec.inputs[index];
    let dt = DataType::parse(datatype)?;
    if dt != want.datatype {
        return Err(ServeError::InvalidRequest(format!(
            "input `{name}` has datatype {datatype}, the model expects {}",
            want.datatype.wire_name()
        )));
    }
    let expected = format!(
        "[-1, {}]",
        want.dims
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let fits = shape.len() == want.dims.len() + 1
        && shape[1..]
            .iter()
            .zip(&want.dims)
            .all(|(&s, &d)| s == d as i64);
    if !fits {
        return Err(ServeError::InvalidRequest(format!(
            "input `{name}` has shape {shape:?}, the model expects {expected} (batch first)"
        )));
    }
    let batch = shape[0];
    if batch < 1 || batch as usize > max_batch {
        return Err(ServeError::InvalidRequest(format!(
            "input `{name}` has batch {batch}; this model takes 1..={max_batch} per request"
        )));
    }
    Ok((index, batch as usize))
}

/// Gathers decoded inputs into the model's order: every input present once, all with the
/// same batch. Returns the batch and the inputs.
pub(crate) fn assemble_inputs(
    spec: &ModelSpec,
    decoded: Vec<Option<(usize, Values)>>,
) -> Result<(usize, Vec<Values>)> {
    let quoted = |names: Vec<&str>| {
        names
            .iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let missing: Vec<&str> = spec
        .inputs
        .iter()
        .zip(&decoded)
        .filter(|(_, d)| d.is_none())
        .map(|(s, _)| s.name.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(ServeError::InvalidRequest(format!(
            "missing input {}; the model takes {}",
            quoted(missing),
            quoted(spec.inputs.iter().map(|i| i.name.as_str()).collect())
        )));
    }
    let mut batch = None;
    let mut inputs = Vec::with_capacity(decoded.len());
    for (spec_input, d) in spec.inputs.iter().zip(decoded) {
        let (b, values) = d.expect("missing inputs reported above");
        if *batch.get_or_insert(b) != b {
            return Err(ServeError::InvalidRequest(format!(
                "input `{}` has batch {b}, the others {}; every input needs the same batch",
                spec_input.name,
                batch.unwrap_or(b)
            )));
        }
        inputs.push(values);
    }
    Ok((batch.unwrap_or(0), inputs))
}

/// Checks that every requested output exists.
pub(crate) fn check_outputs(spec: &ModelSpec, requested: &[RequestedOutput]) -> Result<()> {
    for r in requested {
        if !spec.outputs.iter().any(|o| o.name == r.name) {
            let names: Vec<&str> = spec.outputs.iter().map(|o| o.name.as_str()).collect();
            return Err(ServeError::InvalidRequest(format!(
                "unknown output `{}`; the model has {names:?}",
                r.name
            )));
        }
    }
    Ok(())
}

/// Checks the element count against the shape.
pub(crate) fn check_len(
    name: &str,
    values: &Values,
    batch: usize,
    spec: &TensorSpec,
) -> Result<()> {
    let want = batch * spec.sample_len();
    if values.len() != want {
        return Err(ServeError::InvalidRequest(format!(
            "input `{name}` carries {} elements but its shape needs {want}",
            values.len()
        )));
    }
    Ok(())
}
