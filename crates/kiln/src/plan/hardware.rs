//! The hardware probe: what this machine has, so `auto` settings resolve to real values.

use crate::error::{KilnError, Result};

/// A tensor backend Kiln can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Burn's embedded CPU backend.
    Flex,
    /// NVIDIA GPUs (the `cuda` cargo feature).
    Cuda,
}

impl Backend {
    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Flex => "flex",
            Backend::Cuda => "cuda",
        }
    }

    /// Parses a validated name (anything but `cuda` is flex).
    pub fn from_name(name: &str) -> Self {
        if name == "cuda" {
            Backend::Cuda
        } else {
            Backend::Flex
        }
    }

    /// The Burn device for this backend, with autodiff for training.
    pub fn device(self) -> burn::tensor::Device {
        match self {
            Backend::Flex => burn::tensor::Device::flex(),
            #[cfg(feature = "cuda")]
            Backend::Cuda => burn::tensor::Device::cuda(0),
            #[cfg(not(feature = "cuda"))]
            Backend::Cuda => burn::tensor::Device::flex(),
        }
    }
}

/// What the probe found.
#[derive(Debug, Clone)]
pub struct Hardware {
    /// Logical CPU cores available to this process.
    pub cores: usize,
    /// Whether this binary was built with the `cuda` feature.
    pub cuda_compiled: bool,
    /// Whether the NVIDIA driver library (`libcuda.so.1`) can be loaded.
    pub cuda_driver: bool,
    /// Host memory this process may use, bytes, and what bounds it (the cgroup limit or
    /// physical memory); `None` where the system does not say.
    pub memory: Option<(u64, &'static str)>,
}

impl Hardware {
    /// Probes the current machine.
    pub fn probe() -> Self {
        Hardware {
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cuda_compiled: cfg!(feature = "cuda"),
            cuda_driver: cuda_driver_present(),
            memory: crate::observe::memory::memory_limit(),
        }
    }

    /// The backend `auto` resolves to.
    pub fn best_backend(&self) -> Backend {
        if self.cuda_compiled && self.cuda_driver {
            Backend::Cuda
        } else {
            Backend::Flex
        }
    }

    /// Why `auto` chose what it chose.
    pub fn backend_reason(&self) -> String {
        match (self.cuda_compiled, self.cuda_driver) {
            (true, true) => "built with cuda, driver found".into(),
            (true, false) => "built with cuda but no NVIDIA driver; embedded CPU".into(),
            _ => "no cuda feature; embedded CPU".into(),
        }
    }
}

impl Hardware {
    /// `Ok` when this build and this machine can run `backend`; otherwise an error that says
    /// what is missing and how to get it. `asked` names where the request came from
    /// (`device.backend = "cuda"`, `--device cuda`, `kind = "KIND_GPU"`).
    pub fn ensure_runs(&self, backend: Backend, asked: &str) -> Result<()> {
        if backend == Backend::Cuda && !self.cuda_compiled {
            return Err(KilnError::Inconsistent(format!(
                "{asked} but this kiln was built without CUDA; rebuild with `cargo build \
                 --release --features cuda` (docs/cuda.md) or use the CPU (flex)"
            )));
        }
        if backend == Backend::Cuda && !self.cuda_driver {
            return Err(KilnError::Inconsistent(format!(
                "{asked} but no NVIDIA driver (libcuda.so.1) can be loaded on this machine; \
                 install the driver (or add its directory to LD_LIBRARY_PATH) or use the CPU \
                 (flex)"
            )));
        }
        Ok(())
    }
}

/// Whether the NVIDIA driver library loads. cudarc loads it lazily and panics on a worker
/// thread when it is missing, so Kiln checks first and reports a clear error instead.
#[cfg(feature = "cuda")]
fn cuda_driver_present() -> bool {
    [c"libcuda.so.1", c"libcuda.so"].iter().any(|name| {
        // SAFETY: dlopen/dlclose with a valid NUL-terminated name; the handle is closed
        // immediately and nothing from the library is called.
        unsafe {
            let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY);
            if handle.is_null() {
                false
            } else {
                libc::dlclose(handle);
                true
            }
        }
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda_driver_present() -> bool {
    false
}
