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
    /// Why, in words.
    pub why: String,
}

impl DataParallel {
    /// Resolves `train.data_parallel` (`auto` or `off`) against how the process was launched.
    pub fn resolve(mode: &str, batch_size: usize) -> Result<DataParallel> {
        DataParallel::resolve_for(mode, batch_size, launcher_world(), MPI_COMPILED)
    }

    /// [`DataParallel::resolve`] with the launch and the build given (for tests).
    pub fn resolve_for(
        mode: &str,
        batch_size: usize,
        world: Option<(usize, usize)>,
        mpi_compiled: bool,
    ) -> Result<DataParallel> {
        let Some((rank, size)) = world else {
            return Ok(DataParallel {
                world: None,
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
}
