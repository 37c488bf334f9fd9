//! Model control requests (the repository extension) from the wire: the HTTP bodies of
//! `POST /v2/repository/index`, `.../models/M/load` and `.../unload`, and the parameters of
//! gRPC's `RepositoryModelLoad` / `RepositoryModelUnload`. Both protocols check parameters
//! through one function per request, so they accept and refuse the same things.

use std::collections::HashMap;

use serde_json::Value;

use crate::error::{Result, ServeError};
use crate::proto::pb;
use pb::model_repository_parameter::ParameterChoice;

/// The kind of a control parameter's value (what the checks need of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// A boolean.
    Bool,
    /// An integer.
    Int,
    /// A string.
    Str,
    /// Bytes (gRPC only: uploaded model files).
    Bytes,
    /// Anything else JSON can hold (null, a float, an array, an object).
    Other,
}

/// A control request's parameters: each name with the kind of its value.
pub type Parameters = [(String, ParamKind)];

/// Checks a load request's parameters. Triton's `config` (a configuration override) and
/// `file:` (model files in the request) are refused with the fix: Kiln loads what is in the
/// repository directory, so a load always reproduces from disk.
pub fn check_load(parameters: &Parameters) -> Result<()> {
    // Every parameter Triton defines for a load is one Kiln refuses: the first one named is
    // the refusal.
    if let Some((key, _)) = parameters.first() {
        let why = if key == "config" {
            "a configuration override in the load request is not supported; edit the model's \
             config.toml in the repository and load again"
                .to_string()
        } else if key.starts_with("file:") {
            "model files in the load request are not supported; write them into the model's \
             directory in the repository and load again"
                .to_string()
        } else {
            format!("unknown load parameter `{}`", key.escape_debug())
        };
        return Err(ServeError::InvalidRequest(why));
    }
    Ok(())
}

/// Checks an unload request's parameters: `unload_dependents` (a boolean) is accepted — Kiln
/// has no ensembles, so no model depends on another.
pub fn check_unload(parameters: &Parameters) -> Result<()> {
    for (key, kind) in parameters {
        match (key.as_str(), kind) {
            ("unload_dependents", ParamKind::Bool) => {}
            ("unload_dependents", _) => {
                return Err(ServeError::InvalidRequest(
                    "unload parameter `unload_dependents` must be a boolean".into(),
                ));
            }
            _ => {
                return Err(ServeError::InvalidRequest(format!(
                    "unknown unload parameter `{}`",
                    key.escape_debug()
                )));
            }
        }
    }
    Ok(())
}

/// `POST /v2/repository/index`'s body: `{"ready": bool}` (empty: list every model). True
/// lists only ready versions.
pub fn http_index(body: &[u8]) -> Result<bool> {
    let Some(object) = object(body, "repository index")? else {
        return Ok(false);
    };
    let mut ready = false;
    for (key, value) in object {
        match (key.as_str(), value) {
            ("ready", Value::Bool(b)) => ready = b,
            ("ready", _) => {
                return Err(ServeError::InvalidRequest(
                    "repository index: `ready` must be a boolean".into(),
                ));
            }
            // Triton's clients may name the repository; there is one.
            ("repository_name", Value::String(_)) => {}
            (other, _) => {
                return Err(ServeError::InvalidRequest(format!(
                    "repository index: unknown key `{}`; the body is {{\"ready\": true|false}}",
                    other.escape_debug()
                )));
            }
        }
    }
    Ok(ready)
}

/// A load or unload body's parameters: `{"parameters": {...}}`, or empty.
pub fn http_parameters(body: &[u8], what: &str) -> Result<Vec<(String, ParamKind)>> {
    let Some(object) = object(body, what)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (key, value) in object {
        match (key.as_str(), value) {
            ("parameters", Value::Object(map)) => {
                out.extend(map.into_iter().map(|(k, v)| {
                    let kind = match v {
                        Value::Bool(_) => ParamKind::Bool,
                        Value::Number(n) if n.is_i64() || n.is_u64() => ParamKind::Int,
                        Value::String(_) => ParamKind::Str,
                        _ => ParamKind::Other,
                    };
                    (k, kind)
                }));
            }
            ("parameters", _) => {
                return Err(ServeError::InvalidRequest(format!(
                    "{what}: `parameters` must be an object"
                )));
            }
            (other, _) => {
                return Err(ServeError::InvalidRequest(format!(
                    "{what}: unknown key `{}`; the body is {{\"parameters\": {{...}}}} or empty",
                    other.escape_debug()
                )));
            }
        }
    }
    Ok(out)
}

/// A gRPC control request's parameters.
pub fn grpc_parameters(
    parameters: &HashMap<String, pb::ModelRepositoryParameter>,
) -> Vec<(String, ParamKind)> {
    let mut out: Vec<(String, ParamKind)> = parameters
        .iter()
        .map(|(k, p)| {
            let kind = match &p.parameter_choice {
                Some(ParameterChoice::BoolParam(_)) => ParamKind::Bool,
                Some(ParameterChoice::Int64Param(_)) => ParamKind::Int,
                Some(ParameterChoice::StringParam(_)) => ParamKind::Str,
                Some(ParameterChoice::BytesParam(_)) => ParamKind::Bytes,
                None => ParamKind::Other,
            };
            (k.clone(), kind)
        })
        .collect();
    // A map's order is random: sort so the first refusal is the same every time.
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The body as a JSON object; `None` when it is empty (or only whitespace).
fn object(body: &[u8], what: &str) -> Result<Option<serde_json::Map<String, Value>>> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(Some(map)),
        Ok(_) => Err(ServeError::InvalidRequest(format!(
            "{what}: the body must be a JSON object"
        ))),
        Err(e) => Err(ServeError::InvalidRequest(format!(
            "{what}: the body is not valid JSON ({e})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tritonclients_bodies_are_accepted_and_the_rest_refused_with_the_fix() {
        // What tritonclient.http sends: an empty index body, `{}` to load, and
        // unload_dependents to unload.
        assert!(!http_index(b"").unwrap());
        assert!(http_index(br#"{"ready": true}"#).unwrap());
        assert!(check_load(&http_parameters(b"{}", "load").unwrap()).is_ok());
        let unload = br#"{"parameters": {"unload_dependents": false}}"#;
        assert!(check_unload(&http_parameters(unload, "unload").unwrap()).is_ok());
        let refusals = [
            (
                check_load(&http_parameters(br#"{"parameters":{"config":"{}"}}"#, "load").unwrap()),
                "edit the model's config.toml",
            ),
            (
                check_load(
                    &http_parameters(br#"{"parameters":{"file:1/model.onnx":"AAAA"}}"#, "load")
                        .unwrap(),
                ),
                "write them into the model's directory",
            ),
            (
                check_unload(
                    &http_parameters(br#"{"parameters":{"unload_dependents":1}}"#, "unload")
                        .unwrap(),
                ),
                "must be a boolean",
            ),
            (
                http_index(br#"{"ready": "yes"}"#).map(drop),
                "must be a boolean",
            ),
            (http_index(b"[1]").map(drop), "JSON object"),
            (http_parameters(b"{", "load").map(drop), "not valid JSON"),
            (
                http_parameters(br#"{"params":{}}"#, "load").map(drop),
                "unknown key `params`",
            ),
        ];
        for (result, expected) in refusals {
            let err = result.expect_err(expected).to_string();
            assert!(err.contains(expected), "{err:?} lacks {expected:?}");
        }
    }
}
