//! Real data: the bundled MNIST 5k subset, a loader for the standard IDX format (so a user can
//! point Kiln at the full MNIST or Fashion-MNIST files), and [`open_dir`] for directories of
//! memory-mapped `.npy` or safetensors files, and [`open_images`] for image files (folders,
//! manifests, WebDataset shards, packs).

mod files;
pub mod idx;
mod images;
pub mod mnist;

pub use files::{DatasetPair, open_data, open_dir};
pub use images::{HOLD_OUT_EVERY, ImageOptions, ImageSpec, open_images};
pub use mnist::{Split, bundled, load_dir};
