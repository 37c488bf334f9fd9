//! Ranks as threads of one process, one accelerator each, with the gradients all-reduced
//! where they live by Burn's own collective ([`burn::tensor::distributed`]: NCCL on CUDA),
//! the in-process data parallelism of DDP on one machine with several GPUs.
//!
//! Only the gradients go through the device collective (they are the bulk of the traffic,
//! and copying them to the host and back is what this engine exists to avoid). The small
//! host-side collectives (loss sums, flags, the replica check, broadcasting rank 0's initial
//! parameters) go through a [`ThreadGroup`] beside it, so every rank still takes the same
//! decisions from the same numbers.

use std::sync::Arc;

use burn::tensor::Device;
use burn::tensor::distributed::{DistributedConfig, DistributedContext, ReduceOperation};

use super::{Collective, ReduceOp, ThreadGroup};
use crate::error::{KilnError, Result};

/// One rank of an in-process group over accelerators; build the group with
/// [`DeviceGroup::new`] and train rank `i` on [`DeviceGroup::device`] in its own thread.
pub struct DeviceGroup {
    host: ThreadGroup,
    devices: Arc<Vec<Device>>,
    /// Burn's communication context for these devices, shared by the members and torn down
    /// when the last one is dropped.
    _context: Arc<DistributedContext>,
}

impl DeviceGroup {
    /// The members of a new group, rank `i` on `devices[i]`. Refuses an empty list, a device
    /// named twice (NCCL needs one rank per device) and devices whose backend has no
    /// collective (`flex`: Burn leaves `all_reduce` unimplemented on the CPU; use
    /// [`ThreadGroup`] or MPI there).
    pub fn new(devices: Vec<Device>) -> Result<Vec<DeviceGroup>> {
        Self::with_timeout(devices, None)
    }

    /// As [`DeviceGroup::new`], with the host side's [`ThreadGroup::with_timeout`]: a rank
    /// that does not reach a step's host exchange (which comes before the device all-reduce)
    /// within `timeout` stops the others with an error instead of leaving them waiting.
    pub fn with_timeout(
        devices: Vec<Device>,
        timeout: Option<std::time::Duration>,
    ) -> Result<Vec<DeviceGroup>> {
        if devices.is_empty() {
            return Err(KilnError::Collective(
                "a device group needs at least one device".into(),
            ));
        }
        for (i, d) in devices.iter().enumerate() {
            if !has_collective(d) {
                return Err(KilnError::Collective(format!(
                    "device {d:?} has no device collective in Burn 0.22 (only the CubeCL \
                     backends, CUDA among them, implement all_reduce): train on CUDA \
                     devices, or use ranks as threads (ThreadGroup) or MPI on the CPU"
                )));
            }
            if devices[..i].contains(d) {
                return Err(KilnError::Collective(format!(
                    "device {d:?} is named twice: each rank of a device group needs its own \
                     device (NCCL runs one rank per GPU)"
                )));
            }
        }
        let context = Arc::new(DistributedContext::init(
            devices.clone(),
            DistributedConfig {
                all_reduce_op: ReduceOperation::Sum,
            },
        ));
        let devices = Arc::new(devices);
        Ok(ThreadGroup::group(devices.len(), timeout)
            .into_iter()
            .map(|host| DeviceGroup {
                host,
                devices: devices.clone(),
                _context: context.clone(),
            })
            .collect())
    }

    /// The device this rank trains on.
    pub fn device(&self) -> &Device {
        &self.devices[self.host.rank()]
    }
}

/// The machine's CUDA devices in index order (none in a build without CUDA): the devices of
/// a [`DeviceGroup`] over every GPU.
pub fn cuda_devices() -> Vec<Device> {
    #[cfg(feature = "cuda-eager")]
    {
        Device::enumerate(burn::tensor::DeviceType::Cuda)
            .into_iter()
            .collect()
    }
    #[cfg(not(feature = "cuda-eager"))]
    {
        Vec::new()
    }
}

/// Whether Burn implements the collective for `device`'s backend. Only the CubeCL runtimes
/// do; `flex`, the CPU backend Kiln builds, panics in `all_reduce`, so it is refused first
/// (device equality ignores autodiff).
fn has_collective(device: &Device) -> bool {
    *device != Device::flex()
}

impl Collective for DeviceGroup {
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn size(&self) -> usize {
        self.host.size()
    }
    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.host.all_reduce_f32(buf, op)
    }
    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        self.host.all_reduce_f64(buf, op)
    }
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.host.broadcast_f32(buf, root)
    }
    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }
    fn engine(&self) -> &'static str {
        "devices"
    }
    fn device_group(&self) -> Option<&[Device]> {
        Some(&self.devices)
    }
}
