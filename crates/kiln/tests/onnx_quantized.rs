//! Quantized models as users bring them (`tools/quantize_onnx_models.py`: ONNX Runtime's
//! `quantize_static` in QDQ and QOperator form, `quantize_dynamic`), each checked at batch 1
//! and 3 against ONNX Runtime's outputs computed operator by operator — ONNX's definition of
//! the model (ONNX Runtime's fused int8 session is itself up to 8.8e-2 of the largest output
//! away from it on the ViT, 0 on the CNNs: `quantized.json`).
//!
//! Kiln's static int8 steps compute the layers in integers (int32 sums of the model's int8
//! values, as the definition's float sums of dequantized values are exactly), so outputs
//! agree to [`INT8_TOLERANCE`] of the largest; where a float operator between quantizers
//! sums in another order (a bilinear resize, a transposed convolution), an element can
//! cross a rounding boundary of the next quantizer and come out one grid step apart, which
//! at most [`MAX_STEP_SHARE`] of an output's elements may. Classifiers must pick the same
//! top-1 class for every sample. The static and QOperator forms must run on Kiln's integer
//! kernels (not as dequantize + f32), which the test checks by the steps the model holds.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use kiln::onnx::OnnxModel;
use safetensors::SafeTensors;

#[path = "common/onnx_ref.rs"]
mod onnx_ref;
use burn::tensor::TensorData;
use onnx_ref::tensor;

/// Largest `max |kiln − ort| / max |ort|` for an output computed like ONNX's definition.
const INT8_TOLERANCE: f32 = 1e-4;

/// Share of a dequantized output's elements that may land one grid step from ONNX
/// Runtime's: a float sum (a bilinear resize, a transposed convolution) computed in another
/// order can cross a rounding boundary of the next quantizer.
const MAX_STEP_SHARE: f32 = 0.01;

fn corpus_dir() -> PathBuf {
    std::env::var_os("KILN_ONNX_QUANTIZED").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx/quantized"),
        PathBuf::from,
    )
}

/// Top-1 of each row of a `[batch, classes]` output.
fn top1(values: &[f32], classes: usize) -> Vec<usize> {
    values
        .chunks_exact(classes)
        .map(|row| {
            (0..classes)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap_or(0)
        })
        .collect()
}

/// The step of the grid a dequantized output lies on: the smallest gap between its
/// distinct values (`None` for fewer than two).
fn grid_step(values: &[f32]) -> Option<f32> {
    let mut v: Vec<f32> = values.to_vec();
    v.sort_by(f32::total_cmp);
    v.dedup();
    v.windows(2).map(|w| w[1] - w[0]).reduce(f32::min)
}

/// Compares one output with ONNX Runtime's: `Ok(relative error)` within
/// [`INT8_TOLERANCE`], or on the output's quantization grid at most one step off in at most
/// [`MAX_STEP_SHARE`] of its elements.
fn judge(ours: &[f32], theirs: &[f32]) -> Result<f32, String> {
    let err = onnx_ref::relative_error(ours, theirs);
    if err <= INT8_TOLERANCE {
        return Ok(err);
    }
    let step = grid_step(theirs).unwrap_or(0.0);
    let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (mut off, mut worst) = (0usize, 0f32);
    for (a, b) in ours.iter().zip(theirs) {
        let d = (a - b).abs();
        if d > INT8_TOLERANCE * scale {
            off += 1;
            worst = worst.max(d);
        }
    }
    let share = off as f32 / theirs.len().max(1) as f32;
    if worst <= step * 1.001 && share <= MAX_STEP_SHARE {
        eprintln!(
            "  {off} element(s) one grid step ({step:.3e}) off: {:.3} %",
            share * 100.0
        );
        Ok(err)
    } else {
        Err(format!(
            "relative error {err:.2e}: {off} element(s) off by up to {worst:.3e} \
             (grid step {step:.3e}, {:.2} %)",
            share * 100.0
        ))
    }
}

fn check(path: &Path, kiln_kernels: bool) -> Result<f32, String> {
    let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("?");
    let model = OnnxModel::load(path, &Device::default())
        .map_err(|e| format!("load: {e}"))?
        .with_kiln_kernels(kiln_kernels);
    let ops = model.op_counts();
    let integer = ops.get("QConv").copied().unwrap_or(0) + ops.get("QLinear").copied().unwrap_or(0);
    let static_form = name.ends_with(".qdq") || name.ends_with(".qop");
    if static_form && integer == 0 {
        return Err(format!("no layer on the integer kernels: {ops:?}"));
    }
    let refs = path.with_extension("ref.safetensors");
    let bytes = std::fs::read(&refs).map_err(|e| format!("{}: {e}", refs.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| format!("{e}"))?;
    let floats = |d: TensorData| {
        d.convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| format!("{e:?}"))
    };
    let mut worst = 0f32;
    for batch in [1, 3] {
        let inputs = model
            .inputs()
            .iter()
            .map(|p| {
                tensor(&st, &format!("b{batch}.in.{}", p.name))
                    .ok_or_else(|| format!("no reference input {}", p.name))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let outputs = model
            .run_data(inputs)
            .map_err(|e| format!("b{batch}: {e}"))?;
        for (i, out) in outputs.into_iter().enumerate() {
            let reference = tensor(&st, &format!("b{batch}.out.{i}"))
                .ok_or_else(|| format!("no reference output {i}"))?;
            if out.shape() != reference.shape() {
                return Err(format!(
                    "b{batch} output {i}: shape {:?}, ONNX Runtime {:?}",
                    out.shape(),
                    reference.shape()
                ));
            }
            let classes = (reference.shape().len() == 2).then(|| reference.shape()[1]);
            let (a, b) = (floats(out)?, floats(reference)?);
            worst = worst.max(judge(&a, &b).map_err(|e| format!("b{batch} output {i}: {e}"))?);
            if let Some(classes) = classes.filter(|_| i == 0)
                && top1(&a, classes) != top1(&b, classes)
            {
                return Err(format!(
                    "b{batch}: top-1 {:?}, ONNX Runtime {:?}",
                    top1(&a, classes),
                    top1(&b, classes)
                ));
            }
        }
    }
    Ok(worst)
}

#[test]
fn quantized_models_match_onnx_runtime_int8_on_the_integer_kernels() {
    let dir = corpus_dir();
    let models = onnx_ref::onnx_files(&dir);
    // The committed set: every format of every source model (an outside one may be smaller).
    if std::env::var_os("KILN_ONNX_QUANTIZED").is_none() {
        assert!(models.len() >= 27, "{} quantized models", models.len());
    }
    let mut failures = Vec::new();
    for path in &models {
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("?");
        let result = check(path, true).and_then(|a| Ok(a.max(check(path, false)?)));
        match result {
            Ok(err) => eprintln!("{name}: ok, relative error {err:.2e}"),
            Err(why) => {
                eprintln!("{name}: FAILED: {why}");
                failures.push(format!("{name}: {why}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
