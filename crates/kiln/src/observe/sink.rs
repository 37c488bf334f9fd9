//! Event sinks: where run events go.

use std::io::Write;

use super::Event;

/// Receives run events. Sinks must be cheap: they are called on the training thread.
pub trait EventSink {
    /// Handles one event.
    fn emit(&mut self, event: &Event);
}

/// Discards events.
#[derive(Debug, Default)]
pub struct NullSink;

impl EventSink for NullSink {
    fn emit(&mut self, _event: &Event) {}
}

/// Keeps every event in memory (tests, reports).
#[derive(Debug, Default)]
pub struct MemorySink {
    /// Events in arrival order.
    pub events: Vec<Event>,
}

impl MemorySink {
    /// The step events received so far, in order.
    pub fn steps(&self) -> impl Iterator<Item = &super::StepEvent> {
        self.events.iter().filter_map(|e| match e {
            Event::Step(s) => Some(s),
            _ => None,
        })
    }
}

impl EventSink for MemorySink {
    fn emit(&mut self, event: &Event) {
        self.events.push(event.clone());
    }
}

/// Writes one JSON object per line (`--json`).
pub struct JsonLinesSink<W: Write> {
    out: W,
}

impl<W: Write> JsonLinesSink<W> {
    /// Writes to `out`.
    pub fn new(out: W) -> Self {
        JsonLinesSink { out }
    }
}

impl<W: Write> EventSink for JsonLinesSink<W> {
    fn emit(&mut self, event: &Event) {
        // Events are plain data, so serialization cannot fail; a closed pipe is the reader's
        // choice and must not stop training, so write errors are logged, not raised.
        if let Ok(line) = serde_json::to_string(event)
            && let Err(e) = writeln!(self.out, "{line}").and_then(|_| self.out.flush())
        {
            tracing::warn!("cannot write event: {e}");
        }
    }
}

/// Sends every event to several sinks.
#[derive(Default)]
pub struct FanOut<'a> {
    sinks: Vec<&'a mut dyn EventSink>,
}

impl<'a> FanOut<'a> {
    /// An empty fan-out.
    pub fn new() -> Self {
        FanOut { sinks: Vec::new() }
    }

    /// Adds a sink.
    pub fn with(mut self, sink: &'a mut dyn EventSink) -> Self {
        self.sinks.push(sink);
        self
    }
}

impl EventSink for FanOut<'_> {
    fn emit(&mut self, event: &Event) {
        for s in &mut self.sinks {
            s.emit(event);
        }
    }
}
