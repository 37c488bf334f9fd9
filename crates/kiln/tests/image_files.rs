//! Image files end to end: folders, manifests and WebDataset shards read into batches and
//! trained on; every kind of bad file is an error naming the file, or left out and reported
//! without changing which other samples are seen; the pack is checked on read; decoded
//! pixels and the crop+resize agree with Pillow (when Python has it; CI requires it).

mod common;

use std::path::{Path, PathBuf};

use kiln::burn::module::Module;
use kiln::burn::tensor::{Device, Tensor};
use kiln::data::vision::{
    BadSamplePolicy, CropBox, CropMode, DEFAULT_MAX_PIXELS, ImageFiles, ImageTransform, Location,
    PackFormat, PackOptions, PackedImages, Rgb8, decode, pack, pipeline,
};
use kiln::data::{Dataset, ImageBatches, LoaderOptions, SampleRng};
use kiln::datasets::{ImageOptions, ImageSpec, open_images};
use kiln::nn::{Conv2d, Conv2dConfig, Linear, LinearConfig};
use kiln::observe::{Event, MemorySink};
use kiln::train::TrainOptions;
use kiln::zoo::Classifier;

/// A photo-like test image of class `label`: a colour ramp tinted by the class, noise from
/// `seed` (so classes are learnable and files differ).
fn scene(label: usize, seed: u64, w: u32, h: u32) -> image::RgbImage {
    let tint = [[200u32, 60, 40], [40, 90, 210], [60, 180, 70]][label % 3];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    image::RgbImage::from_fn(w, h, |x, y| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let n = (state % 40) as u32;
        let ramp = x * 40 / w + y * 30 / h;
        image::Rgb(std::array::from_fn(|c| {
            (tint[c] * 3 / 4 + ramp + n).min(255) as u8
        }))
    })
}

fn write_jpeg(path: &Path, img: &image::RgbImage, quality: u8) {
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality)
        .encode_image(img)
        .unwrap();
    std::fs::write(path, out).unwrap();
}

/// `root/<class>/img_<i>.jpg`, `per_class` files of each of `classes` classes.
fn make_folder(root: &Path, classes: usize, per_class: usize) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for c in 0..classes {
        let dir = root.join(format!("class_{c}"));
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..per_class {
            let p = dir.join(format!("img_{i:03}.jpg"));
            let (w, h) = if i % 2 == 0 { (48, 36) } else { (36, 44) };
            write_jpeg(&p, &scene(c, (c * 1000 + i) as u64, w, h), 90);
            files.push(p);
        }
    }
    files
}

fn small(size: usize) -> ImageOptions {
    ImageOptions {
        size,
        ..ImageOptions::default()
    }
}

/// A tiny classifier: one convolution, global average pool, a linear head.
#[derive(Module, Debug)]
struct Tiny {
    conv: Conv2d,
    head: Linear,
}

impl Tiny {
    fn new(classes: usize, device: &Device) -> Tiny {
        Tiny {
            conv: Conv2dConfig::new([3, 8], [3, 3]).init(device),
            head: LinearConfig::new(8, classes).init(device),
        }
    }
}

impl Classifier for Tiny {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = kiln::burn::tensor::activation::relu(self.conv.forward(images));
        let pooled: Tensor<2> = x.mean_dim(3).mean_dim(2).flatten(1, 3);
        self.head.forward(pooled)
    }
}

fn options(epochs: usize) -> TrainOptions {
    TrainOptions {
        epochs,
        batch_size: 8,
        lr: 0.02,
        ..TrainOptions::default()
    }
}

#[test]
fn an_image_folder_trains_a_model_to_accuracy() {
    let dir = common::tempdir("images", "train");
    make_folder(dir.path(), 3, 20);
    let spec = ImageSpec::parse(&format!("imagefolder:{}", dir.path().display())).unwrap();
    let ((train, test), classes) = open_images(&spec, &small(24)).unwrap();
    assert_eq!(classes, vec!["class_0", "class_1", "class_2"]);
    // Every 10th file of each class is held out: 2 of 20.
    assert_eq!((train.len(), test.len()), (54, 6));
    assert_eq!(train.item_shape(), [3, 24, 24]);
    let mut sink = MemorySink::default();
    let device = Device::flex();
    let mut trainer = kiln::Trainer::new(options(12), device, &mut sink);
    let run = trainer
        .fit("tiny", |d| Tiny::new(3, d), &*train, Some(&*test))
        .unwrap();
    let acc = run.summary.test_accuracy.unwrap();
    assert!(
        acc >= 0.99,
        "held-out accuracy {acc} (summary {:?})",
        run.summary
    );
}

#[test]
fn folders_sort_classes_and_walk_subdirectories_as_torchvision() {
    let dir = common::tempdir("images", "walk");
    let root = dir.path();
    for (class, files) in [
        ("zebra", vec!["b.jpg", "a.JPG"]),
        ("ant", vec!["x.png", "sub/y.jpg", "z.txt", "w.bmp"]),
    ] {
        for f in files {
            let p = root.join(class).join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            if f.ends_with("png") {
                scene(0, 1, 16, 16).save(&p).unwrap();
            } else {
                write_jpeg(&p, &scene(0, 1, 16, 16), 90);
            }
        }
    }
    std::fs::create_dir_all(root.join("empty_class")).unwrap();
    let err = ImageFiles::folder(root).unwrap_err().to_string();
    assert!(
        err.contains("empty_class") && err.contains("no image file"),
        "{err}"
    );
    std::fs::remove_dir(root.join("empty_class")).unwrap();
    let files = ImageFiles::folder(root).unwrap();
    assert_eq!(files.classes(), ["ant", "zebra"]);
    let names: Vec<String> = (0..files.len())
        .map(|i| {
            let n = files.name(i);
            n[root.display().to_string().len() + 1..].to_string()
        })
        .collect();
    // A directory's own files come before its subdirectories' (sorted os.walk); `.txt` and
    // `.bmp` are not taken.
    assert_eq!(
        names,
        ["ant/x.png", "ant/sub/y.jpg", "zebra/a.JPG", "zebra/b.jpg"]
    );
    assert!(ImageFiles::folder(root.join("missing")).is_err());
}

#[test]
fn manifests_in_csv_and_json_lines_resolve_paths_labels_and_boxes() {
    let dir = common::tempdir("images", "manifest");
    let files = make_folder(dir.path(), 2, 2);
    let rel = |p: &PathBuf| p.strip_prefix(dir.path()).unwrap().display().to_string();
    let csv = dir.path().join("m.csv");
    std::fs::write(
        &csv,
        format!(
            "path,label,box\n{},dog,1 2 30 20\n{},cat,\n\"{}\",dog,\n",
            rel(&files[0]),
            rel(&files[1]),
            rel(&files[2])
        ),
    )
    .unwrap();
    let m = ImageFiles::manifest(&csv).unwrap();
    assert_eq!(m.classes(), ["cat", "dog"]);
    let labels: Vec<usize> = m.entries().map(|e| e.label).collect();
    assert_eq!(labels, [1, 0, 1]);
    assert_eq!(
        m.entry(0).annotation.as_ref().and_then(|a| a.bbox),
        Some([1.0, 2.0, 30.0, 20.0])
    );
    assert_eq!(m.entry(0).location, Location::File(files[0].clone()));
    assert!(m.sample(0, 0, 0).is_ok());

    let jsonl = dir.path().join("m.jsonl");
    std::fs::write(
        &jsonl,
        format!(
            "{{\"path\": \"{}\", \"label\": 3, \"mask\": \"masks/a.png\"}}\n{{\"path\": \"{}\", \"label\": 0}}\n",
            rel(&files[0]),
            files[1].display()
        ),
    )
    .unwrap();
    let j = ImageFiles::manifest(&jsonl).unwrap();
    assert_eq!(j.classes().len(), 4);
    assert_eq!(
        j.entry(0).annotation.as_ref().and_then(|a| a.mask.clone()),
        Some(dir.path().join("masks/a.png"))
    );
    std::fs::write(&csv, "path,label\nx.jpg\n").unwrap();
    let err = ImageFiles::manifest(&csv).unwrap_err().to_string();
    assert!(err.contains("line 2"), "{err}");
}

/// Writes WebDataset shards of `per_shard` samples: `key.jpg` + `key.cls`.
fn make_shards(dir: &Path, shards: usize, per_shard: usize) -> Vec<Vec<u8>> {
    let mut images = Vec::new();
    for s in 0..shards {
        let file = std::fs::File::create(dir.join(format!("train-{s:03}.tar"))).unwrap();
        let mut b = tar::Builder::new(file);
        for i in 0..per_shard {
            let key = format!("s{s}/sample_{i:04}");
            let label = (s * per_shard + i) % 3;
            let mut jpg = Vec::new();
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpg, 90)
                .encode_image(&scene(label, (s * 100 + i) as u64, 40, 30))
                .unwrap();
            for (ext, bytes) in [
                ("jpg", jpg.clone()),
                ("cls", label.to_string().into_bytes()),
            ] {
                let mut h = tar::Header::new_gnu();
                h.set_size(bytes.len() as u64);
                h.set_mode(0o644);
                h.set_cksum();
                b.append_data(&mut h, format!("{key}.{ext}"), &bytes[..])
                    .unwrap();
            }
            images.push(jpg);
        }
        b.finish().unwrap();
    }
    images
}

#[test]
fn webdataset_shards_are_read_by_offset_shard_by_shard() {
    let dir = common::tempdir("images", "shards");
    let images = make_shards(dir.path(), 3, 12);
    let pattern = format!("{}/train-{{000..002}}.tar", dir.path().display());
    let shards = ImageFiles::shards(&pattern, 4).unwrap();
    assert_eq!(shards.len(), 36);
    for (i, bytes) in images.iter().enumerate() {
        assert_eq!(&shards.read(i).unwrap(), bytes, "sample {i}");
        assert_eq!(shards.entry(i).label, i % 3);
    }
    // The epoch order is every sample once, and batches stay within few shards.
    let order = shards.epoch_order(5, 0).unwrap();
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(sorted, (0..36).collect::<Vec<_>>());
    assert_ne!(order, shards.epoch_order(5, 1).unwrap());
    // Through the loader: one epoch of batches covers every sample exactly once.
    let batches = ImageBatches::new(&shards);
    let opts = LoaderOptions {
        batch_size: 8,
        workers: 2,
        ..LoaderOptions::default()
    };
    let seen = kiln::data::DataLoader::run_source(&batches, &Device::flex(), opts, |l| {
        l.epoch(0, 0).map(|b| b.unwrap().len).sum::<usize>()
    })
    .unwrap();
    assert_eq!(seen, 36);
    // A compressed shard and a sample without its label are named errors.
    let gz = dir.path().join("bad.tar");
    std::fs::write(&gz, [0x1f, 0x8b, 8, 0, 0, 0]).unwrap();
    let err = ImageFiles::shards(&gz.display().to_string(), 4)
        .unwrap_err()
        .to_string();
    assert!(err.contains("gzip"), "{err}");
}

/// A JPEG whose header claims `w × h` pixels (the data is a 16×16 image's): a decompression
/// bomb's header without its gigabytes.
fn bomb_header(w: u16, h: u16) -> Vec<u8> {
    let mut bytes = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 90)
        .encode_image(&scene(0, 0, 16, 16))
        .unwrap();
    let sof = bytes
        .windows(2)
        .position(|p| p == [0xFF, 0xC0])
        .expect("a baseline SOF0 marker");
    bytes[sof + 5..sof + 7].copy_from_slice(&h.to_be_bytes());
    bytes[sof + 7..sof + 9].copy_from_slice(&w.to_be_bytes());
    bytes
}

/// A folder of good files with one of each kind of bad file in class 1; returns the bad
/// files' names and whether the unreadable-permission case applies (root reads anything).
fn folder_with_bad_files(root: &Path) -> (Vec<&'static str>, bool) {
    make_folder(root, 2, 6);
    let c = root.join("class_1");
    let good = std::fs::read(c.join("img_000.jpg")).unwrap();
    std::fs::write(c.join("bad_truncated.jpg"), &good[..good.len() / 2]).unwrap();
    std::fs::write(c.join("bad_empty.jpg"), b"").unwrap();
    std::fs::write(c.join("bad_text.jpg"), b"this is not an image\n").unwrap();
    std::fs::write(c.join("bad_bomb.jpg"), bomb_header(30000, 30000)).unwrap();
    std::os::unix::fs::symlink(c.join("gone.jpg"), c.join("bad_dangling.jpg")).unwrap();
    // A directory named like an image is walked into, as torchvision's os.walk does: no sample.
    std::fs::create_dir(c.join("dir.jpg")).unwrap();
    // A PNG named .jpg is not bad: files are sniffed by content.
    scene(1, 9, 20, 20)
        .save_with_format(c.join("ok_png_named.jpg"), image::ImageFormat::Png)
        .unwrap();
    let locked = c.join("bad_locked.jpg");
    std::fs::write(&locked, &good).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
    let unreadable = std::fs::read(&locked).is_err();
    if !unreadable {
        std::fs::remove_file(&locked).unwrap();
    }
    let mut bad = vec![
        "bad_truncated",
        "bad_empty",
        "bad_text",
        "bad_bomb",
        "bad_dangling",
    ];
    if unreadable {
        bad.push("bad_locked");
    }
    (bad, unreadable)
}

#[test]
fn every_bad_file_is_an_error_naming_it() {
    let dir = common::tempdir("images", "bad-error");
    let (bad, _) = folder_with_bad_files(dir.path());
    let files = ImageFiles::folder(dir.path())
        .unwrap()
        .with_transform(ImageTransform::train(16));
    let mut rng = SampleRng::new(0, 0, 0);
    let mut out = vec![0f32; 3 * 16 * 16];
    let mut failed = Vec::new();
    for i in 0..files.len() {
        let name = files.name(i);
        match files.fill_sample(i, &mut rng, &mut out) {
            Ok(Some(_)) => assert!(!name.contains("bad_"), "{name} decoded"),
            Ok(None) => panic!("the error policy never skips"),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains(&name), "{msg} does not name {name}");
                failed.push((name, msg));
            }
        }
    }
    assert_eq!(failed.len(), bad.len(), "{failed:#?}");
    let reason = |key: &str| {
        failed
            .iter()
            .find(|(n, _)| n.contains(key))
            .map(|(_, m)| m.clone())
            .unwrap_or_default()
    };
    assert!(reason("bad_truncated").contains("truncated"));
    assert!(reason("bad_empty").contains("empty"));
    assert!(reason("bad_text").contains("not a JPEG"));
    assert!(reason("bad_bomb").contains("over the limit"));
    assert!(reason("bad_dangling").contains("cannot read"));
    // Through the trainer: the run stops with that error, not a panic.
    let mut sink = MemorySink::default();
    let files = files.with_transform(ImageTransform::train(16));
    let err = match kiln::Trainer::new(options(1), Device::flex(), &mut sink).fit(
        "tiny",
        |d| Tiny::new(2, d),
        &files,
        None,
    ) {
        Ok(_) => panic!("a bad file stops the run"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("bad_") && err.contains("on_bad_sample"),
        "{err}"
    );
}

#[test]
fn skipped_files_leave_every_other_sample_as_it_was() {
    let dir = common::tempdir("images", "bad-skip");
    let (bad, _) = folder_with_bad_files(dir.path());
    let files = ImageFiles::folder(dir.path())
        .unwrap()
        .with_transform(ImageTransform::train(16))
        .with_policy(BadSamplePolicy::Skip);
    let good: Vec<usize> = (0..files.len())
        .filter(|&i| !files.name(i).contains("bad_"))
        .collect();
    // Each good sample comes out as it would alone, whatever bad files share its batch.
    let batches = ImageBatches::new(&files);
    let opts = LoaderOptions {
        batch_size: 4,
        workers: 2,
        shuffle: false,
        ..LoaderOptions::default()
    };
    let (pixels, labels) =
        kiln::data::DataLoader::run_source(&batches, &Device::flex(), opts, |l| {
            let (mut px, mut lb) = (Vec::new(), Vec::new());
            for b in l.epoch(0, 0) {
                let b = b.unwrap();
                px.extend(b.images.into_data().iter::<f32>());
                lb.extend(b.labels.into_data().iter::<i64>());
            }
            (px, lb)
        })
        .unwrap();
    let item = 3 * 16 * 16;
    assert_eq!(labels.len(), good.len());
    for (k, &i) in good.iter().enumerate() {
        let mut alone = vec![0f32; item];
        let mut rng = SampleRng::new(42, 0, i);
        files.fill_sample(i, &mut rng, &mut alone).unwrap().unwrap();
        assert_eq!(&pixels[k * item..(k + 1) * item], &alone[..], "sample {i}");
        assert_eq!(labels[k] as usize, files.entry(i).label);
    }
    let skipped = files.take_skipped();
    assert_eq!(skipped.len(), bad.len());
    assert!(
        skipped
            .iter()
            .all(|s| s.name.contains("bad_") && !s.reason.is_empty())
    );
    // Through the trainer: events per epoch and the run's count.
    let mut sink = MemorySink::default();
    let run = kiln::Trainer::new(options(2), Device::flex(), &mut sink)
        .fit("tiny", |d| Tiny::new(2, d), &files, None)
        .unwrap();
    assert_eq!(run.summary.skipped_samples, 2 * bad.len() as u64);
    let per_epoch: Vec<usize> = sink
        .events
        .iter()
        .filter_map(|e| match e {
            Event::SamplesSkipped { samples, .. } => Some(samples.len()),
            _ => None,
        })
        .collect();
    assert_eq!(per_epoch, vec![bad.len(), bad.len()]);
}

#[test]
fn a_pack_reads_back_close_to_the_files_and_refuses_damage() {
    let dir = common::tempdir("images", "pack");
    let src = dir.path().join("src");
    make_folder(&src, 2, 5);
    let files = ImageFiles::folder(&src).unwrap();
    for format in [PackFormat::Raw, PackFormat::Jpeg(95)] {
        let out = dir.path().join(format!("{format:?}"));
        let report = pack(
            &files,
            &out,
            &PackOptions {
                shorter: 24,
                format,
                ..PackOptions::default()
            },
            |_, _| {},
        )
        .unwrap();
        assert_eq!(report.images, 10);
        let eval = ImageTransform::eval(20);
        let packed = PackedImages::open(&out)
            .unwrap()
            .with_transform(eval.clone());
        let files = ImageFiles::folder(&src).unwrap().with_transform(eval);
        assert_eq!(packed.len(), files.len());
        for i in 0..files.len() {
            let (a, la) = files.sample(i, 0, 0).unwrap();
            let mut b = vec![0f32; a.len()];
            let lb = packed.fill(i, &mut b).unwrap();
            assert_eq!(la, lb);
            // Resampled twice (to the pack's size, then to the output), so not equal; a
            // normalized unit is ~1/57 of the 8-bit range.
            let mean = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32;
            assert!(mean < 0.15, "{format:?} sample {i}: mean abs diff {mean}");
        }
    }
    let out = dir.path().join("Raw");
    let shard = out.join("pack-00000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[100] ^= 0xFF;
    std::fs::write(&shard, &bytes).unwrap();
    let packed = PackedImages::open(&out).unwrap();
    let err = packed.image(0).unwrap_err().to_string();
    assert!(err.contains("CRC-32"), "{err}");
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let err = PackedImages::open(&out).unwrap_err().to_string();
    assert!(err.contains("truncated"), "{err}");
    std::fs::remove_file(out.join("index.json")).unwrap();
    let err = PackedImages::open(&out).unwrap_err().to_string();
    assert!(err.contains("pack again"), "{err}");
}

#[test]
fn decode_scaling_keeps_the_output_close_to_a_full_decode() {
    let dir = common::tempdir("images", "scaling");
    let p = dir.path().join("big.jpg");
    write_jpeg(&p, &scene(1, 3, 960, 720), 92);
    let bytes = std::fs::read(&p).unwrap();
    let header = decode::probe(&bytes, DEFAULT_MAX_PIXELS).unwrap();
    let t = ImageTransform {
        crop: CropMode::ResizeCenterCrop { shorter: 110 },
        ..ImageTransform::eval(96)
    };
    let full = ImageTransform {
        decode_scaling: false,
        ..t.clone()
    };
    let run = |t: &ImageTransform| {
        let mut out = vec![0f32; t.sample_len()];
        t.apply_bytes(&bytes, &mut SampleRng::new(0, 0, 0), &mut out)
            .unwrap();
        out
    };
    let (a, b) = (run(&t), run(&full));
    let mean = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32;
    assert!(header.scales().contains(&4));
    assert!(
        mean < 0.05,
        "scaled decode vs full: mean abs diff {mean} (normalized units)"
    );
}

/// Pillow's decodes and resizes of files it writes, compared with Kiln's (tests/pillow_check.py).
#[test]
fn decoded_pixels_and_resizes_match_pillow() {
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = std::process::Command::new(&python)
        .args(["-c", "import PIL, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        assert!(
            std::env::var_os("KILN_REQUIRE_PILLOW").is_none(),
            "KILN_REQUIRE_PILLOW is set but `{python} -c 'import PIL, numpy'` fails"
        );
        eprintln!("SKIPPED decoded_pixels_and_resizes_match_pillow: no Pillow for `{python}`");
        return;
    }
    let dir = common::tempdir("images", "pillow");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pillow_check.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("cases.json")).unwrap()).unwrap();
    for case in cases.as_array().unwrap() {
        let name = case["file"].as_str().unwrap();
        let bytes = std::fs::read(dir.path().join(name)).unwrap();
        let want = std::fs::read(dir.path().join(case["rgb"].as_str().unwrap())).unwrap();
        let header = decode::probe(&bytes, DEFAULT_MAX_PIXELS).unwrap();
        let img = decode::decode(&bytes, &header, 1).unwrap();
        let (w, h) = (
            case["width"].as_u64().unwrap() as usize,
            case["height"].as_u64().unwrap() as usize,
        );
        assert_eq!((img.width, img.height), (w, h), "{name}: size");
        let (mean, max) = diff(&img.pixels, &want);
        let (tol_mean, tol_max) = (
            case["tol_mean"].as_f64().unwrap(),
            case["tol_max"].as_f64().unwrap(),
        );
        eprintln!("{name}: mean abs {mean:.3}, max {max} (allowed {tol_mean}, {tol_max})");
        assert!(
            mean <= tol_mean && max as f64 <= tol_max,
            "{name}: mean {mean}, max {max}"
        );
        // Crop + resize against Pillow's resize(BILINEAR, box) of Pillow's own decode.
        if let Some(r) = case.get("resize") {
            let b: Vec<f64> = r["box"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            let (ow, oh) = (
                r["width"].as_u64().unwrap() as usize,
                r["height"].as_u64().unwrap() as usize,
            );
            let pil_decode = Rgb8 {
                width: w,
                height: h,
                pixels: want.clone(),
            };
            let mut got = Vec::new();
            let crop = CropBox {
                left: b[0],
                top: b[1],
                width: b[2] - b[0],
                height: b[3] - b[1],
            };
            pipeline::resize_into(&pil_decode, crop, ow, oh, &mut got).unwrap();
            let expect = std::fs::read(dir.path().join(r["rgb"].as_str().unwrap())).unwrap();
            let (mean, max) = diff(&got, &expect);
            eprintln!("{name} resize: mean abs {mean:.3}, max {max}");
            assert!(
                mean <= 0.5 && max <= 2,
                "{name} resize vs Pillow: mean {mean}, max {max}"
            );
        }
    }
}

fn diff(a: &[u8], b: &[u8]) -> (f64, u8) {
    assert_eq!(a.len(), b.len());
    let mut sum = 0u64;
    let mut max = 0u8;
    for (x, y) in a.iter().zip(b) {
        let d = x.abs_diff(*y);
        sum += d as u64;
        max = max.max(d);
    }
    (sum as f64 / a.len().max(1) as f64, max)
}
