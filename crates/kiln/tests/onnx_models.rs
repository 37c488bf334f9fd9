//! Real exported models (PyTorch/torchvision architectures, a BERT-style encoder, a
//! segmentation head; `tools/export_onnx_models.py`) load through onnx-ir and match ONNX
//! Runtime's outputs, stored beside each model, at batch 1 and batch 3 (dynamic batch).

use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device, TensorData};
use kiln::onnx::{OnnxError, OnnxModel};
use safetensors::SafeTensors;

/// Largest allowed `max |kiln - ort| / max |ort|` per output (f32).
const TOLERANCE: f32 = 1e-4;

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx")
}

fn tensor(st: &SafeTensors, name: &str) -> Option<TensorData> {
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
fn relative_error(ours: &[f32], reference: &[f32]) -> f32 {
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

fn check(name: &str) {
    let device = Device::default();
    let dir = models_dir();
    let model = OnnxModel::load(&dir.join(format!("{name}.onnx")), &device)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let bytes = std::fs::read(dir.join(format!("{name}.ref.safetensors"))).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for batch in [1, 3] {
        let inputs: Vec<TensorData> = model
            .inputs()
            .iter()
            .map(|p| {
                tensor(&st, &format!("b{batch}.in.{}", p.name))
                    .unwrap_or_else(|| panic!("{name}: no reference input {}", p.name))
            })
            .collect();
        let outputs = model
            .run_data(inputs)
            .unwrap_or_else(|e| panic!("{name} b{batch}: {e}"));
        assert_eq!(outputs.len(), model.outputs().len());
        for (i, out) in outputs.into_iter().enumerate() {
            let reference = tensor(&st, &format!("b{batch}.out.{i}")).unwrap();
            assert_eq!(
                out.shape(),
                reference.shape(),
                "{name} b{batch} output {i}: shape"
            );
            let ours = out.convert::<f32>().try_to_vec::<f32>().unwrap();
            let theirs = reference.convert::<f32>().try_to_vec::<f32>().unwrap();
            let err = relative_error(&ours, &theirs);
            eprintln!("{name} b{batch} output {i}: relative error {err:.2e}");
            assert!(
                err <= TOLERANCE,
                "{name} b{batch} output {i}: relative error {err:.2e} > {TOLERANCE:.0e}"
            );
        }
    }
}

macro_rules! model_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                check(stringify!($name));
            }
        )*
    };
}

model_tests!(
    resnet,
    resnet_dynamo,
    resnext,
    mobilenet_v2,
    mobilenet_v3,
    efficientnet,
    squeezenet,
    densenet,
    shufflenet,
    regnet,
    convnext,
    vit,
    bert,
    seghead,
);

#[test]
fn garbage_is_a_clear_error_not_a_panic() {
    let device = Device::default();
    let err = OnnxModel::from_bytes(b"definitely not protobuf", "x", &device).unwrap_err();
    assert!(matches!(err, OnnxError::Parse(_)), "{err}");
    let bytes = std::fs::read(models_dir().join("resnet.onnx")).unwrap();
    for cut in [10, bytes.len() / 3, bytes.len() - 7] {
        let err = OnnxModel::from_bytes(&bytes[..cut], "x", &device).unwrap_err();
        assert!(
            err.to_string().contains("ONNX") || err.to_string().contains("model"),
            "{err}"
        );
    }
}
