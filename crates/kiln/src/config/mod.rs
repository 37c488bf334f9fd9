//! `KilnConfig`: what the user asked for, before it is resolved into a [`crate::plan::Plan`].
//!
//! A config is three layers, lowest first: the optimization [`Level`]'s defaults, the TOML
//! file (`--config kiln.toml`), and command-line overrides. Every key is declared once in
//! [`schema::SETTINGS`] with its type, allowed values and per-level defaults, so validation,
//! `kiln plan` and the documentation cannot drift apart.

pub use crate::names::ConfigName;

mod level;
mod load;
pub mod schema;

pub use level::Level;
pub use load::{KilnConfig, Origin};
pub use schema::{Kind, SettingSpec};
