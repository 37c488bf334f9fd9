//! The KServe v2 HTTP/REST front end (axum) and `/metrics`.

use std::collections::HashMap;
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
use crate::pipeline::ModelRuntime;
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
        .route("/v2/repository/models/{model}/load", post(load_model))
        .route("/v2/repository/models/{model}/unload", post(unload_model))
        .route("/v2/models/stats", get(all_stats))
        .route("/v2/models/{model}", get(metadata))
        .route("/v2/models/{model}/versions/{version}", get(metadata))
        .route("/v2/models/{model}/ready", get(ready))
        .route("/v2/models/{model}/versions/{version}/ready", get(ready))
        .route("/v2/models/{model}/config", get(config))
        .route("/v2/models/{model}/versions/{version}/config", get(config))
        .route("/v2/models/{model}/stats", get(model_stats))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer))
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

async fn repository_index(State(s): State<Http>, request: Request) -> Response {
    let only_ready = match read_body(&s, request)
        .await
        .and_then(|b| crate::codec::control::http_index(&b))
    {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let index: Vec<Value> = s
        .repository
        .index()
        .into_iter()
        .filter(|m| !only_ready || m.state == "READY")
        .map(|m| {
            let mut v = json!({ "name": m.name, "state": m.state });
            if !m.version.is_empty() {
                v["version"] = json!(m.version);
            }
            if !m.reason.is_empty() {
                v["reason"] = json!(m.reason);
            }
            v
        })
        .collect();
    json_response(Value::Array(index))
}

/// `POST /v2/repository/models/M/load`: loads or reloads M (explicit mode); answers when the
/// new versions serve (or with why they do not).
async fn load_model(
    State(s): State<Http>,
    Path(model): Path<String>,
    request: Request,
) -> Response {
    let check = crate::codec::control::check_load;
    if let Err(e) = control_body(&s, request, "model load", check).await {
        return e.into_response();
    }
    let repository = Arc::clone(&s.repository);
    // Loading reads weights and runs the warm-up: blocking work, off the async runtime.
    match tokio::task::spawn_blocking(move || repository.request_load(&model)).await {
        Ok(Ok(_)) => StatusCode::OK.into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => error_response(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

/// `POST /v2/repository/models/M/unload`: takes M out of service; its versions drain their
/// requests in the background.
async fn unload_model(
    State(s): State<Http>,
    Path(model): Path<String>,
    request: Request,
) -> Response {
    let check = crate::codec::control::check_unload;
    if let Err(e) = control_body(&s, request, "model unload", check).await {
        return e.into_response();
    }
    match s.repository.request_unload(&model) {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

/// Reads a load or unload body and checks its parameters with `check`.
async fn control_body(
    s: &Http,
    request: Request,
    what: &str,
    check: fn(&crate::codec::control::Parameters) -> Result<(), ServeError>,
) -> Result<(), ServeError> {
    let body = read_body(s, request).await?;
    check(&crate::codec::control::http_parameters(&body, what)?)
}

/// A request's whole body, up to the server's limit.
async fn read_body(s: &Http, request: Request) -> Result<Bytes, ServeError> {
    axum::body::to_bytes(request.into_body(), s.max_body)
        .await
        .map_err(|_| body_too_large(s.max_body))
}

fn body_too_large(limit: usize) -> ServeError {
    ServeError::InvalidRequest(format!(
        "request body exceeds the server's limit of {limit} bytes (kiln serve --max-body-bytes)"
    ))
}

/// A route's `{model}` and optional `{version}`.
type ModelPath = Path<HashMap<String, String>>;

/// The running model a route names, after checking its version.
fn runtime(s: &Http, path: &HashMap<String, String>) -> Result<Arc<ModelRuntime>, ServeError> {
    let model = path.get("model").map_or("", String::as_str);
    let version = path.get("version").map_or("", String::as_str);
    s.repository.runtime_version(model, version)
}

async fn metadata(State(s): State<Http>, Path(path): ModelPath) -> Response {
    match runtime(&s, &path) {
        Ok(rt) => {
            let tensor = |t: &crate::tensor::TensorSpec| json!({ "name": t.name, "datatype": t.datatype.wire_name(), "shape": t.batched_shape() });
            json_response(json!({
                "name": rt.name,
                "versions": s.repository.ready_versions(&rt.name).iter().map(u64::to_string).collect::<Vec<_>>(),
                "platform": rt.spec.platform,
                "inputs": rt.spec.inputs.iter().map(tensor).collect::<Vec<_>>(),
                "outputs": rt.spec.outputs.iter().map(tensor).collect::<Vec<_>>(),
            }))
        }
        Err(e) => e.into_response(),
    }
}

/// 200 when ready; otherwise the status and the reason the model did not load.
async fn ready(State(s): State<Http>, Path(path): ModelPath) -> Response {
    match runtime(&s, &path) {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn config(State(s): State<Http>, Path(path): ModelPath) -> Response {
    match runtime(&s, &path) {
        Ok(rt) => json_response(crate::triton_config::to_json(&rt)),
        Err(e) => e.into_response(),
    }
}

async fn model_stats(State(s): State<Http>, Path(path): ModelPath) -> Response {
    match runtime(&s, &path) {
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

async fn infer(State(s): State<Http>, Path(path): ModelPath, request: Request) -> Response {
    match infer_body(&s, &path, request).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn infer_body(
    s: &Http,
    path: &HashMap<String, String>,
    request: Request,
) -> Result<Response, ServeError> {
    let rt = runtime(s, path)?;
    let (parts, body) = request.into_parts();
    if let Some(enc) = parts.headers.get(header::CONTENT_ENCODING)
        && enc.as_bytes() != b"identity"
    {
        return Err(ServeError::InvalidRequest(format!(
            "Content-Encoding {enc:?} is not supported; send the body uncompressed"
        )));
    }
    let header_len = header_length(&parts.headers)?;
    let body: Bytes = axum::body::to_bytes(body, s.max_body)
        .await
        .map_err(|_| body_too_large(s.max_body))?;
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
            model: rt.name.clone(),
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
        rt.render_metrics(&mut text);
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}
