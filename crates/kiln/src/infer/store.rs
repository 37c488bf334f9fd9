//! Optimized graphs on disk: `KILNGRF1`, the graph as CBOR, then the SHA-256 of everything
//! before it. Written atomically; verified on load, so a truncated or corrupt file is an
//! error that says so, never a wrong model.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::graph::Graph;
use crate::error::{KilnError, Result};

const MAGIC: &[u8; 8] = b"KILNGRF1";
const DIGEST_LEN: usize = 32;

/// Serializes a graph (any passes applied, int8 included).
pub fn graph_to_bytes(graph: &Graph) -> Result<Vec<u8>> {
    let mut out = MAGIC.to_vec();
    ciborium::into_writer(graph, &mut out)
        .map_err(|e| KilnError::Inference(format!("encoding the graph: {e}")))?;
    let digest = Sha256::digest(&out);
    out.extend_from_slice(&digest);
    Ok(out)
}

/// Writes a graph to `path` atomically (temp file + fsync + rename); returns its size.
pub fn save_graph(graph: &Graph, path: &Path) -> Result<u64> {
    let bytes = graph_to_bytes(graph)?;
    crate::fsutil::write_atomic(path, &bytes)?;
    Ok(bytes.len() as u64)
}

/// Reads and verifies a graph written by [`save_graph`].
pub fn load_graph(path: &Path) -> Result<Graph> {
    let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
    let bad = |problem: String| KilnError::BadData {
        path: path.to_path_buf(),
        problem,
    };
    if bytes.len() < MAGIC.len() + DIGEST_LEN || &bytes[..MAGIC.len()] != MAGIC {
        return Err(bad(
            "not a Kiln graph (wrong magic bytes); pass a model.kgraph written by `kiln optimize`"
                .into(),
        ));
    }
    let (body, digest) = bytes.split_at(bytes.len() - DIGEST_LEN);
    if Sha256::digest(body).as_slice() != digest {
        return Err(bad(
            "checksum mismatch: the file is truncated or corrupt; run `kiln optimize` again".into(),
        ));
    }
    ciborium::from_reader(&body[MAGIC.len()..]).map_err(|e| bad(format!("unreadable graph: {e}")))
}
