//! Real data: the bundled MNIST 5k subset, a loader for the standard IDX format (so a user can
//! point Kiln at the full MNIST or Fashion-MNIST files), and [`open_dir`] for directories of
//! memory-mapped `.npy` or safetensors files.

mod files;
pub mod idx;
pub mod mnist;

pub use files::{DatasetPair, open_dir};
pub use mnist::{Split, bundled, load_dir};
