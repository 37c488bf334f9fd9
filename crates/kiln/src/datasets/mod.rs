//! Real data: the bundled MNIST 5k subset and a loader for the standard IDX format, so a
//! user can point Kiln at the full MNIST or Fashion-MNIST files.

pub mod idx;
pub mod mnist;

pub use mnist::{Split, bundled, load_dir};
