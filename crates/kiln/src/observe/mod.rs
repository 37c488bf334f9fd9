//! Run events and where they go. `observe` depends on nothing else in Kiln: the trainer (and
//! later the tuner, server and profiler) emit [`Event`]s into an [`EventSink`]; sinks render
//! them for people (the CLI's progress bar) or machines (JSON lines, TensorBoard event files).
//! The profiler is a `tracing` layer over the spans the trainer opens around every phase of a
//! step ([`Profiler`]); [`timed`] gives users' own code the same statistics.

mod events;
pub mod heap;
pub mod memory;
pub mod profile;
mod sink;
pub mod tensorboard;
mod timer;
pub mod timing;

pub use events::{
    BatchAdaptedEvent, EpochSummary, Event, GuardAction, GuardEvent, RunSummary, SkippedSample,
    StepEvent, Trouble, WatermarkEvent,
};
pub use memory::Watermark;
pub use profile::{PhaseStats, Profiler, SpanRecord, phase_table, render_table};
pub use sink::{EventSink, FanOut, JsonLinesSink, MemorySink, NullSink};
pub use tensorboard::TensorBoardSink;
pub use timer::{TimerStats, record, reset_timers, timed, timer, timer_stats};
