//! Mutation fuzzing (`kiln::fuzz`) of every library parser of outside input: config TOML,
//! checkpoints, `.kgraph` graphs, ONNX files, IDX, `.npy` and safetensors, image files (JPEG
//! at full and reduced scale, PNG, WebP), image manifests and WebDataset tar shards. Each target starts
//! from a real, valid input and requires a clear error or a valid result for every mutated
//! case: never a panic. Crashers found are kept in `tests/fuzz_regressions/` and replayed
//! first. Longer runs: `KILN_FUZZ_CASES=20000 cargo test --release -p kiln --test fuzz_inputs`.

mod common;

use std::path::Path;

use burn::tensor::Device;
use kiln::burn;
use kiln::data::{ElementType, MmapArray, write_npy};
use kiln::datasets::idx;
use kiln::fuzz::{HeapLimit, Summary, Target, cases, run};
use kiln::infer;
use kiln::onnx::OnnxModel;
use kiln::train::Checkpoint;
use kiln::zoo::ModelKind;
use kiln::{KilnConfig, plan};

// Each thread's heap is counted so that every target's stated `HeapLimit` is checked.
#[global_allocator]
static ALLOC: kiln::observe::heap::CountingAlloc<std::alloc::System, true> =
    kiln::observe::heap::CountingAlloc::per_thread(std::alloc::System);

// The stated heap limits (docs/reliability.md): the most heap one input may make each
// parser hold at once on its thread, as a fixed allowance plus bytes per input byte. The
// per-byte terms cover the copies a format needs (the file read in, its decoded tensors,
// a session's packed weights); none may grow with a length field the input merely claims.
const CONFIG: HeapLimit = HeapLimit::new(1, 64);
const CHECKPOINT: HeapLimit = HeapLimit::new(1, 8);
const KGRAPH: HeapLimit = HeapLimit::new(2, 16);
const ONNX: HeapLimit = HeapLimit::new(4, 32);
const IDX: HeapLimit = HeapLimit::new(1, 4);
const NPY: HeapLimit = HeapLimit::new(1, 4);
const SAFETENSORS: HeapLimit = HeapLimit::new(1, 4);
// A decoded image is its header's claim, not its file's size: the fuzz targets cap the
// claim at FUZZ_IMAGE_PIXELS (data.max_image_pixels in a run), so the fixed term covers the
// RGB image, the decoder's planes and the resize at that size.
const IMAGE: HeapLimit = HeapLimit::new(48, 16);
const FUZZ_IMAGE_PIXELS: u64 = 1 << 20;
const MANIFEST: HeapLimit = HeapLimit::new(1, 32);
const SHARDS: HeapLimit = HeapLimit::new(2, 16);

/// Runs `target` and prints what it saw (`--nocapture` shows it).
fn fuzz<E: std::fmt::Display>(
    target: &Target<'_>,
    parse: impl FnMut(&[u8]) -> Result<(), E>,
) -> Summary {
    let summary = run(target, parse);
    let name = target.name;
    eprintln!(
        "fuzz {name}: seed {} bytes, {} inputs, {} accepted, heap peak {:.2} MiB ({:.0}% of \
         its limit)",
        target.seed.len(),
        summary.inputs,
        summary.accepted,
        summary.heap_peak.unwrap_or(0) as f64 / (1u64 << 20) as f64,
        summary.heap_share.unwrap_or(0.0) * 100.0
    );
    summary
}

/// A target seeded with `seed`, replaying the crashers kept for it.
fn target<'a>(
    name: &'a str,
    seed: &'a [u8],
    sealed: bool,
    cases: usize,
    heap: HeapLimit,
) -> Target<'a> {
    Target {
        name,
        seed,
        sealed,
        cases,
        heap,
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
    let accepted = fuzz(&target("config", seed, false, cases(), CONFIG), |bytes| {
        let text = String::from_utf8_lossy(bytes);
        let config = KilnConfig::from_toml_str(&text, "fuzz.toml")?;
        plan::resolve(&config, &hw).map(drop)
    })
    .accepted;
    // Most edits break the TOML; some land in values and must still resolve.
    assert!(
        accepted > 0,
        "no mutated config resolved: the seed itself is broken?"
    );
}

#[test]
fn checkpoints() {
    let seed = common::sample_checkpoint().to_bytes().unwrap();
    fuzz(
        &target("checkpoint", &seed, true, cases(), CHECKPOINT),
        |bytes| Checkpoint::from_bytes(bytes, Path::new("fuzz.kiln")).map(drop),
    );
}

#[test]
fn graphs() {
    let device = Device::flex();
    let model = ModelKind::Mlp.init(&device);
    let graph = infer::lower(&model, "mlp", [1, 28, 28]).unwrap();
    let seed = infer::graph_to_bytes(&graph).unwrap();
    let dir = common::tempdir("fuzz", "graph-files");
    let path = dir.join("model.kgraph");
    fuzz(&target("kgraph", &seed, true, cases(), KGRAPH), |bytes| {
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
    let summary = fuzz(&target("onnx", &seed, false, cases(), ONNX), |bytes| {
        OnnxModel::from_bytes(bytes, "fuzz", &device).map(drop)
    });
    // Most edits break the protobuf or the graph's types; some must load, or the importer's
    // later stages (type inference, building the executable graph) are never reached.
    assert!(
        summary.accepted > 0,
        "no mutated ONNX file loaded: is the seed valid?"
    );
}

#[test]
fn idx_files() {
    let seed = idx::encode(&[2, 3, 4], &(0..24).collect::<Vec<u8>>());
    fuzz(&target("idx", &seed, false, cases(), IDX), |bytes| {
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
    fuzz(&target("npy", &seed, false, cases(), NPY), |bytes| {
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
    fuzz(
        &target("safetensors", &seed, false, cases(), SAFETENSORS),
        |bytes| {
            std::fs::write(&path, bytes).unwrap();
            read_rows(&MmapArray::open_safetensors(&path, "b1.in.input")?)
        },
    );
}

/// An image file through the training transform (header, the decode at the scale the crop
/// allows, crop + resize, normalize), as a loader worker runs it.
fn transform_image(bytes: &[u8], crop_scale: f64) -> Result<(), kiln::data::vision::ImageError> {
    use kiln::data::vision::{CropMode, ImageTransform};
    let t = ImageTransform {
        max_pixels: FUZZ_IMAGE_PIXELS,
        crop: CropMode::RandomResized {
            scale: (crop_scale, crop_scale),
            ratio: (1.0, 1.0),
        },
        ..ImageTransform::train(16)
    };
    let mut out = vec![0f32; t.sample_len()];
    t.apply_bytes(bytes, &mut kiln::data::SampleRng::new(0, 0, 0), &mut out)
}

#[test]
fn image_files() {
    let img = image::RgbImage::from_fn(96, 72, |x, y| {
        image::Rgb([(x * 2) as u8, (y * 3) as u8, (x ^ y) as u8])
    });
    let mut jpeg = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpeg, 85)
        .encode_image(&img)
        .unwrap();
    let mut png = std::io::Cursor::new(Vec::new());
    img.write_to(&mut png, image::ImageFormat::Png).unwrap();
    // Full-size JPEG (zune-jpeg), the 1/4 scale (jpeg-decoder: a crop of the whole 96×72
    // image into 16×16 allows it), PNG.
    fuzz(&target("jpeg", &jpeg, false, cases(), IMAGE), |b| {
        transform_image(b, 0.05)
    });
    fuzz(&target("jpeg-scaled", &jpeg, false, cases(), IMAGE), |b| {
        transform_image(b, 1.0)
    });
    fuzz(&target("png", png.get_ref(), false, cases(), IMAGE), |b| {
        transform_image(b, 1.0)
    });
}

#[test]
fn image_manifests_and_shards() {
    use kiln::data::Dataset;
    use kiln::data::vision::ImageFiles;
    let dir = common::tempdir("fuzz", "manifest");
    let csv = b"path,label,box\na/x.jpg,dog,1 2 30 20\n\"b, c.png\",cat,\nd.jpg,7,\n";
    let path = dir.join("case.csv");
    fuzz(
        &target("manifest-csv", csv, false, cases(), MANIFEST),
        |bytes| {
            std::fs::write(&path, bytes).unwrap();
            ImageFiles::manifest(&path).map(drop)
        },
    );
    let jsonl = b"{\"path\": \"a.jpg\", \"label\": 3, \"box\": [1, 2, 3, 4]}\n{\"path\": \"b.jpg\", \"label\": 0, \"mask\": \"m.png\"}\n";
    let path = dir.join("case.jsonl");
    fuzz(
        &target("manifest-jsonl", jsonl, false, cases(), MANIFEST),
        |bytes| {
            std::fs::write(&path, bytes).unwrap();
            ImageFiles::manifest(&path).map(drop)
        },
    );
    let mut shard = tar::Builder::new(Vec::new());
    for (name, data) in [
        ("s/k1.jpg", &b"\xFF\xD8\xFFjpeg"[..]),
        ("s/k1.cls", b"3"),
        ("s/k2.png", b"png"),
        ("s/k2.cls", b"1"),
    ] {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        shard.append_data(&mut h, name, data).unwrap();
    }
    let seed = shard.into_inner().unwrap();
    let path = dir.join("case.tar");
    let pattern = path.display().to_string();
    fuzz(
        &target("tar-shard", &seed, false, cases(), SHARDS),
        |bytes| {
            std::fs::write(&path, bytes).unwrap();
            let files = ImageFiles::shards(&pattern, 8)?;
            for i in 0..files.len() {
                let _ = files.read(i);
            }
            Ok::<(), kiln::KilnError>(())
        },
    );
}

/// The heap check itself: a parser that sizes a buffer from a length the input claims (here
/// 64 MiB claimed by a 12-byte input) must fail the run, with the input saved.
#[test]
fn a_buffer_sized_by_a_claimed_length_fails_the_heap_limit() {
    let mut seed = (64u32 << 20).to_le_bytes().to_vec();
    seed.extend_from_slice(b"12345678");
    let naive = Target {
        name: "naive-length",
        seed: &seed,
        sealed: false,
        cases: 20,
        regressions: None,
        heap: HeapLimit::new(1, 4),
    };
    let failure = std::panic::catch_unwind(|| {
        run(&naive, |bytes: &[u8]| {
            let claimed = bytes
                .get(..4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
                .ok_or("too short")?;
            // Trust the claimed length (the bug this check exists for); `black_box` keeps the
            // allocation from being optimized out.
            let buffer = std::hint::black_box(vec![0u8; claimed.min(256 << 20)]);
            drop(buffer);
            Ok::<_, &str>(())
        })
    })
    .expect_err("a 64 MiB buffer from a 12-byte input passed a 1 MiB + 4×len limit");
    let message = failure
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(
        message.contains("over the stated limit") && message.contains("saved to"),
        "{message}"
    );
    if let Some(saved) = message.split("saved to ").nth(1) {
        let _ = std::fs::remove_file(saved.split(' ').next().unwrap_or_default());
    }
}
