//! WebDataset shards: uncompressed tar files whose members are grouped into samples by key
//! (the member's path up to the first dot of its file name: `n0153/img_001.jpg` and
//! `n0153/img_001.cls` are one sample). A sample has one image member (`jpg`, `jpeg`,
//! `png`, `webp`) and a label member (`cls`: the class index as text).
//!
//! Opening a shard reads its headers only (one seek per member); samples are then read by
//! offset, and an epoch goes shard by shard through a shuffle buffer, so reads stay
//! sequential within a shard (see [`super::files::stream_order`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use super::files::{Entry, ImageFiles, Location, Order};
use super::folder::IMAGE_EXTENSIONS;
use crate::error::{KilnError, Result};

/// Samples in the shuffle buffer of a sharded epoch (WebDataset's common `shuffle(1000)`).
pub const DEFAULT_SHUFFLE_BUFFER: usize = 1000;

/// Expands a shard pattern's brace groups: `{000..099}` (zero-padded numeric range,
/// inclusive) and `{a,b,c}` (alternatives), as WebDataset's `braceexpand`.
pub fn expand_braces(pattern: &str) -> Result<Vec<String>> {
    let bad = |problem: String| KilnError::BadData {
        path: PathBuf::from(pattern),
        problem,
    };
    let Some(open) = pattern.find('{') else {
        return Ok(vec![pattern.to_string()]);
    };
    let close = pattern[open..]
        .find('}')
        .map(|c| open + c)
        .ok_or_else(|| bad("a `{` without its `}`".into()))?;
    let (head, body, tail) = (
        &pattern[..open],
        &pattern[open + 1..close],
        &pattern[close + 1..],
    );
    let parts: Vec<String> = if let Some((lo, hi)) = body.split_once("..") {
        let width = lo.len();
        let parse = |s: &str| {
            s.parse::<u64>()
                .map_err(|_| bad(format!("`{{{body}}}`: `{s}` is not a number")))
        };
        let (a, b) = (parse(lo)?, parse(hi)?);
        if b < a || b - a > 1_000_000 {
            return Err(bad(format!("`{{{body}}}`: an empty or huge range")));
        }
        (a..=b).map(|i| format!("{i:0width$}")).collect()
    } else {
        body.split(',').map(str::to_string).collect()
    };
    let mut out = Vec::new();
    for rest in expand_braces(tail)? {
        for p in &parts {
            out.push(format!("{head}{p}{rest}"));
        }
    }
    out.sort();
    Ok(out)
}

/// The key and extension of a member name (`dir/img_1.seg.png` → `dir/img_1`, `seg.png`).
fn split_key(name: &str) -> Option<(&str, &str)> {
    let file_start = name.rfind('/').map_or(0, |i| i + 1);
    let dot = name[file_start..].find('.')? + file_start;
    Some((&name[..dot], &name[dot + 1..]))
}

#[derive(Default)]
struct Sample {
    image: Option<(u64, u64, String)>,
    label: Option<usize>,
}

/// Indexes one shard: every sample's image member and label, in archive order.
fn index_shard(path: &Path, shard: usize) -> Result<(File, Vec<Entry>)> {
    let bad = |problem: String| KilnError::BadData {
        path: path.to_path_buf(),
        problem,
    };
    let file = File::open(path).map_err(|source| KilnError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut magic = [0u8; 2];
    if (&file).read_exact(&mut magic).is_ok() && magic == [0x1f, 0x8b] {
        return Err(bad(
            "a gzip-compressed shard cannot be read by offset; store shards as plain .tar \
             (gunzip them)"
                .into(),
        ));
    }
    let file_len = file
        .metadata()
        .map_err(|source| KilnError::Io {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    let mut archive = tar::Archive::new(File::open(path).map_err(|source| KilnError::Io {
        path: path.to_path_buf(),
        source,
    })?);
    let mut keys: Vec<String> = Vec::new();
    let mut samples: BTreeMap<String, Sample> = BTreeMap::new();
    let entries = archive
        .entries()
        .map_err(|e| bad(format!("not a tar archive: {e}")))?;
    for member in entries {
        let mut member = member.map_err(|e| bad(format!("damaged tar header: {e}")))?;
        if !member.header().entry_type().is_file() {
            continue;
        }
        let name = member
            .path()
            .map_err(|e| bad(format!("a member name: {e}")))?
            .to_string_lossy()
            .into_owned();
        let Some((key, ext)) = split_key(&name) else {
            continue;
        };
        let key = key.to_string();
        let ext = ext.to_ascii_lowercase();
        if !samples.contains_key(&key) {
            keys.push(key.clone());
        }
        let sample = samples.entry(key).or_default();
        if IMAGE_EXTENSIONS.contains(&ext.as_str()) {
            let (offset, len) = (member.raw_file_position(), member.size());
            // Samples are read by offset later: a size the header merely claims must lie
            // inside the file, or a read would allocate it.
            if offset.saturating_add(len) > file_len {
                return Err(bad(format!(
                    "member {name} claims {len} bytes at offset {offset}, past the shard's \
                     end ({file_len} bytes): the shard is truncated or damaged"
                )));
            }
            sample.image = Some((offset, len, name));
        } else if ext == "cls" {
            let mut text = String::new();
            member
                .read_to_string(&mut text)
                .map_err(|e| bad(format!("{name}: {e}")))?;
            let label = text.trim().parse::<usize>().map_err(|_| {
                bad(format!(
                    "{name}: a .cls member holds a class index, found `{}`",
                    text.trim()
                ))
            })?;
            sample.label = Some(label);
        }
    }
    let mut entries = Vec::with_capacity(keys.len());
    for key in keys {
        let s = &samples[&key];
        match (&s.image, s.label) {
            (Some((offset, len, name)), Some(label)) => entries.push(Entry {
                location: Location::Member {
                    shard,
                    offset: *offset,
                    len: *len,
                    name: name.clone(),
                },
                label,
                annotation: None,
            }),
            (Some(_), None) => {
                return Err(bad(format!(
                    "sample `{key}` has an image but no `{key}.cls` label member"
                )));
            }
            // Members of other kinds (captions, metadata) without an image: not a sample.
            (None, _) => {}
        }
    }
    Ok((file, entries))
}

impl ImageFiles {
    /// The samples of the shards `pattern` names (braces expanded: `train-{000..099}.tar`),
    /// read shard by shard through a shuffle buffer of `shuffle_buffer` samples each epoch.
    pub fn shards(pattern: &str, shuffle_buffer: usize) -> Result<ImageFiles> {
        let paths = expand_braces(pattern)?;
        let mut files = Vec::with_capacity(paths.len());
        let mut entries = Vec::new();
        let mut ranges = Vec::with_capacity(paths.len());
        for (shard, p) in paths.iter().enumerate() {
            let path = PathBuf::from(p);
            let (file, mut found) = index_shard(&path, shard)?;
            let start = entries.len();
            entries.append(&mut found);
            ranges.push(start..entries.len());
            files.push((path, file));
        }
        let classes = entries.iter().map(|e| e.label).max().map_or(0, |m| m + 1);
        ImageFiles::from_parts(
            pattern.to_string(),
            (0..classes).map(|c| c.to_string()).collect(),
            entries,
            files,
            Order::Stream {
                shards: ranges,
                buffer: shuffle_buffer,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn braces_expand_like_webdataset() {
        assert_eq!(
            expand_braces("s-{08..11}.tar").unwrap(),
            vec!["s-08.tar", "s-09.tar", "s-10.tar", "s-11.tar"]
        );
        assert_eq!(
            expand_braces("{a,b}/x-{0..1}.tar").unwrap(),
            vec!["a/x-0.tar", "a/x-1.tar", "b/x-0.tar", "b/x-1.tar"]
        );
        assert_eq!(expand_braces("plain.tar").unwrap(), vec!["plain.tar"]);
        assert!(expand_braces("bad-{1..").is_err());
        assert!(expand_braces("bad-{9..1}").is_err());
    }

    #[test]
    fn keys_split_at_the_first_dot_of_the_file_name() {
        assert_eq!(
            split_key("a.b/img_1.seg.png"),
            Some(("a.b/img_1", "seg.png"))
        );
        assert_eq!(split_key("x.jpg"), Some(("x", "jpg")));
        assert_eq!(split_key("noext"), None);
    }
}
