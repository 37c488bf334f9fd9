//! Reading the model repository on disk: which models there are, their numbered versions,
//! the configuration each version loads with, and a fingerprint of its files that tells a
//! poll or an explicit load whether anything changed.
//!
//! Layouts (Triton's, with `config.toml` for `config.pbtxt`):
//!
//! ```text
//! repo/M/config.toml + files          an unversioned model, served as version 1
//! repo/M/config.toml                  a versioned model: version_policy and the config of
//! repo/M/1/…, repo/M/2/…              every version; each version directory holds its
//! repo/M/2/config.toml (optional)     files (relative paths resolve against it) and may
//!                                     hold a config.toml of its own that replaces M's
//! ```

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::config::{ModelConfig, VersionPolicy};

/// Files of a model version as (path relative to the version, length, modification time):
/// two equal fingerprints mean nothing a load reads has changed.
pub type Fingerprint = Vec<(PathBuf, u64, Option<SystemTime>)>;

/// How many files a fingerprint looks at before it stops: a poll must stay cheap even when a
/// user points the repository at a directory with a dataset in it.
const FINGERPRINT_MAX_FILES: usize = 10_000;

/// One version of a model as it is on disk now.
#[derive(Debug)]
pub struct VersionOnDisk {
    /// Its number (1 for an unversioned model).
    pub number: u64,
    /// The configuration it loads with, or why it cannot load.
    pub config: Result<ModelConfig, String>,
    /// Its files now.
    pub fingerprint: Fingerprint,
}

/// A model directory as it is on disk now.
#[derive(Debug)]
pub struct ModelOnDisk {
    /// True when the model is laid out in numbered version directories.
    pub versioned: bool,
    /// The versions its policy selects, ascending.
    pub versions: Vec<VersionOnDisk>,
}

/// Whether `name` can name a model directory: one path component, not hidden. Model names
/// arrive in URLs and gRPC requests, so this is what stops `../` from reaching outside the
/// repository.
pub fn check_name(name: &str) -> Result<(), String> {
    let bad = name.is_empty()
        || name.starts_with('.')
        || name.contains(['/', '\\', '\0'])
        || name.len() > 255;
    if bad {
        Err(format!(
            "`{}` is not a model name: a model is a directory directly under the repository \
             (no path separators, not hidden)",
            name.escape_debug()
        ))
    } else {
        Ok(())
    }
}

/// The model directories under `root` (hidden ones skipped), sorted.
pub fn list_models(root: &Path) -> std::io::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(root)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| check_name(n).is_ok())
        .collect();
    names.sort();
    Ok(names)
}

/// Problems with the repository as a whole that a user should hear about at start-up.
pub fn startup_warnings(root: &Path, models: &[String]) -> Vec<String> {
    let mut warnings = Vec::new();
    if root.join("config.toml").is_file() {
        let parent = root
            .parent()
            .map_or_else(|| "..".to_string(), |p| p.display().to_string());
        warnings.push(format!(
            "{} holds a config.toml: it looks like one model's own directory, but --models \
             takes the repository that holds model directories (--models {parent} serves it \
             as model `{}`)",
            root.display(),
            root.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        ));
    }
    if models.is_empty() {
        warnings.push(format!(
            "the model repository {} holds no model directories; expected {}/<model>/config.toml \
             (`kiln optimize --out {}/<model>` writes one)",
            root.display(),
            root.display(),
            root.display()
        ));
    }
    warnings
}

/// Reads model `name` under `root`: its layout, policy and the versions the policy selects.
/// An error is about the model as a whole (no directory, no readable config).
pub fn read_model(root: &Path, name: &str) -> Result<ModelOnDisk, String> {
    check_name(name)?;
    let dir = root.join(name);
    if !dir.is_dir() {
        return Err(format!(
            "no model directory {} in the repository",
            dir.display()
        ));
    }
    let numbers = version_numbers(&dir)?;
    let model_config = dir.join("config.toml");
    if numbers.is_empty() {
        let config = ModelConfig::load(&dir).map_err(|e| e.to_string());
        return Ok(ModelOnDisk {
            versioned: false,
            versions: vec![VersionOnDisk {
                number: 1,
                config,
                fingerprint: fingerprint(&dir, None),
            }],
        });
    }
    // The model-level config.toml gives the policy and the versions' shared configuration;
    // it may be absent when every version brings its own.
    let shared = match std::fs::read_to_string(&model_config) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("cannot read {} ({e})", model_config.display())),
    };
    let policy = match &shared {
        Some(text) => {
            ModelConfig::parse(text, &dir)
                .map_err(|e| format!("model config {}: {e}", model_config.display()))?
                .version_policy
        }
        None => VersionPolicy::default(),
    };
    let versions = policy
        .select(&numbers)
        .into_iter()
        .map(|number| {
            let vdir = dir.join(number.to_string());
            let config = if vdir.join("config.toml").is_file() {
                ModelConfig::load(&vdir).map_err(|e| e.to_string())
            } else {
                match &shared {
                    Some(text) => ModelConfig::parse(text, &vdir)
                        .map_err(|e| format!("model config {}: {e}", model_config.display())),
                    None => Err(format!(
                        "neither {} nor {} exists; a version needs a config.toml",
                        vdir.join("config.toml").display(),
                        model_config.display()
                    )),
                }
            };
            VersionOnDisk {
                number,
                config,
                fingerprint: fingerprint(&vdir, Some(&model_config)),
            }
        })
        .collect();
    Ok(ModelOnDisk {
        versioned: true,
        versions,
    })
}

/// The numbered version directories of a model directory, ascending.
fn version_numbers(dir: &Path) -> Result<Vec<u64>, String> {
    let listing =
        std::fs::read_dir(dir).map_err(|e| format!("cannot read {} ({e})", dir.display()))?;
    let mut numbers: Vec<u64> = listing
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u64>().ok()))
        .filter(|&n| n >= 1)
        .collect();
    numbers.sort_unstable();
    numbers.dedup();
    Ok(numbers)
}

/// The fingerprint of every file under `dir` (and `extra`, the model-level config a version
/// shares), walked in name order.
fn fingerprint(dir: &Path, extra: Option<&Path>) -> Fingerprint {
    let mut out = Fingerprint::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        let Ok(listing) = std::fs::read_dir(&at) else {
            continue;
        };
        let mut entries: Vec<_> = listing.filter_map(|e| e.ok()).collect();
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            if out.len() >= FINGERPRINT_MAX_FILES {
                return out;
            }
            let path = entry.path();
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                stack.push(path);
            } else {
                let relative = path.strip_prefix(dir).unwrap_or(&path).to_path_buf();
                out.push((relative, meta.len(), meta.modified().ok()));
            }
        }
    }
    if let Some(file) = extra
        && let Ok(meta) = std::fs::metadata(file)
    {
        out.push((file.to_path_buf(), meta.len(), meta.modified().ok()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_leave_the_repository_are_refused() {
        for bad in ["", "..", "../etc", "a/b", ".hidden", "a\\b", "x\0y"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["w3", "resnet-18", "model_v2", "M"] {
            assert!(check_name(good).is_ok(), "{good:?}");
        }
    }
}
