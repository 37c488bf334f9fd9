//! Real exported models (PyTorch/torchvision architectures, a BERT-style encoder, a
//! segmentation head; `tools/export_onnx_models.py`) load through onnx-ir and match ONNX
//! Runtime's outputs, stored beside each model, at batch 1 and batch 3 (dynamic batch).

use std::path::{Path, PathBuf};

use burn::tensor::{Device, TensorData};
use kiln::onnx::{OnnxError, OnnxModel};
use safetensors::SafeTensors;

#[path = "common/onnx_ref.rs"]
mod onnx_ref;
use onnx_ref::{TOLERANCE, compare, relative_error, tensor};

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx")
}

/// Runs `name` at batch 1 and 3 on its reference inputs, with Kiln's CPU kernels on (image
/// layers channels-last on the host, weights packed once) and off (every node on Burn's
/// NCHW operators): both within [`TOLERANCE`] of ONNX Runtime.
fn check(name: &str) {
    for kiln_kernels in [true, false] {
        let layers = check_with(name, kiln_kernels);
        if !kiln_kernels {
            assert_eq!(layers, 0, "{name}: the Burn path packed host layers");
        } else if !matches!(name, "bert" | "vit" | "opmix") {
            assert!(layers > 0, "{name}: no layer ran on the host kernels");
        }
    }
}

/// [`check`] with one kernel setting; returns how many layers ran on packed host weights.
fn check_with(name: &str, kiln_kernels: bool) -> usize {
    let device = Device::default();
    let dir = models_dir();
    let model = OnnxModel::load(&dir.join(format!("{name}.onnx")), &device)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .with_kiln_kernels(kiln_kernels);
    let bytes = std::fs::read(dir.join(format!("{name}.ref.safetensors"))).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    // Each batch twice in a row: the second run reuses the shape arithmetic the first
    // recorded; a change of batch records anew.
    let what = format!("{name} (Kiln kernels {kiln_kernels})");
    let err = compare(&model, &st, &[1, 1, 3, 3, 1], &what).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        err <= TOLERANCE,
        "{what}: relative error {err:.2e} > {TOLERANCE:.0e}"
    );
    model.packed_layers()
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
    lenet,
    resnet,
    resnet_dynamo,
    resnet_unfolded,
    opmix,
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

/// Runs `name` at batch 3 on its reference inputs after `passes`; returns the largest
/// relative difference from ONNX Runtime's outputs, and the model's BatchNormalization
/// counts before and after.
fn after_passes(name: &str, passes: &[kiln::onnx::OnnxPass]) -> (f32, usize, usize) {
    let device = Device::default();
    let dir = models_dir();
    let mut model = OnnxModel::load(&dir.join(format!("{name}.onnx")), &device).unwrap();
    // Fused or not: a ReLU fused at load is named after it (`BatchNormalization+Relu`).
    let batch_norms = |m: &OnnxModel| {
        m.op_counts()
            .iter()
            .filter(|(op, _)| op.split('+').next() == Some("BatchNormalization"))
            .map(|(_, n)| n)
            .sum::<usize>()
    };
    let before = batch_norms(&model);
    for &p in passes {
        let report = model.apply(p).unwrap();
        eprintln!("{name}: {report:?}");
    }
    let bytes = std::fs::read(dir.join(format!("{name}.ref.safetensors"))).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let inputs: Vec<TensorData> = model
        .inputs()
        .iter()
        .map(|p| tensor(&st, &format!("b3.in.{}", p.name)).unwrap())
        .collect();
    let outputs = model.run_data(inputs).unwrap();
    let mut worst = 0f32;
    for (i, out) in outputs.into_iter().enumerate() {
        let reference = tensor(&st, &format!("b3.out.{i}")).unwrap();
        assert_eq!(out.shape(), reference.shape());
        let ours = out.convert::<f32>().try_to_vec::<f32>().unwrap();
        let theirs = reference.convert::<f32>().try_to_vec::<f32>().unwrap();
        worst = worst.max(relative_error(&ours, &theirs));
    }
    (worst, before, batch_norms(&model))
}

/// Folding is exact up to rounding: ResNet exported without the exporter's own folding has a
/// BatchNorm after each of its 14 convolutions, all folded; DenseNet's pre-activation
/// BatchNorms (after a Concat) become precomputed affine maps.
#[test]
fn fold_removes_batch_norms_and_keeps_the_outputs() {
    use kiln::onnx::OnnxPass;
    let (err, before, after) = after_passes("resnet_unfolded", &[OnnxPass::Fold]);
    assert_eq!((before, after), (14, 0), "every Conv+BatchNorm pair folds");
    assert!(err <= TOLERANCE, "folded resnet differs by {err:.2e}");
    let (err, before, after) = after_passes("densenet", &[OnnxPass::Fold]);
    assert!(
        before > 0 && after == 0,
        "DenseNet's BatchNorms (after Concats, not convolutions) become affine maps"
    );
    assert!(
        err <= TOLERANCE,
        "densenet with affine BatchNorms differs by {err:.2e}"
    );
}

/// Int8 (fold first, ReLUs fused) stays near ONNX Runtime's f32 outputs. The bounds are
/// about twice what this commit measured (random-weight models are harsher on int8 than
/// trained ones; MobileNet v2's ReLU6 outputs feed quantized 1×1 convolutions): they guard
/// against regressions, the accuracy report is `kiln optimize --onnx`'s.
#[test]
fn int8_stays_near_onnx_runtime() {
    use kiln::onnx::OnnxPass;
    let cases = [
        ("resnet", 0.12),
        ("resnet_unfolded", 0.12),
        ("resnext", 0.2),
        ("squeezenet", 0.02),
        ("mobilenet_v2", 0.5),
        ("bert", 0.04),
        ("vit", 0.04),
        ("seghead", 0.03),
        // Its pools stay with the int8 convolutions (pooled after them).
        ("lenet", 0.02),
    ];
    // The bounds were measured with 8-bit activations (VNNI, AMX); AVX2's kernel quantizes
    // activations to 7 bits (docs/inference.md: `vpmaddubsw` would saturate 8-bit pairs),
    // half the resolution, so its error may be up to twice as large.
    let levels = kiln_kernels::base::isa::Int8Kernel::detect().max_activation();
    let widen = 255.0 / levels as f32;
    for (name, bound) in cases {
        let bound = bound * widen;
        let (err, before, after) = after_passes(name, &[OnnxPass::Fold, OnnxPass::Int8]);
        eprintln!("{name}: int8 relative error {err:.3e}, BatchNorms {before} -> {after}");
        assert!(
            err <= bound,
            "{name}: int8 relative error {err:.3e} > {bound}"
        );
    }
}

/// The steps of model `name` after load, by operator: a counter (0 for an absent one) and
/// the counts themselves, for messages.
fn op_counts(
    name: &str,
) -> (
    impl Fn(&str) -> usize,
    std::collections::BTreeMap<String, usize>,
) {
    let model = OnnxModel::load(
        &models_dir().join(format!("{name}.onnx")),
        &Device::default(),
    )
    .unwrap();
    let counts = model.op_counts();
    let lookup = counts.clone();
    (move |op: &str| lookup.get(op).copied().unwrap_or(0), counts)
}

/// ResNet's residual blocks end with `Add` + `Relu`: both fold into the convolution that
/// runs last before them (the sum and the ReLU in its store), none stay separate; the
/// outputs still match ONNX Runtime (the `resnet` test above runs the fused model).
#[test]
fn residual_adds_and_relus_fuse_into_convolutions() {
    let (count, counts) = op_counts("resnet");
    assert_eq!(count("Add") + count("Relu"), 0, "{counts:?}");
    assert!(count("Conv2d+Add+Relu") >= 2, "{counts:?}");
}

/// The BERT-style encoder's attention normalization `Softmax(Add(Div(scores, √d), mask))`
/// is one step per layer, and no Softmax is left (the `bert` test above checks the fused
/// model's outputs against ONNX Runtime's, with the last tokens of each sequence masked out,
/// on Kiln's kernels and on Burn's path).
#[test]
fn attention_softmaxes_fuse_with_their_scale_and_mask() {
    let (count, counts) = op_counts("bert");
    assert_eq!(count("ScaledSoftmax"), 2, "{counts:?}");
    assert_eq!(count("Softmax"), 0, "{counts:?}");
}

/// Each block's residual sums (`Add(x, Linear(·))` after the attention's output projection
/// and after the feed-forward block) go into the linear layer's store: in the f32 kernel's
/// and, after the int8 pass, in the integer epilogue (the `bert` test and
/// `int8_stays_near_onnx_runtime` check the fused outputs).
#[test]
fn residual_adds_fuse_into_linear_layers() {
    let (count, counts) = op_counts("bert");
    assert_eq!(count("Linear+Add"), 4, "{counts:?}");
}

/// LeNet's blocks (Conv, ReLU, 2×2 max pool, at odd sizes) become one step each, the pool
/// stored by the convolution's kernel, and its hidden linear layer's ReLU goes into that
/// layer's store (the `lenet` test above checks the outputs on the host kernels and on
/// Burn's path, `int8_stays_near_onnx_runtime` after the int8 pass, which moves that ReLU
/// into the integer epilogue).
#[test]
fn relu_pools_fuse_into_convolutions() {
    let (count, counts) = op_counts("lenet");
    assert_eq!(count("Conv2d+Relu+MaxPool2d"), 2, "{counts:?}");
    assert_eq!(count("Linear+Relu"), 1, "{counts:?}");
    assert_eq!(count("MaxPool2d") + count("Relu"), 0, "{counts:?}");
}

/// EfficientNet exports each SiLU as `Mul(x, Sigmoid(x))`: the pairs become single SiLU
/// steps at load, and each SiLU or squeeze-excitation gate's Sigmoid that follows a
/// convolution goes into that convolution's store (the `efficientnet` test above checks the
/// fused model's outputs); MobileNet v3's HardSwish and HardSigmoid do the same.
#[test]
fn activations_after_convolutions_fuse_into_their_store() {
    let (count, counts) = op_counts("efficientnet");
    assert!(count("Conv2d+Silu") >= 3, "{counts:?}");
    assert!(count("Conv2d+Sigmoid") >= 1, "{counts:?}");
    assert_eq!(count("Silu") + count("Sigmoid"), 0, "{counts:?}");
    let (count, counts) = op_counts("mobilenet_v3");
    assert!(count("Conv2d+HardSwish") >= 1, "{counts:?}");
    assert!(count("Conv2d+HardSigmoid") >= 1, "{counts:?}");
    // The classifier's HardSwish goes into the Linear before it.
    assert_eq!(count("HardSigmoid") + count("HardSwish"), 0, "{counts:?}");
    assert_eq!(count("Linear+HardSwish"), 1, "{counts:?}");
}

/// ShuffleNet v2's channel shuffle (reshape, transpose, reshape) is one step at load, and
/// its shape arithmetic (hundreds of Shape/Gather/Concat nodes) is recorded once per input
/// shape; the `shufflenet` test above checks the outputs on repeated and changing batches.
#[test]
fn channel_shuffles_fuse_and_shape_arithmetic_is_recorded() {
    let (count, counts) = op_counts("shufflenet");
    assert!(count("ChannelShuffle") >= 2, "{counts:?}");
    assert_eq!(count("Transpose"), 0, "{counts:?}");
    for name in ["shufflenet", "bert", "vit"] {
        let model = OnnxModel::load(
            &models_dir().join(format!("{name}.onnx")),
            &Device::default(),
        )
        .unwrap();
        assert!(
            model.cached_shape_steps() > 0,
            "{name}: no shape arithmetic found"
        );
    }
}

/// A model whose dimensions depend on data (a Reshape to a shape given as an input) records
/// no shape arithmetic: a later run with inputs of the same shapes but another target shape
/// gets its own dimensions.
#[test]
fn shapes_that_depend_on_data_are_not_recorded() {
    use kiln::burn::tensor::TensorData;
    use onnx_ir::GraphProto;
    let dims_of = |model: &OnnxModel, inputs: Vec<TensorData>| -> Vec<i64> {
        let out = model.run_data(inputs).unwrap().remove(0);
        out.convert::<i64>().try_to_vec::<i64>().unwrap()
    };
    let ints = |v: &[i64]| TensorData::new(v.to_vec(), vec![v.len()]);

    let mut graph = GraphProto::new();
    graph.name = "reshape_by_data".into();
    // float = 1, int64 = 7.
    graph.input = vec![port("x", 1, &[6]), port("s", 7, &[2])];
    graph.node = vec![
        node("Reshape", &["x", "s"], "y"),
        node("Shape", &["y"], "d"),
    ];
    graph.output = vec![port("d", 7, &[2])];
    let model = model_of(graph);
    assert_eq!(model.cached_shape_steps(), 0);
    let x = || TensorData::new(vec![0f32; 6], vec![6]);
    for target in [[2i64, 3], [3, 2], [6, 1]] {
        assert_eq!(dims_of(&model, vec![x(), ints(&target)]), target);
    }

    // The same through a fused channel shuffle whose reshape targets are inputs.
    let mut graph = GraphProto::new();
    graph.name = "shuffle_by_data".into();
    graph.input = vec![port("x", 1, &[8]), port("s", 7, &[5]), port("t", 7, &[4])];
    let mut transpose = node("Transpose", &["g"], "h");
    let mut perm = onnx_ir::AttributeProto::new();
    perm.name = "perm".into();
    perm.type_ = onnx_ir::AttributeType::INTS.into();
    perm.ints = vec![0, 2, 1, 3, 4];
    transpose.attribute.push(perm);
    graph.node = vec![
        node("Reshape", &["x", "s"], "g"),
        transpose,
        node("Reshape", &["h", "t"], "y"),
        node("Shape", &["y"], "d"),
    ];
    graph.output = vec![port("d", 7, &[4])];
    let model = model_of(graph);
    assert_eq!(model.op_counts().get("ChannelShuffle"), Some(&1));
    assert_eq!(model.cached_shape_steps(), 0);
    let x = || TensorData::new(vec![0f32; 8], vec![8]);
    for back in [[1i64, 8, 1, 1], [2, 4, 1, 1], [1, 2, 2, 2]] {
        let grouped = ints(&[1, 2, 4, 1, 1]);
        assert_eq!(dims_of(&model, vec![x(), grouped, ints(&back)]), back);
    }
}

/// MobileNet v2's ReLU6 (`Clip(0, 6)`) folds into the convolution before it (the clamp in
/// its store); the `mobilenet_v2` test above checks the fused model's outputs, with Kiln's
/// kernels and without.
#[test]
fn relu6_clips_fuse_into_convolutions() {
    let (count, counts) = op_counts("mobilenet_v2");
    assert_eq!(count("Clip"), 0, "{counts:?}");
    // Alone, or in a fused 1×1 + depthwise pair (both layers with their ReLU6).
    assert!(
        count("Conv2d+Clip") + 2 * count("Conv2d+Clip+Conv2d+Clip") >= 4,
        "{counts:?}"
    );
}

/// Where the expanded image outgrows the cache (MobileNet v2's test model at batch 32: 1.5 MB
/// after its first 1×1 layer) the pair runs fused on the host, and the outputs match every
/// node run on Burn's operators (the layers apart, NCHW).
#[test]
fn large_expanded_images_run_fused_and_match_burns_operators() {
    let dir = models_dir();
    let load = |kiln_kernels: bool| {
        OnnxModel::load(&dir.join("mobilenet_v2.onnx"), &Device::default())
            .unwrap()
            .with_kiln_kernels(kiln_kernels)
    };
    let batch = 32;
    let values: Vec<f32> = (0..batch * 3 * 32 * 32)
        .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let input = || vec![TensorData::new(values.clone(), [batch, 3, 32, 32])];
    let before = kiln_kernels::expand_depthwise::fused_calls();
    let fused = load(true);
    let ours = fused.run_data(input()).unwrap().remove(0);
    assert!(
        kiln_kernels::expand_depthwise::fused_calls() > before,
        "no pair ran fused"
    );
    // Both layers of every pair count as packed (the pairs' layers are most of the model's).
    let (pairs, convs) = (fused.op_counts(), count_convs(&fused));
    assert!(
        fused.packed_layers() >= convs,
        "{} packed of {convs} convolutions: {pairs:?}",
        fused.packed_layers()
    );
    let theirs = load(false).run_data(input()).unwrap().remove(0);
    let err = relative_error(
        &ours.convert::<f32>().try_to_vec::<f32>().unwrap(),
        &theirs.convert::<f32>().try_to_vec::<f32>().unwrap(),
    );
    assert!(err <= TOLERANCE, "fused vs Burn's operators: {err:.2e}");
}

/// The convolutions of `model`, those inside fused steps included (by their names).
fn count_convs(model: &OnnxModel) -> usize {
    model
        .op_counts()
        .iter()
        .map(|(op, n)| op.matches("Conv2d").count() * n)
        .sum()
}

/// SqueezeNet's fire modules end in a Concat of two convolutions: each writes its channels
/// of the concatenated image (no copy after), so no Concat runs alone; the `squeezenet` test
/// checks the outputs against ONNX Runtime with and without Kiln's kernels, and
/// `int8_stays_near_onnx_runtime` after the passes take the steps apart.
#[test]
fn concatenated_convolutions_write_in_place() {
    let (count, counts) = op_counts("squeezenet");
    assert_eq!(count("Concat"), 0, "{counts:?}");
    assert!(count("Conv2d+Relu+Concat") >= 2, "{counts:?}");
}

/// Each inverted-residual block's 1×1 expand layer and the depthwise layer after it run as
/// one step (the expanded image made band by band, never stored whole); the model tests
/// above check the fused outputs against ONNX Runtime, with Kiln's kernels (the fused kernel)
/// and without (the two layers in turn). The int8 pass takes the pairs apart and quantizes
/// the 1×1 layers; the depthwise layers stay f32 and unpaired.
#[test]
fn expand_and_depthwise_layers_fuse_and_passes_take_them_apart() {
    use kiln::onnx::OnnxPass;
    let pairs = |counts: &std::collections::BTreeMap<String, usize>| -> usize {
        counts
            .iter()
            .filter(|(op, _)| op.matches("Conv2d").count() == 2)
            .map(|(_, n)| n)
            .sum()
    };
    for (name, at_least) in [
        ("mobilenet_v2", 10),
        ("mobilenet_v3", 4),
        ("efficientnet", 4),
    ] {
        let (_, counts) = op_counts(name);
        assert!(pairs(&counts) >= at_least, "{name}: {counts:?}");
    }
    let dir = models_dir();
    let mut model = OnnxModel::load(&dir.join("mobilenet_v2.onnx"), &Device::default()).unwrap();
    let fused = pairs(&model.op_counts());
    let steps_before = model.op_counts().values().sum::<usize>();
    let report = model.apply(OnnxPass::Fold).unwrap();
    assert_eq!(
        (report.nodes_before, report.nodes_after),
        (steps_before, steps_before),
        "nothing to fold: the pairs come back as they were"
    );
    assert_eq!(pairs(&model.op_counts()), fused);
    model.apply(OnnxPass::Int8).unwrap();
    let counts = model.op_counts();
    assert_eq!(pairs(&counts), 0, "{counts:?}");
    let int8: usize = counts
        .iter()
        .filter(|(op, _)| op.starts_with("QConv"))
        .map(|(_, n)| n)
        .sum();
    assert!(
        int8 >= fused,
        "every 1×1 expand layer quantized: {counts:?}"
    );
}

/// The int8 pass limited to named layers (what `kiln optimize --onnx` keeps where only some
/// layers measured faster in int8, and `kiln serve`'s `int8_layers` applies) quantizes those
/// and no other; per-step times cover every step, and the quantized model still matches.
#[test]
fn int8_on_named_layers_only_and_step_times_cover_every_step() {
    use kiln::onnx::OnnxPass;
    use std::collections::BTreeSet;
    let dir = models_dir();
    let path = dir.join("resnet_unfolded.onnx");
    let mut all = OnnxModel::load(&path, &Device::default()).unwrap();
    all.apply(OnnxPass::Int8).unwrap();
    let names = all.int8_layers();
    assert!(names.len() >= 4, "{names:?}");
    let only: BTreeSet<String> = names.iter().step_by(2).cloned().collect();
    let mut some = OnnxModel::load(&path, &Device::default()).unwrap();
    some.apply_to(OnnxPass::Int8, Some(&only)).unwrap();
    let got: BTreeSet<String> = some.int8_layers().into_iter().collect();
    assert_eq!(got, only);

    let bytes = std::fs::read(dir.join("resnet_unfolded.ref.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let device = Device::default();
    let inputs: Vec<kiln::onnx::Value> = model_inputs(&st, "b3")
        .into_iter()
        .map(|d| kiln::onnx::Value::from_data(d, &device).unwrap())
        .collect();
    let times = some.step_times(&inputs, 2).unwrap();
    assert_eq!(times.len(), some.node_count());
    assert!(
        times.iter().all(|(_, t)| t.is_finite() && *t >= 0.0),
        "{times:?}"
    );
    assert!(times.iter().map(|(_, t)| t).sum::<f64>() > 0.0);
    // Half the layers in int8 still compute the model (int8's tolerance, as the full pass).
    let reference = tensor(&st, "b3.out.0").unwrap();
    let theirs = reference.convert::<f32>().try_to_vec::<f32>().unwrap();
    let ours = some.run(inputs).unwrap()[0].to_f32s().unwrap();
    let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = ours
        .iter()
        .zip(&theirs)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff / scale < 0.2, "{}", diff / scale);
}

/// The Winograd pass limited to named convolutions (what `kiln optimize --onnx` keeps where
/// the implicit GEMM timed faster for the others, and `kiln serve`'s `winograd_layers`
/// applies): the kernels' default runs ResNet's 3×3 layers as Winograd; limited, only the
/// named ones do; none, no layer does; every form matches ONNX Runtime's reference within
/// 1e-4.
#[test]
fn winograd_on_named_layers_only_and_every_form_matches_the_reference() {
    use kiln::onnx::OnnxPass;
    use std::collections::BTreeSet;
    if kiln_kernels::base::isa::F32Kernel::detect() == kiln_kernels::base::isa::F32Kernel::Portable
    {
        return;
    }
    let dir = models_dir();
    let path = dir.join("resnet_unfolded.onnx");
    let device = Device::default();
    let bytes = std::fs::read(dir.join("resnet_unfolded.ref.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let inputs: Vec<kiln::onnx::Value> = model_inputs(&st, "b3")
        .into_iter()
        .map(|d| kiln::onnx::Value::from_data(d, &device).unwrap())
        .collect();
    let theirs = tensor(&st, "b3.out.0")
        .unwrap()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap();
    let run = |only: Option<&BTreeSet<String>>| {
        let mut m = OnnxModel::load(&path, &device).unwrap();
        m.apply(OnnxPass::Fold).unwrap();
        let report = m.apply_to(OnnxPass::Winograd, only).unwrap();
        let ours = m.run(inputs.clone()).unwrap()[0].to_f32s().unwrap();
        let err = relative_error(&ours, &theirs);
        assert!(err < 1e-4, "{only:?}: {err}");
        (m.winograd_layers(), report.changes)
    };
    let (all, changes) = run(None);
    assert!(all.len() >= 2, "{all:?}");
    assert!(changes.is_empty(), "{changes:?}");
    let only: BTreeSet<String> = all.iter().step_by(2).cloned().collect();
    let (some, changes) = run(Some(&only));
    assert_eq!(some.into_iter().collect::<BTreeSet<_>>(), only);
    for name in all.iter().filter(|n| !only.contains(*n)) {
        assert!(
            changes.iter().any(|c| c.starts_with(&format!("{name}:"))),
            "{name} not reported: {changes:?}"
        );
    }
    let (none, _) = run(Some(&BTreeSet::new()));
    assert!(none.is_empty(), "{none:?}");
}

/// A pass applied after the model has run (its weights already packed for the host kernels)
/// takes effect: the fold rewires the convolutions to folded weights, which must be packed
/// anew (`kiln optimize --onnx` measures each stage on one model this way).
#[test]
fn passes_after_a_run_repack_the_weights() {
    use kiln::onnx::OnnxPass;
    let dir = models_dir();
    let mut model = OnnxModel::load(&dir.join("resnet_unfolded.onnx"), &Device::default()).unwrap();
    let bytes = std::fs::read(dir.join("resnet_unfolded.ref.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let inputs = || model_inputs(&st, "b3");
    let reference = tensor(&st, "b3.out.0").unwrap();
    let theirs = reference.convert::<f32>().try_to_vec::<f32>().unwrap();
    let run = |model: &OnnxModel| -> f32 {
        let out = model.run_data(inputs()).unwrap().remove(0);
        relative_error(&out.convert::<f32>().try_to_vec::<f32>().unwrap(), &theirs)
    };
    assert!(run(&model) <= TOLERANCE);
    assert!(model.packed_layers() > 0);
    model.apply(OnnxPass::Fold).unwrap();
    let err = run(&model);
    assert!(
        err <= TOLERANCE,
        "folded after a run: relative error {err:.2e}"
    );
}

/// The reference inputs `{prefix}.in.input` of a single-input image model.
fn model_inputs(st: &SafeTensors, prefix: &str) -> Vec<TensorData> {
    vec![tensor(st, &format!("{prefix}.in.input")).unwrap()]
}

/// A graph input or output `name` of ONNX element type `elem_type` (float = 1, int64 = 7)
/// and shape `dims`.
fn port(name: &str, elem_type: i32, dims: &[i64]) -> onnx_ir::ValueInfoProto {
    use onnx_ir::{TensorShapeProto, TypeProto, ValueInfoProto};
    let mut t = TypeProto::new();
    let tensor = t.mut_tensor_type();
    tensor.elem_type = elem_type;
    let mut shape = TensorShapeProto::new();
    for &len in dims {
        shape.dim.push(Default::default());
        if let Some(d) = shape.dim.last_mut() {
            d.set_dim_value(len);
        }
    }
    tensor.shape = Some(shape).into();
    let mut v = ValueInfoProto::new();
    v.name = name.into();
    v.type_ = Some(t).into();
    v
}

/// A node `op` reading `inputs`, writing `output` (also its name).
fn node(op: &str, inputs: &[&str], output: &str) -> onnx_ir::NodeProto {
    let mut n = onnx_ir::NodeProto::new();
    n.op_type = op.into();
    n.name = output.into();
    n.input = inputs.iter().map(|s| s.to_string()).collect();
    n.output = vec![output.into()];
    n
}

/// `graph` as an opset-17 model, loaded.
fn model_of(graph: onnx_ir::GraphProto) -> OnnxModel {
    use onnx_ir::{Message, ModelProto};
    let mut proto = ModelProto::new();
    proto.ir_version = 8;
    proto.opset_import.push(Default::default());
    if let Some(opset) = proto.opset_import.last_mut() {
        opset.version = 17;
    }
    proto.graph = Some(graph).into();
    OnnxModel::from_bytes(&proto.write_to_bytes().unwrap(), "m", &Device::default()).unwrap()
}

/// A one-value float initializer of shape `dims` (`[]`: a scalar).
fn scalar(name: &str, value: f32, dims: &[i64]) -> onnx_ir::TensorProto {
    let mut t = onnx_ir::TensorProto::new();
    t.name = name.into();
    t.data_type = 1;
    t.dims = dims.to_vec();
    t.float_data = vec![value];
    t
}

/// PyTorch's exports of the exact GELU — `x / √2`, `erf`, `+ 1`, then the products by `x`
/// and by ½ in each order the exporters write them — become one GELU step at load, whose
/// outputs match the f64 definition; a chain whose `erf` is also read elsewhere, or whose ½
/// is a `[1, 1, 1]` tensor (its broadcast changes the output's rank), stays as it is (and
/// still computes the same values).
#[test]
fn exported_gelu_chains_become_one_step() {
    use kiln::burn::tensor::TensorData;
    use onnx_ir::GraphProto;
    let xs: Vec<f32> = (0..64).map(|i| (i as f32 - 32.0) * 0.17).collect();
    let erf64 = |x: f64| {
        let (mut term, mut sum) = (x, x);
        for n in 1..200 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    };
    // (the products' nodes, extra outputs, whether the chain fuses)
    let orders: [(Vec<onnx_ir::NodeProto>, &[&str], bool); 5] = [
        (
            vec![
                node("Mul", &["x", "s"], "p"),
                node("Mul", &["p", "half"], "y"),
            ],
            &[],
            true,
        ),
        (
            vec![
                node("Mul", &["half", "s"], "p"),
                node("Mul", &["x", "p"], "y"),
            ],
            &[],
            true,
        ),
        (
            vec![
                node("Mul", &["x", "half"], "p"),
                node("Mul", &["p", "s"], "y"),
            ],
            &[],
            true,
        ),
        (
            vec![
                node("Mul", &["x", "s"], "p"),
                node("Mul", &["p", "half"], "y"),
            ],
            &["e"],
            false,
        ),
        (
            vec![
                node("Mul", &["x", "s"], "p"),
                node("Mul", &["p", "half3"], "y"),
            ],
            &[],
            false,
        ),
    ];
    for (products, extra, fuses) in orders {
        let mut graph = GraphProto::new();
        graph.name = "gelu".into();
        let rank3 = products
            .iter()
            .any(|n| n.input.iter().any(|i| i == "half3"));
        graph.input = vec![port("x", 1, &[4, 16])];
        graph.initializer = vec![
            scalar("root2", std::f32::consts::SQRT_2, &[]),
            scalar("one", 1.0, &[]),
            scalar("half", 0.5, &[]),
            scalar("half3", 0.5, &[1, 1, 1]),
        ];
        graph.node = vec![
            node("Div", &["x", "root2"], "d"),
            node("Erf", &["d"], "e"),
            node("Add", &["e", "one"], "s"),
        ];
        graph.node.extend(products);
        let y_dims: &[i64] = if rank3 { &[1, 4, 16] } else { &[4, 16] };
        graph.output = vec![port("y", 1, y_dims)];
        graph
            .output
            .extend(extra.iter().map(|name| port(name, 1, &[4, 16])));
        let model = model_of(graph);
        let counts = model.op_counts();
        assert_eq!(
            counts.get("Gelu").copied().unwrap_or(0),
            usize::from(fuses),
            "{counts:?}"
        );
        assert_eq!(counts.len() == 1, fuses, "{counts:?}");
        let out = model
            .run_data(vec![TensorData::new(xs.clone(), vec![4, 16])])
            .unwrap()
            .remove(0);
        assert_eq!(out.shape().len(), y_dims.len(), "{counts:?}");
        let ys = out.convert::<f32>().try_to_vec::<f32>().unwrap();
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = x as f64 * 0.5 * (1.0 + erf64(x as f64 / 2f64.sqrt()));
            assert!(
                (y as f64 - want).abs() < 1e-6,
                "gelu({x}) = {y}, want {want}"
            );
        }
    }
}

/// Transformers (BERT, ViT) and ConvNeXt export each exact GELU after a linear layer: the
/// chain becomes one step and goes into that layer's store; the `convnext`, `vit` and `bert`
/// tests above check the fused models against ONNX Runtime, with Kiln's kernels and without.
#[test]
fn gelus_fuse_into_linear_layers() {
    for name in ["convnext", "vit", "bert"] {
        let (count, counts) = op_counts(name);
        assert_eq!(count("Erf") + count("Gelu"), 0, "{name}: {counts:?}");
        assert!(count("Linear+Gelu") >= 2, "{name}: {counts:?}");
    }
}
