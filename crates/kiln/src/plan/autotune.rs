//! CubeCL's kernel autotune level (`device.autotune`): how many kernel variants Burn's
//! autotune times per shape on the CubeCL backends (cuda). CubeCL reads its configuration
//! once per process, so the level is set before any device opens ([`set_level`], called by
//! [`super::Plan::apply_runtime`]) and a comparison of levels needs one process per level
//! (`kiln tune auto` on a GPU runs them as child processes).

/// The levels CubeCL knows, fewest candidates first.
pub const LEVELS: [&str; 4] = ["minimal", "balanced", "extensive", "full"];

/// CubeCL's own default level.
pub const CUBECL_DEFAULT: &str = "balanced";

/// The environment variable CubeCL reads the level from (what a child process of the A/B
/// is given).
pub const ENV: &str = "CUBECL_AUTOTUNE_LEVEL";

/// Sets CubeCL's autotune level for this process; `default` leaves CubeCL's own
/// configuration (its `cubecl.toml`, [`ENV`], else balanced). Returns false where the level
/// could not be put in force because CubeCL had already read its configuration; true where
/// it is in force or there is nothing to do (`default`, or a build without CUDA, where no
/// CubeCL backend runs).
pub fn set_level(level: &str) -> bool {
    if level == "default" || !LEVELS.contains(&level) {
        return true;
    }
    set_cubecl_level(level)
}

#[cfg(feature = "cuda-eager")]
fn set_cubecl_level(level: &str) -> bool {
    use cubecl::config::autotune::AutotuneLevel;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    // The rest of CubeCL's configuration as it would load it (file, then environment).
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.autotune.level = match level {
        "minimal" => AutotuneLevel::Minimal,
        "extensive" => AutotuneLevel::Extensive,
        "full" => AutotuneLevel::Full,
        _ => AutotuneLevel::Balanced,
    };
    CubeClRuntimeConfig::try_set(config)
}

#[cfg(not(feature = "cuda-eager"))]
fn set_cubecl_level(_level: &str) -> bool {
    true
}
