//! Mutation fuzzing (`kiln::fuzz`) of every library parser of outside input: config TOML,
//! checkpoints, `.kgraph` graphs, ONNX files, IDX, `.npy` and safetensors. Each target starts
//! from a real, valid input and requires a clear error or a valid result for every mutated
//! case: never a panic. Crashers found are kept in `tests/fuzz_regressions/` and replayed
//! first. Longer runs: `KILN_FUZZ_CASES=20000 cargo test --release -p kiln --test fuzz_inputs`.

mod common;

use std::path::Path;

use burn::tensor::Device;
use kiln::burn;
use kiln::data::{ElementType, MmapArray, write_npy};
use kiln::datasets::idx;
use kiln::fuzz::{Target, cases, run};
use kiln::infer;
use kiln::onnx::OnnxModel;
use kiln::train::Checkpoint;
use kiln::zoo::ModelKind;
use kiln::{KilnConfig, plan};

/// A target seeded with `seed`, replaying the crashers kept for it.
fn target<'a>(name: &'a str, seed: &'a [u8], sealed: bool, cases: usize) -> Target<'a> {
    Target {
        name,
        seed,
        sealed,
        cases,
        regressions: Some(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz_regressions"
        ))),
    }
}

#[test]
fn config_toml() {
    let seed = b"level = \"advanced\"\n[train]\nmodel = \"cnn\"\nepochs = 3\nbatch_size = 64\n\
        grad_accum_steps = 2\noptimizer = \"adamw\"\nlr = 1e-3\ngrad_clip_norm = 1.0\n\
        [data]\nworkers = \"auto\"\naugment = \"crop\"\n[observe]\nmemory_watermark_mib = 512\n\
        [infer]\npasses = \"strip,fold,int8\"\n";
    let hw = plan::Hardware::probe();
    let accepted = run(&target("config", seed, false, cases()), |bytes| {
        let text = String::from_utf8_lossy(bytes);
        let config = KilnConfig::from_toml_str(&text, "fuzz.toml")?;
        plan::resolve(&config, &hw).map(drop)
    });
    // Most edits break the TOML; some land in values and must still resolve.
    assert!(
        accepted > 0,
        "no mutated config resolved: the seed itself is broken?"
    );
}

#[test]
fn checkpoints() {
    let seed = common::sample_checkpoint().to_bytes().unwrap();
    run(&target("checkpoint", &seed, true, cases()), |bytes| {
        Checkpoint::from_bytes(bytes, Path::new("fuzz.kiln")).map(drop)
    });
}

#[test]
fn graphs() {
    let device = Device::flex();
    let model = ModelKind::Mlp.init(&device);
    let graph = infer::lower(&model, "mlp", [1, 28, 28]).unwrap();
    let seed = infer::graph_to_bytes(&graph).unwrap();
    let dir = common::tempdir("fuzz", "graph-files");
    let path = dir.join("model.kgraph");
    run(&target("kgraph", &seed, true, cases()), |bytes| {
        std::fs::write(&path, bytes).unwrap();
        let graph = infer::load_graph(&path)?;
        // A graph that decodes must also build a session or say why not.
        infer::InferenceSession::from_graph(graph, &device).map(drop)
    });
}

#[test]
fn onnx_files() {
    let seed =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx/opmix.onnx"))
            .unwrap();
    let device = Device::flex();
    // ONNX parsing and type inference are slower than the other parsers: a third of the cases.
    run(
        &target("onnx", &seed, false, cases().div_ceil(3)),
        |bytes| OnnxModel::from_bytes(bytes, "fuzz", &device).map(drop),
    );
}

#[test]
fn idx_files() {
    let seed = idx::encode(&[2, 3, 4], &(0..24).collect::<Vec<u8>>());
    run(&target("idx", &seed, false, cases()), |bytes| {
        idx::parse(bytes, Path::new("fuzz-idx")).map(drop)
    });
}

/// Opens a mapped array and reads every row it claims to have (up to 64), as the loader
/// would.
fn read_rows(array: &MmapArray) -> kiln::Result<()> {
    let rows = array.shape().first().copied().unwrap_or(0).min(64);
    let mut row = vec![0f32; array.row_len()];
    for r in 0..rows {
        array.read_row_f32(r, 1.0, &mut row)?;
    }
    Ok(())
}

#[test]
fn npy_files() {
    let dir = common::tempdir("fuzz", "npy");
    let seed_path = dir.join("seed.npy");
    write_npy(&seed_path, ElementType::F32, &[3, 2, 2], &[0u8; 48]).unwrap();
    let seed = std::fs::read(&seed_path).unwrap();
    let path = dir.join("case.npy");
    run(&target("npy", &seed, false, cases()), |bytes| {
        std::fs::write(&path, bytes).unwrap();
        read_rows(&MmapArray::open_npy(&path)?)
    });
}

#[test]
fn safetensors_files() {
    let seed = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx/opmix.ref.safetensors"),
    )
    .unwrap();
    let dir = common::tempdir("fuzz", "safetensors");
    let path = dir.join("case.safetensors");
    run(&target("safetensors", &seed, false, cases()), |bytes| {
        std::fs::write(&path, bytes).unwrap();
        read_rows(&MmapArray::open_safetensors(&path, "b1.in.input")?)
    });
}
