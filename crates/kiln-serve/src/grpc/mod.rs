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
}

impl GrpcFrontend {
    /// A service answering from `repository`.
    pub fn new(repository: Arc<Repository>) -> Self {
        GrpcFrontend { repository }
    }

    /// The tonic server for this front end (large messages allowed: batches of images).
    pub fn into_service(
        self,
    ) -> pb::grpc_inference_service_server::GrpcInferenceServiceServer<Self> {
        pb::grpc_inference_service_server::GrpcInferenceServiceServer::new(self)
            .max_decoding_message_size(crate::MAX_BODY_BYTES)
            .max_encoding_message_size(crate::MAX_BODY_BYTES)
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
        let name = &request.get_ref().name;
        self.repository.entry(name)?;
        Ok(Response::new(pb::ModelReadyResponse {
            ready: self.repository.runtime(name).is_ok(),
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
        let rt = self.repository.runtime(&request.get_ref().name)?;
        let meta = |s: &crate::tensor::TensorSpec| pb::model_metadata_response::TensorMetadata {
            name: s.name.clone(),
            datatype: s.datatype.wire_name().into(),
            shape: s.batched_shape(),
        };
        Ok(Response::new(pb::ModelMetadataResponse {
            name: rt.name.clone(),
            versions: vec!["1".into()],
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
        let rt = self.repository.runtime(&request.model_name)?;
        match rt.infer(WireRequest::Grpc(Box::new(request))).await? {
            Encoded::Grpc(response) => Ok(Response::new(*response)),
            Encoded::Http { .. } => Err(Status::internal("HTTP encoding for a gRPC request")),
        }
    }

    async fn model_config(
        &self,
        request: Request<pb::ModelConfigRequest>,
    ) -> Result<Response<pb::ModelConfigResponse>, Status> {
        let rt = self.repository.runtime(&request.get_ref().name)?;
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
                .filter(|m| !only_ready || m.reason.is_empty())
                .map(|m| pb::repository_index_response::ModelIndex {
                    name: m.name,
                    version: "1".into(),
                    state: m.state.into(),
                    reason: m.reason,
                })
                .collect(),
        }))
    }
}
