//! The numerical-stability guard: detects non-finite loss, gradients and parameters after
//! each step with one fused check, and acts by policy (skip the step, roll back to the last
//! good snapshot, or abort), reporting every event.
//!
//! The fused check multiplies each tensor by zero and sums: `0·x` is 0 for finite `x` and NaN
//! for ±Inf or NaN, so the sum over all tensors is 0 exactly when everything is finite, and
//! cannot overflow. One scalar per step crosses to the host; the per-tensor scan that names
//! the offending tensors runs only when the check fails.

mod probe;

use serde::{Deserialize, Serialize};

pub use crate::observe::{GuardAction, GuardEvent, Trouble};
pub use probe::{nonfinite_param_names, param_paths, probe_grads_each, probe_params};

/// What the guard does when a step goes non-finite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuardPolicy {
    /// Skip the optimizer step (the loss scaler backs off) and continue.
    Skip,
    /// Skip the step; if parameters went non-finite, restore the last good snapshot.
    Rollback,
    /// Stop the run with an error; the last checkpoint stays intact.
    Abort,
}

crate::names::config_names!(GuardPolicy { Skip => "skip", Rollback => "rollback", Abort => "abort" });

/// Guard settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuardOptions {
    /// Action on a non-finite step.
    pub policy: GuardPolicy,
    /// Abort after this many non-finite steps in a row (skip/rollback).
    pub max_consecutive: u32,
    /// Also check parameters after each optimizer step (one more fused pass).
    pub check_params: bool,
    /// Take an in-memory snapshot for rollback every N good steps.
    pub snapshot_every: u64,
}

impl Default for GuardOptions {
    fn default() -> Self {
        GuardOptions {
            policy: GuardPolicy::Abort,
            max_consecutive: 10,
            check_params: false,
            snapshot_every: 50,
        }
    }
}

/// The guard's running state.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    options: GuardOptions,
    consecutive: u32,
    /// Every event so far.
    pub events: Vec<GuardEvent>,
}

impl Guard {
    /// A guard with these options.
    pub fn new(options: GuardOptions) -> Self {
        Guard {
            options,
            consecutive: 0,
            events: Vec::new(),
        }
    }

    /// The options.
    pub fn options(&self) -> &GuardOptions {
        &self.options
    }

    /// Records a clean step.
    pub fn clean_step(&mut self) {
        self.consecutive = 0;
    }

    /// Decides the action for a non-finite step: the policy's, or abort once the limit of
    /// consecutive bad steps is reached or when a rollback has nothing to restore.
    pub fn decide(&mut self, trouble: Trouble, have_snapshot: bool) -> GuardAction {
        self.consecutive += 1;
        if self.consecutive > self.options.max_consecutive {
            return GuardAction::Aborted;
        }
        match (self.options.policy, trouble) {
            (GuardPolicy::Abort, _) => GuardAction::Aborted,
            // Parameters already updated to non-finite values: skipping cannot undo that.
            (GuardPolicy::Skip, Trouble::Parameters) => GuardAction::Aborted,
            (GuardPolicy::Rollback, Trouble::Parameters) if !have_snapshot => GuardAction::Aborted,
            (GuardPolicy::Rollback, Trouble::Parameters) => GuardAction::RolledBack,
            (GuardPolicy::Skip | GuardPolicy::Rollback, _) => GuardAction::Skipped,
        }
    }

    /// Non-finite steps in a row so far.
    pub fn consecutive(&self) -> u32 {
        self.consecutive
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(policy: GuardPolicy, max: u32) -> Guard {
        Guard::new(GuardOptions {
            policy,
            max_consecutive: max,
            ..GuardOptions::default()
        })
    }

    #[test]
    fn skip_until_the_limit_then_abort() {
        let mut g = guard(GuardPolicy::Skip, 2);
        assert_eq!(g.decide(Trouble::Gradients, false), GuardAction::Skipped);
        assert_eq!(g.decide(Trouble::Loss, false), GuardAction::Skipped);
        assert_eq!(g.decide(Trouble::Gradients, false), GuardAction::Aborted);
    }

    #[test]
    fn a_clean_step_resets_the_count() {
        let mut g = guard(GuardPolicy::Skip, 1);
        assert_eq!(g.decide(Trouble::Gradients, false), GuardAction::Skipped);
        g.clean_step();
        assert_eq!(g.decide(Trouble::Gradients, false), GuardAction::Skipped);
    }

    #[test]
    fn bad_parameters_need_a_snapshot() {
        let mut g = guard(GuardPolicy::Rollback, 5);
        assert_eq!(g.decide(Trouble::Parameters, true), GuardAction::RolledBack);
        assert_eq!(g.decide(Trouble::Parameters, false), GuardAction::Aborted);
        let mut g = guard(GuardPolicy::Skip, 5);
        assert_eq!(g.decide(Trouble::Parameters, true), GuardAction::Aborted);
        let mut g = guard(GuardPolicy::Abort, 5);
        assert_eq!(g.decide(Trouble::Loss, true), GuardAction::Aborted);
    }
}
