//! Run events and where they go. `observe` depends on nothing else in Kiln: the trainer (and
//! later the tuner, server and profiler) emit [`Event`]s into an [`EventSink`]; sinks render
//! them for people (the CLI's progress bar) or machines (JSON lines).

mod events;
pub mod memory;
mod sink;
pub mod timing;

pub use events::{EpochSummary, Event, GuardAction, GuardEvent, RunSummary, StepEvent, Trouble};
pub use sink::{EventSink, FanOut, JsonLinesSink, MemorySink, NullSink};
