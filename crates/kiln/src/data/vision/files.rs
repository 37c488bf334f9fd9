//! [`ImageFiles`]: a labelled set of image files — a folder tree, a manifest or WebDataset
//! shards — decoded and transformed in the loader's workers.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::bad::{BadSamplePolicy, SkipLog};
use super::decode::ImageError;
use super::pipeline::ImageTransform;
use crate::data::{Dataset, SampleRng};
use crate::error::{KilnError, Result};
use crate::observe::SkippedSample;

/// Where one sample's bytes are.
#[derive(Debug, Clone, PartialEq)]
pub enum Location {
    /// A file of its own.
    File(PathBuf),
    /// A member of a tar shard: its data's byte range.
    Member {
        /// Index into the dataset's shards.
        shard: usize,
        /// Offset of the member's data in the shard.
        offset: u64,
        /// Length of the member's data.
        len: u64,
        /// The member's name in the archive.
        name: String,
    },
}

/// Extra targets a manifest can give a sample (not used by classification batches; a
/// user's own batch source reads them with [`ImageFiles::entries`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Annotation {
    /// A box `[x0, y0, x1, y1]` in pixels.
    pub bbox: Option<[f32; 4]>,
    /// A mask image's path.
    pub mask: Option<PathBuf>,
}

/// One sample: where its bytes are, its class, what else the manifest said.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Where the bytes are.
    pub location: Location,
    /// Class index into [`ImageFiles::classes`].
    pub label: usize,
    /// Box or mask, when a manifest gives them.
    pub annotation: Option<Annotation>,
}

/// How the loader orders an epoch.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Order {
    /// The loader's seeded permutation (files: any order is as cheap as any other).
    Permuted,
    /// Shards in a seeded order, each read front to back through a shuffle buffer of this
    /// many samples (WebDataset's `shardshuffle` + `shuffle(n)`): reads stay sequential.
    Stream {
        /// Each shard's samples, in archive order.
        shards: Vec<Range<usize>>,
        /// Shuffle buffer size.
        buffer: usize,
    },
}

impl Order {
    /// The order of a split holding the entries `subset` (ascending), in the split's own
    /// indices: a stream's shards keep their samples together.
    fn restricted_to(&self, subset: &[usize]) -> Order {
        match self {
            Order::Permuted => Order::Permuted,
            Order::Stream { shards, buffer } => Order::Stream {
                shards: shards
                    .iter()
                    .map(|r| {
                        subset.partition_point(|&i| i < r.start)
                            ..subset.partition_point(|&i| i < r.end)
                    })
                    .collect(),
                buffer: *buffer,
            },
        }
    }
}

/// A labelled set of image files; see the module docs. Built by
/// [`ImageFiles::folder`], [`ImageFiles::manifest`] or [`ImageFiles::shards`].
#[derive(Debug)]
pub struct ImageFiles {
    pub(crate) entries: Arc<Vec<Entry>>,
    pub(crate) classes: Arc<Vec<String>>,
    /// Open tar shards (shared by splits), with their paths.
    pub(crate) shard_files: Arc<Vec<(PathBuf, File)>>,
    /// The entries of this split (all of them unless split).
    pub(crate) subset: Option<Arc<Vec<usize>>>,
    pub(crate) order: Order,
    pub(crate) transform: ImageTransform,
    pub(crate) policy: BadSamplePolicy,
    pub(crate) skipped: SkipLog,
    /// Where the set came from (messages).
    pub(crate) origin: String,
}

impl ImageFiles {
    pub(crate) fn from_parts(
        origin: String,
        classes: Vec<String>,
        entries: Vec<Entry>,
        shard_files: Vec<(PathBuf, File)>,
        order: Order,
    ) -> Result<Self> {
        if entries.is_empty() {
            return Err(KilnError::BadData {
                path: PathBuf::from(&origin),
                problem: "no image files found (expected .jpg, .jpeg, .png or .webp)".into(),
            });
        }
        Ok(ImageFiles {
            entries: Arc::new(entries),
            classes: Arc::new(classes),
            shard_files: Arc::new(shard_files),
            subset: None,
            order,
            transform: ImageTransform::train(224),
            policy: BadSamplePolicy::Error,
            skipped: SkipLog::default(),
            origin,
        })
    }

    /// The same files with another transform.
    pub fn with_transform(mut self, transform: ImageTransform) -> Self {
        self.transform = transform;
        self
    }

    /// The same files with another bad-sample policy.
    pub fn with_policy(mut self, policy: BadSamplePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The transform samples go through.
    pub fn transform(&self) -> &ImageTransform {
        &self.transform
    }

    /// Class names, in label order (sorted, as torchvision's `ImageFolder`).
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// Every sample of this split, in dataset order.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        (0..self.len()).map(|i| self.entry(i))
    }

    /// Sample `index` of this split.
    pub fn entry(&self, index: usize) -> &Entry {
        match &self.subset {
            Some(s) => &self.entries[s[index]],
            None => &self.entries[index],
        }
    }

    /// Samples left out so far (`on_bad_sample = "skip"`).
    pub fn skipped_total(&self) -> u64 {
        self.skipped.total()
    }

    /// Splits off every `every`-th sample of each class (the first at offset `every - 1`)
    /// as a held-out set with `eval` as its transform: a folder with no `val/` of its own
    /// still gets a test split, the same one on every run.
    pub fn hold_out(self, every: usize, eval: ImageTransform) -> (ImageFiles, ImageFiles) {
        let globals: Vec<usize> = (0..self.len())
            .map(|i| self.subset.as_ref().map_or(i, |s| s[i]))
            .collect();
        let labels = globals.iter().map(|&g| self.entries[g].label);
        let (mut train, mut test) = (Vec::new(), Vec::new());
        for (g, held) in globals.iter().zip(held_out(labels, every)) {
            if held { test.push(*g) } else { train.push(*g) }
        }
        let part = |subset: Vec<usize>, transform: ImageTransform| ImageFiles {
            entries: self.entries.clone(),
            classes: self.classes.clone(),
            shard_files: self.shard_files.clone(),
            order: self.order.restricted_to(&subset),
            subset: Some(Arc::new(subset)),
            transform,
            policy: self.policy,
            skipped: SkipLog::default(),
            origin: self.origin.clone(),
        };
        (part(train, self.transform.clone()), part(test, eval))
    }

    /// A printable name of sample `index` (its path or shard member).
    pub fn name(&self, index: usize) -> String {
        match &self.entry(index).location {
            Location::File(p) => p.display().to_string(),
            Location::Member { shard, name, .. } => {
                format!("{}:{name}", self.shard_files[*shard].0.display())
            }
        }
    }

    /// The stored bytes of sample `index`.
    pub fn read(&self, index: usize) -> std::result::Result<Vec<u8>, ImageError> {
        let unreadable = |e: std::io::Error| ImageError::Unreadable {
            reason: e.to_string(),
        };
        match &self.entry(index).location {
            Location::File(p) => std::fs::read(p).map_err(unreadable),
            Location::Member {
                shard, offset, len, ..
            } => {
                let mut buf = vec![0u8; *len as usize];
                self.shard_files[*shard]
                    .1
                    .read_exact_at(&mut buf, *offset)
                    .map_err(unreadable)?;
                Ok(buf)
            }
        }
    }

    /// Sample `index` through the transform with the stream of `(seed, epoch, index)`: the
    /// values (`[C, H, W]`, or `[H, W, C]` channels-last) and the label — for a user's own
    /// batch source or Burn `Batcher`. Errors name the file whatever the policy.
    pub fn sample(&self, index: usize, seed: u64, epoch: usize) -> Result<(Vec<f32>, usize)> {
        let mut out = vec![0f32; self.transform.sample_len()];
        let mut rng = SampleRng::new(seed, epoch, index);
        self.produce(index, &mut rng, &mut out)
            .map_err(|e| self.item_error(index, &e))?;
        Ok((out, self.entry(index).label))
    }

    fn produce(
        &self,
        index: usize,
        rng: &mut SampleRng,
        out: &mut [f32],
    ) -> std::result::Result<(), ImageError> {
        let bytes = self.read(index)?;
        self.transform.apply_bytes(&bytes, rng, out)
    }

    fn item_error(&self, index: usize, e: &ImageError) -> KilnError {
        KilnError::DataItem {
            index,
            problem: format!(
                "{}: {e} (data.on_bad_sample = \"skip\" leaves such files out)",
                self.name(index)
            ),
        }
    }
}

/// Which samples of a split with these `labels` are held out: every `every`-th of each
/// class, and a class too small to reach one (but of two or more samples) gives its last.
pub(crate) fn held_out(labels: impl Iterator<Item = usize>, every: usize) -> Vec<bool> {
    let every = every.max(2);
    let labels: Vec<usize> = labels.collect();
    let mut seen: std::collections::HashMap<usize, (usize, usize)> = Default::default();
    let mut held: Vec<bool> = labels
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let (count, last) = seen.entry(l).or_insert((0, i));
            *count += 1;
            *last = i;
            (*count).is_multiple_of(every)
        })
        .collect();
    for &(count, last) in seen.values() {
        if (2..every).contains(&count) {
            held[last] = true;
        }
    }
    held
}

/// The order of one epoch of a stream: shards shuffled, each read in order through a
/// shuffle buffer.
pub(crate) fn stream_order(
    shards: &[Range<usize>],
    buffer: usize,
    seed: u64,
    epoch: usize,
) -> Vec<usize> {
    let mixed = seed ^ (epoch as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407);
    let mut rng = rand::rngs::StdRng::seed_from_u64(mixed);
    let mut order_of_shards: Vec<usize> = (0..shards.len()).collect();
    order_of_shards.shuffle(&mut rng);
    let buffer = buffer.max(1);
    let mut pool = Vec::with_capacity(buffer);
    let mut out = Vec::with_capacity(shards.iter().map(|r| r.len()).sum());
    for s in order_of_shards {
        for i in shards[s].clone() {
            if pool.len() < buffer {
                pool.push(i);
            } else {
                let k = rng.random_range(0..pool.len());
                out.push(std::mem::replace(&mut pool[k], i));
            }
        }
    }
    pool.shuffle(&mut rng);
    out.extend(pool);
    out
}

impl Dataset for ImageFiles {
    fn len(&self) -> usize {
        self.subset.as_ref().map_or(self.entries.len(), |s| s.len())
    }

    fn item_shape(&self) -> [usize; 3] {
        self.transform.item_shape()
    }

    fn fill(&self, index: usize, out: &mut [f32]) -> Result<usize> {
        let mut rng = SampleRng::new(0, 0, index);
        self.produce(index, &mut rng, out)
            .map_err(|e| self.item_error(index, &e))?;
        Ok(self.entry(index).label)
    }

    fn fill_sample(
        &self,
        index: usize,
        rng: &mut SampleRng,
        out: &mut [f32],
    ) -> Result<Option<usize>> {
        match self.produce(index, rng, out) {
            Ok(()) => Ok(Some(self.entry(index).label)),
            Err(e) => match self.policy {
                BadSamplePolicy::Error => Err(self.item_error(index, &e)),
                BadSamplePolicy::Skip => {
                    self.skipped.record(SkippedSample {
                        index,
                        name: self.name(index),
                        reason: e.to_string(),
                    });
                    Ok(None)
                }
            },
        }
    }

    fn epoch_order(&self, seed: u64, epoch: usize) -> Option<Vec<usize>> {
        match &self.order {
            Order::Permuted => None,
            Order::Stream { shards, buffer } => Some(stream_order(shards, *buffer, seed, epoch)),
        }
    }

    fn take_skipped(&self) -> Vec<SkippedSample> {
        self.skipped.take()
    }
}

/// `path` relative to `base` when it is not absolute.
pub(crate) fn resolve(base: &Path, path: &str) -> PathBuf {
    let p = Path::new(path);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_order_is_a_seeded_permutation_read_shard_by_shard() {
        let shards: Vec<Range<usize>> = (0..10).map(|s| s * 100..(s + 1) * 100).collect();
        let a = stream_order(&shards, 50, 7, 0);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_eq!(a, stream_order(&shards, 50, 7, 0));
        assert_ne!(a, stream_order(&shards, 50, 7, 1));
        // Sequential reads: a batch of 64 consecutive samples touches few shards (a
        // permutation of the whole set would touch all ten in almost every batch).
        let distinct: Vec<usize> = a
            .chunks(64)
            .map(|w| {
                let mut touched: Vec<usize> = w.iter().map(|i| i / 100).collect();
                touched.sort();
                touched.dedup();
                touched.len()
            })
            .collect();
        let mean = distinct.iter().sum::<usize>() as f64 / distinct.len() as f64;
        assert!(mean <= 4.0, "{distinct:?}");
    }
}
