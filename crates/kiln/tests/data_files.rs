//! The bundled data and the IDX loader, including every way a data file can be bad.

mod common;

use std::io::Write;
use std::path::Path;

use kiln::KilnError;
use kiln::data::Dataset;
use kiln::datasets::idx;
use kiln::datasets::{Split, bundled, load_dir};

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// Writes a tiny MNIST-format directory with `n` images of `rows`×`cols`.
fn write_dir(dir: &Path, n: usize, compress: bool) {
    let images: Vec<u8> = (0..n * 28 * 28).map(|i| (i % 251) as u8).collect();
    let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
    for split in ["train", "t10k"] {
        let img = idx::encode(&[n, 28, 28], &images);
        let lab = idx::encode(&[n], &labels);
        let (img, lab, ext) = if compress {
            (gz(&img), gz(&lab), ".gz")
        } else {
            (img, lab, "")
        };
        std::fs::write(dir.join(format!("{split}-images-idx3-ubyte{ext}")), img).unwrap();
        std::fs::write(dir.join(format!("{split}-labels-idx1-ubyte{ext}")), lab).unwrap();
    }
}

#[test]
fn bundled_split_is_4000_train_and_1000_test_stratified() {
    let train = bundled(Split::Train).unwrap();
    let test = bundled(Split::Test).unwrap();
    assert_eq!((train.len(), test.len()), (4000, 1000));
    assert_eq!(train.item_shape(), [1, 28, 28]);
    let mut per_class = [0usize; 10];
    for i in 0..test.len() {
        per_class[test.label(i)] += 1;
    }
    assert_eq!(per_class, [100; 10]);
    // Normalized pixels: background is (0 - mean)/std, ink is positive.
    let mut buf = vec![0f32; 784];
    train.fill(0, &mut buf).unwrap();
    let min = buf.iter().cloned().fold(f32::INFINITY, f32::min);
    let max = buf.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    assert!((min + 0.4242).abs() < 1e-3, "min {min}");
    assert!(max > 2.0, "max {max}");
}

#[test]
fn idx_directory_loads_plain_and_gzipped() {
    for compress in [false, true] {
        let dir = common::tempdir("test", &format!("idx-{compress}"));
        write_dir(&dir, 12, compress);
        let ds = load_dir(&dir, Split::Train).unwrap();
        assert_eq!(ds.len(), 12);
        assert_eq!(ds.label(11), 1);
        assert_eq!(load_dir(&dir, Split::Test).unwrap().len(), 12);
    }
}

fn expect_bad_data(result: kiln::Result<kiln::data::ImageDataset>, needle: &str) {
    match result {
        Err(KilnError::BadData { problem, .. }) => {
            assert!(problem.contains(needle), "{problem:?} lacks {needle:?}")
        }
        other => panic!("expected BadData containing {needle:?}, got {other:?}"),
    }
}

#[test]
fn truncated_file_is_reported_with_sizes() {
    let dir = common::tempdir("test", "trunc");
    write_dir(&dir, 5, false);
    let p = dir.join("train-images-idx3-ubyte");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    expect_bad_data(load_dir(&dir, Split::Train), "truncated");
    std::fs::write(&p, &bytes[..10]).unwrap();
    expect_bad_data(load_dir(&dir, Split::Train), "truncated");
}

#[test]
fn wrong_magic_is_not_an_idx_file() {
    let dir = common::tempdir("test", "magic");
    write_dir(&dir, 5, false);
    std::fs::write(
        dir.join("train-images-idx3-ubyte"),
        b"PK\x03\x04 not idx at all",
    )
    .unwrap();
    expect_bad_data(load_dir(&dir, Split::Train), "not an IDX file");
}

#[test]
fn corrupt_gzip_is_reported() {
    let dir = common::tempdir("test", "gz");
    write_dir(&dir, 5, true);
    let p = dir.join("train-images-idx3-ubyte.gz");
    let mut bytes = std::fs::read(&p).unwrap();
    let cut = bytes.len() / 2;
    bytes.truncate(cut);
    std::fs::write(&p, bytes).unwrap();
    expect_bad_data(load_dir(&dir, Split::Train), "gzip");
}

#[test]
fn swapped_or_mismatched_files_are_reported() {
    let dir = common::tempdir("test", "swap");
    write_dir(&dir, 5, false);
    let lab = dir.join("train-labels-idx1-ubyte");
    std::fs::write(&lab, idx::encode(&[4], &[1, 2, 3, 4])).unwrap();
    expect_bad_data(load_dir(&dir, Split::Train), "do not belong together");
    std::fs::write(&lab, idx::encode(&[5], &[1, 2, 3, 4, 42])).unwrap();
    expect_bad_data(load_dir(&dir, Split::Train), "label 42");
    std::fs::copy(dir.join("t10k-images-idx3-ubyte"), &lab).unwrap();
    expect_bad_data(load_dir(&dir, Split::Train), "is this an images file");
}

#[test]
fn missing_file_names_the_expected_names() {
    let dir = common::tempdir("test", "missing");
    expect_bad_data(load_dir(&dir, Split::Train), "train-images-idx3-ubyte");
}

#[test]
fn checksum_listing_is_verified() {
    let dir = common::tempdir("test", "sums");
    write_dir(&dir, 5, false);
    std::fs::write(
        dir.join("SHA256SUMS"),
        format!("{}  train-images-idx3-ubyte\n", "0".repeat(64)),
    )
    .unwrap();
    expect_bad_data(load_dir(&dir, Split::Train), "checksum mismatch");
    // Files not listed are not checked.
    assert_eq!(load_dir(&dir, Split::Test).unwrap().len(), 5);
}
