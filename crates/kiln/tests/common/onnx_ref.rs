//! Reading the reference files the ONNX export tools write beside each model
//! (`NAME.ref.safetensors`: `b{batch}.in.{input}` and ONNX Runtime's `b{batch}.out.{index}`)
//! and comparing Kiln's outputs with them.
#![allow(dead_code)]

use burn::tensor::{DType, TensorData};
use kiln::onnx::OnnxModel;
use safetensors::SafeTensors;

/// Largest allowed `max |kiln - ort| / max |ort|` per output (f32).
pub const TOLERANCE: f32 = 1e-4;

/// The `.onnx` files of `dir`, sorted.
pub fn onnx_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut models: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "onnx"))
        .collect();
    models.sort();
    models
}

/// The tensor `name` of a reference file, when it holds one.
pub fn tensor(st: &SafeTensors, name: &str) -> Option<TensorData> {
    let view = st.tensor(name).ok()?;
    let dtype = match view.dtype() {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::I64 => DType::I64,
        other => panic!("reference tensor {name} has dtype {other:?}"),
    };
    Some(TensorData::from_bytes_vec(
        view.data().to_vec(),
        view.shape().to_vec(),
        dtype,
    ))
}

/// Largest difference relative to the reference's largest magnitude.
pub fn relative_error(ours: &[f32], reference: &[f32]) -> f32 {
    let scale = reference
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(1e-12);
    let diff = ours
        .iter()
        .zip(reference)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

/// Runs `model` on the reference inputs of each batch in `batches` (in that order, so a
/// repeated batch reuses recorded shape arithmetic) and returns the largest relative error
/// over every output, or what went wrong (a run error, a missing tensor, a shape mismatch).
pub fn compare(
    model: &OnnxModel,
    st: &SafeTensors,
    batches: &[usize],
    what: &str,
) -> Result<f32, String> {
    let mut worst = 0f32;
    for &batch in batches {
        let inputs = model
            .inputs()
            .iter()
            .map(|p| {
                tensor(st, &format!("b{batch}.in.{}", p.name))
                    .ok_or_else(|| format!("{what}: no reference input {}", p.name))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let outputs = model
            .run_data(inputs)
            .map_err(|e| format!("{what} b{batch}: {e}"))?;
        if outputs.len() != model.outputs().len() {
            return Err(format!("{what} b{batch}: {} outputs", outputs.len()));
        }
        for (i, out) in outputs.into_iter().enumerate() {
            let reference = tensor(st, &format!("b{batch}.out.{i}"))
                .ok_or_else(|| format!("{what}: no reference output {i}"))?;
            if out.shape() != reference.shape() {
                return Err(format!(
                    "{what} b{batch} output {i}: shape {:?}, ONNX Runtime {:?}",
                    out.shape(),
                    reference.shape()
                ));
            }
            let ours = out
                .convert::<f32>()
                .try_to_vec::<f32>()
                .map_err(|e| format!("{e:?}"))?;
            let theirs = reference
                .convert::<f32>()
                .try_to_vec::<f32>()
                .map_err(|e| format!("{e:?}"))?;
            let err = relative_error(&ours, &theirs);
            eprintln!("{what} b{batch} output {i}: relative error {err:.2e}");
            worst = worst.max(err);
        }
    }
    Ok(worst)
}
