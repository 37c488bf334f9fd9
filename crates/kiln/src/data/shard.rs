//! Which part of each batch a data-parallel rank loads.
//!
//! Every rank draws the same seeded epoch order. Global batch `k` (of `batch × world`
//! samples) is split into `world` contiguous parts, one per rank, as evenly as its samples
//! allow; so the ranks' batches `k` together are exactly the batch `k` that one process with
//! `batch × world` samples per batch would load, and over an epoch every sample is loaded
//! exactly once by exactly one rank. Only the last, short global batch can leave a rank
//! without samples, so a rank's non-empty batches are always a prefix of the global ones.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// One rank's share of each epoch; see the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// This rank, `0..world`.
    pub rank: usize,
    /// The number of ranks.
    pub world: usize,
}

impl Default for Shard {
    fn default() -> Self {
        Shard::WHOLE
    }
}

impl Shard {
    /// The whole epoch: a world of one.
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    /// The positions in the epoch order (of `n` samples) of this rank's part of global batch
    /// `k`, with `batch` samples per rank and batch.
    pub fn range(&self, n: usize, batch: usize, k: usize) -> Range<usize> {
        let world = self.world.max(1);
        let global = batch.max(1) * world;
        let start = (k * global).min(n);
        let len = ((k + 1) * global).min(n) - start;
        start + self.rank * len / world..start + (self.rank + 1) * len / world
    }

    /// Global batches in an epoch of `n` positions (what [`super::LastBatch::epoch_len`]
    /// makes of the samples: a dropped or padded last batch is already in `n`).
    pub fn global_batches(&self, n: usize, batch: usize) -> usize {
        n.div_ceil(batch.max(1) * self.world.max(1))
    }

    /// Batches this rank loads in an epoch: the global ones but a last one it has no share of.
    pub fn batches(&self, n: usize, batch: usize) -> usize {
        let global = self.global_batches(n, batch);
        if global > 0 && self.range(n, batch, global - 1).is_empty() {
            global - 1
        } else {
            global
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_split_each_global_batch_and_cover_the_epoch_once() {
        for (n, batch, world) in [(10, 1, 4), (23, 3, 2), (64, 8, 4), (5, 4, 3), (1, 2, 2)] {
            let shards: Vec<Shard> = (0..world).map(|rank| Shard { rank, world }).collect();
            let mut seen = vec![0; n];
            for k in 0..shards[0].global_batches(n, batch) {
                let parts: Vec<Range<usize>> =
                    shards.iter().map(|s| s.range(n, batch, k)).collect();
                // The parts tile global batch k of a single process with batch × world.
                let whole = Shard::WHOLE.range(n, batch * world, k);
                assert_eq!(parts[0].start, whole.start);
                assert_eq!(parts[world - 1].end, whole.end);
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                for p in &parts {
                    assert!(p.len() <= batch);
                    for i in p.clone() {
                        seen[i] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "n={n} b={batch} w={world}");
            for s in &shards {
                let count = s.batches(n, batch);
                for k in 0..s.global_batches(n, batch) {
                    assert_eq!(!s.range(n, batch, k).is_empty(), k < count, "prefix");
                }
            }
        }
    }
}
