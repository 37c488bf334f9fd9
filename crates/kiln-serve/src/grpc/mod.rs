//! The KServe v2 gRPC service (`inference.GRPCInferenceService`) on tonic.

pub use crate::proto::pb;

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::codec::{Encoded, WireRequest};
use crate::repository::Repository;
use pb::grpc_inference_service_server::GrpcInferenceService;

/// The gRPC front end over a model repository.
#[derive(Debug, Clone)]
pub struct GrpcFrontend {
    repository: Arc<Repository>,
    max_message_bytes: usize,
}

impl GrpcFrontend {
    /// A service answering from `repository`, taking request messages up to
    /// `max_message_bytes` (`kiln serve --max-body-bytes`, the same limit HTTP bodies have).
    pub fn new(repository: Arc<Repository>, max_message_bytes: usize) -> Self {
        GrpcFrontend {
            repository,
            max_message_bytes,
        }
    }

    /// The tonic server for this front end. Requests above the limit are refused by tonic
    /// before they are decoded (OUT_OF_RANGE, naming the limit); responses are not limited,
    /// as on HTTP: their size is the model's, not the client's to choose.
    pub fn into_service(
        self,
    ) -> pb::grpc_inference_service_server::GrpcInferenceServiceServer<Self> {
        let limit = self.max_message_bytes;
        pb::grpc_inference_service_server::GrpcInferenceServiceServer::new(self)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(usize::MAX)
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for GrpcFrontend {
    async fn server_live(
        &self,
        _: Request<pb::ServerLiveRequest>,
    ) -> Result<Response<pb::ServerLiveResponse>, Status> {
        Ok(Response::new(pb::ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<pb::ServerReadyRequest>,
    ) -> Result<Response<pb::ServerReadyResponse>, Status> {
        Ok(Response::new(pb::ServerReadyResponse {
            ready: self.repository.is_ready(),
        }))
    }

    async fn model_ready(
        &self,
        request: Request<pb::ModelReadyRequest>,
    ) -> Result<Response<pb::ModelReadyResponse>, Status> {
        let request = request.get_ref();
        if !self.repository.contains(&request.name) {
            return Err(crate::error::ServeError::ModelNotFound(request.name.clone()).into());
        }
        Ok(Response::new(pb::ModelReadyResponse {
            ready: self
                .repository
                .runtime_version(&request.name, &request.version)
                .is_ok(),
        }))
    }

    async fn server_metadata(
        &self,
        _: Request<pb::ServerMetadataRequest>,
    ) -> Result<Response<pb::ServerMetadataResponse>, Status> {
        let (name, version, extensions) = crate::server_metadata();
        Ok(Response::new(pb::ServerMetadataResponse {
            name: name.into(),
            version: version.into(),
            extensions: extensions.iter().map(|e| e.to_string()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<pb::ModelMetadataRequest>,
    ) -> Result<Response<pb::ModelMetadataResponse>, Status> {
        let request = request.get_ref();
        let rt = self
            .repository
            .runtime_version(&request.name, &request.version)?;
        let meta = |s: &crate::tensor::TensorSpec| pb::model_metadata_response::TensorMetadata {
            name: s.name.clone(),
            datatype: s.datatype.wire_name().into(),
            shape: s.batched_shape(),
        };
        Ok(Response::new(pb::ModelMetadataResponse {
            name: rt.name.clone(),
            versions: self
                .repository
                .ready_versions(&rt.name)
                .iter()
                .map(u64::to_string)
                .collect(),
            platform: rt.spec.platform.clone(),
            inputs: rt.spec.inputs.iter().map(meta).collect(),
            outputs: rt.spec.outputs.iter().map(meta).collect(),
        }))
    }

    async fn model_infer(
        &self,
        request: Request<pb::ModelInferRequest>,
    ) -> Result<Response<pb::ModelInferResponse>, Status> {
        let request = request.into_inner();
        let rt = self
            .repository
            .runtime_version(&request.model_name, &request.model_version)?;
        match rt.infer(WireRequest::Grpc(Box::new(request))).await? {
            Encoded::Grpc(response) => Ok(Response::new(*response)),
            Encoded::Http { .. } => Err(Status::internal("HTTP encoding for a gRPC request")),
        }
    }

    async fn model_config(
        &self,
        request: Request<pb::ModelConfigRequest>,
    ) -> Result<Response<pb::ModelConfigResponse>, Status> {
        let request = request.get_ref();
        let rt = self
            .repository
            .runtime_version(&request.name, &request.version)?;
        Ok(Response::new(pb::ModelConfigResponse {
            config: Some(crate::triton_config::to_proto(&rt)),
        }))
    }

    async fn model_statistics(
        &self,
        request: Request<pb::ModelStatisticsRequest>,
    ) -> Result<Response<pb::ModelStatisticsResponse>, Status> {
        let name = &request.get_ref().name;
        let runtimes = if name.is_empty() {
            self.repository.ready_runtimes()
        } else {
            vec![self.repository.runtime(name)?]
        };
        Ok(Response::new(pb::ModelStatisticsResponse {
            model_stats: runtimes
                .iter()
                .map(|rt| crate::triton_config::statistics_proto(rt))
                .collect(),
        }))
    }

    async fn repository_index(
        &self,
        request: Request<pb::RepositoryIndexRequest>,
    ) -> Result<Response<pb::RepositoryIndexResponse>, Status> {
        let only_ready = request.get_ref().ready;
        Ok(Response::new(pb::RepositoryIndexResponse {
            models: self
                .repository
                .index()
                .into_iter()
                .filter(|m| !only_ready || m.state == "READY")
                .map(|m| pb::repository_index_response::ModelIndex {
                    name: m.name,
                    version: m.version,
                    state: m.state.into(),
                    reason: m.reason,
                })
                .collect(),
        }))
    }

    async fn repository_model_load(
        &self,
        request: Request<pb::RepositoryModelLoadRequest>,
    ) -> Result<Response<pb::RepositoryModelLoadResponse>, Status> {
        let request = request.into_inner();
        crate::codec::control::check_load(&crate::codec::control::grpc_parameters(
            &request.parameters,
        ))?;
        let repository = Arc::clone(&self.repository);
        // Loading reads weights and runs the warm-up: blocking work, off the async runtime.
        tokio::task::spawn_blocking(move || repository.request_load(&request.model_name))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(pb::RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        request: Request<pb::RepositoryModelUnloadRequest>,
    ) -> Result<Response<pb::RepositoryModelUnloadResponse>, Status> {
        let request = request.into_inner();
        crate::codec::control::check_unload(&crate::codec::control::grpc_parameters(
            &request.parameters,
        ))?;
        self.repository.request_unload(&request.model_name)?;
        Ok(Response::new(pb::RepositoryModelUnloadResponse {}))
    }
}
