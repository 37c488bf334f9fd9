//! The IDX file format (MNIST's): a big-endian header, then a dense array of unsigned bytes.
//! Files may be gzip-compressed (detected by magic bytes, not by name).

use std::io::Read;
use std::path::Path;

use crate::error::{KilnError, Result};

/// A decoded IDX array of unsigned bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct IdxArray {
    /// Dimensions from the header.
    pub dims: Vec<usize>,
    /// The data, row-major.
    pub data: Vec<u8>,
}

/// Reads an IDX file from disk (plain or gzip'd).
pub fn read(path: &Path) -> Result<IdxArray> {
    let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
    parse(&bytes, path)
}

/// Decodes IDX bytes; `path` is used in error messages.
pub fn parse(bytes: &[u8], path: &Path) -> Result<IdxArray> {
    let bad = |problem: String| KilnError::BadData {
        path: path.to_path_buf(),
        problem,
    };
    let raw;
    let bytes = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_end(&mut out)
            .map_err(|e| {
                bad(format!(
                    "gzip stream is corrupt or truncated ({e}); download the file again"
                ))
            })?;
        raw = out;
        &raw[..]
    } else {
        bytes
    };
    if bytes.len() < 4 {
        return Err(bad(format!(
            "{} bytes is too short for an IDX header; the file is truncated",
            bytes.len()
        )));
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        return Err(bad(
            "not an IDX file: the first two bytes must be zero (is this an MNIST-format file?)"
                .into(),
        ));
    }
    if bytes[2] != 0x08 {
        return Err(bad(format!(
            "IDX element type 0x{:02x} is not supported; only unsigned bytes (0x08) are",
            bytes[2]
        )));
    }
    let ndims = bytes[3] as usize;
    if ndims == 0 {
        return Err(bad("IDX header declares zero dimensions".into()));
    }
    let header_len = 4 + 4 * ndims;
    if bytes.len() < header_len {
        return Err(bad(format!(
            "header declares {ndims} dimensions but the file ends after {} bytes; it is truncated",
            bytes.len()
        )));
    }
    let dims: Vec<usize> = bytes[4..header_len]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
    let body = &bytes[header_len..];
    if body.len() != expected {
        let what = if body.len() < expected {
            "truncated"
        } else {
            "longer than its header says"
        };
        return Err(bad(format!(
            "header says {dims:?} = {expected} bytes of data but the file holds {}; it is {what}",
            body.len()
        )));
    }
    Ok(IdxArray {
        dims,
        data: body.to_vec(),
    })
}

/// Encodes an unsigned-byte IDX array (uncompressed); used by tests and converters.
pub fn encode(dims: &[usize], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, 0x08, dims.len() as u8];
    for &d in dims {
        out.extend_from_slice(&(d as u32).to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}
