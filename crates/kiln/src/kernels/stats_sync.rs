//! Synchronized batch statistics (SyncBatchNorm): while a [`StatsSync`] scope is open on a
//! thread, the BatchNorm kernels of that thread sum their per-channel sums over the ranks of
//! a data-parallel group — in the forward the sums of `x` and `x²` and the sample count (so
//! every rank normalizes with the statistics of the global batch), in the backward the sums
//! of `dy` and `dy·x̂` (so `dx` is the gradient of the global batch's loss). `dγ` and `dβ`
//! stay per rank: the trainer's gradient reduction sums them like every other gradient.
//!
//! The kernels see only a summing function, not the collective: the trainer opens the scope
//! with one that all-reduces over its group. Every rank must make the same calls in the same
//! order, so a rank without samples in a micro-batch replays the previous micro-batch's calls
//! with zeros ([`replay_with_zeros`]): a zero sum and a zero count change nothing. A layer can
//! attach an action to its call ([`on_replay`]): the BatchNorm layer updates its running
//! statistics from the replayed global sums, as the ranks with samples do, so the replicas'
//! running statistics stay equal.

use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;

use burn::module::ParamId;

use crate::error::{KilnError, Result};

/// Sums a buffer over the ranks, in place.
pub type SumOverRanks = Box<dyn Fn(&mut [f64]) -> Result<()>>;

/// What a replayed call does with the summed buffer (besides taking part in the sum).
pub type OnReplay = Rc<dyn Fn(&[f64])>;

/// One call of a micro-batch: its buffer's length and what its replay does.
#[derive(Clone)]
struct Call {
    len: usize,
    on_replay: Option<OnReplay>,
}

struct State {
    sum: SumOverRanks,
    /// This micro-batch's calls so far.
    calls: Vec<Call>,
    /// The calls of the last complete micro-batch: what a rank without samples replays.
    last: Option<Vec<Call>>,
    /// The first failed sum (the others are skipped): reported at the micro-batch's end.
    error: Option<KilnError>,
    /// Every call so far (a layer compares it before and after its forward).
    count: u64,
    /// BatchNorm layers (their γ) that normalized with synchronized statistics.
    synced: HashSet<ParamId>,
}

thread_local! {
    static STATE: RefCell<Option<State>> = const { RefCell::new(None) };
}

/// Synchronized statistics on this thread until dropped (then the previous state returns).
pub struct StatsSync {
    previous: Option<State>,
}

impl StatsSync {
    /// Sums the BatchNorm kernels' statistics with `sum` on this thread while the scope lives.
    pub fn enter(sum: SumOverRanks) -> StatsSync {
        // The kernels call one process-wide hook, which reads this thread's state.
        kiln_kernels::norm::set_rank_sum(sum_over_ranks);
        let state = State {
            sum,
            calls: Vec::new(),
            last: None,
            error: None,
            count: 0,
            synced: HashSet::new(),
        };
        StatsSync {
            previous: STATE.with_borrow_mut(|s| s.replace(state)),
        }
    }

    /// Local statistics on this thread while the returned scope lives (steps that only one
    /// rank takes, like the loader's worker probe, must not call the collective).
    pub fn pause() -> StatsSync {
        StatsSync {
            previous: STATE.with_borrow_mut(Option::take),
        }
    }
}

impl Drop for StatsSync {
    fn drop(&mut self) {
        let previous = self.previous.take();
        STATE.with_borrow_mut(|s| *s = previous);
    }
}

/// Sums `buf` over the ranks when a scope is open (`true`), else leaves it (`false`). After a
/// failed sum the rest of the micro-batch runs on local values; the failure is returned by
/// [`end_micro_batch`].
fn sum_over_ranks(buf: &mut [f64]) -> bool {
    STATE.with_borrow_mut(|s| {
        let Some(st) = s else { return false };
        st.calls.push(Call {
            len: buf.len(),
            on_replay: None,
        });
        st.count += 1;
        st.sum_once(buf);
        true
    })
}

impl State {
    /// One sum over the ranks, unless one already failed in this micro-batch.
    fn sum_once(&mut self, buf: &mut [f64]) {
        if self.error.is_none()
            && let Err(e) = (self.sum)(buf)
        {
            self.error = Some(e);
        }
    }

    /// The micro-batch's first failed sum, if any (cleared for the next one).
    fn take_error(&mut self) -> Result<()> {
        self.error.take().map_or(Ok(()), Err)
    }
}

/// Attaches `action` to this micro-batch's latest call: when a rank without samples replays
/// the call, it runs `action` on the summed buffer.
pub(crate) fn on_replay(action: OnReplay) {
    STATE.with_borrow_mut(|s| {
        if let Some(call) = s.as_mut().and_then(|st| st.calls.last_mut()) {
            call.on_replay = Some(action);
        }
    });
}

/// The number of synchronized sums so far on this thread (0 without a scope).
pub(crate) fn calls() -> u64 {
    STATE.with_borrow(|s| s.as_ref().map_or(0, |st| st.count))
}

/// Records that the BatchNorm layer with scale `gamma` used synchronized statistics.
pub(crate) fn mark_synced(gamma: ParamId) {
    STATE.with_borrow_mut(|s| {
        if let Some(st) = s {
            st.synced.insert(gamma);
        }
    });
}

/// Whether the layer with scale `gamma` has used synchronized statistics in this scope.
pub fn was_synced(gamma: ParamId) -> bool {
    STATE.with_borrow(|s| s.as_ref().is_some_and(|st| st.synced.contains(&gamma)))
}

/// Starts a micro-batch's calls.
pub fn begin_micro_batch() {
    STATE.with_borrow_mut(|s| {
        if let Some(st) = s {
            st.calls.clear();
        }
    });
}

/// Ends a micro-batch: keeps its calls for [`replay_with_zeros`] and returns the first sum
/// that failed in it.
pub fn end_micro_batch() -> Result<()> {
    STATE.with_borrow_mut(|s| {
        let Some(st) = s else { return Ok(()) };
        st.last = Some(std::mem::take(&mut st.calls));
        st.take_error()
    })
}

/// Takes part in a micro-batch this rank has no samples of: the previous micro-batch's calls
/// with zeros (neutral in every sum, the sample count included), each followed by its
/// [`on_replay`] action. An error if this rank has not run a micro-batch yet, as it cannot
/// know the calls.
pub fn replay_with_zeros() -> Result<()> {
    let calls = STATE.with_borrow(|s| s.as_ref().map(|st| st.last.clone()));
    let Some(calls) = calls else { return Ok(()) };
    let calls = calls.ok_or_else(|| {
        KilnError::Collective(
            "this rank has no samples in its first micro-batch, so it cannot take part in the \
             synchronized BatchNorm statistics of the others: use a batch size or dataset \
             size that gives every rank a part of the first micro-batch"
                .into(),
        )
    })?;
    for call in calls {
        let mut buf = vec![0.0; call.len];
        // The state's borrow ends before the action, which may run kernels of its own.
        STATE.with_borrow_mut(|s| {
            if let Some(st) = s {
                st.count += 1;
                st.sum_once(&mut buf);
            }
        });
        if let Some(action) = &call.on_replay {
            action(&buf);
        }
    }
    STATE.with_borrow_mut(|s| s.as_mut().map_or(Ok(()), State::take_error))
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use kiln_kernels::norm::{NormShape, batch_norm_stats};

    /// One channel of 4 values on this rank.
    fn shape() -> NormShape {
        NormShape {
            batch: 1,
            channels: 1,
            plane: 4,
        }
    }

    #[test]
    fn batch_statistics_inside_a_scope_are_the_global_batchs() {
        // This rank has four 1s; "the other rank" four 3s: the global batch has mean 2 and
        // variance 1, and its forward call carries Σx, Σx² and the count.
        let _sync = StatsSync::enter(Box::new(|buf: &mut [f64]| {
            assert_eq!(buf, &[4.0, 4.0, 4.0]);
            buf.copy_from_slice(&[16.0, 40.0, 8.0]);
            Ok(())
        }));
        begin_micro_batch();
        assert_eq!(
            batch_norm_stats(&shape(), &[1.0; 4]),
            (vec![2.0], vec![1.0])
        );
        end_micro_batch().unwrap();
        // Paused (a probe step of this rank alone): local statistics, no call.
        let before = calls();
        {
            let _local = StatsSync::pause();
            assert!(!sum_over_ranks(&mut [1.0]));
            assert_eq!(
                batch_norm_stats(&shape(), &[1.0; 4]),
                (vec![1.0], vec![0.0])
            );
        }
        assert_eq!(calls(), before);
        // The scope is back after the pause.
        assert!(sum_over_ranks(&mut [4.0, 4.0, 4.0]));
    }

    #[test]
    fn an_empty_rank_replays_the_last_micro_batch_with_zeros_and_its_actions() {
        let seen = Rc::new(RefCell::new(Vec::new()));
        let log = seen.clone();
        let _sync = StatsSync::enter(Box::new(move |buf: &mut [f64]| {
            log.borrow_mut().push(buf.to_vec());
            Ok(())
        }));
        // Before any micro-batch this rank cannot know the calls.
        let e = replay_with_zeros().unwrap_err().to_string();
        assert!(e.contains("first micro-batch"), "{e}");
        begin_micro_batch();
        let mut a = vec![1.0, 2.0, 3.0];
        assert!(sum_over_ranks(&mut a));
        let replayed = Rc::new(Cell::new(0));
        let counter = replayed.clone();
        on_replay(Rc::new(move |summed: &[f64]| {
            assert_eq!(summed, &[0.0, 0.0, 0.0]);
            counter.set(counter.get() + 1);
        }));
        assert!(sum_over_ranks(&mut [5.0]));
        end_micro_batch().unwrap();
        seen.borrow_mut().clear();
        // Twice in a row: the same calls each time, each with its action.
        replay_with_zeros().unwrap();
        replay_with_zeros().unwrap();
        assert_eq!(
            *seen.borrow(),
            vec![vec![0.0; 3], vec![0.0], vec![0.0; 3], vec![0.0]]
        );
        assert_eq!(replayed.get(), 2);
    }

    #[test]
    fn a_failed_sum_ends_the_micro_batch_with_its_error() {
        let tries = Rc::new(Cell::new(0));
        let count = tries.clone();
        let _sync = StatsSync::enter(Box::new(move |_: &mut [f64]| {
            count.set(count.get() + 1);
            Err(KilnError::PeerLost("rank 1 failed".into()))
        }));
        begin_micro_batch();
        assert!(sum_over_ranks(&mut [1.0]));
        assert!(sum_over_ranks(&mut [1.0]));
        // The second call did not try again: the group is gone.
        assert_eq!(tries.get(), 1);
        let e = end_micro_batch().unwrap_err();
        assert!(matches!(e, KilnError::PeerLost(_)), "{e}");
    }
}
