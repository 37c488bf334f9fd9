//! Bottleneck detection: from where a training step's time goes (the profiler's phase table,
//! or the trainer's own data/compute split), a verdict — data-, transfer-, overhead- or
//! compute-bound — with the numbers behind it and the concrete next action.
//!
//! The thresholds say when a part is worth acting on: data wait ≥ 10% of the step (the loader
//! can usually hide it completely), transfer ≥ 15% (copies and synchronization that overlap
//! could hide), fixed per-step costs ≥ 20% (the step is too small for its bookkeeping).
//! Otherwise the kernels dominate and the step is compute-bound.

use serde::Serialize;

use crate::observe::PhaseStats;

/// Data wait share from which a run is data-bound.
pub const DATA_BOUND: f64 = 0.10;
/// Transfer/synchronization share from which a run is transfer-bound.
pub const TRANSFER_BOUND: f64 = 0.15;
/// Fixed-cost share from which a run is overhead-bound.
pub const OVERHEAD_BOUND: f64 = 0.20;

/// Shares of step time, each in [0, 1].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepSplit {
    /// Mean step time, ms.
    pub step_ms: f64,
    /// Waiting for the next batch.
    pub data: f64,
    /// Device↔host copies and synchronization (`sync`).
    pub transfer: f64,
    /// Forward and backward passes.
    pub compute: f64,
    /// The optimizer update.
    pub optimizer: f64,
    /// Per-step fixed costs: guard checks, clipping, unscaling, reporting, and whatever no
    /// span covers.
    pub overhead: f64,
}

impl StepSplit {
    /// The split from a profiler phase table (`kiln profile`), or `None` without `step` spans.
    pub fn from_phases(table: &[PhaseStats]) -> Option<Self> {
        let total = |name: &str| {
            table
                .iter()
                .find(|p| p.name == name)
                .map_or(0.0, |p| p.total_ms)
        };
        let step = table.iter().find(|p| p.name == "step")?;
        let t = step.total_ms.max(1e-9);
        let data = total("data_wait") / t;
        let transfer = total("sync") / t;
        let compute = (total("forward") + total("backward")) / t;
        let optimizer = total("optimizer") / t;
        Some(StepSplit {
            step_ms: step.mean_ms,
            data,
            transfer,
            compute,
            optimizer,
            overhead: (1.0 - data - transfer - compute - optimizer).max(0.0),
        })
    }
}

/// The kind of bottleneck.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bottleneck {
    /// The step waits for data.
    DataBound,
    /// Copies and synchronization take a large share.
    TransferBound,
    /// Fixed per-step costs take a large share.
    OverheadBound,
    /// The kernels dominate.
    ComputeBound,
}

/// A verdict with its evidence and the next action.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// The kind.
    pub kind: Bottleneck,
    /// The split it was decided from.
    pub split: StepSplit,
    /// One line: the kind and the number that decided it.
    pub summary: String,
    /// What to do next, concretely.
    pub action: String,
}

/// What the verdict's advice may refer to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunContext {
    /// Loader workers the run used.
    pub workers: usize,
    /// CPU cores.
    pub cores: usize,
    /// Micro-batch size.
    pub batch_size: usize,
    /// Whether the run is on a GPU backend.
    pub gpu: bool,
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// Decides the bottleneck of a step split.
pub fn diagnose(split: &StepSplit, ctx: &RunContext) -> Verdict {
    let (kind, summary, action) = if split.data >= DATA_BOUND {
        let action = if ctx.workers < ctx.cores.max(1) * 2 {
            format!(
                "raise data.workers {} -> {} (or set data.workers = \"auto\"); if that does not \
                 close it, cache the preprocessing (CachedDataset) or lighten data.augment",
                ctx.workers,
                (ctx.workers * 2)
                    .max(ctx.workers + 1)
                    .min(ctx.cores.max(1) * 2)
            )
        } else {
            format!(
                "the {} workers cannot keep up: cache the preprocessing (CachedDataset), store \
                 samples pre-decoded (memory-mapped .npy) or lighten data.augment",
                ctx.workers
            )
        };
        (
            Bottleneck::DataBound,
            format!(
                "data-bound: {} of step time waiting for data",
                pct(split.data)
            ),
            action,
        )
    } else if split.transfer >= TRANSFER_BOUND {
        let action = if ctx.gpu {
            "overlap copies with compute: keep the loader's workers > 0 so uploads happen on \
             their threads, and read values back less often (log every N steps)"
                .to_string()
        } else {
            "reduce device→host reads: log the loss every N steps instead of every step".into()
        };
        (
            Bottleneck::TransferBound,
            format!(
                "transfer-bound: {} of step time in copies and synchronization",
                pct(split.transfer)
            ),
            action,
        )
    } else if split.overhead >= OVERHEAD_BOUND {
        (
            Bottleneck::OverheadBound,
            format!(
                "overhead-bound: {} of a {:.1} ms step in fixed per-step costs (guard, clipping, \
                 reporting)",
                pct(split.overhead),
                split.step_ms
            ),
            format!(
                "amortize them: raise train.batch_size {} -> {} (the fixed costs stay, the work per \
                 step doubles), or drop guard.check_params where the run is known stable",
                ctx.batch_size,
                ctx.batch_size * 2
            ),
        )
    } else {
        let action = if ctx.gpu {
            "compute-bound: use precision.policy = \"bf16\" (or \"f16\") and the largest batch \
             that fits (kiln tune batch)"
                .to_string()
        } else {
            "compute-bound: the kernels dominate; on CPU low precision does not pay (see \
             BENCHMARKS run 4) — a GPU, a smaller model, or for inference `kiln optimize` (int8)"
                .to_string()
        };
        (
            Bottleneck::ComputeBound,
            format!(
                "compute-bound: forward+backward {}, optimizer {}, data wait {}",
                pct(split.compute),
                pct(split.optimizer),
                pct(split.data)
            ),
            action,
        )
    };
    Verdict {
        kind,
        split: *split,
        summary,
        action,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(data: f64, transfer: f64, compute: f64, optimizer: f64) -> StepSplit {
        StepSplit {
            step_ms: 10.0,
            data,
            transfer,
            compute,
            optimizer,
            overhead: (1.0 - data - transfer - compute - optimizer).max(0.0),
        }
    }

    const CTX: RunContext = RunContext {
        workers: 0,
        cores: 2,
        batch_size: 64,
        gpu: false,
    };

    #[test]
    fn each_kind_is_recognized_with_its_action() {
        let v = diagnose(&split(0.38, 0.0, 0.55, 0.05), &CTX);
        assert_eq!(v.kind, Bottleneck::DataBound);
        assert!(
            v.summary.contains("38.0% of step time waiting"),
            "{}",
            v.summary
        );
        assert!(v.action.contains("data.workers 0 -> 1"), "{}", v.action);
        let v = diagnose(
            &split(0.38, 0.0, 0.55, 0.05),
            &RunContext { workers: 4, ..CTX },
        );
        assert!(v.action.contains("cannot keep up"), "{}", v.action);
        let v = diagnose(&split(0.01, 0.2, 0.7, 0.05), &CTX);
        assert_eq!(v.kind, Bottleneck::TransferBound);
        let v = diagnose(&split(0.01, 0.0, 0.6, 0.05), &CTX);
        assert_eq!(v.kind, Bottleneck::OverheadBound);
        assert!(
            v.action.contains("train.batch_size 64 -> 128"),
            "{}",
            v.action
        );
        let v = diagnose(&split(0.01, 0.0, 0.93, 0.04), &CTX);
        assert_eq!(v.kind, Bottleneck::ComputeBound);
        let v = diagnose(
            &split(0.01, 0.0, 0.93, 0.04),
            &RunContext { gpu: true, ..CTX },
        );
        assert!(v.action.contains("bf16"));
    }
}
