//! Memory-mapped datasets: `.npy` and safetensors files read the same values as the in-memory
//! dataset, bad files are clear errors, and streaming a file far larger than a set bound keeps
//! resident memory under that bound. (Its own test binary: RSS is per process, and other tests
//! running in parallel threads would blur the measurement.)

mod common;

use burn::tensor::Device;
use kiln::burn;
use kiln::data::{
    DataLoader, Dataset, ElementType, LoaderOptions, MappedImages, MmapArray, write_npy,
};
use kiln::datasets::{Split, bundled};
use kiln::observe::memory::current_rss_bytes;

/// The bundled training subset as raw bytes: images `[n, 28, 28]` u8 and labels `[n]` i64.
fn raw_mnist(n: usize) -> (Vec<u8>, Vec<i64>) {
    let data = bundled(Split::Train).unwrap().take(n);
    let (pixels, labels) = data.raw();
    (pixels.to_vec(), labels.iter().map(|&l| l as i64).collect())
}

fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A safetensors file written by hand from the format's definition (8-byte header length,
/// JSON header, data), so the reader is checked against the spec, not against itself.
fn write_safetensors(path: &std::path::Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes.len()]}),
        );
        offset += bytes.len();
    }
    let mut text = serde_json::to_string(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    for (_, _, _, bytes) in tensors {
        out.extend_from_slice(bytes);
    }
    std::fs::write(path, out).unwrap();
}

#[test]
fn npy_and_safetensors_read_the_same_samples_as_memory() {
    let dir = common::tempdir("mmap", "formats");
    let n = 200;
    let (pixels, labels) = raw_mnist(n);
    write_npy(dir.join("x.npy"), ElementType::U8, &[n, 28, 28], &pixels).unwrap();
    write_npy(
        dir.join("y.npy"),
        ElementType::I64,
        &[n],
        &i64_bytes(&labels),
    )
    .unwrap();
    write_safetensors(
        &dir.join("mnist.safetensors"),
        &[
            ("labels", "I64", vec![n], i64_bytes(&labels)),
            ("images", "U8", vec![n, 1, 28, 28], pixels.clone()),
        ],
    );
    let (mean, std) = kiln::data::MNIST_MEAN_STD;
    let npy = MappedImages::open_npy(dir.join("x.npy"), dir.join("y.npy"))
        .unwrap()
        .with_scaling(mean, std);
    let st = MappedImages::open_safetensors(dir.join("mnist.safetensors"), "images", "labels")
        .unwrap()
        .with_scaling(mean, std);
    let memory = bundled(Split::Train).unwrap().take(n);
    assert_eq!(npy.item_shape(), [1, 28, 28]);
    assert_eq!(st.item_shape(), [1, 28, 28]);
    let (mut a, mut b, mut c) = (vec![0f32; 784], vec![0f32; 784], vec![0f32; 784]);
    for i in 0..n {
        let la = npy.fill(i, &mut a).unwrap();
        let lb = st.fill(i, &mut b).unwrap();
        let lc = memory.fill(i, &mut c).unwrap();
        assert_eq!((la, lb), (lc, lc));
        for ((x, y), z) in a.iter().zip(&b).zip(&c) {
            assert!((x - z).abs() < 1e-5 && (y - z).abs() < 1e-5, "sample {i}");
        }
    }
    assert!(npy.fill(n, &mut a).is_err(), "out of range is an error");

    // Bad files name the problem.
    let err = MmapArray::open_safetensors(dir.join("mnist.safetensors"), "pixels")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no tensor `pixels`") && err.contains("images"),
        "{err}"
    );
    write_npy(
        dir.join("y_short.npy"),
        ElementType::I64,
        &[n - 1],
        &i64_bytes(&labels[1..]),
    )
    .unwrap();
    let err = MappedImages::open_npy(dir.join("x.npy"), dir.join("y_short.npy"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("labels must be [N] with N = 200"), "{err}");
    std::fs::write(
        dir.join("junk.safetensors"),
        b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk",
    )
    .unwrap();
    let err = MmapArray::open_safetensors(dir.join("junk.safetensors"), "images")
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a safetensors file"), "{err}");
}

#[test]
fn streaming_a_file_much_larger_than_the_bound_keeps_rss_bounded() {
    let dir = common::tempdir("mmap", "large");
    // 256 MiB per run: never left behind in the temp dir.
    // 256 MiB of 3×64×64 u8 images: 8× the 32 MiB bound set below.
    let (c, h, w) = (3usize, 64usize, 64usize);
    let item = c * h * w;
    let n = (256usize << 20) / item;
    let images = dir.join("images.npy");
    {
        // Written in chunks so the test itself never holds the file in memory.
        use std::io::Write;
        let tmp = dir.join("header.npy");
        write_npy(&tmp, ElementType::U8, &[n, c, h, w], &[]).unwrap();
        // The header alone (write_npy does not check the length); the data is appended.
        let header = std::fs::read(&tmp).unwrap();
        let mut f = std::fs::File::create(&images).unwrap();
        f.write_all(&header).unwrap();
        let chunk: Vec<u8> = (0..item * 256).map(|i| (i * 31 % 251) as u8).collect();
        let mut left = n;
        while left > 0 {
            let rows = left.min(256);
            f.write_all(&chunk[..rows * item]).unwrap();
            left -= rows;
        }
    }
    let labels: Vec<i64> = (0..n as i64).map(|i| i % 10).collect();
    write_npy(
        dir.join("labels.npy"),
        ElementType::I64,
        &[n],
        &i64_bytes(&labels),
    )
    .unwrap();

    let bound: u64 = 32 << 20;
    let data = MappedImages::open_npy(&images, dir.join("labels.npy"))
        .unwrap()
        .with_release_every(bound);
    let device = Device::flex();
    let base = current_rss_bytes().expect("Linux /proc/self/status");
    let options = LoaderOptions {
        batch_size: 64,
        workers: 2,
        prefetch_factor: 2,
        shuffle: true,
        drop_last: false,
        pad_last: false,
        seed: 1,
    };
    let (peak, samples, checksum) = DataLoader::run(&data, None, &device, options, |loader| {
        let mut peak = 0u64;
        let mut samples = 0usize;
        let mut checksum = 0f64;
        for (k, b) in loader.epoch(0, 0).enumerate() {
            let b = b.unwrap();
            samples += b.len;
            if k % 16 == 0 {
                checksum += b.images.sum().into_scalar::<f32>() as f64;
                peak = peak.max(current_rss_bytes().unwrap_or(0));
            }
        }
        (peak, samples, checksum)
    })
    .unwrap();
    assert_eq!(samples, n, "every sample streamed");
    assert!(checksum > 0.0);
    let growth = peak.saturating_sub(base);
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        for line in status.lines().filter(|l| l.starts_with("Rss")) {
            eprintln!("{line}");
        }
    }
    // The bound on mapped pages, plus the loader's in-flight batches (6 × 3 MiB of f32) and
    // allocator slack.
    let allowed = bound + (48 << 20);
    eprintln!(
        "file {} MiB, RSS growth {} MiB (allowed {} MiB)",
        (n * item) >> 20,
        growth >> 20,
        allowed >> 20
    );
    assert!(
        growth <= allowed,
        "resident memory grew by {} MiB streaming a {} MiB file (bound {} MiB)",
        growth >> 20,
        (n * item) >> 20,
        allowed >> 20
    );
}
