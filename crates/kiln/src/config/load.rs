//! Loading a config from TOML and layering command-line overrides on top.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{Level, schema};
use crate::error::{KilnError, Result};

/// What the user asked for: a level, the file's settings and the flags' overrides, each
/// validated against [`schema::SETTINGS`] as it arrives. Resolve it with
/// [`crate::plan::resolve`].
#[derive(Debug, Clone, Default)]
pub struct KilnConfig {
    /// The optimization level.
    pub level: Level,
    /// Where the level came from (`None` = the built-in default level).
    pub level_origin: Option<Origin>,
    /// The config file, if one was loaded.
    pub file: Option<PathBuf>,
    file_values: BTreeMap<String, toml::Value>,
    overrides: BTreeMap<String, toml::Value>,
}

/// Where a user-given value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The config file.
    File(PathBuf),
    /// A command-line flag.
    Flag,
}

impl KilnConfig {
    /// Reads and validates a TOML config file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| KilnError::io(path, e))?;
        Self::from_toml_str(&text, path)
    }

    /// Parses and validates TOML text; `path` is only used in messages and `kiln plan`.
    pub fn from_toml_str(text: &str, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let table: toml::Table =
            text.parse()
                .map_err(|e: toml::de::Error| KilnError::ConfigSyntax {
                    path: path.clone(),
                    message: e.to_string().trim().to_string(),
                })?;
        let mut flat = BTreeMap::new();
        flatten("", &table, &mut flat);
        let mut config = KilnConfig {
            file: Some(path.clone()),
            ..Default::default()
        };
        for (key, value) in flat {
            if key == "level" {
                let name = value.as_str().ok_or_else(|| KilnError::InvalidValue {
                    key: "level".into(),
                    value: value.to_string(),
                    expected: "one of basic, advanced, ultra, custom".into(),
                })?;
                config.level = name.parse()?;
                config.level_origin = Some(Origin::File(path.clone()));
                continue;
            }
            let spec = schema::find(&key).ok_or_else(|| schema::unknown_key(&key))?;
            config.file_values.insert(key, spec.validate(&value)?);
        }
        Ok(config)
    }

    /// Sets the level from a command-line flag.
    pub fn set_level(&mut self, level: Level) {
        self.level = level;
        self.level_origin = Some(Origin::Flag);
    }

    /// Applies a command-line override `key = raw`, parsed by the key's type.
    pub fn set(&mut self, key: &str, raw: &str) -> Result<()> {
        if key == "level" {
            self.set_level(raw.parse()?);
            return Ok(());
        }
        let spec = schema::find(key).ok_or_else(|| schema::unknown_key(key))?;
        self.overrides
            .insert(key.to_string(), spec.parse_flag(raw)?);
        Ok(())
    }

    /// Applies an override given as `key=value` (the `--set` flag's syntax).
    pub fn set_pair(&mut self, pair: &str) -> Result<()> {
        let (key, raw) = pair
            .split_once('=')
            .ok_or_else(|| KilnError::InvalidValue {
                key: "--set".into(),
                value: format!("{pair:?}"),
                expected: "key=value, e.g. train.lr=0.01".into(),
            })?;
        self.set(key.trim(), raw.trim())
    }

    /// Sets `key` to `value` as a command-line flag would, validated by the key's type
    /// (an integer where a float is expected is taken).
    pub fn set_value(&mut self, key: &str, value: toml::Value) -> Result<()> {
        let spec = schema::find(key).ok_or_else(|| schema::unknown_key(key))?;
        self.overrides
            .insert(key.to_string(), spec.validate(&value)?);
        Ok(())
    }

    /// What the user gave — the level (when chosen) and every value from the file and the
    /// flags, flags winning — as a TOML document with one table per section, which
    /// [`KilnConfig::load`] reads back as the same settings. Every value went through the
    /// schema on the way in, so the text is valid by construction.
    pub fn to_toml_string(&self) -> Result<String> {
        let mut values = self.file_values.clone();
        values.extend(self.overrides.clone());
        let mut root = toml::Table::new();
        if self.level_origin.is_some() {
            root.insert(
                "level".into(),
                toml::Value::String(self.level.name().into()),
            );
        }
        for (key, value) in values {
            let (section, name) = key.split_once('.').unwrap_or(("", key.as_str()));
            let table = root
                .entry(section.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if let toml::Value::Table(t) = table {
                t.insert(name.to_string(), value);
            }
        }
        toml::to_string(&root).map_err(|e| KilnError::Inconsistent(format!("writing TOML: {e}")))
    }

    /// The user-given value of a key (flag over file) and where it came from, if any.
    pub fn user_value(&self, key: &str) -> Option<(&toml::Value, Origin)> {
        if let Some(v) = self.overrides.get(key) {
            return Some((v, Origin::Flag));
        }
        let file = self.file.clone().unwrap_or_default();
        self.file_values.get(key).map(|v| (v, Origin::File(file)))
    }
}

/// Flattens nested tables into dotted keys; arrays and scalars are leaves.
fn flatten(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, toml::Value>) {
    for (k, v) in table {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(t) => flatten(&key, t, out),
            other => {
                out.insert(key, other.clone());
            }
        }
    }
}
