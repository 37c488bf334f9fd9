//! A manifest: one sample a line, CSV (`path,label[,box][,mask]`, a header line naming the
//! columns optional) or JSON lines (`{"path": …, "label": …, "box": [x0,y0,x1,y1],
//! "mask": …}`). Paths are relative to the manifest's directory unless absolute; labels are
//! class indices, or class names (then sorted into indices, as an image folder's).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::files::{Annotation, Entry, ImageFiles, Location, Order, resolve};
use crate::error::{KilnError, Result};

/// One manifest row before labels are resolved.
#[derive(Debug, Deserialize)]
struct Row {
    path: String,
    label: serde_json::Value,
    #[serde(default, rename = "box")]
    bbox: Option<[f32; 4]>,
    #[serde(default)]
    mask: Option<String>,
}

fn bad(path: &Path, line: usize, problem: impl std::fmt::Display) -> KilnError {
    KilnError::BadData {
        path: path.to_path_buf(),
        problem: format!("line {line}: {problem}"),
    }
}

/// Splits a CSV line into fields (double quotes group, `""` is a quote).
fn csv_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                chars.next();
                if let Some(f) = fields.last_mut() {
                    f.push('"');
                }
            }
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(String::new()),
            c => {
                if let Some(f) = fields.last_mut() {
                    f.push(c);
                }
            }
        }
    }
    fields.into_iter().map(|f| f.trim().to_string()).collect()
}

fn csv_rows(path: &Path, text: &str) -> Result<Vec<(usize, Row)>> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
    let Some((first_no, first)) = lines.next() else {
        return Ok(Vec::new());
    };
    let first_fields = csv_fields(first);
    let (columns, data_first) = if first_fields.iter().any(|f| f.eq_ignore_ascii_case("path")) {
        (
            first_fields
                .iter()
                .map(|f| f.to_ascii_lowercase())
                .collect(),
            None,
        )
    } else {
        (
            vec![
                "path".to_string(),
                "label".into(),
                "box".into(),
                "mask".into(),
            ],
            Some((first_no, first)),
        )
    };
    let col = |name: &str| columns.iter().position(|c| c == name);
    let (Some(pc), Some(lc)) = (col("path"), col("label")) else {
        return Err(bad(
            path,
            first_no + 1,
            "the header needs `path` and `label` columns",
        ));
    };
    let (bc, mc) = (col("box"), col("mask"));
    let mut rows = Vec::new();
    for (no, line) in data_first.into_iter().chain(lines) {
        let f = csv_fields(line);
        let get = |i: Option<usize>| i.and_then(|i| f.get(i)).filter(|s| !s.is_empty());
        let (Some(p), Some(l)) = (get(Some(pc)), get(Some(lc))) else {
            return Err(bad(path, no + 1, "needs a path and a label"));
        };
        let bbox = match get(bc) {
            None => None,
            Some(b) => {
                let v: Vec<f32> = b
                    .split([' ', ';'])
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse::<f32>())
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|e| bad(path, no + 1, format!("box `{b}`: {e}")))?;
                let arr: [f32; 4] = v.try_into().map_err(|_| {
                    bad(
                        path,
                        no + 1,
                        format!("box `{b}` needs four numbers x0 y0 x1 y1"),
                    )
                })?;
                Some(arr)
            }
        };
        let label = match l.parse::<u64>() {
            Ok(n) => serde_json::Value::from(n),
            Err(_) => serde_json::Value::from(l.as_str()),
        };
        rows.push((
            no,
            Row {
                path: p.clone(),
                label,
                bbox,
                mask: get(mc).cloned(),
            },
        ));
    }
    Ok(rows)
}

fn json_rows(path: &Path, text: &str) -> Result<Vec<(usize, Row)>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(no, l)| {
            serde_json::from_str::<Row>(l)
                .map(|r| (no, r))
                .map_err(|e| bad(path, no + 1, e))
        })
        .collect()
}

impl ImageFiles {
    /// The samples a manifest lists (see the module docs): `.jsonl` / `.json` files are JSON
    /// lines, anything else CSV.
    pub fn manifest(path: impl AsRef<Path>) -> Result<ImageFiles> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| KilnError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let json = matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("jsonl" | "json" | "ndjson")
        );
        let rows = if json {
            json_rows(path, &text)?
        } else {
            csv_rows(path, &text)?
        };
        let base = path.parent().unwrap_or(Path::new("."));
        // Labels: all integers, or class names sorted into indices.
        let numeric = rows.iter().all(|(_, r)| r.label.is_u64());
        let names: Vec<String> = if numeric {
            let max = rows
                .iter()
                .filter_map(|(_, r)| r.label.as_u64())
                .max()
                .unwrap_or(0);
            (0..=max).map(|i| i.to_string()).collect()
        } else {
            let mut set = BTreeSet::new();
            for (no, r) in &rows {
                match &r.label {
                    serde_json::Value::String(s) => set.insert(s.clone()),
                    serde_json::Value::Number(n) => set.insert(n.to_string()),
                    other => {
                        return Err(bad(path, no + 1, format!("label {other} is not a class")));
                    }
                };
            }
            set.into_iter().collect()
        };
        let mut entries = Vec::with_capacity(rows.len());
        for (no, r) in rows {
            let label = match (&r.label, numeric) {
                (v, true) => v.as_u64().unwrap_or(0) as usize,
                (serde_json::Value::String(s), false) => names.binary_search(s).unwrap_or(0),
                (v, false) => names.binary_search(&v.to_string()).unwrap_or(0),
            };
            if r.path.is_empty() {
                return Err(bad(path, no + 1, "empty path"));
            }
            let annotation = (r.bbox.is_some() || r.mask.is_some()).then(|| Annotation {
                bbox: r.bbox,
                mask: r.mask.as_deref().map(|m| resolve(base, m)),
            });
            entries.push(Entry {
                location: Location::File(resolve(base, &r.path)),
                label,
                annotation,
            });
        }
        ImageFiles::from_parts(
            path.display().to_string(),
            names,
            entries,
            Vec::<(PathBuf, std::fs::File)>::new(),
            Order::Permuted,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_fields_handle_quotes() {
        assert_eq!(csv_fields("a,b , c"), vec!["a", "b", "c"]);
        assert_eq!(
            csv_fields(r#""x, y.jpg",3,"1 2 3 4""#),
            vec!["x, y.jpg", "3", "1 2 3 4"]
        );
        assert_eq!(csv_fields(r#""say ""hi""",1"#), vec![r#"say "hi""#, "1"]);
    }
}
