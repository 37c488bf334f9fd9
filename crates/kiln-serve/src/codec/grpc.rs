//! The KServe v2 gRPC inference messages (`raw_input_contents` or typed `contents`).

use super::{
    Encoded, InferRequest, Param, RequestedOutput, ResponseFormat, assemble_inputs, check_input,
    check_len, check_outputs,
};
use crate::error::{Result, ServeError};
use crate::proto::pb;
use crate::signature::ModelSpec;
use crate::tensor::{DataType, NamedTensor, Values};

fn bad(message: impl Into<String>) -> ServeError {
    ServeError::InvalidRequest(message.into())
}

/// Decodes and validates a `ModelInferRequest`.
pub fn decode(
    request: pb::ModelInferRequest,
    spec: &ModelSpec,
    max_batch: usize,
) -> Result<InferRequest> {
    if !request.raw_input_contents.is_empty()
        && request.raw_input_contents.len() != request.inputs.len()
    {
        return Err(bad(format!(
            "raw_input_contents has {} entries for {} inputs; give one per input or none",
            request.raw_input_contents.len(),
            request.inputs.len()
        )));
    }
    let mut decoded: Vec<Option<(usize, Values)>> = vec![None; spec.inputs.len()];
    for (i, input) in request.inputs.iter().enumerate() {
        let (index, batch) =
            check_input(spec, &input.name, &input.datatype, &input.shape, max_batch)?;
        if decoded[index].is_some() {
            return Err(bad(format!("input `{}` is given twice", input.name)));
        }
        let dt = spec.inputs[index].datatype;
        let values = match request.raw_input_contents.get(i) {
            Some(raw) => Values::from_le_bytes(dt, raw)?,
            None => {
                let contents = input.contents.as_ref().ok_or_else(|| {
                    bad(format!(
                        "input `{}` has neither contents nor raw_input_contents",
                        input.name
                    ))
                })?;
                match dt {
                    DataType::Fp32 => Values::F32(contents.fp32_contents.clone()),
                    DataType::Int64 => Values::I64(contents.int64_contents.clone()),
                }
            }
        };
        check_len(&input.name, &values, batch, &spec.inputs[index])?;
        decoded[index] = Some((batch, values));
    }
    let (batch, inputs) = assemble_inputs(spec, decoded)?;
    let outputs: Vec<RequestedOutput> = request
        .outputs
        .iter()
        .map(|o| RequestedOutput {
            name: o.name.clone(),
            binary: None,
        })
        .collect();
    check_outputs(spec, &outputs)?;
    let timeout = match request
        .parameters
        .get("timeout")
        .and_then(|p| p.parameter_choice.as_ref())
    {
        None => None,
        Some(pb::infer_parameter::ParameterChoice::Int64Param(us)) if *us >= 0 => {
            Some(std::time::Duration::from_micros(*us as u64))
        }
        Some(other) => {
            return Err(bad(format!(
                "parameter `timeout` must be microseconds (a non-negative int64), got {other:?}"
            )));
        }
    };
    let sequence = super::sequence_control(|key| {
        use pb::infer_parameter::ParameterChoice as C;
        request
            .parameters
            .get(key)
            .and_then(|p| p.parameter_choice.as_ref())
            .map(|c| match c {
                C::BoolParam(b) => Param::Bool(*b),
                C::Int64Param(i) => Param::Int(*i),
                C::StringParam(t) => Param::Text(t.clone()),
                #[allow(unreachable_patterns)] // newer protocol versions add kinds
                other => Param::Other(format!("{other:?}")),
            })
    })?;
    Ok(InferRequest {
        id: request.id,
        batch,
        inputs,
        outputs,
        format: ResponseFormat::Grpc,
        timeout,
        sequence,
    })
}

/// Encodes outputs as a `ModelInferResponse` with `raw_output_contents`, as Triton does.
pub fn encode(
    model: &str,
    version: &str,
    id: String,
    outputs: Vec<(NamedTensor, Option<bool>)>,
) -> Encoded {
    let mut response = pb::ModelInferResponse {
        model_name: model.to_string(),
        model_version: version.to_string(),
        id,
        ..Default::default()
    };
    for (t, _) in outputs {
        response
            .outputs
            .push(pb::model_infer_response::InferOutputTensor {
                name: t.name,
                datatype: t.values.datatype().wire_name().into(),
                shape: t.shape.iter().map(|&d| d as i64).collect(),
                ..Default::default()
            });
        response.raw_output_contents.push(t.values.to_le_bytes());
    }
    Encoded::Grpc(Box::new(response))
}
