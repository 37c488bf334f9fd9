//! A size-bounded disk cache of preprocessed samples.
//!
//! - **Content-addressed.** An entry's name is the SHA-256 of (source, preprocessing, version,
//!   sample index): change the data, the preprocessing or bump the version and old entries are
//!   simply never asked for again (and age out by LRU).
//! - **Size-bounded, LRU.** The cache tracks the bytes it holds and evicts the least recently
//!   used entries beyond its capacity. Recency survives restarts through file modification
//!   times (an entry's mtime is refreshed when it is read).
//! - **Atomic and verified.** Entries are written to a unique temporary file and renamed into
//!   place, so a reader sees a whole entry or none. Each entry carries the SHA-256 of its
//!   payload; a mismatch (torn disk, bit rot, a foreign file) is logged, the entry deleted and
//!   the sample recomputed — a corrupt sample is never returned.
//! - **No fsync.** A cache entry lost in a crash is recomputed, so durability is not worth a
//!   disk flush per sample; the checksum catches what a crash can leave behind.
//! - **Concurrent readers.** The index sits behind a mutex, file I/O happens outside it; the
//!   loader's workers share one cache.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

use super::Dataset;
use crate::error::{KilnError, Result};

const MAGIC: &[u8; 8] = b"KILNCAC1";
const HEADER: usize = 8 + 32 + 8;
const SUFFIX: &str = "kc";

/// Counters of what the cache did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups answered from disk.
    pub hits: u64,
    /// Lookups that found nothing.
    pub misses: u64,
    /// Entries found corrupt (deleted and recomputed).
    pub corrupt: u64,
    /// Entries evicted to stay under capacity.
    pub evictions: u64,
    /// Entries written.
    pub writes: u64,
}

#[derive(Debug)]
struct Entry {
    size: u64,
    last_used: u64,
}

#[derive(Debug, Default)]
struct Index {
    entries: HashMap<String, Entry>,
    total: u64,
    clock: u64,
    stats: CacheStats,
}

/// A directory of checksummed, content-addressed entries bounded to `capacity` bytes.
#[derive(Debug)]
pub struct DiskCache {
    dir: PathBuf,
    capacity: u64,
    index: Mutex<Index>,
    temp_counter: AtomicU64,
}

impl DiskCache {
    /// Opens (or creates) a cache in `dir` holding at most `capacity` bytes, adopting the
    /// entries already there (oldest-modified first in the LRU order).
    pub fn open(dir: impl Into<PathBuf>, capacity: u64) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| KilnError::io(&dir, e))?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(|e| KilnError::io(&dir, e))? {
            let entry = entry.map_err(|e| KilnError::io(&dir, e))?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().to_string();
            if name.contains(".tmp.") {
                // A writer died between write and rename: never a valid entry.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let Some(key) = name.strip_suffix(&format!(".{SUFFIX}")) else {
                continue;
            };
            let meta = entry.metadata().map_err(|e| KilnError::io(&path, e))?;
            let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            found.push((mtime, key.to_string(), meta.len()));
        }
        found.sort();
        let mut index = Index::default();
        for (_, key, size) in found {
            index.clock += 1;
            index.total += size;
            index.entries.insert(
                key,
                Entry {
                    size,
                    last_used: index.clock,
                },
            );
        }
        let cache = DiskCache {
            dir,
            capacity,
            index: Mutex::new(index),
            temp_counter: AtomicU64::new(0),
        };
        let mut index = cache.lock();
        cache.evict(&mut index, None);
        drop(index);
        Ok(cache)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes currently held.
    pub fn size(&self) -> u64 {
        self.lock().total
    }

    /// Entries currently held.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the cache did so far.
    pub fn stats(&self) -> CacheStats {
        self.lock().stats
    }

    /// The entry name for a key: hex SHA-256 of the key's parts.
    pub fn key(parts: &[&[u8]]) -> String {
        let mut h = Sha256::new();
        for p in parts {
            // Length-prefixed, so ("ab","c") and ("a","bc") differ.
            h.update((p.len() as u64).to_le_bytes());
            h.update(p);
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn path_of(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.{SUFFIX}"))
    }

    /// The payload stored under `key`, verified; `None` when absent or corrupt (a corrupt entry
    /// is deleted and logged).
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let path = self.path_of(key);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(_) => {
                let mut index = self.lock();
                index.stats.misses += 1;
                // Evicted by another process, or never there.
                if let Some(e) = index.entries.remove(key) {
                    index.total -= e.size;
                }
                return None;
            }
        };
        match verify(&bytes) {
            Ok(payload) => {
                let payload = payload.to_vec();
                let mut index = self.lock();
                index.stats.hits += 1;
                index.clock += 1;
                let clock = index.clock;
                let size = bytes.len() as u64;
                match index.entries.get_mut(key) {
                    Some(e) => e.last_used = clock,
                    None => {
                        // Written by another process sharing the directory: adopt it.
                        index.total += size;
                        index.entries.insert(
                            key.to_string(),
                            Entry {
                                size,
                                last_used: clock,
                            },
                        );
                    }
                }
                drop(index);
                // Refresh the mtime so recency survives a restart; best effort.
                if let Ok(f) = std::fs::File::options().append(true).open(&path) {
                    let _ = f.set_modified(SystemTime::now());
                }
                Some(payload)
            }
            Err(problem) => {
                tracing::warn!(
                    "disk cache: corrupt entry {} ({problem}); deleted, the sample is recomputed",
                    path.display()
                );
                let _ = std::fs::remove_file(&path);
                let mut index = self.lock();
                index.stats.corrupt += 1;
                index.stats.misses += 1;
                if let Some(e) = index.entries.remove(key) {
                    index.total -= e.size;
                }
                None
            }
        }
    }

    /// Stores `payload` under `key` (atomically), then evicts least-recently-used entries
    /// beyond capacity. A payload larger than the whole capacity is not stored.
    pub fn put(&self, key: &str, payload: &[u8]) -> Result<()> {
        let size = (HEADER + payload.len()) as u64;
        if size > self.capacity {
            return Ok(());
        }
        let mut bytes = Vec::with_capacity(HEADER + payload.len());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&Sha256::digest(payload));
        bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        bytes.extend_from_slice(payload);
        let path = self.path_of(key);
        let tmp = self.dir.join(format!(
            "{key}.tmp.{}.{}",
            std::process::id(),
            self.temp_counter.fetch_add(1, Ordering::Relaxed)
        ));
        let written = std::fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(&bytes))
            .and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            let hint = crate::error::disk_full_hint(&path, &e);
            let problem = if hint.is_empty() {
                format!("cannot write the entry: {e}; check free space and permissions")
            } else {
                format!("cannot write the entry: {e}{hint}")
            };
            return Err(KilnError::Cache { path, problem });
        }
        let mut index = self.lock();
        index.clock += 1;
        index.stats.writes += 1;
        let clock = index.clock;
        if let Some(old) = index.entries.insert(
            key.to_string(),
            Entry {
                size,
                last_used: clock,
            },
        ) {
            index.total -= old.size;
        }
        index.total += size;
        self.evict(&mut index, Some(key));
        Ok(())
    }

    /// Deletes least-recently-used entries until the total fits, never `keep`.
    fn evict(&self, index: &mut Index, keep: Option<&str>) {
        if index.total <= self.capacity {
            return;
        }
        let mut by_age: Vec<(u64, String)> = index
            .entries
            .iter()
            .filter(|(k, _)| Some(k.as_str()) != keep)
            .map(|(k, e)| (e.last_used, k.clone()))
            .collect();
        by_age.sort_unstable();
        for (_, key) in by_age {
            if index.total <= self.capacity {
                break;
            }
            if let Some(e) = index.entries.remove(&key) {
                index.total -= e.size;
                index.stats.evictions += 1;
                let _ = std::fs::remove_file(self.path_of(&key));
            }
        }
    }
}

/// Checks an entry's magic, length and checksum; returns the payload.
fn verify(bytes: &[u8]) -> std::result::Result<&[u8], String> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err("bad header".into());
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[40..48]);
    let len = u64::from_le_bytes(len) as usize;
    let payload = &bytes[HEADER..];
    if payload.len() != len {
        return Err(format!("length {} but header says {len}", payload.len()));
    }
    if Sha256::digest(payload).as_slice() != &bytes[8..40] {
        return Err("checksum mismatch".into());
    }
    Ok(payload)
}

/// A dataset whose (deterministic) preprocessing is cached on disk: each sample is computed by
/// `inner` once and read back from the cache afterwards. Put random augmentation in the
/// loader's transform, not here: a cached sample must not depend on the epoch.
pub struct CachedDataset<D> {
    inner: D,
    cache: DiskCache,
    prefix: String,
}

impl<D: Dataset> CachedDataset<D> {
    /// Caches `inner`'s samples in `cache`. `source` identifies the data (a path plus size and
    /// modification time, a URL plus an ETag), `preprocessing` what `inner` does to it, and
    /// `version` is bumped by hand when the code changes in a way neither string shows.
    pub fn new(
        inner: D,
        cache: DiskCache,
        source: &str,
        preprocessing: &str,
        version: u32,
    ) -> Self {
        let prefix = DiskCache::key(&[
            source.as_bytes(),
            preprocessing.as_bytes(),
            &version.to_le_bytes(),
        ]);
        CachedDataset {
            inner,
            cache,
            prefix,
        }
    }

    /// The cache.
    pub fn cache(&self) -> &DiskCache {
        &self.cache
    }

    /// The wrapped dataset.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    fn key(&self, index: usize) -> String {
        DiskCache::key(&[self.prefix.as_bytes(), &(index as u64).to_le_bytes()])
    }
}

impl<D: Dataset> Dataset for CachedDataset<D> {
    fn len(&self) -> usize {
        self.inner.len()
    }

    fn item_shape(&self) -> [usize; 3] {
        self.inner.item_shape()
    }

    fn fill(&self, index: usize, out: &mut [f32]) -> Result<usize> {
        let key = self.key(index);
        if let Some(payload) = self.cache.get(&key)
            && payload.len() == 8 + out.len() * 4
        {
            let mut label = [0u8; 8];
            label.copy_from_slice(&payload[..8]);
            for (o, c) in out.iter_mut().zip(payload[8..].chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            return Ok(u64::from_le_bytes(label) as usize);
        }
        let label = self.inner.fill(index, out)?;
        let mut payload = Vec::with_capacity(8 + out.len() * 4);
        payload.extend_from_slice(&(label as u64).to_le_bytes());
        for v in out.iter() {
            payload.extend_from_slice(&v.to_le_bytes());
        }
        if let Err(e) = self.cache.put(&key, &payload) {
            // A full disk must not stop training: the sample is correct, only not cached.
            tracing::warn!("{e}");
        }
        Ok(label)
    }
}
