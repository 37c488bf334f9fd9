//! `kiln bench --onnx FILE`: Kiln's ONNX runtime and ONNX Runtime on the same file, the same
//! input shapes and the same thread count, in one run (the peer is a Python child running
//! `bench/peers/ort_file_bench.py`; absent onnxruntime, the table says so and Kiln's column
//! stands alone).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use burn::tensor::{Device, TensorData};
use kiln::burn;
use kiln::observe::timing::{Timing, measure};
use kiln::onnx::{OnnxModel, OnnxPass, Port, Value, ValueKind, show_dims};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::work_dir::WorkDir;

/// The peer script, embedded so the binary needs no source tree beside it.
const ORT_SCRIPT: &str = include_str!("../../../bench/peers/ort_file_bench.py");

/// What `kiln bench --onnx` measures.
pub struct OnnxBench {
    /// The model file.
    pub path: PathBuf,
    /// Batch sizes to time.
    pub batches: Vec<usize>,
    /// CPU threads for Kiln and the peer.
    pub threads: usize,
    /// Timed runs per repeat (3 repeats after 5 warm-up runs).
    pub steps: usize,
    /// Sizes of non-batch dynamic axes, per input.
    pub input_dims: BTreeMap<String, Vec<usize>>,
    /// JSON lines instead of a table.
    pub json: bool,
    /// Int8 on both sides: Kiln's fold + int8 passes, onnxruntime's `quantize_dynamic`.
    pub int8: bool,
    /// Where Kiln runs the model (the CPU's `flex` by default; a GPU with `--device cuda`).
    pub device: Device,
}

/// One row: a batch size, both runtimes.
#[derive(Debug, Serialize)]
struct Row {
    model: String,
    int8: bool,
    batch: usize,
    threads: usize,
    kiln_ms: f64,
    kiln_spread: f64,
    /// ONNX Runtime's median, when it could run.
    ort_ms: Option<f64>,
    /// `ort_ms / kiln_ms`: above 1, Kiln is faster.
    kiln_speedup_vs_ort: Option<f64>,
    /// Largest `max |kiln − ort| / max |ort|` over the outputs, on the same inputs.
    max_rel_diff_vs_ort: Option<f64>,
    /// Why the peer column is empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    ort_note: Option<String>,
}

/// Runs the benchmark and prints its table (or JSON lines).
pub fn run(bench: &OnnxBench) -> Result<()> {
    kiln::plan::set_cpu_threads(bench.threads);
    let device = bench.device.clone();
    let mut model = OnnxModel::load(&bench.path, &device)
        .with_context(|| format!("loading {}", bench.path.display()))?;
    if bench.int8 {
        for pass in [OnnxPass::Fold, OnnxPass::Int8] {
            model.apply(pass)?;
        }
    }
    let mut rows = Vec::new();
    for &batch in &bench.batches {
        let shapes = input_shapes(model.inputs(), batch, &bench.input_dims)?;
        let inputs = make_inputs(model.inputs(), &shapes, &device)?;
        let kiln = time_kiln(&model, &inputs, bench.steps)?;
        let ours = model.run(inputs.clone())?;
        let (ort_ms, diff, ort_note) = match time_ort(&bench.path, &shapes, &inputs, &ours, bench) {
            Ok((ms, diff)) => (Some(ms), Some(diff), None),
            Err(e) => (None, None, Some(format!("{e:#}"))),
        };
        let row = Row {
            model: model.name().to_string(),
            int8: bench.int8,
            batch,
            threads: bench.threads,
            kiln_ms: kiln.median_ms,
            kiln_spread: kiln.spread,
            ort_ms,
            kiln_speedup_vs_ort: ort_ms.map(|o| o / kiln.median_ms),
            max_rel_diff_vs_ort: diff,
            ort_note,
        };
        if bench.json {
            println!("{}", serde_json::to_string(&row)?);
        }
        rows.push(row);
    }
    if !bench.json {
        print_table(&rows);
    }
    Ok(())
}

/// Each input's full shape at `batch`: the batch on the input's batch axis (the first, or
/// the one named like the first input's: a sequence-first RNN's `[seq, batch, ..]`), the
/// other dynamic axes from `input_dims`, given in order without the batch axis.
pub(crate) fn input_shapes(
    ports: &[Port],
    batch: usize,
    input_dims: &BTreeMap<String, Vec<usize>>,
) -> Result<Vec<(String, Vec<usize>)>> {
    ports
        .iter()
        .map(|p| {
            let rest: Vec<Option<usize>> = p
                .dims
                .iter()
                .enumerate()
                .filter(|&(axis, _)| Some(axis) != p.batch_axis)
                .map(|(_, &d)| d)
                .collect();
            let mut dims: Vec<usize> = match input_dims.get(&p.name) {
                Some(given) if given.len() == rest.len() => given.clone(),
                Some(given) => bail!(
                    "--input-dims gives {given:?} for `{}`, which has {} axes besides the batch",
                    p.name,
                    rest.len()
                ),
                None => rest
                    .iter()
                    .map(|d| {
                        d.with_context(|| {
                            format!(
                                "input `{}` {} has a dynamic axis besides the batch; give its \
                                 size with --input-dims {}=N",
                                p.name,
                                show_dims(&p.dims),
                                p.name
                            )
                        })
                    })
                    .collect::<Result<_>>()?,
            };
            if let Some(axis) = p.batch_axis {
                dims.insert(axis, batch);
            }
            Ok((p.name.clone(), dims))
        })
        .collect()
}

/// Seeded inputs: standard-normal-ish floats, integer ones (a valid token id and mask).
pub(crate) fn make_inputs(
    ports: &[Port],
    shapes: &[(String, Vec<usize>)],
    device: &Device,
) -> Result<Vec<Value>> {
    let mut rng = StdRng::seed_from_u64(1);
    ports
        .iter()
        .zip(shapes)
        .map(|(port, (_, shape))| {
            let n: usize = shape.iter().product();
            let data = match port.kind {
                ValueKind::Float => TensorData::new(
                    (0..n)
                        .map(|_| rng.random_range(-1.0f32..1.0))
                        .collect::<Vec<_>>(),
                    shape.clone(),
                ),
                ValueKind::Int => TensorData::new(vec![1i64; n], shape.clone()),
                ValueKind::Bool => TensorData::new(vec![true; n], shape.clone()),
            };
            Value::from_data(data, device).map_err(Into::into)
        })
        .collect()
}

/// Kiln's median per run, outputs read back to the host (as ONNX Runtime returns them).
pub(crate) fn time_kiln(model: &OnnxModel, inputs: &[Value], steps: usize) -> Result<Timing> {
    time_runs(model, inputs, 5, steps, 3)
}

/// [`time_kiln`] with the protocol's counts given: `warmup` runs, then `repeats` of `steps`.
pub(crate) fn time_runs(
    model: &OnnxModel,
    inputs: &[Value],
    warmup: usize,
    steps: usize,
    repeats: usize,
) -> Result<Timing> {
    // One checked run first, so a failure is an error rather than a panic in the loop.
    for out in model.run(inputs.to_vec())? {
        out.data()?;
    }
    let mut failure = None;
    let timing = measure(
        || match model.run(inputs.to_vec()) {
            Ok(outs) => {
                for out in outs {
                    let _ = out.data();
                }
            }
            Err(e) => failure = Some(e),
        },
        warmup,
        steps,
        repeats,
    );
    match failure {
        Some(e) => Err(e.into()),
        None => Ok(timing),
    }
}

/// ONNX Runtime's median per run on the same inputs and threads, and how far Kiln's outputs
/// (`ours`) are from its outputs on those inputs.
fn time_ort(
    path: &Path,
    shapes: &[(String, Vec<usize>)],
    inputs: &[Value],
    ours: &[Value],
    bench: &OnnxBench,
) -> Result<(f64, f64)> {
    // The script, inputs and outputs; removed on every way out.
    let work = WorkDir::create("ort-bench")?;
    let script = work.join("ort_file_bench.py");
    std::fs::write(&script, ORT_SCRIPT).context("writing the peer script")?;
    for (i, input) in inputs.iter().enumerate() {
        let bytes: Vec<u8> = match input.kind() {
            ValueKind::Float => input
                .to_f32s()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            _ => input
                .to_i64s()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        };
        std::fs::write(work.join(format!("in{i}.bin")), bytes)?;
    }
    let shapes: BTreeMap<&str, &Vec<usize>> = shapes.iter().map(|(n, s)| (n.as_str(), s)).collect();
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .arg(&script)
        .arg(path)
        .args(["--shapes", &serde_json::to_string(&shapes)?])
        .args(["--threads", &bench.threads.to_string()])
        .args(["--steps", &bench.steps.to_string()])
        .args(bench.int8.then_some("--int8"))
        .arg("--io")
        .arg(&*work)
        .output()
        .with_context(|| {
            format!("running {python} (set KILN_PYTHON to a Python with onnxruntime)")
        })?;
    let diff = compare_outputs(&work, ours);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("no output");
        bail!(
            "ONNX Runtime peer failed ({last}); pip install onnxruntime numpy, or set KILN_PYTHON"
        );
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(line.trim())
        .with_context(|| format!("parsing the peer's output {line:?}"))?;
    let ms = v["ms_per_run"]
        .as_f64()
        .context("the peer's output has no ms_per_run")?;
    Ok((ms, diff?))
}

/// The largest relative difference between Kiln's outputs and the peer's `out{i}.bin`.
fn compare_outputs(work: &Path, ours: &[Value]) -> Result<f64> {
    let mut worst = 0f64;
    for (i, out) in ours.iter().enumerate() {
        let bytes = std::fs::read(work.join(format!("out{i}.bin")))
            .with_context(|| format!("reading ONNX Runtime's output {i}"))?;
        let theirs: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mine = out.to_f32s()?;
        if mine.len() != theirs.len() {
            bail!(
                "output {i}: Kiln gives {} values, ONNX Runtime {}",
                mine.len(),
                theirs.len()
            );
        }
        let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
        let diff = mine
            .iter()
            .zip(&theirs)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(f64::from(diff / scale));
    }
    Ok(worst)
}

fn print_table(rows: &[Row]) {
    println!(
        "{:<18} {:>5} {:>7} {:>11} {:>11} {:>12} {:>10}",
        "model", "batch", "threads", "kiln ms", "ort ms", "kiln vs ort", "max diff"
    );
    for r in rows {
        let (ort, ratio, diff) = match (r.ort_ms, r.kiln_speedup_vs_ort, r.max_rel_diff_vs_ort) {
            (Some(o), Some(x), Some(d)) => {
                (format!("{o:.3}"), format!("{x:.2}x"), format!("{d:.1e}"))
            }
            _ => ("-".into(), "-".into(), "-".into()),
        };
        let name = if r.int8 {
            format!("{} int8", r.model)
        } else {
            r.model.clone()
        };
        println!(
            "{:<18} {:>5} {:>7} {:>11.3} {:>11} {:>12} {:>10}",
            name, r.batch, r.threads, r.kiln_ms, ort, ratio, diff
        );
    }
    for r in rows {
        if let Some(note) = &r.ort_note {
            println!("batch {}: no ONNX Runtime column: {note}", r.batch);
        }
    }
    println!(
        "kiln vs ort = ORT ms / Kiln ms (above 1: Kiln faster); 5 warm-up, 3 repeats, median; \
         max diff = max |kiln - ort| / max |ort| on the same inputs"
    );
}
