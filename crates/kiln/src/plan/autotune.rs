//! CubeCL's runtime configuration on cuda: the kernel autotune level (`device.autotune`:
//! how many kernel variants Burn's autotune times per shape) and the kernel cache
//! (`device.kernel_cache`: where compiled kernels and autotune results persist between
//! processes). CubeCL reads its configuration once per process, so both are set before any
//! device opens ([`configure`], called by [`super::Plan::apply_runtime`]) and a comparison
//! of levels needs one process per level (`kiln tune auto` on a GPU runs them as child
//! processes).
//!
//! Why a cache by default: CubeCL compiles each kernel per new shape (W2's first step took
//! 13 s on the H200, BENCHMARKS.md run 37) and, left to itself, keeps autotune results under
//! the build's `target/` directory and compiled kernels nowhere — an installed `kiln` or a
//! user's second run would compile everything again.

use std::path::PathBuf;

/// The levels CubeCL knows, fewest candidates first.
pub const LEVELS: [&str; 4] = ["minimal", "balanced", "extensive", "full"];

/// CubeCL's own default level.
pub const CUBECL_DEFAULT: &str = "balanced";

/// The environment variable CubeCL reads the level from (what a child process of the A/B
/// is given).
pub const ENV: &str = "CUBECL_AUTOTUNE_LEVEL";

/// The kernel cache `device.kernel_cache = "auto"` means: `kiln/cubecl` under the user cache
/// directory (`$XDG_CACHE_HOME`, else `~/.cache`); `None` where neither is set.
pub fn user_kernel_cache() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kiln").join("cubecl"))
}

/// The directory `cache` (a `device.kernel_cache` value) puts CubeCL's caches in; `None`
/// for `off` (CubeCL's own default).
pub fn kernel_cache_dir(cache: &str) -> Option<PathBuf> {
    match cache {
        "off" | "default" | "" => None,
        "auto" => user_kernel_cache(),
        dir => Some(PathBuf::from(dir)),
    }
}

/// Puts the autotune `level` (`default` = CubeCL's own) and the kernel `cache` (see
/// [`kernel_cache_dir`]) in force for this process. Returns false where CubeCL had already
/// read its configuration; true where they are in force or there is nothing to do (a build
/// without CUDA, where no CubeCL backend runs).
pub fn configure(level: &str, cache: &str) -> bool {
    let level = LEVELS.contains(&level).then_some(level);
    let cache = kernel_cache_dir(cache);
    if level.is_none() && cache.is_none() {
        return true;
    }
    set_cubecl(level, cache)
}

#[cfg(feature = "cuda-eager")]
fn set_cubecl(level: Option<&str>, cache: Option<PathBuf>) -> bool {
    use cubecl::config::autotune::AutotuneLevel;
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    // The rest of CubeCL's configuration as it would load it (file, then environment).
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if let Some(level) = level {
        config.autotune.level = match level {
            "minimal" => AutotuneLevel::Minimal,
            "extensive" => AutotuneLevel::Extensive,
            "full" => AutotuneLevel::Full,
            _ => AutotuneLevel::Balanced,
        };
    }
    if let Some(dir) = cache {
        // Compiled kernels and autotune results both live in CubeCL's active environment,
        // rooted here.
        config.environment.path = CacheConfig::Directory(dir);
        config.compilation.cache = true;
    }
    CubeClRuntimeConfig::try_set(config)
}

#[cfg(not(feature = "cuda-eager"))]
fn set_cubecl(_level: Option<&str>, _cache: Option<PathBuf>) -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_cache_settings_resolve_to_directories() {
        assert_eq!(kernel_cache_dir("off"), None);
        assert_eq!(
            kernel_cache_dir("/data/kernels"),
            Some(PathBuf::from("/data/kernels"))
        );
        if let Some(auto) = kernel_cache_dir("auto") {
            assert!(auto.ends_with("kiln/cubecl"), "{}", auto.display());
        }
    }
}
