//! kiln-serve: a dynamic-batching inference server for Kiln models that speaks the KServe v2
//! protocol (the one NVIDIA Triton implements) over HTTP/REST and gRPC, so Triton's own
//! clients — `tritonclient`, `perf_analyzer` — drive it unmodified.
//!
//! ```text
//! model repository (dir/<model>/config.toml)
//!        │ load: zoo checkpoint + passes | kiln graph | identity
//!        ▼
//! HTTP (axum) ─┐                 ┌─ per model: preprocess → dynamic batcher → N instances
//! gRPC (tonic) ┴─▶ Repository ──▶┤              → postprocess, bounded queues between
//!              /metrics (Prometheus)
//! ```
//!
//! A model with `[sequence_batching]` is a stateful stream model ([`sequence`]): the
//! protocol's sequence parameters, Kiln's temporal coherence and regions of interest; with
//! `output = "mask" | "image" | "boxes"` a per-frame ONNX model ([`per_frame`]) whose
//! sequences each keep a video stream's state.
//!
//! Models change while serving by the [`ModelControlMode`] ([`repository`]): numbered
//! versions under a version policy, poll or explicit load/unload, each new version built and
//! warmed beside the serving one and switched in without dropping a request.
//!
//! Start it with `kiln serve --models DIR` or [`Server::bind`] + [`Server::run`].
#![deny(missing_docs)]

pub mod backend;
pub mod codec;
pub mod config;
pub mod error;
pub mod grpc;
pub mod http;
pub mod loader;
pub mod metrics;
pub mod per_frame;
pub mod pipeline;
pub mod proto;
pub mod queue;
pub mod repository;
pub mod sequence;
pub mod server;
pub mod signature;
pub mod tensor;
pub mod triton_config;
pub mod warmup;

pub use config::{
    BackendConfig, DynamicBatching, InstanceKind, ModelConfig, SequenceConfig, VersionPolicy,
    Warmup,
};
pub use error::{Result, ServeError};
pub use pipeline::Stages;
pub use repository::{ModelControlMode, Repository, RepositoryOptions};
pub use server::{Server, ServerOptions};

/// Largest request or response body accepted on either protocol by default.
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Server name, version and the protocol extensions it implements.
pub fn server_metadata() -> (&'static str, &'static str, &'static [&'static str]) {
    (
        "kiln-serve",
        env!("CARGO_PKG_VERSION"),
        &[
            "binary_tensor_data",
            "statistics",
            "model_configuration",
            "model_repository",
            "model_repository(unload_dependents)",
            "sequence",
        ],
    )
}
