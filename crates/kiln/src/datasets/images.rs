//! Opening image files as a training/test pair from a `data.dir` spec: `imagefolder:DIR`,
//! `manifest:FILE`, `shards:PATTERN`, `packed:DIR`.

use std::path::{Path, PathBuf};

use super::files::DatasetPair;
use crate::data::vision::{
    BadSamplePolicy, DEFAULT_MAX_PIXELS, DEFAULT_SHUFFLE_BUFFER, ImageFiles, ImageTransform,
    PackedImages,
};
use crate::error::{KilnError, Result};

/// Every `HOLD_OUT_EVERY`-th sample of each class is the test split of a source that has no
/// split of its own (10%).
pub const HOLD_OUT_EVERY: usize = 10;

/// How image files are read (`data.image_size`, `data.on_bad_sample`,
/// `data.max_image_pixels`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageOptions {
    /// Side of the square model input.
    pub size: usize,
    /// What an unreadable file does.
    pub on_bad_sample: BadSamplePolicy,
    /// The pixel limit.
    pub max_pixels: u64,
}

impl Default for ImageOptions {
    fn default() -> Self {
        ImageOptions {
            size: 224,
            on_bad_sample: BadSamplePolicy::Error,
            max_pixels: DEFAULT_MAX_PIXELS,
        }
    }
}

impl ImageOptions {
    /// The training transform (RandomResizedCrop, flip, Normalize) at this size.
    pub fn train_transform(&self) -> ImageTransform {
        ImageTransform {
            max_pixels: self.max_pixels,
            ..ImageTransform::train(self.size)
        }
    }

    /// The evaluation transform (Resize, CenterCrop, Normalize) at this size.
    pub fn eval_transform(&self) -> ImageTransform {
        ImageTransform {
            max_pixels: self.max_pixels,
            ..ImageTransform::eval(self.size)
        }
    }
}

/// An image source named by a `data.dir` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSpec {
    /// `imagefolder:DIR`.
    Folder(PathBuf),
    /// `manifest:FILE`.
    Manifest(PathBuf),
    /// `shards:PATTERN`.
    Shards(String),
    /// `packed:DIR`.
    Packed(PathBuf),
}

impl ImageSpec {
    /// The spec `value` names, if it has one of the image prefixes.
    pub fn parse(value: &str) -> Option<ImageSpec> {
        let (kind, rest) = value.split_once(':')?;
        Some(match kind {
            "imagefolder" => ImageSpec::Folder(rest.into()),
            "manifest" => ImageSpec::Manifest(rest.into()),
            "shards" => ImageSpec::Shards(rest.into()),
            "packed" => ImageSpec::Packed(rest.into()),
            _ => return None,
        })
    }
}

/// The first of `names` that is a directory under `dir`.
fn sub_dir(dir: &Path, names: &[&str]) -> Option<PathBuf> {
    names.iter().map(|n| dir.join(n)).find(|p| p.is_dir())
}

/// Opens an image source as (training, test) datasets: the training split through
/// `opts.train_transform()`, the test split through `opts.eval_transform()`.
///
/// - `imagefolder:DIR`: `DIR/train` and `DIR/val` (or `DIR/test`) when present (the
///   ImageNet layout), else `DIR` itself with every 10th file of each class held out;
/// - `manifest:FILE`, `shards:PATTERN`: every 10th sample of each class held out (a shard
///   stream's split keeps its shards' samples together);
/// - `packed:DIR`: `DIR/train` + `DIR/val` when `kiln data pack` wrote both, else one pack
///   with every 10th image held out.
///
/// Returns the pair and the class names (label order).
pub fn open_images(spec: &ImageSpec, opts: &ImageOptions) -> Result<(DatasetPair, Vec<String>)> {
    let mut classes = Vec::new();
    let mut note = |c: &[String]| {
        if classes.is_empty() {
            classes = c.to_vec();
        }
    };
    let files = |f: ImageFiles| f.with_policy(opts.on_bad_sample);
    let mut held_out = |f: ImageFiles| -> DatasetPair {
        note(f.classes());
        let (train, test) = files(f)
            .with_transform(opts.train_transform())
            .hold_out(HOLD_OUT_EVERY, opts.eval_transform());
        (Box::new(train), Box::new(test))
    };
    let pair: DatasetPair = match spec {
        ImageSpec::Folder(dir) => {
            if !dir.is_dir() {
                return Err(KilnError::BadData {
                    path: dir.clone(),
                    problem: "not a directory (imagefolder:DIR wants DIR/<class>/*.jpg)".into(),
                });
            }
            match (sub_dir(dir, &["train"]), sub_dir(dir, &["val", "test"])) {
                (Some(train), Some(test)) => {
                    let train = ImageFiles::folder(train)?;
                    let test = ImageFiles::folder(test)?;
                    if test.classes() != train.classes() {
                        return Err(KilnError::BadData {
                            path: dir.clone(),
                            problem: format!(
                                "the test split's classes {:?} are not the training split's {:?}",
                                test.classes(),
                                train.classes()
                            ),
                        });
                    }
                    classes = train.classes().to_vec();
                    (
                        Box::new(files(train).with_transform(opts.train_transform())),
                        Box::new(files(test).with_transform(opts.eval_transform())),
                    )
                }
                (Some(train), None) => held_out(ImageFiles::folder(train)?),
                _ => held_out(ImageFiles::folder(dir)?),
            }
        }
        ImageSpec::Manifest(file) => held_out(ImageFiles::manifest(file)?),
        ImageSpec::Shards(pattern) => {
            held_out(ImageFiles::shards(pattern, DEFAULT_SHUFFLE_BUFFER)?)
        }
        ImageSpec::Packed(dir) => {
            match (sub_dir(dir, &["train"]), sub_dir(dir, &["val", "test"])) {
                (Some(train), Some(test)) => {
                    let train = PackedImages::open(train)?;
                    classes = train.index().classes.clone();
                    (
                        Box::new(train.with_transform(opts.train_transform())),
                        Box::new(PackedImages::open(test)?.with_transform(opts.eval_transform())),
                    )
                }
                _ => {
                    let packed = PackedImages::open(dir)?;
                    classes = packed.index().classes.clone();
                    let (train, test) = packed
                        .with_transform(opts.train_transform())
                        .hold_out(HOLD_OUT_EVERY, opts.eval_transform());
                    (Box::new(train), Box::new(test))
                }
            }
        }
    };
    Ok((pair, classes))
}
