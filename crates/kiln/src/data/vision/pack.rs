//! The preprocessed cache (`kiln data pack SRC OUT`), FFCV-style: every image decoded once,
//! its shorter side resized to a bound, and stored — raw RGB (no decoding at all in later
//! epochs) or re-encoded as JPEG at that size (a quarter of the disk, a small decode) — in
//! large shard files read by offset. Random crops, flips and normalization still run per
//! epoch ([`PackedImages`] applies the training transform to the stored image).
//!
//! Written atomically: each shard goes to a temporary file, is synced and renamed; the index
//! (`index.json`: classes, each record's shard, offset, length, size, label and CRC-32) is
//! written last the same way, so a pack interrupted at any point is either whole or has no
//! index. Every record's CRC-32 is checked when it is read.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::bad::{BadSamplePolicy, SkipLog};
use super::crop::CropBox;
use super::decode::{self, ImageError, Rgb8};
use super::files::ImageFiles;
use super::pipeline::{ImageTransform, resize_into};
use crate::data::{Dataset, SampleRng};
use crate::error::{KilnError, Result};
use crate::observe::SkippedSample;

/// The index file's format version.
const PACK_VERSION: u32 = 1;
/// Samples decoded in parallel before they are written in order.
const CHUNK: usize = 256;

/// How images are stored in a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PackFormat {
    /// Raw RGB bytes: no decoding when read.
    Raw,
    /// JPEG at this quality: smaller on disk, a small decode when read.
    Jpeg(u8),
}

/// What `kiln data pack` does.
#[derive(Debug, Clone, PartialEq)]
pub struct PackOptions {
    /// The shorter side of every stored image (images already smaller are kept as they are).
    pub shorter: usize,
    /// Raw or JPEG.
    pub format: PackFormat,
    /// A shard file is closed once it holds this many bytes.
    pub shard_bytes: u64,
    /// What a file that cannot be decoded does.
    pub on_bad_sample: BadSamplePolicy,
    /// The pixel limit of the source files.
    pub max_pixels: u64,
}

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions {
            shorter: 256,
            format: PackFormat::Raw,
            shard_bytes: 1 << 30,
            on_bad_sample: BadSamplePolicy::Error,
            max_pixels: decode::DEFAULT_MAX_PIXELS,
        }
    }
}

/// One stored image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackedRecord {
    /// Shard file index.
    pub shard: usize,
    /// Byte offset in the shard.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// Stored width.
    pub width: usize,
    /// Stored height.
    pub height: usize,
    /// Class index.
    pub label: usize,
    /// CRC-32 of the stored bytes.
    pub crc32: u32,
}

/// `index.json` of a pack.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PackIndex {
    /// Format version.
    pub version: u32,
    /// How the images are stored.
    pub format: PackFormat,
    /// The shorter side bound they were resized to.
    pub shorter: usize,
    /// Class names in label order.
    pub classes: Vec<String>,
    /// Shard file names, relative to the pack's directory.
    pub shards: Vec<String>,
    /// Every stored image, in the source's order (left-out files are not here).
    pub records: Vec<PackedRecord>,
    /// Source samples left out as unreadable (with `on_bad_sample = skip`).
    pub skipped: Vec<SkippedSample>,
}

/// What a pack run did.
#[derive(Debug, Clone, PartialEq)]
pub struct PackReport {
    /// Images stored.
    pub images: usize,
    /// Source files left out.
    pub skipped: usize,
    /// Bytes written (shards).
    pub bytes: u64,
    /// Shard files.
    pub shards: usize,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> KilnError + '_ {
    move |source| KilnError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Decodes and resizes one source image for the pack.
fn prepare(
    src: &ImageFiles,
    i: usize,
    options: &PackOptions,
) -> std::result::Result<(Vec<u8>, usize, usize), ImageError> {
    let bytes = src.read(i)?;
    let header = decode::probe(&bytes, options.max_pixels)?;
    let (w, h) = header.size();
    let short = w.min(h);
    let (tw, th) = if short <= options.shorter {
        (w, h)
    } else {
        // torchvision's Resize(shorter) output size.
        let long = (options.shorter as f64 * w.max(h) as f64 / short as f64) as usize;
        if w <= h {
            (options.shorter, long)
        } else {
            (long, options.shorter)
        }
    };
    // Decode at the smallest JPEG scale that still has the stored size.
    let scale = header
        .scales()
        .iter()
        .copied()
        .filter(|&k| w / k >= tw && h / k >= th)
        .max()
        .unwrap_or(1);
    let img = decode::decode(&bytes, &header, scale)?;
    let resized = if (img.width, img.height) == (tw, th) {
        img.pixels
    } else {
        let mut out = Vec::new();
        let whole = CropBox {
            left: 0.0,
            top: 0.0,
            width: img.width as f64,
            height: img.height as f64,
        };
        resize_into(&img, whole, tw, th, &mut out)?;
        out
    };
    let stored = match options.format {
        PackFormat::Raw => resized,
        PackFormat::Jpeg(q) => {
            let mut out = Vec::new();
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, q)
                .encode(
                    &resized,
                    tw as u32,
                    th as u32,
                    image::ExtendedColorType::Rgb8,
                )
                .map_err(|e| ImageError::Corrupt {
                    reason: format!("re-encoding: {e}"),
                })?;
            out
        }
    };
    Ok((stored, tw, th))
}

/// A shard being written: a temporary file renamed into place when closed.
struct ShardWriter {
    tmp: PathBuf,
    path: PathBuf,
    file: std::io::BufWriter<File>,
    bytes: u64,
}

impl ShardWriter {
    fn create(out: &Path, index: usize) -> Result<ShardWriter> {
        let path = out.join(format!("pack-{index:05}.bin"));
        let tmp = out.join(format!(".pack-{index:05}.bin.tmp"));
        let file = File::create(&tmp).map_err(io(&tmp))?;
        Ok(ShardWriter {
            tmp,
            path,
            file: std::io::BufWriter::new(file),
            bytes: 0,
        })
    }

    fn close(self) -> Result<()> {
        let file = self.file.into_inner().map_err(|e| KilnError::Io {
            path: self.tmp.clone(),
            source: e.into_error(),
        })?;
        file.sync_all().map_err(io(&self.tmp))?;
        std::fs::rename(&self.tmp, &self.path).map_err(io(&self.path))
    }
}

/// Writes `src` as a pack in `out` (created if missing); see the module docs.
pub fn pack(
    src: &ImageFiles,
    out: &Path,
    options: &PackOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<PackReport> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    // An old index would describe shards this run overwrites: remove it first, so a crash
    // mid-pack leaves no index at all rather than a wrong one.
    let index_path = out.join("index.json");
    if index_path.exists() {
        std::fs::remove_file(&index_path).map_err(io(&index_path))?;
    }
    let mut records = Vec::with_capacity(src.len());
    let mut shards = Vec::new();
    let skipped = SkipLog::default();
    let mut writer = ShardWriter::create(out, 0)?;
    let mut total_bytes = 0u64;
    let n = src.len();
    for start in (0..n).step_by(CHUNK) {
        let chunk: Vec<_> = (start..(start + CHUNK).min(n))
            .into_par_iter()
            .map(|i| (i, prepare(src, i, options)))
            .collect();
        for (i, result) in chunk {
            let (bytes, width, height) = match result {
                Ok(r) => r,
                Err(e) => match options.on_bad_sample {
                    BadSamplePolicy::Error => {
                        return Err(KilnError::DataItem {
                            index: i,
                            problem: format!(
                                "{}: {e} (--on-bad-sample skip leaves such files out)",
                                src.name(i)
                            ),
                        });
                    }
                    BadSamplePolicy::Skip => {
                        skipped.record(SkippedSample {
                            index: i,
                            name: src.name(i),
                            reason: e.to_string(),
                        });
                        continue;
                    }
                },
            };
            if writer.bytes > 0 && writer.bytes + bytes.len() as u64 > options.shard_bytes {
                shards.push(file_name(&writer.path));
                let next = shards.len();
                std::mem::replace(&mut writer, ShardWriter::create(out, next)?).close()?;
            }
            writer.file.write_all(&bytes).map_err(io(&writer.tmp))?;
            records.push(PackedRecord {
                shard: shards.len(),
                offset: writer.bytes,
                len: bytes.len() as u64,
                width,
                height,
                label: src.entry(i).label,
                crc32: crc32fast::hash(&bytes),
            });
            writer.bytes += bytes.len() as u64;
            total_bytes += bytes.len() as u64;
        }
        progress((start + CHUNK).min(n), n);
    }
    shards.push(file_name(&writer.path));
    writer.close()?;
    let index = PackIndex {
        version: PACK_VERSION,
        format: options.format,
        shorter: options.shorter,
        classes: src.classes().to_vec(),
        shards,
        records,
        skipped: skipped.take(),
    };
    let report = PackReport {
        images: index.records.len(),
        skipped: index.skipped.len(),
        bytes: total_bytes,
        shards: index.shards.len(),
    };
    let json = serde_json::to_vec(&index).map_err(|e| KilnError::Record {
        what: "pack index",
        message: e.to_string(),
    })?;
    crate::fsutil::write_atomic(&index_path, &json)?;
    Ok(report)
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// A pack written by [`pack`], read as a dataset through a transform (random crops and flips
/// per epoch, on the stored images).
#[derive(Debug)]
pub struct PackedImages {
    dir: PathBuf,
    index: std::sync::Arc<PackIndex>,
    files: std::sync::Arc<Vec<File>>,
    /// The records of this split (all unless held out).
    subset: Option<std::sync::Arc<Vec<usize>>>,
    transform: ImageTransform,
}

impl PackedImages {
    /// Opens the pack in `dir`, checking that every shard is there and long enough.
    pub fn open(dir: impl AsRef<Path>) -> Result<PackedImages> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join("index.json");
        let bad = |problem: String| KilnError::Cache {
            path: dir.clone(),
            problem,
        };
        let text = std::fs::read(&index_path).map_err(|e| {
            bad(format!(
                "no readable index.json ({e}): not a pack, or one whose packing did not finish; \
                 pack again (`kiln data pack`)"
            ))
        })?;
        let index: PackIndex = serde_json::from_slice(&text)
            .map_err(|e| bad(format!("index.json is damaged ({e}); pack again")))?;
        if index.version != PACK_VERSION {
            return Err(bad(format!(
                "pack format {} (this Kiln reads {PACK_VERSION}); pack again",
                index.version
            )));
        }
        let mut files = Vec::with_capacity(index.shards.len());
        for name in &index.shards {
            let path = dir.join(name);
            let file = File::open(&path).map_err(io(&path))?;
            let len = file.metadata().map_err(io(&path))?.len();
            let need = index
                .records
                .iter()
                .filter(|r| index.shards.get(r.shard) == Some(name))
                .map(|r| r.offset + r.len)
                .max()
                .unwrap_or(0);
            if len < need {
                return Err(bad(format!(
                    "{name} is {len} bytes but its records need {need}: truncated; pack again"
                )));
            }
            files.push(file);
        }
        if index.records.iter().any(|r| r.shard >= files.len()) {
            return Err(bad("a record names a shard the index does not list".into()));
        }
        Ok(PackedImages {
            dir,
            index: std::sync::Arc::new(index),
            files: std::sync::Arc::new(files),
            subset: None,
            transform: ImageTransform::train(224),
        })
    }

    /// Splits off every `every`-th record of each class as a held-out set with `eval` as its
    /// transform (as [`ImageFiles::hold_out`]).
    pub fn hold_out(self, every: usize, eval: ImageTransform) -> (PackedImages, PackedImages) {
        let labels = self.index.records.iter().map(|r| r.label);
        let (mut train, mut test) = (Vec::new(), Vec::new());
        for (i, held) in super::files::held_out(labels, every)
            .into_iter()
            .enumerate()
        {
            if held { test.push(i) } else { train.push(i) }
        }
        let part = |subset: Vec<usize>, transform: ImageTransform| PackedImages {
            dir: self.dir.clone(),
            index: self.index.clone(),
            files: self.files.clone(),
            subset: Some(std::sync::Arc::new(subset)),
            transform,
        };
        (part(train, self.transform.clone()), part(test, eval))
    }

    fn record_index(&self, i: usize) -> usize {
        self.subset.as_ref().map_or(i, |s| s[i])
    }

    /// The same pack through another transform.
    pub fn with_transform(mut self, transform: ImageTransform) -> Self {
        self.transform = transform;
        self
    }

    /// The pack's index.
    pub fn index(&self) -> &PackIndex {
        &self.index
    }

    /// Stored image `i` of this split, checksum verified.
    pub fn image(&self, i: usize) -> Result<Rgb8> {
        let r = &self.index.records[self.record_index(i)];
        let mut buf = vec![0u8; r.len as usize];
        self.files[r.shard]
            .read_exact_at(&mut buf, r.offset)
            .map_err(io(&self.dir.join(&self.index.shards[r.shard])))?;
        if crc32fast::hash(&buf) != r.crc32 {
            return Err(KilnError::DataItem {
                index: i,
                problem: format!(
                    "packed record in {} at offset {} fails its CRC-32: the pack is damaged; \
                     pack again",
                    self.index.shards[r.shard], r.offset
                ),
            });
        }
        match self.index.format {
            PackFormat::Raw if buf.len() == r.width * r.height * 3 => Ok(Rgb8 {
                width: r.width,
                height: r.height,
                pixels: buf,
            }),
            PackFormat::Raw => Err(KilnError::DataItem {
                index: i,
                problem: format!(
                    "record of {} bytes for {}×{} RGB",
                    buf.len(),
                    r.width,
                    r.height
                ),
            }),
            PackFormat::Jpeg(_) => {
                let header = decode::probe(&buf, u64::MAX).map_err(|e| KilnError::DataItem {
                    index: i,
                    problem: e.to_string(),
                })?;
                decode::decode(&buf, &header, 1).map_err(|e| KilnError::DataItem {
                    index: i,
                    problem: e.to_string(),
                })
            }
        }
    }
}

impl Dataset for PackedImages {
    fn len(&self) -> usize {
        self.subset
            .as_ref()
            .map_or(self.index.records.len(), |s| s.len())
    }

    fn item_shape(&self) -> [usize; 3] {
        self.transform.item_shape()
    }

    fn fill(&self, index: usize, out: &mut [f32]) -> Result<usize> {
        self.fill_sample(index, &mut SampleRng::new(0, 0, index), out)
            .map(|l| l.unwrap_or(0))
    }

    fn fill_sample(
        &self,
        index: usize,
        rng: &mut SampleRng,
        out: &mut [f32],
    ) -> Result<Option<usize>> {
        let img = self.image(index)?;
        self.transform.apply_image(&img, rng, out);
        Ok(Some(self.index.records[self.record_index(index)].label))
    }
}
