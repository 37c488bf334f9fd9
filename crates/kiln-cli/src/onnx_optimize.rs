//! `kiln optimize --onnx FILE --out DIR`: the passes (fold, winograd, int8, channels-last; the
//! last three measured, crate::onnx_layer_choice) on an imported ONNX model,
//! one row per stage: latency at batch 1 and 8, weight bytes, and how far the outputs moved
//! from the imported model on the same seeded inputs (largest relative difference, and top-1
//! agreement of the first output). Writes a servable model directory: the file, a
//! `config.toml` that applies the same passes at load, and the summary.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use burn::tensor::Device;
use kiln::burn;
use kiln::onnx::{OnnxModel, OnnxPass, Value};
use serde::Serialize;

use crate::onnx_bench::{input_shapes, make_inputs, time_kiln};
use crate::onnx_layer_choice::{self, KeptPass};

/// What `kiln optimize --onnx` does.
pub struct OnnxOptimize {
    /// Where the model runs (`--device`, resolved through the plan).
    pub device: Device,
    /// Whether the model runs on Kiln's kernels (the plan's `device.kiln_kernels`).
    pub kiln_kernels: bool,
    /// The model file.
    pub path: PathBuf,
    /// Passes in order.
    pub passes: Vec<OnnxPass>,
    /// Output directory.
    pub out: PathBuf,
    /// Sizes of non-batch dynamic axes, per input.
    pub input_dims: BTreeMap<String, Vec<usize>>,
    /// Timed runs per repeat.
    pub steps: usize,
    /// JSON on stdout instead of the table.
    pub json: bool,
    /// Apply every pass without measuring whether it pays (`--keep-all`).
    pub keep_all: bool,
}

/// One stage: the model after the passes so far.
#[derive(Debug, Serialize)]
struct Stage {
    passes: String,
    nodes: usize,
    latency_b1_ms: f64,
    latency_b8_ms: f64,
    weight_bytes: usize,
    /// Largest `max |y − y_f32| / max |y_f32|` over the outputs (batch 8, seeded inputs).
    max_rel_diff_vs_f32: f64,
    /// Rows of output 0 whose arg-max over the last axis agrees with the f32 model's.
    top1_agreement_vs_f32: f64,
    changes: Vec<String>,
    /// For a measured pass: kept or dropped, and the times that decided it.
    #[serde(skip_serializing_if = "Option::is_none")]
    decision: Option<onnx_layer_choice::Decision>,
}

/// Runs the passes stage by stage, measures each, writes the model directory.
pub fn run(job: &OnnxOptimize) -> Result<()> {
    let device = job.device.clone();
    let load = || {
        OnnxModel::load(&job.path, &device)
            .map(|m| m.with_kiln_kernels(job.kiln_kernels))
            .with_context(|| format!("loading {}", job.path.display()))
    };
    let mut model = load()?;
    let probe_shapes = input_shapes(model.inputs(), 8, &job.input_dims)?;
    let probe = make_inputs(model.inputs(), &probe_shapes, &device)?;
    let one_shapes = input_shapes(model.inputs(), 1, &job.input_dims)?;
    let one = make_inputs(model.inputs(), &one_shapes, &device)?;
    let reference = outputs(&model, &probe)?;
    let mut stages = Vec::new();
    let mut changes = Vec::new();
    // The passes applied so far, each with the layers it is limited to.
    let mut kept: Vec<KeptPass> = Vec::new();
    // Whether the model kept is served on Kiln's kernels (the channels-last pass can drop them).
    let mut kiln_kernels = job.kiln_kernels;
    let mut names: Vec<String> = Vec::new();
    for upto in 0..=job.passes.len() {
        let mut decision = None;
        if upto > 0 {
            let pass = job.passes[upto - 1];
            if pass == OnnxPass::ChannelsLast && !job.keep_all {
                // Measured: Kiln's kernels stay unless Burn's ops ran faster at batch 1 and 8
                // (crate::onnx_layer_choice::choose_kernels).
                let (burn, d) = if job.kiln_kernels {
                    onnx_layer_choice::choose_kernels(
                        &load,
                        &kept,
                        &model,
                        [one.as_slice(), probe.as_slice()],
                        job.steps,
                    )?
                } else {
                    (None, onnx_layer_choice::Decision::plan_off(pass))
                };
                changes = vec![format!(
                    "{} {}: {}",
                    pass.name(),
                    if d.kept { "kept" } else { "dropped" },
                    d.reason
                )];
                names.push(if d.kept {
                    pass.name().to_string()
                } else {
                    format!("({} dropped)", pass.name())
                });
                if d.kept {
                    kept.push((pass, None));
                }
                if let Some(m) = burn {
                    model = m;
                    kiln_kernels = false;
                }
                decision = Some(d);
            } else if matches!(pass, OnnxPass::Int8 | OnnxPass::Winograd) && !job.keep_all {
                // Measured: the pass stays only on the layers, and in the form, that ran
                // faster than the model without it at batch 1 and 8
                // (crate::onnx_layer_choice).
                let choice = onnx_layer_choice::choose(
                    pass,
                    &load,
                    &kept,
                    &model,
                    [one.as_slice(), probe.as_slice()],
                    job.steps,
                )?;
                changes = choice.changes;
                names.push(if choice.decision.kept {
                    pass.name().to_string()
                } else {
                    format!("({} dropped)", pass.name())
                });
                decision = Some(choice.decision);
                if let Some(m) = choice.model {
                    model = m;
                }
                kept.extend(choice.applied);
            } else {
                let report = model.apply(pass)?;
                changes = report.changes;
                kept.push((pass, None));
                names.push(pass.name().to_string());
            }
        }
        let ours = outputs(&model, &probe)?;
        let (diff, agree) = compare(&ours, &reference);
        let stage = Stage {
            passes: if names.is_empty() {
                "f32".into()
            } else {
                names.join("+")
            },
            nodes: model.node_count(),
            latency_b1_ms: time_kiln(&model, &one, job.steps)?.median_ms,
            latency_b8_ms: time_kiln(&model, &probe, job.steps)?.median_ms,
            weight_bytes: model.weight_bytes(),
            max_rel_diff_vs_f32: diff,
            top1_agreement_vs_f32: agree,
            changes: std::mem::take(&mut changes),
            decision,
        };
        if !job.json {
            eprintln!("kiln optimize: {} measured", stage.passes);
        }
        stages.push(stage);
    }
    write_model_dir(job, (&kept, kiln_kernels), &stages)?;
    if job.json {
        println!("{}", serde_json::to_string(&stages)?);
    } else {
        print!("{}", render(&job.path, &stages));
        println!("wrote {}", job.out.display());
    }
    Ok(())
}

/// Every output's values and dims on the host.
fn outputs(model: &OnnxModel, inputs: &[Value]) -> Result<Vec<(Vec<f32>, Vec<usize>)>> {
    model
        .run(inputs.to_vec())?
        .iter()
        .map(|v| Ok((v.to_f32s()?, v.dims())))
        .collect()
}

/// Largest relative difference over the outputs, and top-1 agreement of output 0.
fn compare(ours: &[(Vec<f32>, Vec<usize>)], reference: &[(Vec<f32>, Vec<usize>)]) -> (f64, f64) {
    let mut worst = 0f64;
    for ((a, _), (b, _)) in ours.iter().zip(reference) {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
        let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(f64::from(d / scale));
    }
    let agree = match (ours.first(), reference.first()) {
        (Some((a, dims)), Some((b, _))) => {
            let classes = dims.last().copied().unwrap_or(1).max(1);
            let argmax = |row: &[f32]| {
                row.iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                        if v > best.1 { (i, v) } else { best }
                    })
                    .0
            };
            let rows = a.len() / classes;
            let same = a
                .chunks_exact(classes)
                .zip(b.chunks_exact(classes))
                .filter(|(x, y)| argmax(x) == argmax(y))
                .count();
            same as f64 / rows.max(1) as f64
        }
        _ => 1.0,
    };
    (worst, agree)
}

/// The model directory: the file, a serving config with the passes, the summary.
fn write_model_dir(
    job: &OnnxOptimize,
    (kept, kiln_kernels): (&[KeptPass], bool),
    stages: &[Stage],
) -> Result<()> {
    std::fs::create_dir_all(&job.out).with_context(|| format!("creating {}", job.out.display()))?;
    let file = job.out.join("model.onnx");
    if job.path.canonicalize().ok() != file.canonicalize().ok() {
        std::fs::copy(&job.path, &file)
            .with_context(|| format!("copying {} to {}", job.path.display(), file.display()))?;
    }
    let config = job.out.join("config.toml");
    if !config.exists() {
        let dims: Vec<String> = job
            .input_dims
            .iter()
            .map(|(k, v)| {
                let v: Vec<String> = v.iter().map(|d| d.to_string()).collect();
                format!("{k} = [{}]", v.join(", "))
            })
            .collect();
        let dims_line = if dims.is_empty() {
            String::new()
        } else {
            format!("input_dims = {{ {} }}\n", dims.join(", "))
        };
        // The passes that were kept (a measured pass that lost is not applied at load, but
        // a Winograd that lost everywhere is, on no layer).
        let passes: Vec<&str> = kept.iter().map(|(p, _)| p.name()).collect();
        // Burn's ops measured faster than Kiln's kernels (or the plan turned them off).
        let kernels_line = if kiln_kernels {
            ""
        } else {
            "kiln_kernels = false\n"
        };
        // A pass on some layers only: the ones measured faster (a TOML array of node names).
        let layers_line: String = kept
            .iter()
            .filter_map(|(p, only)| {
                let key = match p {
                    OnnxPass::Int8 => "int8_layers",
                    OnnxPass::Winograd => "winograd_layers",
                    OnnxPass::Fold | OnnxPass::ChannelsLast => return None,
                };
                let quoted: Vec<String> = only.as_ref()?.iter().map(|n| format!("{n:?}")).collect();
                Some(format!("{key} = [{}]\n", quoted.join(", ")))
            })
            .collect();
        let text = format!(
            "# kiln-serve model configuration (written by `kiln optimize --onnx`).\n\
             # Serve every model directory under the parent: kiln serve --models <parent>\n\
             backend = \"onnx\"\nfile = \"model.onnx\"\npasses = \"{}\"\n{layers_line}{dims_line}{kernels_line}\
             max_batch_size = 16\ninstances = 1\nmax_queue_size = 1024\n\n\
             [dynamic_batching]\nmax_queue_delay_microseconds = 500\n",
            passes.join(",")
        );
        std::fs::write(&config, text).with_context(|| format!("writing {}", config.display()))?;
    }
    std::fs::write(job.out.join("summary.md"), render(&job.path, stages))?;
    std::fs::write(
        job.out.join("summary.json"),
        serde_json::to_string_pretty(stages)?,
    )?;
    Ok(())
}

fn render(path: &Path, stages: &[Stage]) -> String {
    let mut s = format!(
        "## kiln optimize --onnx {}\n\n\
         | passes | nodes | latency b1 (ms) | latency b8 (ms) | weights | max rel. diff vs f32 | top-1 agreement |\n\
         |---|---|---|---|---|---|---|\n",
        path.display()
    );
    for st in stages {
        s.push_str(&format!(
            "| {} | {} | {:.3} | {:.3} | {:.2} MB | {:.2e} | {:.1}% |\n",
            st.passes,
            st.nodes,
            st.latency_b1_ms,
            st.latency_b8_ms,
            st.weight_bytes as f64 / 1e6,
            st.max_rel_diff_vs_f32,
            st.top1_agreement_vs_f32 * 100.0
        ));
    }
    s.push('\n');
    for st in stages.iter().filter(|s| !s.changes.is_empty()) {
        s.push_str(&format!("- {}: {}\n", st.passes, st.changes.join("; ")));
    }
    s.push_str(
        "\nSeeded inputs (batch 8 for the differences); 5 warm-up, 3 repeats, median. \
         Top-1 agreement: rows of the first output whose arg-max matches the imported model's.\n",
    );
    s
}
