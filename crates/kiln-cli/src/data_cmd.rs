//! `kiln data pack SRC OUT`: the preprocessed image cache (`kiln::data::vision::pack`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use kiln::data::Dataset;
use kiln::data::vision::{
    BadSamplePolicy, DEFAULT_SHUFFLE_BUFFER, ImageFiles, PackFormat, PackOptions, pack,
};
use kiln::datasets::ImageSpec;

/// `kiln data …`.
#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Decode every image of SRC once, resize its shorter side to --shorter, and store it in
    /// shard files under OUT (raw RGB, or JPEG with --format jpeg), written atomically with a
    /// CRC-32 per image; `--data packed:OUT` then trains from it. A folder with train/ and
    /// val/ is packed to OUT/train and OUT/val.
    Pack(PackArgs),
    /// Write a deterministic test video (a still camera with sensor noise and moving objects,
    /// a camera pan, or a scene cut) and its ground truth (OUT.json: every object's box in
    /// every frame); needs the `video` feature.
    MakeVideo(MakeVideoArgs),
}

/// Arguments of `kiln data make-video`.
#[derive(Args, Debug)]
pub struct MakeVideoArgs {
    /// The file; its extension picks the container (.mp4, .mkv, .webm, .ts, .h264).
    out: PathBuf,
    /// static, pan or cut.
    #[arg(long, default_value = "static", value_parser = ["static", "pan", "cut"])]
    scene: String,
    /// `WIDTHxHEIGHT` (even sides), e.g. 1920x1080 or 3840x2160.
    #[arg(long, default_value = "1920x1080")]
    size: String,
    /// Seconds at 30 frames/s.
    #[arg(long, default_value_t = 5.0)]
    seconds: f32,
    /// h264, h265 or vp9.
    #[arg(long, default_value = "h264", value_parser = ["h264", "h265", "vp9"])]
    codec: String,
    /// Moving objects.
    #[arg(long, default_value_t = 3)]
    objects: usize,
    /// Seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// Arguments of `kiln data pack`.
#[derive(Args, Debug)]
pub struct PackArgs {
    /// The images: imagefolder:DIR (or a plain DIR), manifest:FILE or shards:PATTERN.
    src: String,
    /// Where the pack goes (created).
    out: PathBuf,
    /// Shorter side of the stored images (larger images are resized down, smaller kept).
    #[arg(long, default_value_t = 256)]
    shorter: usize,
    /// raw (no decode later) or jpeg (about a quarter of the disk; a small decode later).
    #[arg(long, default_value = "raw", value_parser = ["raw", "jpeg"])]
    format: String,
    /// JPEG quality with --format jpeg.
    #[arg(long, default_value_t = 90)]
    quality: u8,
    /// error (stop at the first unreadable file, naming it) or skip (leave it out, listed
    /// in the pack's index).
    #[arg(long, default_value = "error", value_parser = ["error", "skip"])]
    on_bad_sample: String,
    /// Bytes per shard file.
    #[arg(long, default_value_t = 1 << 30)]
    shard_bytes: u64,
}

/// Runs a `kiln data` command.
pub fn run(cmd: DataCommand) -> Result<()> {
    match cmd {
        DataCommand::Pack(args) => run_pack(&args),
        DataCommand::MakeVideo(args) => make_video(&args),
    }
}

#[cfg(feature = "video")]
fn make_video(args: &MakeVideoArgs) -> Result<()> {
    use kiln::video::{ClipSpec, Codec, Scene, write_clip};
    let (w, h) = args
        .size
        .split_once(['x', 'X'])
        .and_then(|(w, h)| {
            Some((
                w.trim().parse::<usize>().ok()?,
                h.trim().parse::<usize>().ok()?,
            ))
        })
        .with_context(|| format!("--size {:?}: expected WIDTHxHEIGHT", args.size))?;
    let scene = Scene::from_name(&args.scene).unwrap_or(Scene::Static);
    let spec = ClipSpec {
        codec: Codec::from_name(&args.codec).unwrap_or(Codec::H264),
        objects: args.objects,
        seed: args.seed,
        ..ClipSpec::new(scene, w, h, args.seconds)
    };
    let truth = write_clip(&args.out, &spec)?;
    let json = args.out.with_extension("json");
    let text = serde_json::to_string(&serde_json::json!({"spec": spec, "truth": truth}))?;
    kiln::fsutil::write_atomic(&json, text.as_bytes())
        .with_context(|| format!("writing {}", json.display()))?;
    eprintln!(
        "wrote {} ({} frames, {w}×{h}, {}) and {}",
        args.out.display(),
        spec.frames,
        args.codec,
        json.display()
    );
    Ok(())
}

#[cfg(not(feature = "video"))]
fn make_video(_: &MakeVideoArgs) -> Result<()> {
    bail!(
        "make-video needs the `video` feature: cargo build --release -p kiln-cli --features video"
    )
}

fn run_pack(args: &PackArgs) -> Result<()> {
    let options = PackOptions {
        shorter: args.shorter,
        format: match args.format.as_str() {
            "jpeg" => PackFormat::Jpeg(args.quality.clamp(1, 100)),
            _ => PackFormat::Raw,
        },
        shard_bytes: args.shard_bytes.max(1),
        on_bad_sample: BadSamplePolicy::from_name(&args.on_bad_sample)
            .unwrap_or(BadSamplePolicy::Error),
        ..PackOptions::default()
    };
    let spec =
        ImageSpec::parse(&args.src).unwrap_or_else(|| ImageSpec::Folder(args.src.clone().into()));
    let splits: Vec<(ImageFiles, PathBuf)> = match &spec {
        ImageSpec::Folder(dir) => {
            let (train, val) = (dir.join("train"), dir.join("val"));
            if train.is_dir() {
                let mut v = vec![(ImageFiles::folder(&train)?, args.out.join("train"))];
                if val.is_dir() {
                    v.push((ImageFiles::folder(&val)?, args.out.join("val")));
                }
                v
            } else {
                vec![(ImageFiles::folder(dir)?, args.out.clone())]
            }
        }
        ImageSpec::Manifest(f) => vec![(ImageFiles::manifest(f)?, args.out.clone())],
        ImageSpec::Shards(p) => vec![(
            ImageFiles::shards(p, DEFAULT_SHUFFLE_BUFFER)?,
            args.out.clone(),
        )],
        ImageSpec::Packed(_) => bail!("{} is a pack already", args.src),
    };
    for (files, out) in splits {
        pack_one(&files, &out, &options)
            .with_context(|| format!("packing into {}", out.display()))?;
    }
    Ok(())
}

fn pack_one(files: &ImageFiles, out: &Path, options: &PackOptions) -> Result<()> {
    let bar = indicatif::ProgressBar::new(files.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(format!("packing {}", out.display()));
    let t = std::time::Instant::now();
    let report = pack(files, out, options, |done, _| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    println!(
        "packed {} images ({} skipped) into {} shard(s), {} in {:.1}s: {}",
        report.images,
        report.skipped,
        report.shards,
        kiln::observe::memory::human_bytes(report.bytes),
        t.elapsed().as_secs_f64(),
        out.display()
    );
    Ok(())
}
