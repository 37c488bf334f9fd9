//! The KServe v2 HTTP/REST inference body, JSON with the binary tensor data extension.

use serde_json::{Map, Value, json};

use super::{
    InferRequest, Param, RequestedOutput, ResponseFormat, assemble_inputs, check_input, check_len,
    check_outputs,
};
use crate::error::{Result, ServeError};
use crate::signature::ModelSpec;
use crate::tensor::{DataType, NamedTensor, Values};

fn bad(message: impl Into<String>) -> ServeError {
    ServeError::InvalidRequest(message.into())
}

/// Decodes an HTTP infer body: a JSON header of `header_len` bytes (the whole body when
/// `None`) followed by binary tensor data for inputs that declare `binary_data_size`.
pub fn decode(
    body: &[u8],
    header_len: Option<usize>,
    spec: &ModelSpec,
    max_batch: usize,
) -> Result<InferRequest> {
    let split = header_len.unwrap_or(body.len());
    if split > body.len() {
        return Err(bad(format!(
            "Inference-Header-Content-Length is {split} but the body has only {} bytes",
            body.len()
        )));
    }
    let (header, mut binary) = body.split_at(split);
    let json: Value = serde_json::from_slice(header)
        .map_err(|e| bad(format!("request body is not valid JSON: {e}")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| bad("request body must be a JSON object with an `inputs` array"))?;
    let id = match obj.get("id") {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(bad(format!("`id` must be a string, got {other}"))),
    };
    let params = obj.get("parameters").and_then(Value::as_object);
    let timeout = match params.and_then(|p| p.get("timeout")) {
        None => None,
        Some(t) => Some(std::time::Duration::from_micros(t.as_u64().ok_or_else(
            || {
                bad(format!(
                    "parameter `timeout` must be microseconds (a non-negative integer), got {t}"
                ))
            },
        )?)),
    };
    let binary_default = params
        .and_then(|p| p.get("binary_data_output"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let inputs = obj
        .get("inputs")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("request body has no `inputs` array"))?;
    let mut decoded: Vec<Option<(usize, Values)>> = vec![None; spec.inputs.len()];
    for input in inputs {
        let input = input
            .as_object()
            .ok_or_else(|| bad("each entry of `inputs` must be an object"))?;
        let name = str_field(input, "name", "input")?;
        let datatype = str_field(input, "datatype", name)?;
        let shape: Vec<i64> = input
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(format!("input `{name}` has no `shape` array")))?
            .iter()
            .map(|d| d.as_i64())
            .collect::<Option<_>>()
            .ok_or_else(|| bad(format!("input `{name}`: `shape` must hold integers")))?;
        let (index, batch) = check_input(spec, name, datatype, &shape, max_batch)?;
        if decoded[index].is_some() {
            return Err(bad(format!("input `{name}` is given twice")));
        }
        let dt = spec.inputs[index].datatype;
        let binary_size = input
            .get("parameters")
            .and_then(Value::as_object)
            .and_then(|p| p.get("binary_data_size"));
        let values = match binary_size {
            Some(size) => {
                let size = size.as_u64().ok_or_else(|| {
                    bad(format!(
                        "input `{name}`: binary_data_size must be a byte count"
                    ))
                })? as usize;
                if size > binary.len() {
                    return Err(bad(format!(
                        "input `{name}` declares {size} bytes of binary data but only {} follow the JSON header",
                        binary.len()
                    )));
                }
                let (mine, rest) = binary.split_at(size);
                binary = rest;
                Values::from_le_bytes(dt, mine)?
            }
            None => {
                let data = input.get("data").ok_or_else(|| {
                    bad(format!(
                        "input `{name}` has neither `data` nor binary_data_size"
                    ))
                })?;
                json_values(name, dt, data)?
            }
        };
        check_len(name, &values, batch, &spec.inputs[index])?;
        decoded[index] = Some((batch, values));
    }
    let (batch, inputs) = assemble_inputs(spec, decoded)?;
    if !binary.is_empty() {
        return Err(bad(format!(
            "{} bytes of binary data after the inputs that no input declares",
            binary.len()
        )));
    }
    let outputs = match obj.get("outputs") {
        None => Vec::new(),
        Some(list) => list
            .as_array()
            .ok_or_else(|| bad("`outputs` must be an array"))?
            .iter()
            .map(|o| {
                let o = o
                    .as_object()
                    .ok_or_else(|| bad("each output must be an object"))?;
                Ok(RequestedOutput {
                    name: str_field(o, "name", "output")?.to_string(),
                    binary: o
                        .get("parameters")
                        .and_then(Value::as_object)
                        .and_then(|p| p.get("binary_data"))
                        .and_then(Value::as_bool),
                })
            })
            .collect::<Result<Vec<_>>>()?,
    };
    check_outputs(spec, &outputs)?;
    let sequence = super::sequence_control(|key| {
        params.and_then(|p| p.get(key)).map(|v| match v {
            Value::Bool(b) => Param::Bool(*b),
            Value::Number(n) => match n.as_i64() {
                Some(i) => Param::Int(i),
                None => Param::Other(n.to_string()),
            },
            Value::String(t) => Param::Text(t.clone()),
            other => Param::Other(other.to_string()),
        })
    })?;
    Ok(InferRequest {
        id,
        batch,
        inputs,
        outputs,
        format: ResponseFormat::Http { binary_default },
        timeout,
        sequence,
    })
}

fn str_field<'a>(obj: &'a Map<String, Value>, key: &str, what: &str) -> Result<&'a str> {
    obj.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("{what}: missing string field `{key}`")))
}

/// Flattens (possibly nested) JSON arrays of numbers into values of `dt`.
fn json_values(name: &str, dt: DataType, data: &Value) -> Result<Values> {
    /// Visits the numbers in row-major order; false at the first non-array, non-number.
    fn walk(v: &Value, push: &mut dyn FnMut(&serde_json::Number) -> bool) -> bool {
        match v {
            Value::Array(items) => items.iter().all(|i| walk(i, push)),
            Value::Number(n) => push(n),
            _ => false,
        }
    }
    let mut values = Values::with_capacity(dt, 0);
    let ok = match &mut values {
        Values::F32(out) => walk(data, &mut |n| {
            n.as_f64().map(|x| out.push(x as f32)).is_some()
        }),
        Values::I64(out) => walk(data, &mut |n| n.as_i64().map(|x| out.push(x)).is_some()),
    };
    if !ok {
        return Err(bad(format!(
            "input `{name}`: `data` must be (nested) arrays of {} numbers; element {} is not",
            dt.wire_name(),
            values.len()
        )));
    }
    Ok(values)
}

/// Encodes outputs as the KServe v2 JSON response, binary where requested.
pub fn encode(
    model: &str,
    version: &str,
    id: &str,
    outputs: Vec<(NamedTensor, Option<bool>)>,
    binary_default: bool,
) -> Result<super::Encoded> {
    let mut binary = Vec::new();
    let mut listed = Vec::with_capacity(outputs.len());
    for (t, want_binary) in outputs {
        let mut entry = json!({
            "name": t.name,
            "datatype": t.values.datatype().wire_name(),
            "shape": t.shape,
        });
        if want_binary.unwrap_or(binary_default) {
            let bytes = t.values.to_le_bytes();
            entry["parameters"] = json!({ "binary_data_size": bytes.len() });
            binary.extend_from_slice(&bytes);
        } else {
            entry["data"] = match &t.values {
                Values::F32(v) => json!(v),
                Values::I64(v) => json!(v),
            };
        }
        listed.push(entry);
    }
    let mut response = json!({
        "model_name": model,
        "model_version": version,
        "outputs": listed,
    });
    if !id.is_empty() {
        response["id"] = json!(id);
    }
    let mut body = serde_json::to_vec(&response).map_err(|e| ServeError::Inference {
        model: model.to_string(),
        message: format!("encoding the response: {e}"),
    })?;
    let header_len = (!binary.is_empty()).then_some(body.len());
    body.extend_from_slice(&binary);
    Ok(super::Encoded::Http { body, header_len })
}
