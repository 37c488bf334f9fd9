//! The disk cache of preprocessed samples: LRU eviction under a size bound, corruption
//! detected and recomputed (never returned), concurrent readers through the loader, and
//! entries adopted after a restart.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::Device;
use kiln::burn;
use kiln::data::{CachedDataset, DataLoader, Dataset, DiskCache, LoaderOptions};
use kiln::datasets::{Split, bundled};

/// Counts how often the expensive path runs.
struct Counting<D> {
    inner: D,
    computed: AtomicUsize,
}

impl<D: Dataset> Dataset for Counting<D> {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn item_shape(&self) -> [usize; 3] {
        self.inner.item_shape()
    }
    fn fill(&self, index: usize, out: &mut [f32]) -> kiln::Result<usize> {
        self.computed.fetch_add(1, Ordering::SeqCst);
        self.inner.fill(index, out)
    }
}

fn entry_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kc"))
        .collect()
}

#[test]
fn lru_eviction_keeps_the_cache_under_its_bound() {
    let dir = common::tempdir("cache", "lru");
    let payload = vec![7u8; 1000];
    // Room for five entries (payload + 48-byte header each).
    let cache = DiskCache::open(dir.path(), 5 * 1048 + 100).unwrap();
    let keys: Vec<String> = (0..8u32)
        .map(|i| DiskCache::key(&[&i.to_le_bytes()]))
        .collect();
    for k in &keys[..5] {
        cache.put(k, &payload).unwrap();
    }
    // Touch entry 0 so it is the most recently used: entries 1 and 2 must go first.
    assert_eq!(cache.get(&keys[0]).as_deref(), Some(&payload[..]));
    for k in &keys[5..7] {
        cache.put(k, &payload).unwrap();
    }
    assert!(cache.size() <= 5 * 1048 + 100, "{}", cache.size());
    assert_eq!(cache.len(), 5);
    assert!(
        cache.get(&keys[1]).is_none(),
        "least recently used is evicted"
    );
    assert!(cache.get(&keys[2]).is_none());
    assert!(
        cache.get(&keys[0]).is_some(),
        "recently read entry survives"
    );
    assert!(cache.get(&keys[6]).is_some());
    assert_eq!(cache.stats().evictions, 2);
    assert_eq!(entry_files(&dir).len(), 5, "evicted files are deleted");
    // A payload larger than the whole cache is not stored (and evicts nothing).
    cache.put(&keys[7], &vec![0u8; 10_000]).unwrap();
    assert!(cache.get(&keys[7]).is_none());
    assert_eq!(cache.len(), 5);

    // Reopen: the entries and their recency come back from the directory.
    drop(cache);
    let reopened = DiskCache::open(dir.path(), 5 * 1048 + 100).unwrap();
    assert_eq!(reopened.len(), 5);
    assert!(reopened.get(&keys[6]).is_some());
    // A smaller capacity evicts on open.
    drop(reopened);
    let small = DiskCache::open(dir.path(), 2 * 1048).unwrap();
    assert_eq!(small.len(), 2);
    assert_eq!(entry_files(&dir).len(), 2);
}

#[test]
fn a_corrupt_entry_is_recomputed_never_returned() {
    let dir = common::tempdir("cache", "corrupt");
    let data = Counting {
        inner: bundled(Split::Train).unwrap().take(20),
        computed: AtomicUsize::new(0),
    };
    let cached = CachedDataset::new(
        data,
        DiskCache::open(dir.path(), 1 << 20).unwrap(),
        "bundled-mnist-train",
        "normalize(mnist)",
        1,
    );
    let mut want = vec![0f32; 784];
    let mut got = vec![0f32; 784];
    for i in 0..20 {
        cached.fill(i, &mut want).unwrap();
    }
    assert_eq!(cached.inner().computed.load(Ordering::SeqCst), 20);
    for i in 0..20 {
        cached.fill(i, &mut got).unwrap();
    }
    assert_eq!(
        cached.inner().computed.load(Ordering::SeqCst),
        20,
        "second pass is served from the cache"
    );
    assert_eq!(cached.cache().stats().hits, 20);

    // Flip one payload byte in every entry, and truncate one.
    let files = entry_files(&dir);
    assert_eq!(files.len(), 20);
    for (k, f) in files.iter().enumerate() {
        let mut bytes = std::fs::read(f).unwrap();
        if k == 0 {
            bytes.truncate(bytes.len() / 2);
        } else {
            let at = bytes.len() - 17;
            bytes[at] ^= 0x40;
        }
        std::fs::write(f, bytes).unwrap();
    }
    let reference = bundled(Split::Train).unwrap().take(20);
    for i in 0..20 {
        let label = cached.fill(i, &mut got).unwrap();
        let want_label = reference.fill(i, &mut want).unwrap();
        assert_eq!(label, want_label);
        assert_eq!(
            got, want,
            "sample {i} must be the true value, not the corrupt one"
        );
    }
    assert_eq!(cached.cache().stats().corrupt, 20);
    assert_eq!(cached.inner().computed.load(Ordering::SeqCst), 40);
    // The recomputed entries were written back and are good again.
    for i in 0..20 {
        cached.fill(i, &mut got).unwrap();
    }
    assert_eq!(cached.inner().computed.load(Ordering::SeqCst), 40);
}

#[test]
fn concurrent_readers_through_the_loader_see_correct_samples() {
    let dir = common::tempdir("cache", "concurrent");
    let n = 300;
    let cached = CachedDataset::new(
        Counting {
            inner: bundled(Split::Train).unwrap().take(n),
            computed: AtomicUsize::new(0),
        },
        // Smaller than the data set: eviction runs while four workers read and write.
        DiskCache::open(dir.path(), 200 * (784 * 4 + 8 + 48)).unwrap(),
        "bundled-mnist-train",
        "normalize(mnist)",
        1,
    );
    let reference = bundled(Split::Train).unwrap().take(n);
    let device = Device::flex();
    let options = LoaderOptions {
        batch_size: 16,
        workers: 4,
        prefetch_factor: 2,
        shuffle: true,
        drop_last: false,
        pad_last: false,
        seed: 3,
    };
    let collect = |data: &dyn Dataset| {
        DataLoader::run(data, None, &device, options.clone(), |loader| {
            (0..3)
                .flat_map(|e| {
                    loader
                        .epoch(e, 0)
                        .map(|b| {
                            b.unwrap()
                                .images
                                .into_data()
                                .try_into_vec_as::<f32>()
                                .unwrap()
                        })
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        })
        .unwrap()
    };
    assert_eq!(collect(&cached), collect(&reference));
    let stats = cached.cache().stats();
    assert!(stats.hits > 0 && stats.evictions > 0, "{stats:?}");
    assert_eq!(stats.corrupt, 0);
    assert!(cached.cache().size() <= 200 * (784 * 4 + 8 + 48));
}
