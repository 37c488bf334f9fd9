//! `kiln optimize`: a trained checkpoint → an optimized inference graph, with a table of what
//! each pass bought (latency b1, throughput b64, size on disk, accuracy, logit drift).

use anyhow::{Context, Result};
use kiln::data::{Dataset, collate};
use kiln::datasets::{self, Split};
use kiln::infer::{
    self, CandidateTiming, InferenceSession, LayerTiming, LogitDelta, Pass, Probe, choose_int8,
    choose_winograd, kernels_pay, onnx_export, pass_pays,
};
use kiln::observe::timing::measure;
use kiln::plan::Plan;
use kiln::zoo::{self, ModelKind};
use serde::Serialize;

use crate::OptimizeArgs;

/// One row of the summary: the model after the passes so far.
#[derive(Debug, Serialize)]
struct Stage {
    /// Passes applied, in order (`f32` for none).
    passes: String,
    /// Median latency of one image, ms.
    latency_b1_ms: f64,
    /// Images per second at batch 64.
    throughput_b64: f64,
    /// Size of the graph file (weights + structure), bytes.
    size_bytes: usize,
    /// Top-1 on the test split.
    accuracy: f64,
    /// Logit drift from the unoptimized model.
    logits_vs_f32: LogitDelta,
    /// What the newest pass changed.
    changes: Vec<String>,
    /// Whether the newest pass was kept, and the measurements that decided it.
    #[serde(skip_serializing_if = "Option::is_none")]
    decision: Option<Decision>,
}

/// A pass that can lose, measured and kept or dropped.
#[derive(Debug, Clone, Serialize)]
struct Decision {
    pass: &'static str,
    kept: bool,
    reason: String,
    /// Int8 and winograd: each candidate layer's time without and with the pass.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    layers: Vec<LayerTiming>,
    /// Int8 and winograd: the whole-model forms timed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    candidates: Vec<CandidateTiming>,
    /// Int8 and winograd: the index into `candidates` of the form kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    chosen: Option<usize>,
}

/// The plan for `kiln optimize`: the same road as `kiln train` (config file, level, flags;
/// `--device` validated: a device this build or machine cannot run is an error).
pub fn resolve_plan(args: &OptimizeArgs) -> Result<Plan> {
    let plan = args.config.resolve()?;
    // The plan's thread count, as `kiln train` applies it (the kernel switch goes to each
    // session).
    plan.apply_runtime();
    tracing::info!(
        "device {}; passes from the plan at level {}: {}",
        plan.backend.name(),
        plan.level,
        plan.infer_passes
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>()
            .join(",")
    );
    Ok(plan)
}

pub fn run(args: OptimizeArgs) -> Result<()> {
    let Some(checkpoint) = &args.checkpoint else {
        anyhow::bail!("kiln optimize needs --checkpoint (or --onnx FILE)");
    };
    if args.config.model.is_none() && args.config.config.is_none() {
        anyhow::bail!(
            "kiln optimize needs the checkpoint's model: --model (mlp, cnn, transformer, \
             resnet) or a --config file with train.model"
        );
    }
    let plan = resolve_plan(&args)?;
    let kind = plan.model;
    let passes = match &args.passes {
        Some(list) => Pass::parse_list(list)?,
        None => plan.infer_passes.clone(),
    };
    // The test split of the run's data (any format `kiln train` reads), else the bundled one.
    let test: Box<dyn Dataset> = match &plan.data_dir {
        Some(dir) => datasets::open_dir(dir)?.1,
        None => Box::new(datasets::bundled(Split::Test)?),
    };
    let test = test.as_ref();
    let shape = test.item_shape();
    let checkpoint = if checkpoint.is_dir() {
        kiln::train::latest_checkpoint(checkpoint)?
            .with_context(|| format!("no checkpoint (step-*.kiln) in {}", checkpoint.display()))?
    } else {
        checkpoint.clone()
    };
    let device = plan.backend.device();
    let model = zoo::load_model(kind, shape[0], &checkpoint, &device)?;
    let mut kiln_kernels = plan.train.kiln_kernels;

    // Real test images at batch 1 and the serving batch: what the keep/drop measurements run.
    let mut batches = vec![1, args.batch.max(1)];
    batches.dedup();
    let images = batches
        .iter()
        .map(|&b| {
            let indices: Vec<usize> = (0..b).map(|i| i % test.len()).collect();
            collate(test, &indices, &device).map(|c| c.images)
        })
        .collect::<kiln::Result<Vec<_>>>()?;
    let mut probe = Probe {
        device: &device,
        kiln_kernels,
        images: &images,
        steps: args.steps.clamp(1, 10),
    };

    let mut graph = infer::lower(&model, kind.name(), shape)?;
    let mut stages = Vec::new();
    let mut decisions = Vec::new();
    let mut names: Vec<String> = Vec::new();
    let mut reference: Option<(Vec<f32>, f64)> = None;
    let mut last = None;
    for upto in 0..=passes.len() {
        let mut changes = Vec::new();
        let mut decision = None;
        let before = graph.clone();
        if upto > 0 {
            let pass = passes[upto - 1];
            let measured = !args.keep_all && pass.can_lose();
            let (kept, why) = match pass {
                _ if !measured => {
                    changes = pass.apply(&mut graph)?;
                    (true, String::new())
                }
                Pass::ChannelsLast if !kiln_kernels => (
                    false,
                    "Kiln's kernels are off in the plan (device.kiln_kernels = false)".to_string(),
                ),
                Pass::ChannelsLast => {
                    let (stay, why) = kernels_pay(&graph, &probe)?;
                    if !stay {
                        // Everything after runs, and is served, on Burn's ops.
                        kiln_kernels = false;
                        probe.kiln_kernels = false;
                        changes = vec!["kiln_kernels = false in config.toml".to_string()];
                    }
                    (stay, why)
                }
                Pass::Int8 | Pass::Winograd => {
                    let choice = if pass == Pass::Int8 {
                        choose_int8(&graph, &probe)?
                    } else {
                        choose_winograd(&graph, &probe)?
                    };
                    changes = choice.apply(&mut graph)?;
                    let kept = choice.kept();
                    let why = choice.reason.clone();
                    decision = Some(choice);
                    (kept, why)
                }
                _ => {
                    let mut after = graph.clone();
                    let rewritten = pass.apply(&mut after)?;
                    let (b, a, pays) = pass_pays(&graph, &after, &probe)?;
                    let why = format!(
                        "{} at batch {:?}: {:.3?} ms vs {:.3?} ms before",
                        if pays { "faster" } else { "not faster" },
                        batches,
                        a,
                        b
                    );
                    if pays {
                        graph = after;
                        changes = rewritten;
                    }
                    (pays, why)
                }
            };
            names.push(if kept {
                pass.name().to_string()
            } else {
                format!("({} dropped)", pass.name())
            });
            if measured {
                decisions.push(Decision {
                    pass: pass.name(),
                    kept,
                    reason: why,
                    layers: decision
                        .as_ref()
                        .map(|c| c.layers.clone())
                        .unwrap_or_default(),
                    chosen: decision.as_ref().map(|c| c.chosen),
                    candidates: decision.map(|c| c.candidates).unwrap_or_default(),
                });
            }
        }
        let mut session =
            InferenceSession::from_graph(graph.clone(), &device)?.with_kiln_kernels(kiln_kernels);
        let mut predictions = session.evaluate(test, 250)?;
        let (reference_logits, reference_accuracy) =
            reference.get_or_insert_with(|| (predictions.logits.clone(), predictions.accuracy));
        let drop_points = (*reference_accuracy - predictions.accuracy) * 100.0;
        let measured = upto > 0 && !args.keep_all && passes[upto - 1].can_lose();
        if measured && drop_points > args.max_accuracy_drop && graph != before {
            // The pass costs more accuracy than the budget: the model stays as it was.
            graph = before;
            changes = vec![format!(
                "dropped: {drop_points:.2} points of accuracy lost, more than --max-accuracy-drop {}",
                args.max_accuracy_drop
            )];
            if let Some(d) = decisions.last_mut() {
                d.kept = false;
                // The base form (without int8; Winograd wherever the kernels take it).
                d.chosen = d.chosen.map(|_| 0);
                d.reason = changes[0].clone();
            }
            if let Some(name) = names.last_mut() {
                *name = format!("({} dropped)", passes[upto - 1].name());
            }
            session = InferenceSession::from_graph(graph.clone(), &device)?
                .with_kiln_kernels(kiln_kernels);
            predictions = session.evaluate(test, 250)?;
        }
        let stage = Stage {
            passes: if names.is_empty() {
                "f32".into()
            } else {
                names.join("+")
            },
            latency_b1_ms: time_batch(&session, test, 1, args.steps)?,
            throughput_b64: 64.0 / (time_batch(&session, test, 64, args.steps)? / 1e3),
            size_bytes: infer::graph_to_bytes(session.graph())?.len(),
            accuracy: predictions.accuracy,
            logits_vs_f32: LogitDelta::between(&predictions.logits, reference_logits),
            changes,
            decision: if measured {
                decisions.last().cloned()
            } else {
                None
            },
        };
        if !args.json {
            eprintln!(
                "kiln optimize: {} measured ({} changes)",
                stage.passes,
                stage.changes.len()
            );
        }
        stages.push(stage);
        last = Some(session);
    }
    let session = last.context("no stage was measured")?;

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let graph_path = args.out.join("model.kgraph");
    infer::save_graph(session.graph(), &graph_path)?;
    let onnx_note = match onnx_export::export(session.graph(), &args.out.join("model.onnx")) {
        Ok(()) => "model.onnx (opset 17)".to_string(),
        Err(e) => format!("no ONNX file: {e}"),
    };
    // The output directory doubles as a kiln-serve model directory; a config the user
    // already edited is kept.
    let serve_config = args.out.join("config.toml");
    if !serve_config.exists() {
        // Burn's ops measured faster than Kiln's kernels (or the plan turned them off).
        let kernels_line = if kiln_kernels {
            ""
        } else {
            "kiln_kernels = false\n"
        };
        std::fs::write(
            &serve_config,
            format!("{SERVE_CONFIG}{kernels_line}{SERVE_BATCHING}"),
        )
        .with_context(|| format!("writing {}", serve_config.display()))?;
    }
    let table = render(kind, &stages, &onnx_note);
    std::fs::write(args.out.join("summary.md"), &table)?;
    std::fs::write(
        args.out.join("summary.json"),
        serde_json::to_string_pretty(&stages)?,
    )?;
    if args.json {
        println!("{}", serde_json::to_string(&stages)?);
    } else {
        print!("{table}");
        println!("wrote {} and {}", graph_path.display(), onnx_note);
    }
    Ok(())
}

/// The kiln-serve configuration written beside `model.kgraph`.
const SERVE_CONFIG: &str = "\
# kiln-serve model configuration (written by `kiln optimize`).
# Serve every model directory under the parent: kiln serve --models <parent>
backend = \"graph\"
graph = \"model.kgraph\"
max_batch_size = 64
instances = 1
max_queue_size = 1024
";

/// The serving config's dynamic batching, after its top-level keys.
const SERVE_BATCHING: &str = "
[dynamic_batching]
max_queue_delay_microseconds = 500
";

/// Median ms per forward of `batch` real test images (5 warm-up, 3 × `steps`).
fn time_batch(
    session: &InferenceSession,
    data: &dyn Dataset,
    batch: usize,
    steps: usize,
) -> Result<f64> {
    let indices: Vec<usize> = (0..batch).map(|i| i % data.len()).collect();
    let images = collate(data, &indices, session.device())?.images;
    let mut failure = None;
    let timing = measure(
        || {
            if let Err(e) = session.forward(images.clone()).map(|y| y.into_data()) {
                failure = Some(e);
            }
        },
        5,
        steps.max(1),
        3,
    );
    match failure {
        Some(e) => Err(e.into()),
        None => Ok(timing.median_ms),
    }
}

fn render(kind: ModelKind, stages: &[Stage], onnx_note: &str) -> String {
    let mut s = format!(
        "# kiln optimize: {} ({})\n\n| passes | latency b1 | throughput b64 | size | accuracy | max |Δlogit| | mean |Δlogit| |\n|---|---:|---:|---:|---:|---:|---:|\n",
        kind.name(),
        kind.workload()
    );
    for st in stages {
        s.push_str(&format!(
            "| {} | {:.3} ms | {:.0} img/s | {} | {:.2}% | {:.4} | {:.4} |\n",
            st.passes,
            st.latency_b1_ms,
            st.throughput_b64,
            kiln::observe::memory::human_bytes(st.size_bytes as u64),
            st.accuracy * 100.0,
            st.logits_vs_f32.max_abs,
            st.logits_vs_f32.mean_abs,
        ));
    }
    s.push_str(&format!("\nExport: {onnx_note}\n"));
    for d in stages.iter().filter_map(|st| st.decision.as_ref()) {
        s.push_str(&render_decision(d));
    }
    for st in stages.iter().filter(|st| !st.changes.is_empty()) {
        s.push_str(&format!("\n{}:\n", st.passes));
        for c in &st.changes {
            s.push_str(&format!("- {c}\n"));
        }
    }
    s
}

/// A measured pass: kept or dropped and why; for int8 and winograd the per-layer and
/// whole-model times.
fn render_decision(d: &Decision) -> String {
    let mut s = format!(
        "\n## {}: {}\n\n{}\n",
        d.pass,
        if d.kept { "kept" } else { "dropped" },
        d.reason
    );
    let ms = |v: &[f64]| {
        v.iter()
            .map(|m| format!("{m:.3}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    if !d.layers.is_empty() {
        let (without, with, stays) = if d.pass == "int8" {
            ("f32", "int8", "slower: stays f32")
        } else {
            ("implicit GEMM", "Winograd", "slower: implicit GEMM")
        };
        s.push_str(&format!(
            "\n| layer | kind | {without} ms | {with} ms | {} |\n|---|---|---:|---:|---|\n",
            d.pass
        ));
        for l in &d.layers {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                l.name,
                l.kind,
                ms(&l.without_ms),
                ms(&l.with_ms),
                if l.keeps { "kept" } else { stays }
            ));
        }
    }
    if !d.candidates.is_empty() {
        s.push_str("\n| whole model | ms (batch 1 / serving batch) |\n|---|---:|\n");
        for c in &d.candidates {
            s.push_str(&format!("| {} | {} |\n", c.label, ms(&c.ms)));
        }
    }
    s
}
