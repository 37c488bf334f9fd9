//! Binding and running the HTTP and gRPC front ends with graceful shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::error::{Result, ServeError};
use crate::grpc::GrpcFrontend;
use crate::repository::Repository;

/// Where and how to serve.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// HTTP/REST address (Triton's default port is 8000).
    pub http: SocketAddr,
    /// gRPC address (Triton's default 8001); `None` serves HTTP only.
    pub grpc: Option<SocketAddr>,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            http: SocketAddr::from(([127, 0, 0, 1], 8000)),
            grpc: Some(SocketAddr::from(([127, 0, 0, 1], 8001))),
            max_body_bytes: crate::MAX_BODY_BYTES,
        }
    }
}

/// A server with its sockets bound (so port 0 resolves before it runs).
#[derive(Debug)]
pub struct Server {
    repository: Arc<Repository>,
    http: TcpListener,
    grpc: Option<TcpListener>,
    max_body_bytes: usize,
}

impl Server {
    /// Binds the sockets; a port in use is an error naming the address.
    pub async fn bind(repository: Arc<Repository>, options: &ServerOptions) -> Result<Self> {
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr).await.map_err(|e| {
                ServeError::Io(std::io::Error::new(
                    e.kind(),
                    format!("cannot listen on {addr}: {e}; choose another port"),
                ))
            })
        };
        let http = bind(options.http).await?;
        let grpc = match options.grpc {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        Ok(Server {
            repository,
            http,
            grpc,
            max_body_bytes: options.max_body_bytes,
        })
    }

    /// The bound HTTP address.
    pub fn http_addr(&self) -> Result<SocketAddr> {
        Ok(self.http.local_addr()?)
    }

    /// The bound gRPC address, if serving gRPC.
    pub fn grpc_addr(&self) -> Result<Option<SocketAddr>> {
        Ok(self.grpc.as_ref().map(|l| l.local_addr()).transpose()?)
    }

    /// Serves until `shutdown` completes; then stops accepting, finishes every in-flight
    /// request on both protocols, and drains and stops the model pipelines.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let router = crate::http::router(Arc::clone(&self.repository), self.max_body_bytes);
        let http = tokio::spawn(
            axum::serve(self.http, router)
                .with_graceful_shutdown(stopped(stop_rx.clone()))
                .into_future(),
        );
        let grpc = self.grpc.map(|listener| {
            let service =
                GrpcFrontend::new(Arc::clone(&self.repository), self.max_body_bytes).into_service();
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, stopped(stop_rx.clone())),
            )
        });
        shutdown.await;
        tracing::info!("shutting down: finishing in-flight requests");
        let _ = stop_tx.send(true);
        let join_err = |e: tokio::task::JoinError| ServeError::Io(std::io::Error::other(e));
        let http_result = http.await.map_err(join_err)?;
        if let Some(g) = grpc {
            g.await
                .map_err(join_err)?
                .map_err(|e| ServeError::Io(std::io::Error::other(e)))?;
        }
        // Every request a client is still waiting on has been answered; stop the stages.
        let repository = Arc::clone(&self.repository);
        tokio::task::spawn_blocking(move || repository.shutdown())
            .await
            .map_err(join_err)?;
        http_result?;
        tracing::info!("stopped");
        Ok(())
    }
}
