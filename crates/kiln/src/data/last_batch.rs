//! What an epoch does with its last, short batch (`data.last_batch`).
//!
//! Why it matters: on a GPU every new tensor shape compiles (and autotunes) its kernels, so
//! an epoch whose last batch is short compiles a second set of kernels for it — each epoch's
//! 13 s on the H200 (BENCHMARKS.md run 37) before the kernel cache. Padding or dropping
//! makes every batch of the epoch one shape.

use serde::{Deserialize, Serialize};

/// The last batch of an epoch when the samples do not fill it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum LastBatch {
    /// Train on it as it is (torch's `drop_last=False`): every sample once, one more shape.
    #[default]
    Keep,
    /// Leave it out (torch's `drop_last=True`): up to a batch of samples unseen in the epoch
    /// (other samples each epoch when shuffled).
    Drop,
    /// Fill it with the epoch's first samples in this epoch's order (as torch's
    /// `DistributedSampler` pads): every sample at least once, a few twice.
    Pad,
}

crate::names::config_names!(LastBatch { Keep => "keep", Drop => "drop", Pad => "pad" });

impl LastBatch {
    /// Positions in an epoch of `n` samples taken in batches of `global` samples (over all
    /// ranks): `n` to keep, the full batches' samples to drop (all `n` when there is not
    /// one full batch: dropping would leave nothing), the next multiple of `global` to pad.
    pub fn epoch_len(self, n: usize, global: usize) -> usize {
        let global = global.max(1);
        match self {
            LastBatch::Keep => n,
            LastBatch::Drop if n >= global => n - n % global,
            LastBatch::Drop => n,
            LastBatch::Pad => n.div_ceil(global) * global,
        }
    }

    /// `order` (an epoch's sample order) cut or extended to [`LastBatch::epoch_len`]: padding
    /// repeats the order from its start.
    pub fn apply(self, mut order: Vec<usize>, global: usize) -> Vec<usize> {
        let n = order.len();
        let len = self.epoch_len(n, global);
        if len <= n {
            order.truncate(len);
        } else if n > 0 {
            let extra: Vec<usize> = order.iter().cycle().take(len - n).copied().collect();
            order.extend(extra);
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_gives_an_epoch_of_full_batches_or_keeps_the_short_one() {
        assert_eq!(LastBatch::Keep.epoch_len(100, 32), 100);
        assert_eq!(LastBatch::Drop.epoch_len(100, 32), 96);
        assert_eq!(LastBatch::Pad.epoch_len(100, 32), 128);
        assert_eq!(
            LastBatch::Drop.epoch_len(20, 32),
            20,
            "never an empty epoch"
        );
        assert_eq!(LastBatch::Pad.epoch_len(96, 32), 96, "nothing to pad");
        let order: Vec<usize> = (0..10).rev().collect();
        assert_eq!(LastBatch::Pad.apply(order.clone(), 4).len(), 12);
        assert_eq!(LastBatch::Pad.apply(order.clone(), 4)[10..], [9, 8]);
        assert_eq!(LastBatch::Drop.apply(order.clone(), 4), order[..8].to_vec());
        // Fewer samples than one batch: the order repeats as often as it takes.
        assert_eq!(LastBatch::Pad.apply(vec![1, 2], 5), [1, 2, 1, 2, 1]);
    }
}
