//! One model's serving pipeline: preprocess → dynamic batcher → instances → postprocess,
//! each a set of threads joined by bounded queues.
//!
//! ```text
//! handler ──try_push──▶ [pre queue] ──▶ preprocess threads (decode, validate)
//!                                          │ try_push (full → 429 / RESOURCE_EXHAUSTED)
//!                                          ▼
//!                                    [batch queue] ──▶ instance threads (form batch, execute)
//!                                                          │ push (blocks: back-pressure)
//!                                                          ▼
//! handler ◀──oneshot── postprocess threads (split, arg-max, encode) ◀── [post queue]
//! ```
//!
//! Decoding and encoding run on their own threads, so a model instance goes from one batch
//! to the next without waiting for JSON work, and the async runtime never runs model code.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::backend::Backend;
use crate::codec::{self, Encoded, InferRequest, WireRequest};
use crate::config::{DynamicBatching, ModelConfig};
use crate::error::{Result, ServeError};
use crate::loader::{build_backends, instance_device};
use crate::metrics::ModelMetrics;
use crate::queue::{BoundedQueue, PushError};
use crate::signature::{ModelSpec, postprocess};
use crate::tensor::Values;

type Reply = oneshot::Sender<Result<Encoded>>;

/// Where a model's decoding and encoding run.
///
/// A thread hand-off costs tens of microseconds of wake-up latency (measured ~25 µs on a
/// busy 2-core machine, BENCHMARKS.md run 11), more than decoding a binary tensor or encoding
/// ten logits. So work on payloads up to `inline_bytes` runs in place — decoding in the
/// request handler, encoding on the instance thread — and only larger payloads (big JSON
/// bodies, whose parsing takes milliseconds) go to the stage threads, where that work
/// overlaps inference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stages {
    /// Preprocess and postprocess threads per model; 0 = everything in place.
    pub threads: usize,
    /// Payloads up to this many bytes are decoded / encoded in place.
    pub inline_bytes: usize,
}

impl Stages {
    /// Every request through the stage threads (`threads` of each).
    pub fn staged(threads: usize) -> Self {
        Stages {
            threads: threads.max(1),
            inline_bytes: 0,
        }
    }

    /// No stage threads: decoding and encoding always in place.
    pub fn inline() -> Self {
        Stages {
            threads: 0,
            inline_bytes: usize::MAX,
        }
    }

    /// True when a payload of `bytes` goes to a stage thread.
    fn hand_off(&self, bytes: usize) -> bool {
        self.threads > 0 && bytes > self.inline_bytes
    }
}

impl Default for Stages {
    /// One thread per stage; payloads up to 16 KiB in place.
    fn default() -> Self {
        Stages {
            threads: 1,
            inline_bytes: 16 << 10,
        }
    }
}

struct PreJob {
    wire: WireRequest,
    reply: Reply,
}

struct Pending {
    request: InferRequest,
    /// The request's stream sequence (stream models only).
    sequence: Option<crate::backend::SequenceState>,
    enqueued: Instant,
    /// The tighter of the model's `timeout_microseconds` and the request's own `timeout`.
    timeout: Option<std::time::Duration>,
    reply: Reply,
}

impl Pending {
    fn deadline(&self) -> Option<Instant> {
        self.timeout.map(|t| self.enqueued + t)
    }
}

struct PostJob {
    request: InferRequest,
    outputs: Vec<Values>,
    reply: Reply,
}

/// A loaded model serving requests.
pub struct ModelRuntime {
    /// Model name.
    pub name: String,
    /// Which version of the model this is (1 for a model directory without numbered
    /// versions).
    pub version: u64,
    /// Whether the model is laid out in numbered versions: its metrics then carry a
    /// `version` label, so that two versions serving side by side are two series.
    pub versioned: bool,
    /// Its configuration.
    pub config: ModelConfig,
    /// Its wire signature.
    pub spec: ModelSpec,
    /// Its counters.
    pub metrics: Arc<ModelMetrics>,
    pre: Arc<BoundedQueue<PreJob>>,
    batch: Arc<BoundedQueue<Pending>>,
    post: Arc<BoundedQueue<PostJob>>,
    /// Where decoding and encoding run.
    stages: Stages,
    /// A stream model's active sequences (`[sequence_batching]`).
    sequences: Option<crate::sequence::Sequences>,
    threads: Mutex<Vec<Vec<JoinHandle<()>>>>,
}

impl std::fmt::Debug for ModelRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRuntime")
            .field("name", &self.name)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl ModelRuntime {
    /// Builds `config.instances` backends and starts `stages.threads` pre- and postprocess
    /// threads each: version 1 of a model without numbered versions.
    pub fn start(name: &str, config: ModelConfig, stages: Stages) -> Result<Arc<Self>> {
        Self::start_version(name, None, config, stages)
    }

    /// [`ModelRuntime::start`] for numbered version `version` (`None`: an unversioned
    /// model, served as version 1). The warm-up, when configured, runs on every instance
    /// before this returns: a runtime that exists is ready.
    pub fn start_version(
        name: &str,
        version: Option<u64>,
        mut config: ModelConfig,
        stages: Stages,
    ) -> Result<Arc<Self>> {
        let stage_threads = stages.threads;
        // The kind as it resolved on this machine (KIND_AUTO becomes CPU or GPU), so the
        // model's configuration reports where it really runs.
        let (kind, device) = instance_device(name, config.kind)?;
        config.kind = kind;
        let (mut backends, spec) = build_backends(name, &config, &device)?;
        if let Some(warmup) = &config.warmup {
            crate::warmup::run(name, warmup, &spec, &mut backends)?;
        }
        let capacity = config.max_queue_size;
        let runtime = Arc::new(ModelRuntime {
            name: name.to_string(),
            version: version.unwrap_or(1),
            versioned: version.is_some(),
            metrics: Arc::new(ModelMetrics::new(config.max_batch_size)),
            pre: Arc::new(BoundedQueue::new(capacity)),
            batch: Arc::new(BoundedQueue::new(capacity)),
            post: Arc::new(BoundedQueue::new(capacity)),
            threads: Mutex::new(Vec::new()),
            stages,
            sequences: config
                .sequence
                .clone()
                .map(|c| crate::sequence::Sequences::new(name, c)),
            config,
            spec,
        });
        let spawn = |what: &str, i: usize, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(format!("{name}-{what}-{i}"))
                .spawn(f)
                .map_err(ServeError::Io)
        };
        let mut pre = Vec::new();
        for i in 0..stage_threads {
            let rt = Arc::clone(&runtime);
            pre.push(spawn("pre", i, Box::new(move || rt.preprocess_loop()))?);
        }
        let mut instances = Vec::new();
        for (i, backend) in backends.into_iter().enumerate() {
            let rt = Arc::clone(&runtime);
            instances.push(spawn(
                "instance",
                i,
                Box::new(move || rt.instance_loop(backend)),
            )?);
        }
        let mut post = Vec::new();
        for i in 0..stage_threads {
            let rt = Arc::clone(&runtime);
            post.push(spawn("post", i, Box::new(move || rt.postprocess_loop()))?);
        }
        *runtime.threads.lock().unwrap_or_else(|e| e.into_inner()) = vec![pre, instances, post];
        Ok(runtime)
    }

    /// Appends the model's series to a Prometheus exposition: its counters, and for a stream
    /// model the sequences it holds.
    pub fn render_metrics(&self, out: &mut String) {
        let labels = self.metric_labels();
        self.metrics.render(out, &labels);
        if let Some(table) = &self.sequences {
            use std::fmt::Write;
            let _ = writeln!(
                out,
                "kiln_stream_sequences_active{{{labels}}} {}",
                table.active()
            );
        }
    }

    /// The Prometheus labels naming this model (and its version, when numbered).
    fn metric_labels(&self) -> String {
        let model = self.name.replace(['"', '\\', '\n'], "_");
        if self.versioned {
            format!("model=\"{model}\",version=\"{}\"", self.version)
        } else {
            format!("model=\"{model}\"")
        }
    }

    /// Threads this runtime runs (each holds a reference to it until it stops).
    pub fn thread_count(&self) -> usize {
        self.threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(Vec::len)
            .sum()
    }

    /// Runs one request through the pipeline and returns its encoded response; overload,
    /// timeout and shutdown come back as errors, never as a hang.
    pub async fn infer(&self, wire: WireRequest) -> Result<Encoded> {
        let started = Instant::now();
        // A guard, so a request whose client hung up (future dropped) is still uncounted,
        // and counted as `cancelled` unless it got to an answer.
        let mut inflight = Inflight::enter(&self.metrics);
        let (reply, answer) = oneshot::channel();
        let queued = if self.stages.hand_off(wire.size()) {
            self.pre
                .try_push(PreJob { wire, reply })
                .map_err(|(why, _)| why)
        } else if self.pre.lock().closed {
            Err(PushError::Closed)
        } else {
            self.admit(wire, reply);
            Ok(())
        };
        let result = match queued {
            Ok(()) => answer.await.unwrap_or_else(|_| {
                Err(ServeError::Inference {
                    model: self.name.clone(),
                    message: "the pipeline dropped the request (a stage thread stopped)".into(),
                })
            }),
            Err(PushError::Full) => Err(self.queue_full()),
            Err(PushError::Closed) => Err(ServeError::ShuttingDown),
        };
        match &result {
            Ok(_) => {
                self.metrics
                    .success
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.metrics
                    .request_seconds
                    .observe(started.elapsed().as_secs_f64());
            }
            Err(e) => self.metrics.fail(e.metric_reason()),
        }
        inflight.answered = true;
        result
    }

    /// Stops taking requests, lets every queued one finish, and joins the stage threads.
    pub fn shutdown(&self) {
        let stages = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        let queues: [&dyn Fn(); 3] = [&|| self.pre.close(), &|| self.batch.close(), &|| {
            self.post.close()
        }];
        // Close each queue only after the stage feeding it has drained and stopped.
        for (close, threads) in queues.iter().zip(stages) {
            close();
            for t in threads {
                let _ = t.join();
            }
        }
    }

    fn queue_full(&self) -> ServeError {
        ServeError::QueueFull {
            model: self.name.clone(),
            limit: self.config.max_queue_size,
        }
    }

    fn preprocess_loop(&self) {
        while let Some(job) = self.pre.pop() {
            self.admit(job.wire, job.reply);
        }
    }

    /// Decodes a request and queues it for batching; a bad request or a full queue is
    /// answered at once.
    fn admit(&self, wire: WireRequest, reply: Reply) {
        let started = Instant::now();
        let decoded = codec::decode(wire, &self.spec, self.config.max_batch_size);
        ModelMetrics::add_time(&self.metrics.pre_ns, started.elapsed());
        let request = match decoded {
            Ok(r) => r,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let timeout = match (self.config.timeout, request.timeout) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let sequence = match (&self.sequences, &request.sequence) {
            (Some(table), _) => match table.admit(&request) {
                Ok(state) => Some(state),
                Err(e) => {
                    let _ = reply.send(Err(e));
                    return;
                }
            },
            (None, Some(_)) => {
                let _ = reply.send(Err(ServeError::InvalidRequest(format!(
                    "model `{}` is not a stream model (no [sequence_batching] in its \
                     config.toml); send requests without sequence parameters",
                    self.name
                ))));
                return;
            }
            (None, None) => None,
        };
        let pending = Pending {
            request,
            sequence,
            enqueued: Instant::now(),
            timeout,
            reply,
        };
        if let Err((why, p)) = self.batch.try_push(pending) {
            let _ = p.reply.send(Err(match why {
                PushError::Full => self.queue_full(),
                PushError::Closed => ServeError::ShuttingDown,
            }));
        }
    }

    fn instance_loop(&self, mut backend: Box<dyn Backend>) {
        let out_lens: Vec<usize> = self.spec.outputs.iter().map(|o| o.sample_len()).collect();
        while let Some(mut batch) = self.next_batch() {
            let rows: usize = batch.iter().map(|p| p.request.batch).sum();
            // The inputs move into the batch (a lone request's buffers run as they are, no
            // copy); what stays in each request is what the response needs.
            let inputs: Vec<Values> = if batch.len() == 1 {
                std::mem::take(&mut batch[0].request.inputs)
            } else {
                self.spec
                    .inputs
                    .iter()
                    .enumerate()
                    .map(|(i, spec)| {
                        let mut all =
                            Values::with_capacity(spec.datatype, rows * spec.sample_len());
                        for p in &mut batch {
                            if let Some(part) = p.request.inputs.get_mut(i) {
                                all.extend_from(&std::mem::replace(
                                    part,
                                    Values::with_capacity(spec.datatype, 0),
                                ));
                            }
                        }
                        all
                    })
                    .collect()
            };
            let started = Instant::now();
            let result = if self.sequences.is_some() {
                let states: Vec<_> = batch.iter().filter_map(|p| p.sequence.clone()).collect();
                let result = backend.execute_sequences(inputs, rows, &states);
                // The stream spec's third output says, per region, computed (1) or reused.
                if let Ok(outputs) = &result
                    && let Some(Values::I64(fresh)) = outputs.get(2)
                {
                    let computed = fresh.iter().filter(|&&f| f == 1).count() as u64;
                    let [c, r] = &self.metrics.stream_regions;
                    c.fetch_add(computed, std::sync::atomic::Ordering::Relaxed);
                    r.fetch_add(
                        fresh.len() as u64 - computed,
                        std::sync::atomic::Ordering::Relaxed,
                    );
                }
                result
            } else {
                backend.execute(inputs, rows)
            };
            self.metrics.record_batch(rows, started.elapsed());
            match result {
                Ok(outputs) => {
                    let mut row = 0;
                    for p in batch {
                        let n = p.request.batch;
                        let mine = outputs
                            .iter()
                            .zip(&out_lens)
                            .map(|(o, &len)| o.slice(row * len, (row + n) * len))
                            .collect();
                        row += n;
                        let job = PostJob {
                            request: p.request,
                            outputs: mine,
                            reply: p.reply,
                        };
                        let bytes: usize = job.outputs.iter().map(Values::byte_len).sum();
                        if !self.stages.hand_off(bytes) {
                            self.finish(job);
                        } else if let Err(job) = self.post.push(job) {
                            let _ = job.reply.send(Err(ServeError::ShuttingDown));
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(model = %self.name, error = %e, "batch failed");
                    for p in batch {
                        let _ = p.reply.send(Err(ServeError::Inference {
                            model: self.name.clone(),
                            message: e.to_string(),
                        }));
                    }
                }
            }
        }
    }

    fn postprocess_loop(&self) {
        while let Some(job) = self.post.pop() {
            self.finish(job);
        }
    }

    /// Postprocesses and encodes one request's outputs and sends the response.
    fn finish(&self, job: PostJob) {
        let started = Instant::now();
        let outputs = postprocess(&self.spec, job.request.batch, job.outputs);
        let encoded = codec::encode(&self.name, &self.version.to_string(), job.request, outputs);
        ModelMetrics::add_time(&self.metrics.post_ns, started.elapsed());
        let _ = job.reply.send(encoded);
    }

    /// Waits for the next batch by Triton's dynamic-batcher rules; `None` at shutdown.
    fn next_batch(&self) -> Option<Vec<Pending>> {
        let max = self.config.max_batch_size;
        let mut state = self.batch.lock();
        loop {
            // Requests carry their own timeouts, so expired ones can be anywhere in the
            // queue: one comparison pass, and a rebuild only when something expired.
            let now = Instant::now();
            if state
                .items
                .iter()
                .any(|p| p.deadline().is_some_and(|d| d <= now))
            {
                for p in std::mem::take(&mut state.items) {
                    match (p.deadline(), p.timeout) {
                        (Some(d), Some(timeout)) if d <= now => {
                            let _ = p.reply.send(Err(ServeError::Timeout {
                                model: self.name.clone(),
                                waited_us: now.duration_since(p.enqueued).as_micros() as u64,
                                timeout_us: timeout.as_micros() as u64,
                            }));
                        }
                        _ => state.items.push_back(p),
                    }
                }
            }
            if state.items.is_empty() {
                if state.closed {
                    return None;
                }
                state = self.batch.wait(state, None);
                continue;
            }
            let take = match &self.config.dynamic_batching {
                None => Some(1),
                Some(rules) => batch_cut(&state.items, max, rules, state.closed),
            };
            if let Some(take) = take {
                let batch: Vec<Pending> = state.items.drain(..take).collect();
                drop(state);
                let now = Instant::now();
                for p in &batch {
                    self.metrics.record_queue(now.duration_since(p.enqueued));
                }
                return Some(batch);
            }
            let oldest = state.items[0].enqueued;
            let mut deadline = oldest
                + self
                    .config
                    .dynamic_batching
                    .as_ref()
                    .map_or_else(Default::default, |b| b.max_queue_delay);
            if let Some(expiry) = state.items.iter().filter_map(Pending::deadline).min() {
                deadline = deadline.min(expiry);
            }
            state = self.batch.wait(state, Some(deadline));
        }
    }
}

/// Counts a request in flight for as long as it lives.
/// A request in flight: counted in `kiln_inflight_requests` until dropped, and as a
/// `cancelled` failure if dropped before it was answered (the client disconnected and the
/// server dropped the request's future).
struct Inflight<'a> {
    metrics: &'a ModelMetrics,
    answered: bool,
}

impl<'a> Inflight<'a> {
    fn enter(metrics: &'a ModelMetrics) -> Self {
        metrics
            .inflight
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Inflight {
            metrics,
            answered: false,
        }
    }
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.metrics.fail("cancelled");
        }
        self.metrics
            .inflight
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How many queued requests (oldest first) form the next batch now, or `None` to wait for
/// more. Triton's rules: a batch that is full (the next request would not fit) or whose
/// oldest request has waited `max_queue_delay` runs at once; otherwise the largest cut that
/// lands exactly on a preferred batch size runs; otherwise wait.
fn batch_cut(
    items: &std::collections::VecDeque<Pending>,
    max: usize,
    rules: &DynamicBatching,
    closing: bool,
) -> Option<usize> {
    let sizes: Vec<usize> = items.iter().map(|p| p.request.batch).collect();
    let oldest_wait = items
        .front()
        .map(|p| p.enqueued.elapsed())
        .unwrap_or_default();
    cut_for_sizes(
        &sizes,
        max,
        &rules.preferred_batch_sizes,
        closing || oldest_wait >= rules.max_queue_delay,
    )
}

/// [`batch_cut`] over plain request sizes: `expired` is true when the oldest has waited long
/// enough (or the queue is closing).
fn cut_for_sizes(sizes: &[usize], max: usize, preferred: &[usize], expired: bool) -> Option<usize> {
    let mut rows = 0;
    let mut take = 0;
    let mut preferred_cut = 0;
    for &n in sizes {
        if rows + n > max {
            break;
        }
        rows += n;
        take += 1;
        if preferred.contains(&rows) {
            preferred_cut = take;
        }
    }
    let full = rows == max || take < sizes.len();
    if take > 0 && (full || expired) {
        Some(take)
    } else if preferred_cut > 0 {
        Some(preferred_cut)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::cut_for_sizes;

    #[test]
    fn batches_follow_tritons_rules() {
        // Not full, not preferred, not expired: wait.
        assert_eq!(cut_for_sizes(&[1, 1, 1], 8, &[], false), None);
        // Delay expired: run what is there.
        assert_eq!(cut_for_sizes(&[1, 1, 1], 8, &[], true), Some(3));
        // Exactly full.
        assert_eq!(cut_for_sizes(&[4, 4], 8, &[], false), Some(2));
        // The next request would not fit: the batch is as full as it gets.
        assert_eq!(cut_for_sizes(&[4, 3, 2], 8, &[], false), Some(2));
        // The largest preferred cut runs without waiting.
        assert_eq!(cut_for_sizes(&[2, 2, 2, 1], 16, &[2, 4], false), Some(2));
        assert_eq!(cut_for_sizes(&[1, 2, 2], 16, &[4], false), None);
        assert_eq!(cut_for_sizes(&[2, 2, 1], 16, &[4], false), Some(2));
    }
}
