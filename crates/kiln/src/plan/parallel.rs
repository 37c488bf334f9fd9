//! The plan's data-parallel decision: how many ranks this run has, from whom, and whether
//! this build can join them.

use crate::distributed::launcher_world;
use crate::error::{KilnError, Result};

/// Whether this build has the MPI engine (cargo feature `mpi`).
pub const MPI_COMPILED: bool = cfg!(feature = "mpi");

/// What `train.data_parallel` resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataParallel {
    /// This process's rank and the number of ranks, when launched as one of several.
    pub world: Option<(usize, usize)>,
    /// Ranks as threads of this process, one per CUDA device (`train.data_parallel =
    /// "gpus"`): how many.
    pub gpus: Option<usize>,
    /// Why, in words.
    pub why: String,
}

impl DataParallel {
    /// Resolves `train.data_parallel` (`auto`, `off` or `gpus`) against how the process was
    /// launched; `cuda_devices` is how many CUDA devices the run's backend has (`None` when
    /// it is not `cuda`).
    pub fn resolve(
        mode: &str,
        batch_size: usize,
        cuda_devices: Option<usize>,
    ) -> Result<DataParallel> {
        match mode {
            "gpus" => DataParallel::on_gpus(batch_size, launcher_world(), cuda_devices),
            _ => DataParallel::resolve_for(mode, batch_size, launcher_world(), MPI_COMPILED),
        }
    }

    /// `gpus`: one rank per CUDA device, as threads of this process (not combined with an MPI
    /// launch; a backend other than cuda, or no device, is refused).
    pub fn on_gpus(
        batch_size: usize,
        world: Option<(usize, usize)>,
        cuda_devices: Option<usize>,
    ) -> Result<DataParallel> {
        if let Some((rank, size)) = world {
            return Err(KilnError::Inconsistent(format!(
                "train.data_parallel = \"gpus\" (one rank per GPU inside one process) but this \
                 process is rank {rank} of {size} launched by an MPI launcher: launch one \
                 process, or set train.data_parallel = \"auto\" for one rank per process"
            )));
        }
        let n = match cuda_devices {
            None => {
                return Err(KilnError::Inconsistent(
                    "train.data_parallel = \"gpus\" needs the cuda backend (device.backend = \
                     \"cuda\" or auto on a machine with an NVIDIA GPU, a kiln built with \
                     --features cuda); on the CPU use ranks as processes (--processes N)"
                        .into(),
                ));
            }
            Some(0) => {
                return Err(KilnError::Inconsistent(
                    "train.data_parallel = \"gpus\" but the CUDA driver reports no device".into(),
                ));
            }
            Some(n) => n,
        };
        Ok(DataParallel {
            world: None,
            gpus: Some(n),
            why: format!(
                "one rank per GPU in this process ({n} CUDA device(s)): {batch_size} samples \
                 per GPU and micro-batch, {} in all; gradients all-reduced on the devices by \
                 Burn's collective (NCCL) once per optimizer step",
                batch_size * n
            ),
        })
    }

    /// [`DataParallel::resolve`] of `auto`/`off` with the launch and the build given (for
    /// tests).
    pub fn resolve_for(
        mode: &str,
        batch_size: usize,
        world: Option<(usize, usize)>,
        mpi_compiled: bool,
    ) -> Result<DataParallel> {
        let Some((rank, size)) = world else {
            return Ok(DataParallel {
                world: None,
                gpus: None,
                why: "one process (run `mpirun -n N kiln train ...` or `kiln train --processes \
                      N` with the mpi build for N ranks)"
                    .into(),
            });
        };
        if mode == "off" {
            return Err(KilnError::Inconsistent(format!(
                "train.data_parallel = \"off\" but this process is rank {rank} of {size} \
                 launched by an MPI launcher: launch one process, or set train.data_parallel = \
                 \"auto\" to train one model over the {size} ranks"
            )));
        }
        if !mpi_compiled {
            return Err(KilnError::Inconsistent(format!(
                "launched as rank {rank} of {size} by an MPI launcher, but this kiln was built \
                 without MPI: build with `--features mpi` (needs `apt install libopenmpi-dev \
                 openmpi-bin libclang-dev`), or launch one process"
            )));
        }
        Ok(DataParallel {
            world: Some((rank, size)),
            gpus: None,
            why: format!(
                "MPI, rank {rank} of {size}: {batch_size} samples per rank and micro-batch, {} \
                 in all; gradients all-reduced once per optimizer step",
                batch_size * size
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launch_with_ranks_needs_auto_and_the_mpi_build() {
        let single = DataParallel::resolve_for("auto", 64, None, false).unwrap();
        assert_eq!(single.world, None);
        let dp = DataParallel::resolve_for("auto", 64, Some((1, 4)), true).unwrap();
        assert_eq!(dp.world, Some((1, 4)));
        assert!(dp.why.contains("256 in all"), "{}", dp.why);
        let off = DataParallel::resolve_for("off", 64, Some((0, 2)), true).unwrap_err();
        assert!(off.to_string().contains("data_parallel = \"off\""), "{off}");
        let unbuilt = DataParallel::resolve_for("auto", 64, Some((0, 2)), false).unwrap_err();
        assert!(unbuilt.to_string().contains("--features mpi"), "{unbuilt}");
    }

    #[test]
    fn gpus_means_one_rank_per_cuda_device_and_says_what_it_needs() {
        let two = DataParallel::on_gpus(32, None, Some(2)).unwrap();
        assert_eq!((two.world, two.gpus), (None, Some(2)));
        assert!(two.why.contains("64 in all"), "{}", two.why);
        let cpu = DataParallel::on_gpus(32, None, None)
            .unwrap_err()
            .to_string();
        assert!(
            cpu.contains("cuda backend") && cpu.contains("--processes"),
            "{cpu}"
        );
        let none = DataParallel::on_gpus(32, None, Some(0))
            .unwrap_err()
            .to_string();
        assert!(none.contains("no device"), "{none}");
        let mpi = DataParallel::on_gpus(32, Some((0, 2)), Some(1)).unwrap_err();
        assert!(mpi.to_string().contains("MPI launcher"), "{mpi}");
    }
}
