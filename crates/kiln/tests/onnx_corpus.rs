//! The ONNX corpus (`tools/onnx_corpus.py`): models as users export them — recurrent,
//! audio, video, image-to-image, decoders, window and einsum attention, the indexing
//! operators — each exported by both PyTorch exporters, checked against ONNX Runtime's
//! outputs stored beside it at batch 1 and 3.
//!
//! By default the committed set in `models/onnx/corpus` (every model must load and match).
//! `KILN_ONNX_CORPUS=DIR` checks a corpus built elsewhere (`--set full`: timm and
//! transformers too) and writes `DIR/kiln-report.json`: each model loaded or not (the
//! error naming what is missing), and its largest relative error; there the target,
//! at least 95 % loading and matching, is what is asserted.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use kiln::onnx::OnnxModel;
use safetensors::SafeTensors;

#[path = "common/onnx_ref.rs"]
mod onnx_ref;
use onnx_ref::{TOLERANCE, compare};

/// Share of an outside corpus that must load and match (issue 50's target).
const REQUIRED_SHARE: f64 = 0.95;

fn corpus_dir() -> (PathBuf, bool) {
    match std::env::var_os("KILN_ONNX_CORPUS") {
        Some(dir) => (PathBuf::from(dir), true),
        None => (
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx/corpus"),
            false,
        ),
    }
}

/// One model's result: `Ok(largest relative error)` or why it failed.
fn check_model(path: &Path, kiln_kernels: bool) -> Result<f32, String> {
    let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("?");
    let model = OnnxModel::load(path, &Device::default())
        .map_err(|e| format!("load: {e}"))?
        .with_kiln_kernels(kiln_kernels);
    let refs = path.with_extension("ref.safetensors");
    let bytes = std::fs::read(&refs).map_err(|e| format!("{}: {e}", refs.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| format!("{e}"))?;
    let what = format!("{name} (Kiln kernels {kiln_kernels})");
    let err = compare(&model, &st, &[1, 3, 3, 1], &what)?;
    if err > TOLERANCE {
        return Err(format!("relative error {err:.2e} > {TOLERANCE:.0e}"));
    }
    Ok(err)
}

#[test]
fn every_corpus_model_loads_and_matches_onnx_runtime() {
    let (dir, outside) = corpus_dir();
    let models = onnx_ref::onnx_files(&dir);
    assert!(!models.is_empty(), "no .onnx files in {}", dir.display());
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for path in &models {
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("?");
        // Kiln's host kernels and Burn's operators: both paths must agree with ONNX Runtime.
        let result = check_model(path, true).and_then(|a| Ok(a.max(check_model(path, false)?)));
        match &result {
            Ok(err) => eprintln!("{name}: ok, relative error {err:.2e}"),
            Err(why) => {
                eprintln!("{name}: FAILED: {why}");
                failures.push(format!("{name}: {why}"));
            }
        }
        report.push(serde_json::json!({
            "name": name,
            "ok": result.is_ok(),
            "max_rel_error": result.as_ref().ok(),
            "error": result.as_ref().err(),
        }));
    }
    let passed = models.len() - failures.len();
    let share = passed as f64 / models.len() as f64;
    eprintln!(
        "{passed} of {} corpus models load and match ({:.1} %)",
        models.len(),
        share * 100.0
    );
    if outside {
        let text = serde_json::to_string_pretty(&report).unwrap();
        std::fs::write(dir.join("kiln-report.json"), text).unwrap();
        assert!(
            share >= REQUIRED_SHARE,
            "{passed} of {} load and match, below {:.0} %:\n{}",
            models.len(),
            REQUIRED_SHARE * 100.0,
            failures.join("\n")
        );
    } else {
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}

/// A model of the committed corpus.
fn committed(name: &str) -> OnnxModel {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/onnx/corpus")
        .join(format!("{name}.onnx"));
    OnnxModel::load(&path, &Device::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The exporters' shape arithmetic is recorded once per input shape in the models whose
/// reshape targets pass through a `Mod` (`nn.MultiheadAttention`'s head split), a
/// `Transpose` (`F.pad`'s pads) or a `Trilu` (a causal mask): each such model is
/// shape-static. The corpus test above checks their outputs on repeated and changing
/// batches (1, 3, 3, 1), the recorded values among them.
#[test]
fn shape_arithmetic_through_mod_transpose_and_trilu_is_recorded() {
    for name in [
        "torch_encoder",
        "whisper_stem",
        "tcn",
        "style_transfer",
        "causal_lm",
    ] {
        let model = committed(name);
        assert!(
            model.cached_shape_steps() > 0,
            "{name}: its shape arithmetic is not recorded"
        );
    }
    // NonZero's output length is data: nothing is recorded.
    assert_eq!(committed("indexing").cached_shape_steps(), 0);
}

/// Each input's batch axis, found by its name wherever it sits: first for a batch-first
/// model, second in a sequence-first RNN's input and in an initial state.
#[test]
fn inputs_know_their_batch_axis() {
    let axes = |name: &str| -> Vec<(String, Option<usize>)> {
        committed(name)
            .inputs()
            .iter()
            .map(|p| (p.name.clone(), p.batch_axis))
            .collect()
    };
    assert_eq!(axes("lstm"), [("tokens".to_string(), Some(0))]);
    assert_eq!(axes("rnn"), [("x".to_string(), Some(1))]);
    assert_eq!(
        axes("gru"),
        [("x".to_string(), Some(0)), ("h0".to_string(), Some(1))]
    );
}
