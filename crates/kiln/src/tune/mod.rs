//! Tuning: measurements turned into decisions — the auto-optimizer ([`auto`]), batch-size
//! search under a memory budget ([`batch`]) and bottleneck detection from the step's phase
//! split ([`bottleneck`]). Both searches take the caller's own model and data as library
//! calls ([`auto::search_source`], [`batch::search_source`]); the CLI's zoo runs are users
//! of the same searches.

pub mod auto;
pub mod batch;
pub mod bottleneck;

pub use batch::{SearchMode, SearchOptions, SearchResult, Trial, TrialOutcome, parse_size, search};
pub use bottleneck::{Bottleneck, RunContext, StepSplit, Verdict, diagnose};
