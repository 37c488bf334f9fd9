//! The profiler's trace: valid Trace Event Format, spans that nest, children that cover each
//! step, a memory counter track, user timers. Its own test binary: the coverage figure is wall
//! time, and trainers running in parallel test threads of the same process would deschedule
//! the profiled thread between spans.

mod common;

use kiln::observe::{self, timer};
use kiln::train::TrainOptions;

#[test]
fn the_trace_is_valid_trace_event_format_and_its_spans_nest_and_cover_the_steps() {
    let (spans, _) = common::profiled_run(
        12,
        TrainOptions {
            grad_clip_norm: Some(1.0),
            grad_accum_steps: 2,
            epochs: 2,
            ..TrainOptions::default()
        },
    );
    let trace = kiln::observe::profile::chrome_trace(&spans);
    // Round-trip through text, as a viewer would read it.
    let trace: serde_json::Value = serde_json::from_str(&trace.to_string()).unwrap();
    let events = trace["traceEvents"].as_array().expect("traceEvents array");
    let mut complete = Vec::new();
    let mut counters = 0;
    for e in events {
        let ph = e["ph"].as_str().expect("ph");
        assert!(
            e["name"].is_string() && e["pid"].is_u64() && e["tid"].is_u64(),
            "{e}"
        );
        match ph {
            "M" => assert_eq!(e["name"], "thread_name"),
            "C" => {
                assert!(e["ts"].as_f64().unwrap() >= 0.0);
                assert!(e["args"]["rss_mib"].as_f64().unwrap() > 0.0, "{e}");
                counters += 1;
            }
            "X" => {
                let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
                assert!(ts >= 0.0 && dur >= 0.0, "{e}");
                assert!(e["args"].is_object());
                complete.push((e["tid"].as_u64().unwrap(), ts, ts + dur, e["name"].clone()));
            }
            other => panic!("unexpected phase {other}"),
        }
    }
    assert!(counters >= 12, "a memory counter per step: {counters}");
    // Every phase of a step is there.
    for phase in [
        "step",
        "data_wait",
        "forward",
        "backward",
        "sync",
        "guard_check",
        "clip",
        "optimizer",
        "report",
    ] {
        assert!(
            complete.iter().any(|c| c.3 == phase),
            "no `{phase}` span in the trace"
        );
    }
    assert_eq!(complete.iter().filter(|c| c.3 == "step").count(), 12);
    // Proper nesting: on one thread, two spans are disjoint or one contains the other.
    const EPS: f64 = 0.01;
    for a in &complete {
        for b in &complete {
            if a.0 != b.0 || std::ptr::eq(a, b) {
                continue;
            }
            let disjoint = a.2 <= b.1 + EPS || b.2 <= a.1 + EPS;
            let a_in_b = a.1 + EPS >= b.1 && a.2 <= b.2 + EPS;
            let b_in_a = b.1 + EPS >= a.1 && b.2 <= a.2 + EPS;
            assert!(disjoint || a_in_b || b_in_a, "{a:?} and {b:?} overlap");
        }
    }
    // The direct children of each step cover >= 95% of its wall time.
    for step in spans.iter().filter(|s| s.name == "step") {
        let end = step.start_us + step.dur_us;
        let covered: f64 = spans
            .iter()
            .filter(|c| {
                c.thread == step.thread
                    && c.depth == step.depth + 1
                    && c.start_us >= step.start_us
                    && c.start_us + c.dur_us <= end + EPS
            })
            .map(|c| c.dur_us)
            .sum();
        assert!(
            covered >= 0.95 * step.dur_us,
            "step {:?}: children cover {covered:.0} of {:.0} us",
            step.fields,
            step.dur_us
        );
    }
    // Operations inside the phases: each Kiln kernel call is a span within the forward or
    // the backward that ran it, with its shape and FLOPs.
    let within = |op: &str, phase: &str| {
        spans.iter().filter(|s| s.name == op).any(|o| {
            spans.iter().any(|p| {
                p.name == phase
                    && p.thread == o.thread
                    && p.start_us <= o.start_us + EPS
                    && o.start_us + o.dur_us <= p.start_us + p.dur_us + EPS
            })
        })
    };
    assert!(
        within("kiln.linear", "forward"),
        "no kiln.linear span in a forward"
    );
    for grad in ["kiln.linear.grad_input", "kiln.linear.grad_weight"] {
        assert!(within(grad, "backward"), "no {grad} span in a backward");
    }
    let linear = spans.iter().find(|s| s.name == "kiln.linear").unwrap();
    assert!(
        linear
            .fields
            .iter()
            .any(|(k, v)| k == "flops" && v.parse::<u64>().unwrap() > 0),
        "{:?}",
        linear.fields
    );
    // The user's timer is a span in the trace and has statistics.
    assert!(
        spans
            .iter()
            .any(|s| s.name == "timed" && s.fields.iter().any(|(_, v)| v == "user-code"))
    );
    // Other tests in this binary time the same name concurrently: at least this one call.
    assert!(timer("user-code").is_some_and(|t| t.count >= 1 && t.p50_ms >= 2.0));
    // The phase table accounts for the same spans.
    let table = observe::phase_table(&spans);
    let step_row = table.iter().find(|p| p.name == "step").unwrap();
    assert_eq!(step_row.count, 12);
    assert!(step_row.p95_ms >= step_row.p50_ms && step_row.total_ms > 0.0);
}

/// Inference is profiled per node: every executor node of an imported ONNX model and of a
/// Kiln inference session is a span named by its operator, with the Kiln kernel calls
/// inside; the table has a row per operator.
#[test]
fn inference_nodes_are_spans_grouped_by_operator() {
    use kiln::burn::tensor::{Device, Distribution, Tensor, TensorData};
    use tracing_subscriber::layer::SubscriberExt;
    let device = Device::flex();
    let onnx = kiln::onnx::OnnxModel::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx/opmix.onnx"),
        &device,
    )
    .unwrap();
    let dims: Vec<usize> = onnx.inputs()[0]
        .dims
        .iter()
        .map(|d| d.unwrap_or(2))
        .collect();
    let input = TensorData::new(vec![0.5f32; dims.iter().product()], dims);
    let model = kiln::zoo::ModelKind::Cnn.init(&device);
    let session =
        kiln::infer::InferenceSession::new(&model, "cnn", [1, 28, 28], &[], &device).unwrap();
    let images = Tensor::<4>::random([2, 1, 28, 28], Distribution::Default, &device);
    let profiler = observe::Profiler::new();
    // On a pool thread, where a large forward would hop to anyway, so the thread's
    // subscriber sees every node.
    rayon::scope(|_| {
        let subscriber = tracing_subscriber::registry().with(profiler.layer());
        tracing::subscriber::with_default(subscriber, || {
            onnx.run_data(vec![input]).unwrap();
            session.forward(images).unwrap();
        });
    });
    let spans = profiler.spans();
    let labels: Vec<String> = spans.iter().map(|s| s.label()).collect();
    for want in ["onnx.node Conv2d", "infer.node Conv", "infer.node Linear"] {
        assert!(
            labels.iter().any(|l| l == want),
            "no {want:?} in {labels:?}"
        );
    }
    // The kernel call sits inside its node.
    let conv = spans
        .iter()
        .find(|s| s.label() == "infer.node Conv")
        .unwrap();
    assert!(spans.iter().any(|k| k.name == "kiln.conv2d_nhwc"
        && k.thread == conv.thread
        && k.start_us >= conv.start_us
        && k.start_us + k.dur_us <= conv.start_us + conv.dur_us + 0.01));
    let table = observe::phase_table(&spans);
    assert!(
        table
            .iter()
            .any(|p| p.name == "onnx.node Conv2d" && p.count >= 2)
    );
}
