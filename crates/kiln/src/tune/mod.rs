//! Tuning: measurements turned into decisions — the auto-optimizer ([`auto`]), batch-size
//! search under a memory budget ([`batch`]) and bottleneck detection from the step's phase
//! split ([`bottleneck`]).

pub mod auto;
pub mod batch;
pub mod bottleneck;

pub use batch::{SearchMode, SearchOptions, SearchResult, Trial, TrialOutcome, parse_size, search};
pub use bottleneck::{Bottleneck, RunContext, StepSplit, Verdict, diagnose};
