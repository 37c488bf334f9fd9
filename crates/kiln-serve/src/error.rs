//! Errors of the server and what each one means on the wire.

use thiserror::Error;

/// Result alias for kiln-serve.
pub type Result<T, E = ServeError> = std::result::Result<T, E>;

/// Everything that can go wrong between a request arriving and its response leaving.
///
/// Each variant maps to one HTTP status and one gRPC code ([`ServeError::http_status`],
/// [`ServeError::grpc_code`]), so both protocols reject the same request the same way.
#[derive(Debug, Error)]
pub enum ServeError {
    /// The request is malformed: bad JSON, wrong shape or datatype, a missing input.
    #[error("{0}")]
    InvalidRequest(String),
    /// No model of that name is in the repository.
    #[error("unknown model `{0}`; GET /v2/repository/index lists the models")]
    ModelNotFound(String),
    /// The model exists but failed to load; the reason says why.
    #[error("model `{model}` is not ready: {reason}")]
    ModelNotReady {
        /// Model name.
        model: String,
        /// Why it did not load.
        reason: String,
    },
    /// The model's queue is full: the server is overloaded, the client should back off.
    #[error(
        "model `{model}` queue is full ({limit} requests waiting); retry later or raise max_queue_size"
    )]
    QueueFull {
        /// Model name.
        model: String,
        /// The configured bound.
        limit: usize,
    },
    /// A stream model holds as many sequences as it may: a new one must wait for one to end.
    #[error(
        "model `{model}` has {limit} active sequences (max_active_sequences); end one (sequence_end) or raise the limit"
    )]
    SequencesFull {
        /// Model name.
        model: String,
        /// The configured bound.
        limit: usize,
    },
    /// The request waited longer than its timeout before it could run.
    #[error(
        "request to model `{model}` timed out after {waited_us} µs in the queue (timeout {timeout_us} µs)"
    )]
    Timeout {
        /// Model name.
        model: String,
        /// How long it waited.
        waited_us: u64,
        /// The configured limit.
        timeout_us: u64,
    },
    /// The server is shutting down and takes no new work.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The model failed while running a batch.
    #[error("inference failed in model `{model}`: {message}")]
    Inference {
        /// Model name.
        model: String,
        /// What failed.
        message: String,
    },
    /// A model's weights or graph could not be loaded.
    #[error("cannot load model `{model}`: {message}")]
    Load {
        /// Model name.
        model: String,
        /// What failed.
        message: String,
    },
    /// A model repository or model configuration problem.
    #[error("model config {path}: {message}")]
    Config {
        /// The file or directory.
        path: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A model control request (load, unload) that this server's mode does not allow, or
    /// that names no model it could load.
    #[error("{0}")]
    ControlRefused(String),
    /// Binding or serving a socket failed.
    #[error("server I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl ServeError {
    /// The HTTP status this error is answered with.
    pub fn http_status(&self) -> u16 {
        match self {
            // A failed load is the request's problem to fix (its files), as Triton answers it.
            ServeError::InvalidRequest(_)
            | ServeError::ModelNotReady { .. }
            | ServeError::ControlRefused(_)
            | ServeError::Load { .. } => 400,
            ServeError::ModelNotFound(_) => 404,
            ServeError::QueueFull { .. } | ServeError::SequencesFull { .. } => 429,
            ServeError::Timeout { .. } | ServeError::ShuttingDown => 503,
            ServeError::Inference { .. } | ServeError::Config { .. } | ServeError::Io(_) => 500,
        }
    }

    /// The gRPC status code this error is answered with.
    pub fn grpc_code(&self) -> tonic::Code {
        match self {
            ServeError::InvalidRequest(_) => tonic::Code::InvalidArgument,
            ServeError::ModelNotFound(_) => tonic::Code::NotFound,
            ServeError::ModelNotReady { .. } | ServeError::ControlRefused(_) => {
                tonic::Code::FailedPrecondition
            }
            ServeError::QueueFull { .. } | ServeError::SequencesFull { .. } => {
                tonic::Code::ResourceExhausted
            }
            ServeError::Timeout { .. } | ServeError::ShuttingDown => tonic::Code::Unavailable,
            ServeError::Inference { .. }
            | ServeError::Load { .. }
            | ServeError::Config { .. }
            | ServeError::Io(_) => tonic::Code::Internal,
        }
    }

    /// The label this error is counted under in `/metrics`.
    pub fn metric_reason(&self) -> &'static str {
        match self {
            ServeError::InvalidRequest(_) | ServeError::ControlRefused(_) => "invalid",
            ServeError::ModelNotFound(_) | ServeError::ModelNotReady { .. } => "not_ready",
            ServeError::QueueFull { .. } | ServeError::SequencesFull { .. } => "queue_full",
            ServeError::Timeout { .. } => "timeout",
            ServeError::ShuttingDown => "shutdown",
            ServeError::Inference { .. }
            | ServeError::Load { .. }
            | ServeError::Config { .. }
            | ServeError::Io(_) => "internal",
        }
    }
}

impl From<ServeError> for tonic::Status {
    fn from(e: ServeError) -> Self {
        tonic::Status::new(e.grpc_code(), e.to_string())
    }
}
