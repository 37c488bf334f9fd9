//! `kiln serve`: the KServe v2 inference server over a model repository.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use kiln_serve::{
    InstanceKind, ModelControlMode, Repository, RepositoryOptions, Server, ServerOptions,
};

/// `kiln serve` arguments.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model repository: one directory per model, each with a config.toml
    /// (`kiln optimize --out DIR/NAME` writes a servable one).
    #[arg(long)]
    models: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// HTTP/REST port (Triton's default is 8000; 0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    http_port: u16,
    /// gRPC port (Triton's default is 8001; 0 picks a free one).
    #[arg(long, default_value_t = 8001)]
    grpc_port: u16,
    /// Serve HTTP only.
    #[arg(long)]
    no_grpc: bool,
    /// Threads per model for each of the preprocess and postprocess stages (0 = none: all
    /// decoding in the request handler, all encoding on the instance thread).
    #[arg(long, default_value_t = 1)]
    stage_threads: usize,
    /// Requests and responses up to this many bytes are decoded / encoded in place instead of
    /// on a stage thread (a hand-off costs more than the work); 0 = always staged.
    #[arg(long, default_value_t = 16384)]
    inline_bytes: usize,
    /// Largest request in bytes, on both protocols (an HTTP body, a gRPC message).
    #[arg(long, default_value_t = kiln_serve::MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// How models change while serving (Triton's modes): none (loaded once at start), poll
    /// (the repository is re-read every --repository-poll-secs: new, changed and removed
    /// models and versions load, reload and unload), explicit (clients load and unload:
    /// POST /v2/repository/models/M/load and /unload, gRPC RepositoryModelLoad/Unload).
    #[arg(long, default_value = "none")]
    model_control_mode: String,
    /// Poll mode: seconds between two reads of the repository.
    #[arg(long, default_value_t = 15)]
    repository_poll_secs: u64,
    /// Explicit mode: a model to load at start (repeat it; `*` loads every model). Others
    /// wait for a load request.
    #[arg(long = "load-model")]
    load_models: Vec<String>,
    /// Exit with an error when any model fails to load at start, instead of serving the
    /// others (for deployments that want all or nothing).
    #[arg(long)]
    exit_on_error: bool,
    /// Seconds a replaced or unloaded model version waits for its in-flight requests before
    /// it stops anyway.
    #[arg(long, default_value_t = 60)]
    drain_timeout_secs: u64,
    /// CPU threads for tensor work (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Where models run whose config.toml says `kind = "KIND_AUTO"` or nothing: auto (a GPU
    /// when this kiln is built with CUDA and a driver loads, else the CPU), cpu or gpu.
    #[arg(long, default_value = "auto")]
    device: String,
}

/// Loads the repository, serves until Ctrl-C / SIGTERM, then drains in-flight requests.
pub fn run(args: ServeArgs) -> Result<()> {
    crate::alloc::purge_for_serving();
    if args.threads > 0 {
        kiln::plan::set_cpu_threads(args.threads);
    }
    let default_kind = InstanceKind::parse(&args.device)
        .map_err(|_| anyhow::anyhow!("--device {:?}: use auto, cpu or gpu", args.device))?;
    let mode = ModelControlMode::parse(&args.model_control_mode)
        .map_err(|e| anyhow::anyhow!("--model-control-mode: {e}"))?;
    if !args.load_models.is_empty() && mode != ModelControlMode::Explicit {
        anyhow::bail!(
            "--load-model applies to --model-control-mode explicit; the {} mode loads every model",
            mode.name()
        );
    }
    if mode == ModelControlMode::Poll && args.repository_poll_secs == 0 {
        anyhow::bail!("--repository-poll-secs must be at least 1");
    }
    let options = RepositoryOptions {
        stages: kiln_serve::Stages {
            threads: args.stage_threads,
            inline_bytes: args.inline_bytes,
        },
        default_kind,
        mode,
        startup_models: args.load_models.clone(),
        drain_timeout: std::time::Duration::from_secs(args.drain_timeout_secs),
        release_memory: Some(crate::alloc::release_free_memory),
    };
    let repository = Arc::new(
        Repository::open(&args.models, options)
            .with_context(|| format!("loading models from {}", args.models.display()))?,
    );
    for w in repository.warnings() {
        eprintln!("warning: {w}");
    }
    for m in repository.index() {
        let version = if m.version.is_empty() {
            String::new()
        } else {
            format!(" version {}", m.version)
        };
        if m.reason.is_empty() {
            eprintln!("model {}{version}: {}", m.name, m.state);
        } else {
            eprintln!("model {}{version}: {} — {}", m.name, m.state, m.reason);
        }
    }
    let failures = repository.failures();
    if args.exit_on_error && !failures.is_empty() {
        repository.shutdown();
        let names: Vec<String> = failures
            .iter()
            .map(|f| match f.version.as_str() {
                "" => f.name.clone(),
                v => format!("{} version {v}", f.name),
            })
            .collect();
        anyhow::bail!(
            "--exit-on-error: {} failed to load ({}); the reasons are above",
            if names.len() == 1 {
                "a model"
            } else {
                "models"
            },
            names.join(", ")
        );
    }
    if mode == ModelControlMode::Poll {
        repository
            .start_polling(std::time::Duration::from_secs(args.repository_poll_secs))
            .context("starting the repository poll")?;
    }
    let options = ServerOptions {
        http: SocketAddr::new(args.host, args.http_port),
        grpc: (!args.no_grpc).then(|| SocketAddr::new(args.host, args.grpc_port)),
        max_body_bytes: args.max_body_bytes,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let server = Server::bind(Arc::clone(&repository), &options).await?;
        let shutdown = shutdown_signal()?;
        // One line a script can wait for, with the ports actually bound.
        println!(
            "kiln-serve listening: http {} grpc {}",
            server.http_addr()?,
            server
                .grpc_addr()?
                .map_or_else(|| "off".to_string(), |a| a.to_string())
        );
        server.run(shutdown).await?;
        anyhow::Ok(())
    })
}

/// Ctrl-C or SIGTERM, registered now: a signal that arrives right after the listening line
/// (a supervisor stopping a server it just started) still drains in-flight requests instead of
/// killing the process, which a handler installed on the future's first poll would miss.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()> + Send + 'static> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("listening for Ctrl-C")?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {},
                _ = interrupt.recv() => {},
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
