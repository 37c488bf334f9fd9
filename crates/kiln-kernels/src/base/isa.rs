//! The one place a kernel family learns which instruction set to run: the CPU's features
//! probed once, and an environment variable that may name a lesser path so it can be
//! measured on a better machine (`KILN_F32_KERNEL`, `KILN_INT8_KERNEL`, `KILN_WINOGRAD`).
//! Every family chooses through [`choose`], so an unknown or unsupported name warns the same
//! way everywhere.

use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
use std::arch::asm;

/// Defines `fn $name(args)` whose body is compiled three times, for AVX-512, for AVX2 + FMA
/// and for the baseline, and run as [`F32Kernel::detect`] picks
/// (`KILN_F32_KERNEL`): the same Rust, so LLVM vectorizes each copy to its instruction set's
/// width. Used by the element-wise kernels (activations, pooling, layout, per-channel arithmetic).
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn portable($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) {
                    portable($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) {
                    portable($($arg),*)
                }
                match $crate::base::isa::F32Kernel::detect() {
                    // SAFETY: `detect` picks an instruction set only where the CPU has it.
                    $crate::base::isa::F32Kernel::Avx512 => unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    $crate::base::isa::F32Kernel::Avx2 => unsafe { avx2($($arg),*) },
                    $crate::base::isa::F32Kernel::Portable => portable($($arg),*),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            portable($($arg),*)
        }
    };
}

/// The kernel a family of SIMD kernels runs: `best` (what this CPU supports), or the one the
/// environment variable `var` names when this CPU runs it, so a lesser path (AVX2 on an
/// AVX-512 machine) can be measured. `all` is ordered best first; a named kernel before
/// `best` or an unknown name falls back to `best` with a warning that says why.
pub fn choose<K: Copy + PartialEq>(
    var: &str,
    all: &[K],
    best: K,
    name: fn(K) -> &'static str,
) -> K {
    let Ok(wanted) = std::env::var(var) else {
        return best;
    };
    let rank = |k: K| all.iter().position(|a| *a == k);
    match all.iter().copied().find(|k| name(*k) == wanted) {
        Some(k) if rank(k) >= rank(best) => k,
        Some(k) => {
            tracing::warn!(
                "{var}={wanted}: this CPU lacks {}; using {}",
                name(k),
                name(best)
            );
            best
        }
        None => {
            let names: Vec<&str> = all.iter().map(|k| name(*k)).collect();
            tracing::warn!(
                "{var}={wanted} is not a kernel ({}); using {}",
                names.join(", "),
                name(best)
            );
            best
        }
    }
}

/// Which f32 convolution kernel this CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F32Kernel {
    /// AVX-512F: 12 × 32 register tile.
    Avx512,
    /// AVX2 + FMA: 6 × 16 register tile.
    Avx2,
    /// The `gemm` crate over a gathered patch matrix.
    Portable,
}

impl F32Kernel {
    /// The kernel f32 convolutions use (decided once): the best this CPU supports, or the one
    /// named by `KILN_F32_KERNEL` (`avx512`, `avx2`, `portable`) when the CPU supports it, so
    /// the AVX2 path can be measured on an AVX-512 machine.
    pub fn detect() -> F32Kernel {
        static KERNEL: OnceLock<F32Kernel> = OnceLock::new();
        *KERNEL.get_or_init(|| {
            choose(
                "KILN_F32_KERNEL",
                &[F32Kernel::Avx512, F32Kernel::Avx2, F32Kernel::Portable],
                F32Kernel::best_supported(),
                F32Kernel::name,
            )
        })
    }

    fn best_supported() -> F32Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            // The AVX-512 kernels use AVX2 and FMA too (every AVX-512 CPU has them).
            if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                return F32Kernel::Avx512;
            }
            if avx2 {
                return F32Kernel::Avx2;
            }
        }
        F32Kernel::Portable
    }

    /// Every kernel this CPU can run, best first (benchmarks and tests compare them).
    pub fn all_supported() -> Vec<F32Kernel> {
        [F32Kernel::Avx512, F32Kernel::Avx2, F32Kernel::Portable]
            .into_iter()
            .filter(|k| k.supported())
            .collect()
    }

    /// Whether this CPU can run the kernel (the variants go from the most demanding down).
    pub fn supported(self) -> bool {
        self as u8 >= F32Kernel::best_supported() as u8
    }

    /// Name for reports and `KILN_F32_KERNEL`.
    pub fn name(self) -> &'static str {
        match self {
            F32Kernel::Avx512 => "avx512",
            F32Kernel::Avx2 => "avx2",
            F32Kernel::Portable => "portable",
        }
    }
}

/// Which integer kernel this CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Kernel {
    /// AMX `tdpbusd` tiles for plain matrices (linear layers), AVX-512 VNNI for the rest (the
    /// same weight packing).
    Amx,
    /// AVX-512 VNNI `vpdpbusd`.
    Vnni512,
    /// AVX2 `vpmaddubsw` + `vpmaddwd` on u8 × i8 bytes (ONNX Runtime's MLAS approach), with
    /// 7-bit activations so the i16 pair sums never saturate.
    Avx2,
    /// Portable loops over i16 operands.
    Scalar,
}

impl Int8Kernel {
    /// The kernel int8 layers use (decided once): the best this CPU supports, or the one
    /// named by the `KILN_INT8_KERNEL` environment variable (`amx`, `avx512-vnni`, `avx2`, `scalar`)
    /// when the CPU supports it — so the AVX2 path can be measured on a VNNI machine.
    pub fn detect() -> Int8Kernel {
        static KERNEL: OnceLock<Int8Kernel> = OnceLock::new();
        *KERNEL.get_or_init(|| {
            choose(
                "KILN_INT8_KERNEL",
                &[
                    Int8Kernel::Amx,
                    Int8Kernel::Vnni512,
                    Int8Kernel::Avx2,
                    Int8Kernel::Scalar,
                ],
                Int8Kernel::best_supported(),
                Int8Kernel::name,
            )
        })
    }

    /// The best kernel this CPU supports.
    fn best_supported() -> Int8Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if amx_available() {
                return Int8Kernel::Amx;
            }
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                return Int8Kernel::Vnni512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Int8Kernel::Avx2;
            }
        }
        Int8Kernel::Scalar
    }

    /// Name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Int8Kernel::Amx => "amx",
            Int8Kernel::Vnni512 => "avx512-vnni",
            Int8Kernel::Avx2 => "avx2",
            Int8Kernel::Scalar => "scalar",
        }
    }
}

/// Whether the Winograd path of 3×3 stride-1 convolutions runs (`KILN_WINOGRAD=off` turns
/// it off for this process, to measure against the implicit GEMM).
pub fn winograd_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        choose("KILN_WINOGRAD", &[true, false], true, |on| {
            if on { "on" } else { "off" }
        })
    })
}

/// Linux's `arch_prctl` request that lets this process use a dynamically enabled CPU state
/// component, and AMX's tile data component number (`XFEATURE_XTILEDATA`).
#[cfg(target_arch = "x86_64")]
const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
#[cfg(target_arch = "x86_64")]
const XFEATURE_XTILEDATA: u64 = 18;
#[cfg(target_arch = "x86_64")]
const SYS_ARCH_PRCTL: u64 = 158;

/// Whether this CPU has AMX-INT8 and the OS lets this process use it (asked once). Linux
/// (5.16+) enables the 8 KB tile state per process on request; without the grant the first
/// tile instruction would fault.
#[cfg(target_arch = "x86_64")]
pub fn amx_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        if !cpu_has_amx_int8() {
            return false;
        }
        let granted = if cfg!(target_os = "linux") {
            // SAFETY: the arch_prctl system call with a permission request reads no memory;
            // rcx and r11 are clobbered by `syscall`.
            let ret: i64;
            unsafe {
                asm!(
                    "syscall",
                    inlateout("rax") SYS_ARCH_PRCTL as i64 => ret,
                    in("rdi") ARCH_REQ_XCOMP_PERM,
                    in("rsi") XFEATURE_XTILEDATA,
                    lateout("rcx") _,
                    lateout("r11") _,
                    options(nostack),
                );
            }
            ret == 0
        } else {
            false
        };
        if !granted {
            tracing::debug!("the CPU has AMX but the OS did not grant its tile state");
        }
        granted
    })
}

/// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25), with AVX-512 VNNI for the
/// operands AMX does not take.
#[cfg(target_arch = "x86_64")]
fn cpu_has_amx_int8() -> bool {
    if !(std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vnni"))
    {
        return false;
    }
    // CPUID leaf 7 exists on every CPU with AVX-512.
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}
