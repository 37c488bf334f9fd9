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
            #[cfg(feature = "cuda-eager")]
            Backend::Cuda => burn::tensor::Device::cuda(0),
            #[cfg(not(feature = "cuda-eager"))]
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
    /// CUDA devices the driver reports (0 without a cuda build or a driver).
    pub gpu_count: usize,
    /// Memory of the first CUDA device, bytes (a cuda build with the driver; `None`
    /// otherwise): what a run on `cuda` budgets against instead of host memory.
    pub gpu_memory: Option<u64>,
}

impl Hardware {
    /// Probes the current machine.
    pub fn probe() -> Self {
        Hardware {
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cuda_compiled: cfg!(feature = "cuda-eager"),
            cuda_driver: cuda_driver_present(),
            memory: crate::observe::memory::memory_limit(),
            gpu_count: cuda_devices().map_or(0, |c| c.count),
            gpu_memory: cuda_devices().map(|c| c.memory),
        }
    }

    /// The memory a run on `backend` has, bytes, and what it is: the GPU's memory on `cuda`
    /// (where the probe read it), else the host's ([`Hardware::memory`]).
    pub fn memory_for(&self, backend: Backend) -> Option<(u64, &'static str)> {
        match (backend, self.gpu_memory) {
            (Backend::Cuda, Some(bytes)) => Some((bytes, "GPU memory")),
            _ => self.memory,
        }
    }

    /// The backend a `device.backend` / `--device` value names on this machine: `auto` is
    /// [`Hardware::best_backend`], any other validated name [`Backend::from_name`].
    pub fn backend_named(&self, name: &str) -> Backend {
        if name == "auto" {
            self.best_backend()
        } else {
            Backend::from_name(name)
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

/// The NVIDIA driver library (`libcuda.so.1`, else `libcuda.so`), opened with dlopen; `None`
/// where neither loads. The handle stays open (dlopen counts references; cudarc opens the
/// same library later).
#[cfg(feature = "cuda-eager")]
fn open_libcuda() -> Option<*mut libc::c_void> {
    [c"libcuda.so.1", c"libcuda.so"]
        .iter()
        // SAFETY: dlopen with a valid NUL-terminated name; nothing is called here.
        .map(|name| unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY) })
        .find(|h| !h.is_null())
}

/// Whether the NVIDIA driver library loads. cudarc loads it lazily and panics on a worker
/// thread when it is missing, so Kiln checks first and reports a clear error instead.
#[cfg(feature = "cuda-eager")]
fn cuda_driver_present() -> bool {
    open_libcuda().is_some()
}

#[cfg(not(feature = "cuda-eager"))]
fn cuda_driver_present() -> bool {
    false
}

/// What the CUDA driver reports: the devices and the first one's memory.
#[derive(Debug, Clone, Copy)]
struct CudaDevices {
    count: usize,
    memory: u64,
}

/// The CUDA devices, read once through the driver API (`cuInit`, `cuDeviceGetCount`,
/// `cuDeviceGet`, `cuDeviceTotalMem_v2` from `libcuda.so.1`); `None` without a driver or a
/// device. Read here rather than through Burn so that the plan can size the watermark and
/// the ranks before any device is opened.
#[cfg(feature = "cuda-eager")]
fn cuda_devices() -> Option<CudaDevices> {
    static FOUND: std::sync::OnceLock<Option<CudaDevices>> = std::sync::OnceLock::new();
    *FOUND.get_or_init(|| {
        type Init = unsafe extern "C" fn(u32) -> i32;
        type Count = unsafe extern "C" fn(*mut i32) -> i32;
        type Get = unsafe extern "C" fn(*mut i32, i32) -> i32;
        type Total = unsafe extern "C" fn(*mut usize, i32) -> i32;
        let lib = open_libcuda()?;
        // SAFETY: the symbols are the CUDA driver API's, called with their documented
        // signatures (CUresult = int, CUdevice = int, int and size_t out-parameters) while the
        // library stays loaded.
        unsafe {
            let sym = |name: &std::ffi::CStr| {
                let f = libc::dlsym(lib, name.as_ptr());
                (!f.is_null()).then_some(f)
            };
            let init: Init = std::mem::transmute(sym(c"cuInit")?);
            let count: Count = std::mem::transmute(sym(c"cuDeviceGetCount")?);
            let get: Get = std::mem::transmute(sym(c"cuDeviceGet")?);
            let total: Total = std::mem::transmute(sym(c"cuDeviceTotalMem_v2")?);
            let (mut n, mut device, mut bytes) = (0, 0, 0usize);
            let ok = init(0) == 0
                && count(&mut n) == 0
                && n > 0
                && get(&mut device, 0) == 0
                && total(&mut bytes, device) == 0;
            ok.then_some(CudaDevices {
                count: n as usize,
                memory: bytes as u64,
            })
        }
    })
}

#[cfg(not(feature = "cuda-eager"))]
fn cuda_devices() -> Option<CudaDevices> {
    None
}
