//! Image files as users have them: folders of JPEG/PNG/WebP files, manifests, WebDataset tar
//! shards, and Kiln's own packed cache — decoded, augmented with torchvision v2's semantics
//! and normalized in the loader's workers.
//!
//! - Sources: [`ImageFiles::folder`] (`root/<class>/*.jpg`, classes sorted as torchvision's
//!   `ImageFolder`), [`ImageFiles::manifest`] (CSV or JSON lines), [`ImageFiles::shards`]
//!   (`train-{000..099}.tar`, read shard by shard), [`PackedImages`] (`kiln data pack`).
//!   Each is a [`crate::data::Dataset`], so [`crate::data::ImageBatches`], the loader and the
//!   trainer take it as they take MNIST; a user's own batch source calls
//!   [`ImageFiles::sample`].
//! - Decoding ([`decode`]): sniffed by content, EXIF orientation, a pixel limit, JPEG at
//!   1/2–1/8 size when the crop allows ([`crop::decode_scale`]).
//! - Transforms ([`ImageTransform`]): `RandomResizedCrop`, `Resize` + `CenterCrop`,
//!   horizontal flip, `ColorJitter`, `Normalize`, planar or channels-last output — crop and
//!   resize in one SIMD pass, flip, normalize and layout in one more.
//! - Bad files ([`BadSamplePolicy`]): an error naming the file, or the sample left out of its
//!   batch and reported; never a panic.

pub mod bad;
pub mod crop;
pub mod decode;
mod files;
mod folder;
pub mod jitter;
mod manifest;
pub mod pack;
pub mod pipeline;
mod shards;

pub use bad::{BadSamplePolicy, SkipLog};
pub use crop::{CropBox, CropMode};
pub use decode::{DEFAULT_MAX_PIXELS, ImageError, Rgb8};
pub use files::{Annotation, Entry, ImageFiles, Location};
pub use folder::IMAGE_EXTENSIONS;
pub use jitter::ColorJitter;
pub use pack::{PackFormat, PackIndex, PackOptions, PackReport, PackedImages, pack};
pub use pipeline::{IMAGENET_MEAN, IMAGENET_STD, ImageTransform, Layout};
pub use shards::{DEFAULT_SHUFFLE_BUFFER, expand_braces};
