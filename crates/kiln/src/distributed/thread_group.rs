//! Ranks as threads of one process: an in-process [`Collective`] for tests and for data
//! parallelism without a launcher. Each call deposits the rank's buffer; the last rank to
//! arrive reduces the buffers in rank order for all, so every rank gets bit-identical results.
//!
//! A group never leaves its ranks waiting for one that is gone. A member that is dropped (its
//! thread returned an error, panicked, or finished early) breaks the group, and so does a call
//! that waits longer than the group's timeout, if it has one: every call waiting then, and
//! every later one, returns [`KilnError::PeerLost`] naming the rank and why, so the other
//! ranks stop at their next collective instead of hanging (under MPI the launcher gives the
//! same guarantee by aborting the job).

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{Collective, ReduceOp, check_root};
use crate::error::{KilnError, Result};

/// The state the ranks of one group share.
struct Shared {
    size: usize,
    /// The longest a rank waits for the others at one call; `None`: as long as it takes.
    timeout: Option<Duration>,
    state: Mutex<State>,
    /// Signalled when a meeting completes or the group breaks.
    changed: Condvar,
}

/// One meeting of the ranks at a time: the buffers deposited so far, and what the last
/// meeting produced.
struct State {
    /// One slot per rank for the current call's buffer; `None` until the rank arrives.
    slots: Vec<Option<Vec<f64>>>,
    arrived: usize,
    /// Completed meetings; a waiting rank is released when this moves past its meeting.
    generation: u64,
    /// The last completed meeting's result, read by every rank of it (a rank cannot deposit
    /// for the next meeting's result before all have arrived at it, so it is never
    /// overwritten while read).
    result: std::result::Result<Arc<Vec<f64>>, String>,
    /// Why the group can no longer meet, once it cannot.
    broken: Option<String>,
}

/// How a meeting combines the ranks' buffers (the same on every rank).
#[derive(Clone, Copy)]
enum Combine {
    Reduce(ReduceOp),
    From(usize),
}

/// One rank of an in-process group; build the group with [`ThreadGroup::new`] (or
/// [`ThreadGroup::with_timeout`]) and hand one member to each thread.
pub struct ThreadGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    /// The `size` members of a new group, rank 0 first. A rank waits at a call for as long as
    /// the others take; one that is dropped (its thread failed) still releases the others
    /// with an error.
    pub fn new(size: usize) -> Vec<ThreadGroup> {
        Self::group(size, None)
    }

    /// As [`ThreadGroup::new`], but a rank that waits longer than `timeout` at one call breaks
    /// the group (naming the ranks that did not arrive), so a rank that hangs rather than
    /// fails stops the others too. The timeout must exceed everything rank 0 does alone
    /// between two calls (evaluation, checkpoints).
    pub fn with_timeout(size: usize, timeout: Duration) -> Vec<ThreadGroup> {
        Self::group(size, Some(timeout))
    }

    /// [`ThreadGroup::new`] or [`ThreadGroup::with_timeout`], by whether there is a timeout.
    pub(super) fn group(size: usize, timeout: Option<Duration>) -> Vec<ThreadGroup> {
        let size = size.max(1);
        let shared = Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(State {
                slots: vec![None; size],
                arrived: 0,
                generation: 0,
                result: Ok(Arc::new(Vec::new())),
                broken: None,
            }),
            changed: Condvar::new(),
        });
        (0..size)
            .map(|rank| ThreadGroup {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // The lock is only held for plain bookkeeping and the reduction; a rank that panicked
        // there left nothing half-written that the others would misread (the group is
        // broken by its drop anyway).
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Deposits `values`, waits for every rank, and returns the meeting's combination of the
    /// ranks' buffers (in rank order); an error if the group is or becomes broken first.
    fn exchange(&self, values: Vec<f64>, how: Combine) -> Result<Arc<Vec<f64>>> {
        let mut st = self.state();
        if let Some(why) = &st.broken {
            return Err(KilnError::PeerLost(why.clone()));
        }
        st.slots[self.rank] = Some(values);
        st.arrived += 1;
        let generation = st.generation;
        if st.arrived == self.shared.size {
            let slots: Vec<Vec<f64>> = st
                .slots
                .iter_mut()
                .map(|s| s.take().unwrap_or_default())
                .collect();
            st.result = combine(&slots, how).map(Arc::new);
            st.arrived = 0;
            st.generation += 1;
            self.shared.changed.notify_all();
        } else {
            let deadline = self.shared.timeout.map(|t| Instant::now() + t);
            while st.generation == generation && st.broken.is_none() {
                st = match deadline {
                    None => self
                        .shared
                        .changed
                        .wait(st)
                        .unwrap_or_else(PoisonError::into_inner),
                    Some(deadline) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            st.broken = Some(self.timed_out(&st));
                            self.shared.changed.notify_all();
                            break;
                        }
                        self.shared
                            .changed
                            .wait_timeout(st, left)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0
                    }
                };
            }
            // A meeting that completed counts even if a rank left right after it.
            if st.generation == generation {
                let why = st.broken.clone().unwrap_or_default();
                return Err(KilnError::PeerLost(why));
            }
        }
        st.result.clone().map_err(KilnError::Collective)
    }

    /// Marks the group broken for `why` (unless it already is: the first cause is the one
    /// the ranks report) and wakes every waiting rank.
    fn break_group(&self, why: String) {
        let mut st = self.state();
        if st.broken.is_none() && self.shared.size > 1 {
            st.broken = Some(why);
        }
        self.shared.changed.notify_all();
    }

    /// Why the group broke when this rank gave up waiting: the ranks that had not arrived.
    fn timed_out(&self, st: &State) -> String {
        let missing: Vec<String> = (0..self.shared.size)
            .filter(|&r| st.slots[r].is_none())
            .map(|r| r.to_string())
            .collect();
        format!(
            "rank(s) {} did not reach a collective call within {:?} (rank {} waited): a rank \
             hangs or is far slower than the others; raise the group's timeout if the work \
             between two calls is legitimately that long",
            missing.join(", "),
            self.shared.timeout.unwrap_or_default(),
            self.rank
        )
    }

    fn reduce(&self, buf: &[f64], op: ReduceOp) -> Result<Arc<Vec<f64>>> {
        self.exchange(buf.to_vec(), Combine::Reduce(op))
    }
}

/// The meeting's result from every rank's buffer, or why the buffers do not fit together.
fn combine(slots: &[Vec<f64>], how: Combine) -> std::result::Result<Vec<f64>, String> {
    let len = slots[0].len();
    if let Some((r, s)) = slots.iter().enumerate().find(|(_, s)| s.len() != len) {
        return Err(format!(
            "rank 0 passed {len} values but rank {r} passed {}: every rank must make the same \
             calls with buffers of the same length",
            s.len()
        ));
    }
    Ok(match how {
        Combine::From(root) => slots[root].clone(),
        Combine::Reduce(op) => {
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
        }
    })
}

impl Drop for ThreadGroup {
    /// Breaks the group so that no rank waits for this one any more. After the last call of
    /// a run every rank has its result already, so a normal end breaks nothing anyone needs.
    fn drop(&mut self) {
        let how = if std::thread::panicking() {
            "panicked"
        } else {
            "stopped (its thread returned, most likely with an error) while the others still \
             needed it"
        };
        self.break_group(format!("rank {} {how}", self.rank));
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
        for (b, o) in buf.iter_mut().zip(out.iter()) {
            *b = *o as f32;
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
        let out = self.exchange(wide, Combine::From(root))?;
        for (b, o) in buf.iter_mut().zip(out.iter()) {
            *b = *o as f32;
        }
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        self.exchange(Vec::new(), Combine::From(0)).map(|_| ())
    }
    fn engine(&self) -> &'static str {
        "threads"
    }
    fn abandon(&self, why: &str) {
        self.break_group(format!("rank {} failed: {why}", self.rank));
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

    /// Runs `f` on each member of `group` on its own thread and returns the results, or
    /// fails the test if the ranks are not done within 30 s (a hang is the bug tested for).
    fn within_deadline<T: Send + 'static>(
        group: Vec<ThreadGroup>,
        f: impl Fn(ThreadGroup) -> T + Send + Sync + 'static,
    ) -> Vec<std::thread::Result<T>> {
        let f = Arc::new(f);
        let (tx, rx) = std::sync::mpsc::channel();
        let handles: Vec<_> = group
            .into_iter()
            .map(|g| {
                let (f, tx) = (f.clone(), tx.clone());
                std::thread::spawn(move || {
                    let rank = g.rank;
                    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(g)));
                    let _ = tx.send(rank);
                    out
                })
            })
            .collect();
        for _ in 0..handles.len() {
            rx.recv_timeout(Duration::from_secs(30))
                .expect("a rank is still waiting after 30 s: the group hangs");
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn peer_lost(r: &Result<()>) -> String {
        match r {
            Err(KilnError::PeerLost(why)) => why.clone(),
            other => panic!("expected PeerLost, got {other:?}"),
        }
    }

    #[test]
    fn a_rank_that_goes_away_releases_the_others_with_its_reason() {
        // Rank 2 fails after the first call and says why; the others are waiting in (or
        // about to make) their second call.
        let out = within_deadline(ThreadGroup::new(3), |g| {
            let mut buf = vec![1.0f32; 4];
            g.all_reduce_f32(&mut buf, ReduceOp::Sum).unwrap();
            assert_eq!(buf, vec![3.0; 4]);
            if g.rank() == 2 {
                g.abandon("its data file is corrupt");
                return Ok(());
            }
            g.all_reduce_f32(&mut buf, ReduceOp::Sum)?;
            g.barrier()
        });
        for r in &out[..2] {
            let why = peer_lost(r.as_ref().unwrap());
            assert!(
                why.contains("rank 2 failed: its data file is corrupt"),
                "{why}"
            );
        }
        // A member dropped without a word (its thread returned early) and one whose thread
        // panicked release the others too, each named.
        for panics in [false, true] {
            let out = within_deadline(ThreadGroup::new(2), move |g| {
                if g.rank() == 1 {
                    if panics {
                        panic!("rank 1's step panicked");
                    }
                    return Ok(());
                }
                g.barrier()
            });
            let why = peer_lost(out[0].as_ref().unwrap());
            let how = if panics {
                "rank 1 panicked"
            } else {
                "rank 1 stopped"
            };
            assert!(why.contains(how), "{why}");
            assert_eq!(out[1].is_err(), panics);
        }
    }

    #[test]
    fn calls_completed_before_a_rank_leaves_still_count() {
        // Every rank makes the same 200 calls and then drops its member: however the threads
        // interleave, no call fails (a completed meeting is not undone by a later drop).
        let out = within_deadline(ThreadGroup::new(3), |g| {
            for i in 0..200 {
                let mut b = vec![i as f64 + g.rank() as f64];
                g.all_reduce_f64(&mut b, ReduceOp::Max)?;
                assert_eq!(b, vec![i as f64 + 2.0]);
            }
            Ok::<_, KilnError>(())
        });
        assert!(out.iter().all(|r| matches!(r, Ok(Ok(())))));
    }

    #[test]
    fn a_rank_that_hangs_past_the_timeout_stops_the_others() {
        // Rank 1 is alive but stuck until the other two have given up on it: without the
        // timeout this deadlocks (and the deadline fails the test).
        let gave_up = Arc::new((Mutex::new(0usize), Condvar::new()));
        let out = within_deadline(
            ThreadGroup::with_timeout(3, Duration::from_millis(200)),
            move |g| {
                let (count, changed) = &*gave_up;
                if g.rank() == 1 {
                    let mut n = count.lock().unwrap();
                    while *n < 2 {
                        n = changed.wait(n).unwrap();
                    }
                    drop(n);
                    return g.barrier();
                }
                let r = g.barrier();
                *count.lock().unwrap() += 1;
                changed.notify_all();
                r
            },
        );
        // Every rank, rank 1 too when it came back, reports who did not arrive.
        for r in &out {
            let why = peer_lost(r.as_ref().unwrap());
            assert!(why.contains("rank(s) 1 did not reach"), "{why}");
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
