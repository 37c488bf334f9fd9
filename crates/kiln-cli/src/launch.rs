//! Data parallelism from the command line: `kiln train --processes N` relaunches itself
//! under `mpirun -n N` on this machine, and a process launched by an MPI launcher joins
//! `MPI_COMM_WORLD` (the `mpi` build).

use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use kiln::distributed::Collective;
use kiln::plan::Plan;

/// Runs this same `kiln train` command as `processes` ranks under `mpirun` and returns its
/// exit code. Ranks are not bound to cores (Open MPI binds each to one core by default, which
/// would put all of a rank's threads on it); each rank's plan divides the cores between the
/// ranks on the machine unless `--threads` is given.
pub fn relaunch(processes: usize) -> Result<i32> {
    if !kiln::plan::MPI_COMPILED {
        bail!(
            "--processes needs the mpi build of kiln: `cargo install --path crates/kiln-cli \
             --features mpi` (with `apt install libopenmpi-dev openmpi-bin libclang-dev`)"
        );
    }
    let exe = std::env::current_exe().context("finding the kiln executable")?;
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "-n",
        &processes.to_string(),
        "--oversubscribe",
        "--bind-to",
        "none",
    ]);
    // Open MPI refuses to run as root without both; containers and CI run as root.
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    // The same arguments, `--processes` included: a rank sees the launcher's environment
    // and trains instead of relaunching (`train_cmd::run`).
    cmd.arg(exe).args(std::env::args().skip(1));
    tracing::info!("relaunching as {processes} ranks: {cmd:?}");
    let status = cmd.status().map_err(|e| {
        anyhow::anyhow!(
            "cannot start mpirun ({e}): --processes launches ranks with Open MPI's mpirun \
             (`apt install openmpi-bin`)"
        )
    })?;
    Ok(status.code().unwrap_or(1))
}

/// The collective this process trains with: MPI's world when the plan says the process is
/// one of several ranks, else none (one process).
pub fn join(plan: &Plan) -> Result<Option<Arc<dyn Collective>>> {
    if plan.data_parallel.world.is_none() {
        return Ok(None);
    }
    #[cfg(feature = "mpi")]
    {
        let world =
            kiln::distributed::mpi::MpiCollective::init()?.with_timeout(plan.collective_timeout);
        Ok(Some(Arc::new(world)))
    }
    #[cfg(not(feature = "mpi"))]
    {
        // The plan refuses a multi-rank launch in a build without MPI.
        bail!("this kiln was built without MPI (--features mpi)")
    }
}
