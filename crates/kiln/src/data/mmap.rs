//! Memory-mapped datasets: `.npy` arrays and safetensors files read through `memmap2`, without
//! loading the file.
//!
//! Mapping a file is not enough to keep memory bounded: every page a read touches stays
//! mapped (and counts in the process's RSS) until the kernel needs it back — and a fault maps
//! far more than the bytes read (fault-around maps 64 KiB windows; with large page-cache folios,
//! as ext4 and XFS have on recent kernels, a 12 KiB read can map 2 MiB). A dataset many times
//! larger than RAM would push everything else out first. So each [`MmapArray`] watches the
//! process's file-backed resident memory (`/proc/self/statm`, read every few rows, often
//! enough that even 2 MiB per row cannot overshoot by much) and, once it has grown by
//! `release_every` since the array was opened, tells the kernel it no longer needs the mapped
//! pages (`MADV_DONTNEED`). Pages read again later come back from the page cache or the file;
//! the mapping is read-only and shared, so dropping pages never loses data. Where `/proc` is
//! missing, it falls back to releasing every `release_every` bytes served.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{Advice, Mmap, UncheckedAdvice};

use super::Dataset;
use crate::error::{KilnError, Result};
use crate::observe::memory::Statm;

/// The most a single page fault can map: one PMD-sized (2 MiB) page-cache folio.
const MAX_FAULT_BYTES: u64 = 2 << 20;

/// Default bytes served between two releases of the mapped pages.
pub const DEFAULT_RELEASE_EVERY: u64 = 64 << 20;

/// Element types Kiln reads from mapped arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementType {
    /// `u8` (pixels).
    U8,
    /// Little-endian `f32`.
    F32,
    /// Little-endian `i32`.
    I32,
    /// Little-endian `i64`.
    I64,
}

impl ElementType {
    fn size(self) -> usize {
        match self {
            ElementType::U8 => 1,
            ElementType::F32 | ElementType::I32 => 4,
            ElementType::I64 => 8,
        }
    }
}

/// One array in a memory-mapped file: element type, shape and where its bytes are.
pub struct MmapArray {
    path: PathBuf,
    map: Mmap,
    offset: usize,
    dtype: ElementType,
    shape: Vec<usize>,
    served: AtomicU64,
    rows: AtomicU64,
    release_every: u64,
    /// Resident-memory readings for the bound.
    statm: Statm,
    /// File-backed resident pages (statm's `shared`) when the array was opened, in bytes.
    baseline: u64,
}

impl std::fmt::Debug for MmapArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmapArray")
            .field("path", &self.path)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

fn bad(path: &Path, problem: impl Into<String>) -> KilnError {
    KilnError::BadData {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| KilnError::io(path, e))?;
    // SAFETY: the mapping is read-only; Kiln never writes through it. If another process
    // truncates the file while it is mapped, reads past the new end fault (SIGBUS) — the same
    // contract as every mmap reader (numpy's mmap_mode, safetensors).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| KilnError::io(path, e))?;
    // Training reads samples in shuffled order: read-ahead would fault in pages nobody asked for.
    let _ = map.advise(Advice::Random);
    Ok(map)
}

impl MmapArray {
    /// Opens a `.npy` file (format versions 1–3, C order, `|u1`, `<f4`, `<i4` or `<i8`).
    pub fn open_npy(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let map = map_file(path)?;
        let (offset, dtype, shape) = parse_npy_header(&map).map_err(|p| bad(path, p))?;
        Self::new(path, map, offset, dtype, shape)
    }

    /// Opens the tensor `name` of a safetensors file (`U8`, `F32`, `I32` or `I64`).
    pub fn open_safetensors(path: impl AsRef<Path>, name: &str) -> Result<Self> {
        let path = path.as_ref();
        let map = map_file(path)?;
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| bad(path, format!("not a safetensors file: {e}")))?;
        let tensors = meta.tensors();
        let info = tensors.get(name).ok_or_else(|| {
            let mut names: Vec<&String> = tensors.keys().collect();
            names.sort();
            bad(
                path,
                format!("has no tensor `{name}`; it holds {names:?}; name one of those"),
            )
        })?;
        let dtype = match info.dtype {
            safetensors::Dtype::U8 => ElementType::U8,
            safetensors::Dtype::F32 => ElementType::F32,
            safetensors::Dtype::I32 => ElementType::I32,
            safetensors::Dtype::I64 => ElementType::I64,
            other => {
                return Err(bad(
                    path,
                    format!("tensor `{name}` has dtype {other:?}; Kiln reads U8, F32, I32, I64"),
                ));
            }
        };
        let offset = 8 + header_len + info.data_offsets.0;
        Self::new(path, map, offset, dtype, info.shape.clone())
    }

    fn new(
        path: &Path,
        map: Mmap,
        offset: usize,
        dtype: ElementType,
        shape: Vec<usize>,
    ) -> Result<Self> {
        let count: usize = shape.iter().product();
        let needed = count
            .checked_mul(dtype.size())
            .and_then(|b| b.checked_add(offset));
        match needed {
            Some(n) if n <= map.len() => {}
            _ => {
                return Err(bad(
                    path,
                    format!(
                        "truncated: shape {shape:?} of {dtype:?} needs {} bytes after offset \
                         {offset}, the file has {}; re-export the file",
                        count.saturating_mul(dtype.size()),
                        map.len().saturating_sub(offset)
                    ),
                ));
            }
        }
        Ok(MmapArray {
            path: path.to_path_buf(),
            map,
            offset,
            dtype,
            shape,
            served: AtomicU64::new(0),
            rows: AtomicU64::new(0),
            release_every: DEFAULT_RELEASE_EVERY,
            baseline: 0,
            statm: Statm::open(),
        }
        .with_baseline())
    }

    fn with_baseline(mut self) -> Self {
        self.baseline = self.statm.file_backed_bytes().unwrap_or(0);
        self
    }

    /// Rows between two residency checks: a row can map up to [`MAX_FAULT_BYTES`], so check
    /// often enough that the overshoot stays within a quarter of the bound.
    fn check_every(&self) -> u64 {
        (self.release_every / 4 / MAX_FAULT_BYTES).max(1)
    }

    /// Releases the mapped pages every `bytes` served (the resident-memory bound).
    pub fn with_release_every(mut self, bytes: u64) -> Self {
        self.release_every = bytes.max(1);
        self
    }

    /// The array's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> ElementType {
        self.dtype
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Elements per row (product of all but the first dimension).
    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    fn row_bytes(&self, row: usize) -> &[u8] {
        let size = self.row_len() * self.dtype.size();
        let start = self.offset + row * size;
        &self.map[start..start + size]
    }

    /// Counts a read of `bytes` and drops the mapped pages when the bound is reached (see the
    /// module docs).
    fn account(&self, bytes: usize) {
        let due = if self.statm.available() {
            let row = self.rows.fetch_add(1, Ordering::Relaxed);
            row.is_multiple_of(self.check_every())
                && self
                    .statm
                    .file_backed_bytes()
                    .is_some_and(|r| r > self.baseline + self.release_every)
        } else {
            let before = self.served.fetch_add(bytes as u64, Ordering::Relaxed);
            before / self.release_every != (before + bytes as u64) / self.release_every
        };
        if due {
            // SAFETY: the mapping is shared and read-only, so MADV_DONTNEED only drops clean
            // pages from this process's page tables; the next read faults them back in from
            // the page cache or the file with identical contents. Concurrent readers in other
            // threads at worst take that fault.
            if let Err(e) = unsafe { self.map.unchecked_advise(UncheckedAdvice::DontNeed) } {
                tracing::debug!("madvise(DONTNEED) on {} failed: {e}", self.path.display());
            }
        }
    }

    /// Converts row `row` to f32 into `out` (`u8` values scaled by `u8_scale`).
    pub fn read_row_f32(&self, row: usize, u8_scale: f32, out: &mut [f32]) -> Result<()> {
        if row >= self.shape.first().copied().unwrap_or(0) || out.len() != self.row_len() {
            return Err(KilnError::DataItem {
                index: row,
                problem: format!(
                    "row {row} of {} with {} values requested; the array has shape {:?}",
                    self.path.display(),
                    out.len(),
                    self.shape
                ),
            });
        }
        let bytes = self.row_bytes(row);
        match self.dtype {
            ElementType::U8 => {
                for (o, &b) in out.iter_mut().zip(bytes) {
                    *o = b as f32 * u8_scale;
                }
            }
            ElementType::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            ElementType::I32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
                }
            }
            ElementType::I64 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(c);
                    *o = i64::from_le_bytes(b) as f32;
                }
            }
        }
        self.account(bytes.len());
        Ok(())
    }

    /// Reads element `row` of a 1-D integer array as a class label.
    pub fn read_label(&self, row: usize) -> Result<usize> {
        let n = self.shape.first().copied().unwrap_or(0);
        if row >= n || self.row_len() != 1 {
            return Err(KilnError::DataItem {
                index: row,
                problem: format!(
                    "label {row} of {} (shape {:?}) does not exist",
                    self.path.display(),
                    self.shape
                ),
            });
        }
        let b = self.row_bytes(row);
        let value: i64 = match self.dtype {
            ElementType::U8 => b[0] as i64,
            ElementType::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            ElementType::I64 => {
                let mut a = [0u8; 8];
                a.copy_from_slice(b);
                i64::from_le_bytes(a)
            }
            ElementType::F32 => {
                return Err(KilnError::DataItem {
                    index: row,
                    problem: format!("labels in {} are f32; store them as integers", {
                        self.path.display()
                    }),
                });
            }
        };
        usize::try_from(value).map_err(|_| KilnError::DataItem {
            index: row,
            problem: format!("label {value} is negative"),
        })
    }
}

/// Parses a `.npy` header: (data offset, element type, shape).
fn parse_npy_header(bytes: &[u8]) -> std::result::Result<(usize, ElementType, Vec<usize>), String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not a .npy file (missing the \\x93NUMPY magic); save with numpy.save".into());
    }
    let major = bytes[6];
    let (header_len, start) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(format!("unsupported .npy format version {v}")),
    };
    let header = bytes
        .get(start..start + header_len)
        .ok_or("truncated .npy header")?;
    let header = std::str::from_utf8(header).map_err(|_| "the .npy header is not text")?;
    let field = |key: &str| -> std::result::Result<&str, String> {
        let at = header
            .find(&format!("'{key}'"))
            .ok_or(format!("the .npy header has no '{key}'"))?;
        let rest = &header[at + key.len() + 2..];
        let colon = rest.find(':').ok_or("malformed .npy header")?;
        Ok(rest[colon + 1..].trim_start())
    };
    let descr = field("descr")?;
    let dtype = if descr.starts_with("'|u1'") || descr.starts_with("'<u1'") {
        ElementType::U8
    } else if descr.starts_with("'<f4'") {
        ElementType::F32
    } else if descr.starts_with("'<i4'") {
        ElementType::I32
    } else if descr.starts_with("'<i8'") {
        ElementType::I64
    } else {
        let d: String = descr.chars().take(8).collect();
        return Err(format!(
            "dtype {d} is not supported; use uint8, float32, int32 or int64 (little-endian)"
        ));
    };
    if field("fortran_order")?.starts_with("True") {
        return Err(
            "the array is in Fortran order; save a C-ordered copy (np.ascontiguousarray)".into(),
        );
    }
    let shape_text = field("shape")?;
    // `(3, 2, 2)`: a tuple; anything else (the fuzzer found `)3, 2, 2)`) is malformed.
    let malformed = || "malformed shape in the .npy header (expected a tuple like (3, 28, 28))";
    let inner = shape_text.strip_prefix('(').ok_or_else(malformed)?;
    let close = inner.find(')').ok_or_else(malformed)?;
    let shape = inner[..close]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| format!("bad dimension `{s}`"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((start + header_len, dtype, shape))
}

/// Writes a C-ordered `.npy` (version 1) file: for tests, benchmarks and exporting data.
pub fn write_npy(
    path: impl AsRef<Path>,
    dtype: ElementType,
    shape: &[usize],
    data: &[u8],
) -> Result<()> {
    let descr = match dtype {
        ElementType::U8 => "|u1",
        ElementType::F32 => "<f4",
        ElementType::I32 => "<i4",
        ElementType::I64 => "<i8",
    };
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Pad so the data starts on a 64-byte boundary, as numpy does.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat(total.next_multiple_of(64) - total));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len());
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    crate::fsutil::write_atomic(path.as_ref(), &bytes)
}

/// How raw values become model inputs: `(x · u8_scale − mean) / std`, where `u8_scale` is
/// 1/255 for `u8` images and 1 otherwise.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PixelScaling {
    /// Mean subtracted after scaling.
    pub mean: f32,
    /// Standard deviation divided by.
    pub std: f32,
}

/// A labelled image dataset backed by two mapped arrays: images `[N, H, W]` or `[N, C, H, W]`
/// and integer labels `[N]`.
#[derive(Debug)]
pub struct MappedImages {
    images: MmapArray,
    labels: MmapArray,
    shape: [usize; 3],
    scaling: PixelScaling,
}

impl MappedImages {
    fn new(images: MmapArray, labels: MmapArray) -> Result<Self> {
        let shape = match images.shape() {
            [_, h, w] => [1, *h, *w],
            [_, c, h, w] => [*c, *h, *w],
            other => {
                return Err(bad(
                    images.path(),
                    format!("images must be [N, H, W] or [N, C, H, W], got {other:?}"),
                ));
            }
        };
        let (n_img, n_lab) = (images.shape()[0], labels.shape().first().copied());
        if labels.shape().len() != 1 || n_lab != Some(n_img) {
            return Err(bad(
                labels.path(),
                format!(
                    "labels must be [N] with N = {n_img} images, got {:?}",
                    labels.shape()
                ),
            ));
        }
        if labels.dtype() == ElementType::F32 {
            return Err(bad(
                labels.path(),
                "labels are float32; store class labels as uint8, int32 or int64",
            ));
        }
        Ok(MappedImages {
            images,
            labels,
            shape,
            scaling: PixelScaling {
                mean: 0.0,
                std: 1.0,
            },
        })
    }

    /// Sets the normalization applied on read.
    pub fn with_scaling(mut self, mean: f32, std: f32) -> Self {
        self.scaling = PixelScaling { mean, std };
        self
    }

    /// Sets the resident-memory bound of both mappings (see the module docs).
    pub fn with_release_every(mut self, bytes: u64) -> Self {
        self.images = self.images.with_release_every(bytes);
        self.labels = self.labels.with_release_every(bytes);
        self
    }
}

impl Dataset for MappedImages {
    fn len(&self) -> usize {
        self.images.shape()[0]
    }

    fn item_shape(&self) -> [usize; 3] {
        self.shape
    }

    fn fill(&self, index: usize, out: &mut [f32]) -> Result<usize> {
        let u8_scale = if self.images.dtype() == ElementType::U8 {
            1.0 / 255.0
        } else {
            1.0
        };
        self.images.read_row_f32(index, u8_scale, out)?;
        let PixelScaling { mean, std } = self.scaling;
        if mean != 0.0 || std != 1.0 {
            let inv = 1.0 / std;
            for v in out.iter_mut() {
                *v = (*v - mean) * inv;
            }
        }
        self.labels.read_label(index)
    }
}

/// A dataset of two `.npy` files (images and labels), memory-mapped.
pub type NpyDataset = MappedImages;

/// A dataset of two tensors in one safetensors file, memory-mapped.
pub type SafetensorsDataset = MappedImages;

impl MappedImages {
    /// Maps `images.npy` (`[N,H,W]` or `[N,C,H,W]`, u8 or f32) and `labels.npy` (`[N]`).
    pub fn open_npy(images: impl AsRef<Path>, labels: impl AsRef<Path>) -> Result<Self> {
        Self::new(MmapArray::open_npy(images)?, MmapArray::open_npy(labels)?)
    }

    /// Maps the tensors `images` and `labels` of one safetensors file.
    pub fn open_safetensors(path: impl AsRef<Path>, images: &str, labels: &str) -> Result<Self> {
        let path = path.as_ref();
        Self::new(
            MmapArray::open_safetensors(path, images)?,
            MmapArray::open_safetensors(path, labels)?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_header_round_trip_and_errors() {
        let dir = std::env::temp_dir().join(format!("kiln-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tempdir");
        let p = dir.join("a.npy");
        let data: Vec<u8> = (0..24).collect();
        write_npy(&p, ElementType::U8, &[2, 3, 4], &data).expect("write");
        let a = MmapArray::open_npy(&p).expect("open");
        assert_eq!(a.shape(), &[2, 3, 4]);
        let mut row = vec![0f32; 12];
        a.read_row_f32(1, 1.0, &mut row).expect("row");
        assert_eq!(row[0], 12.0);
        assert_eq!(row[11], 23.0);
        assert!(a.read_row_f32(2, 1.0, &mut row).is_err());
        // Truncated file: the header promises more than the file holds.
        let bytes = std::fs::read(&p).expect("read");
        std::fs::write(&p, &bytes[..bytes.len() - 5]).expect("truncate");
        let err = MmapArray::open_npy(&p).expect_err("truncated").to_string();
        assert!(err.contains("truncated"), "{err}");
        std::fs::write(&p, b"not numpy at all").expect("write");
        let err = MmapArray::open_npy(&p).expect_err("garbage").to_string();
        assert!(err.contains("not a .npy file"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
