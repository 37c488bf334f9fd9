//! Ranks as threads of one process: an in-process [`Collective`] for tests and for data
//! parallelism without a launcher. Each call deposits the rank's buffer, waits for all ranks,
//! and reduces the buffers in rank order, so every rank computes bit-identical results.

use std::sync::{Arc, Barrier, Mutex, PoisonError};

use super::{Collective, ReduceOp, check_root};
use crate::error::{KilnError, Result};

/// The state the ranks of one group share.
struct Shared {
    size: usize,
    /// One slot per rank for the current call's buffer.
    slots: Mutex<Vec<Vec<f64>>>,
    barrier: Barrier,
}

/// One rank of an in-process group; build the group with [`ThreadGroup::new`] and hand one
/// member to each thread.
pub struct ThreadGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    /// The `size` members of a new group, rank 0 first.
    pub fn new(size: usize) -> Vec<ThreadGroup> {
        let size = size.max(1);
        let shared = Arc::new(Shared {
            size,
            slots: Mutex::new(vec![Vec::new(); size]),
            barrier: Barrier::new(size),
        });
        (0..size)
            .map(|rank| ThreadGroup {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Deposits `values`, waits for every rank, and returns `combine` over the ranks' buffers
    /// (in rank order), then waits again so that no slot is overwritten while read.
    fn exchange<T>(&self, values: Vec<f64>, combine: impl FnOnce(&[Vec<f64>]) -> T) -> Result<T> {
        let len = values.len();
        self.slots()[self.rank] = values;
        self.shared.barrier.wait();
        let out = {
            let slots = self.slots();
            if let Some((r, s)) = slots.iter().enumerate().find(|(_, s)| s.len() != len) {
                Err(KilnError::Collective(format!(
                    "rank {} passed {len} values but rank {r} passed {}: every rank must make \
                     the same calls with buffers of the same length",
                    self.rank,
                    s.len()
                )))
            } else {
                Ok(combine(&slots))
            }
        };
        self.shared.barrier.wait();
        out
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Vec<f64>>> {
        // A poisoned lock means another rank panicked between two plain assignments.
        self.shared
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn reduce(&self, buf: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
        self.exchange(buf.to_vec(), |slots| {
            let mut out = slots[0].clone();
            for s in &slots[1..] {
                for (o, v) in out.iter_mut().zip(s) {
                    *o = match op {
                        ReduceOp::Sum => *o + v,
                        ReduceOp::Max => o.max(*v),
                    };
                }
            }
            out
        })
    }
}

impl Collective for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        // Summed in f64 and rounded once: the same on every rank (rank order is fixed).
        let wide: Vec<f64> = buf.iter().map(|&v| v as f64).collect();
        let out = self.reduce(&wide, op)?;
        for (b, o) in buf.iter_mut().zip(out) {
            *b = o as f32;
        }
        Ok(())
    }
    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        let out = self.reduce(buf, op)?;
        buf.copy_from_slice(&out);
        Ok(())
    }
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<()> {
        check_root(root, self.shared.size)?;
        let wide: Vec<f64> = buf.iter().map(|&v| v as f64).collect();
        let out = self.exchange(wide, |slots| slots[root].clone())?;
        for (b, o) in buf.iter_mut().zip(out) {
            *b = o as f32;
        }
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        self.shared.barrier.wait();
        Ok(())
    }
    fn engine(&self) -> &'static str {
        "threads"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_ranks<T: Send>(size: usize, f: impl Fn(ThreadGroup) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = ThreadGroup::new(size)
                .into_iter()
                .map(|g| s.spawn(|| f(g)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_sums_and_maxes_on_every_rank() {
        let out = on_ranks(3, |g| {
            let r = g.rank() as f32;
            let mut sum = vec![r, 10.0 * r];
            g.all_reduce_f32(&mut sum, ReduceOp::Sum).unwrap();
            let mut max = vec![r, -r];
            g.all_reduce_f32(&mut max, ReduceOp::Max).unwrap();
            let mut b = vec![r + 1.0];
            g.broadcast_f32(&mut b, 2).unwrap();
            (sum, max, b)
        });
        for (sum, max, b) in out {
            assert_eq!(sum, vec![3.0, 30.0]);
            assert_eq!(max, vec![2.0, 0.0]);
            assert_eq!(b, vec![3.0]);
        }
    }

    #[test]
    fn mismatched_lengths_are_an_error_on_every_rank() {
        let out = on_ranks(2, |g| {
            let mut buf = vec![0.0; 1 + g.rank()];
            g.all_reduce_f64(&mut buf, ReduceOp::Sum)
        });
        for r in out {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("same length"), "{e}");
        }
    }
}
