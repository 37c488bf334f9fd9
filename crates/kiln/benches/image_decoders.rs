//! Why Kiln decodes JPEG with zune-jpeg at full size and jpeg-decoder at reduced sizes:
//! decode-only megapixels per second of both decoders on a folder of JPEG files, one
//! thread, at every scale each supports (docs/data.md quotes a run).
//!
//!     cargo bench -p kiln --bench image_decoders -- DIR [FILES]
//!
//! DIR is walked for `*.jpg`; the first FILES (default 300) are read into memory, then each
//! decoder passes over them three times; the median pass is reported.

use std::path::{Path, PathBuf};
use std::time::Instant;

use kiln::data::vision::decode;

fn jpegs(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut items: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    items.sort();
    for p in items {
        if p.is_dir() {
            jpegs(&p, out);
        } else if p.extension().is_some_and(|e| e.eq_ignore_ascii_case("jpg")) {
            out.push(p);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let Some(dir) = args.first() else {
        eprintln!("usage: cargo bench -p kiln --bench image_decoders -- DIR [FILES]");
        return;
    };
    let n: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(300);
    let mut paths = Vec::new();
    jpegs(Path::new(dir), &mut paths);
    paths.truncate(n);
    let files: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
    let headers: Vec<_> = files
        .iter()
        .map(|b| decode::probe(b, u64::MAX).unwrap())
        .collect();
    let pixels: f64 = headers
        .iter()
        .map(|h| (h.stored_width * h.stored_height) as f64)
        .sum();
    println!(
        "{} JPEG files, {:.1} MP in all, one thread",
        files.len(),
        pixels / 1e6
    );
    let time = |name: &str, f: &dyn Fn(&[u8], &decode::Header) -> usize| {
        let mut passes = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            let mut sink = 0usize;
            for (b, h) in files.iter().zip(&headers) {
                sink += f(b, h);
            }
            passes.push(t.elapsed().as_secs_f64());
            std::hint::black_box(sink);
        }
        passes.sort_by(f64::total_cmp);
        let s = passes[1];
        println!(
            "{name:<36} {:>8.2} ms/image {:>8.1} source MP/s",
            s * 1e3 / files.len() as f64,
            pixels / 1e6 / s
        );
    };
    time("zune-jpeg, full size (Kiln: scale 1)", &|b, h| {
        decode::decode(b, h, 1).unwrap().pixels.len()
    });
    time("jpeg-decoder, full size", &|b, _| {
        let mut d = jpeg_decoder::Decoder::new(std::io::Cursor::new(b));
        d.decode().unwrap().len()
    });
    for k in [2usize, 4, 8] {
        time(
            &format!("jpeg-decoder at 1/{k} (Kiln: scale {k})"),
            &|b, h| decode::decode(b, h, k).unwrap().pixels.len(),
        );
    }
}
