//! The KServe v2 HTTP/REST front end (axum) and `/metrics`.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::codec::{Encoded, WireRequest};
use crate::error::ServeError;
use crate::repository::Repository;

/// Shared state of the HTTP handlers.
#[derive(Debug, Clone)]
struct Http {
    repository: Arc<Repository>,
    max_body: usize,
}

/// The header that splits a body into a JSON part and binary tensor data.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// The router serving the KServe v2 REST endpoints and `/metrics` from `repository`, taking
/// request bodies up to `max_body` bytes.
pub fn router(repository: Arc<Repository>, max_body: usize) -> Router {
    let state = Http {
        repository,
        max_body,
    };
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(server_ready))
        .route("/v2/repository/index", post(repository_index))
        .route("/v2/models/stats", get(all_stats))
        .route("/v2/models/{model}", get(model_metadata))
        .route(
            "/v2/models/{model}/versions/{version}",
            get(model_metadata_v),
        )
        .route("/v2/models/{model}/ready", get(model_ready))
        .route(
            "/v2/models/{model}/versions/{version}/ready",
            get(model_ready_v),
        )
        .route("/v2/models/{model}/config", get(model_config))
        .route(
            "/v2/models/{model}/versions/{version}/config",
            get(model_config_v),
        )
        .route("/v2/models/{model}/stats", get(model_stats))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer_v))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            error_response(
                StatusCode::NOT_FOUND,
                "no such endpoint; see the KServe v2 REST API",
            )
        })
        .with_state(state)
}

fn error_response(status: StatusCode, message: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        json!({ "error": message }).to_string(),
    )
        .into_response()
}

impl IntoResponse for ServeError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        error_response(status, &self.to_string())
    }
}

fn json_response(v: Value) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// Only version 1 exists: a model is served as loaded.
fn check_version(model: &str, version: &str) -> Result<(), ServeError> {
    if version.is_empty() || version == "1" {
        Ok(())
    } else {
        Err(ServeError::ModelNotFound(format!(
            "{model} (version {version}; only version 1 is served)"
        )))
    }
}

async fn server_metadata() -> Response {
    let (name, version, extensions) = crate::server_metadata();
    json_response(json!({ "name": name, "version": version, "extensions": extensions }))
}

async fn server_ready(State(s): State<Http>) -> StatusCode {
    if s.repository.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn repository_index(State(s): State<Http>) -> Response {
    let index: Vec<Value> = s
        .repository
        .index()
        .into_iter()
        .map(|m| {
            let mut v = json!({ "name": m.name, "version": "1", "state": m.state });
            if !m.reason.is_empty() {
                v["reason"] = json!(m.reason);
            }
            v
        })
        .collect();
    json_response(Value::Array(index))
}

async fn model_metadata(state: State<Http>, Path(model): Path<String>) -> Response {
    metadata(state, &model, "").into_response()
}

async fn model_metadata_v(
    state: State<Http>,
    Path((model, version)): Path<(String, String)>,
) -> Response {
    metadata(state, &model, &version).into_response()
}

fn metadata(State(s): State<Http>, model: &str, version: &str) -> Result<Response, ServeError> {
    check_version(model, version)?;
    let rt = s.repository.runtime(model)?;
    let tensor = |t: &crate::tensor::TensorSpec| {
        let mut shape = vec![-1i64];
        shape.extend(t.dims.iter().map(|&d| d as i64));
        json!({ "name": t.name, "datatype": t.datatype.wire_name(), "shape": shape })
    };
    Ok(json_response(json!({
        "name": rt.name,
        "versions": ["1"],
        "platform": rt.spec.platform,
        "inputs": [tensor(&rt.spec.input)],
        "outputs": rt.spec.outputs.iter().map(tensor).collect::<Vec<_>>(),
    })))
}

async fn model_ready(state: State<Http>, Path(model): Path<String>) -> Response {
    ready(state, &model, "")
}

async fn model_ready_v(
    state: State<Http>,
    Path((model, version)): Path<(String, String)>,
) -> Response {
    ready(state, &model, &version)
}

/// 200 when ready; otherwise the status and the reason the model did not load.
fn ready(State(s): State<Http>, model: &str, version: &str) -> Response {
    match check_version(model, version).and_then(|_| s.repository.runtime(model)) {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn model_config(state: State<Http>, Path(model): Path<String>) -> Response {
    config(state, &model, "").into_response()
}

async fn model_config_v(
    state: State<Http>,
    Path((model, version)): Path<(String, String)>,
) -> Response {
    config(state, &model, &version).into_response()
}

fn config(State(s): State<Http>, model: &str, version: &str) -> Result<Response, ServeError> {
    check_version(model, version)?;
    Ok(json_response(crate::triton_config::to_json(
        &*s.repository.runtime(model)?,
    )))
}

async fn model_stats(State(s): State<Http>, Path(model): Path<String>) -> Response {
    match s.repository.runtime(&model) {
        Ok(rt) => json_response(json!({
            "model_stats": [crate::triton_config::statistics_json(&rt)]
        })),
        Err(e) => e.into_response(),
    }
}

async fn all_stats(State(s): State<Http>) -> Response {
    let stats: Vec<Value> = s
        .repository
        .ready_runtimes()
        .iter()
        .map(|rt| crate::triton_config::statistics_json(rt))
        .collect();
    json_response(json!({ "model_stats": stats }))
}

async fn infer(state: State<Http>, Path(model): Path<String>, request: Request) -> Response {
    run_infer(state, &model, "", request).await
}

async fn infer_v(
    state: State<Http>,
    Path((model, version)): Path<(String, String)>,
    request: Request,
) -> Response {
    run_infer(state, &model, &version, request).await
}

async fn run_infer(
    State(s): State<Http>,
    model: &str,
    version: &str,
    request: Request,
) -> Response {
    match infer_body(&s, model, version, request).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn infer_body(
    s: &Http,
    model: &str,
    version: &str,
    request: Request,
) -> Result<Response, ServeError> {
    check_version(model, version)?;
    let rt = s.repository.runtime(model)?;
    let (parts, body) = request.into_parts();
    if let Some(enc) = parts.headers.get(header::CONTENT_ENCODING)
        && enc.as_bytes() != b"identity"
    {
        return Err(ServeError::InvalidRequest(format!(
            "Content-Encoding {enc:?} is not supported; send the body uncompressed"
        )));
    }
    let header_len = header_length(&parts.headers)?;
    let body: Bytes = axum::body::to_bytes(body, s.max_body).await.map_err(|_| {
        ServeError::InvalidRequest(format!(
            "request body exceeds the server's limit of {} bytes (kiln serve --max-body-bytes)",
            s.max_body
        ))
    })?;
    match rt.infer(WireRequest::Http { body, header_len }).await? {
        Encoded::Http { body, header_len } => {
            let mut response = Response::new(Body::from(body));
            let headers = response.headers_mut();
            match header_len {
                Some(n) => {
                    headers.insert(
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("application/octet-stream"),
                    );
                    headers.insert(HEADER_LENGTH, HeaderValue::from(n));
                }
                None => {
                    headers.insert(
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("application/json"),
                    );
                }
            }
            Ok(response)
        }
        Encoded::Grpc(_) => Err(ServeError::Inference {
            model: model.into(),
            message: "gRPC encoding for an HTTP request".into(),
        }),
    }
}

fn header_length(headers: &HeaderMap) -> Result<Option<usize>, ServeError> {
    headers
        .get(HEADER_LENGTH)
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .ok_or_else(|| {
                    ServeError::InvalidRequest(format!(
                        "Inference-Header-Content-Length {v:?} is not a byte count"
                    ))
                })
        })
        .transpose()
}

async fn metrics(State(s): State<Http>) -> Response {
    let mut text = crate::metrics::preamble();
    for rt in s.repository.ready_runtimes() {
        rt.metrics.render(&mut text, &rt.name);
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}
