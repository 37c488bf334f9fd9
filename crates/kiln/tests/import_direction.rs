//! The dependency direction of the workspace's crates, held by a test: DESIGN.md states the
//! rules once (its `imports` block: each crate's top-level modules in layers, lowest first,
//! and the imports that are never allowed), and this test reads every source file of
//! `kiln-kernels`, `kiln` and `kiln-serve` and fails on an import against them — so a new
//! `use` that points up, or a module left out of the map, is caught in CI, not in review.
//!
//! What counts as an import: every path through `crate::` (and `$crate::` in macros) or
//! through `super::` that leaves a top-level module, in code and in tests alike (comments are
//! skipped). A name under `crate::` that is not a module (a root re-export) is not an edge.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One crate's rules: its modules' layers and the forbidden edges.
#[derive(Default, Debug)]
struct Rules {
    /// Module name → its layer (0 = lowest).
    layer: BTreeMap<String, usize>,
    /// `(from, to)` pairs never allowed, even where the layers would allow them.
    forbidden: BTreeSet<(String, String)>,
}

/// Parses DESIGN.md's fenced block whose info string is `imports`:
///
/// ```text
/// crate kiln
/// layer error names classifier
/// layer fsutil
/// forbid infer -> nn
/// ```
fn rules(design: &str) -> BTreeMap<String, Rules> {
    let start = design
        .find("```imports")
        .expect("DESIGN.md has an `imports` block");
    let body = &design[start + "```imports".len()..];
    let body = &body[..body.find("```").expect("the imports block is closed")];
    let mut all: BTreeMap<String, Rules> = BTreeMap::new();
    let mut current = String::new();
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        match word {
            "crate" => current = rest.trim().to_string(),
            "layer" => {
                let rules = all.entry(current.clone()).or_default();
                let next = rules.layer.values().max().map_or(0, |l| l + 1);
                for module in rest.split_whitespace() {
                    let old = rules.layer.insert(module.to_string(), next);
                    assert!(old.is_none(), "{module} is in two layers of {current}");
                }
            }
            "forbid" => {
                let (from, to) = rest.split_once("->").expect("forbid a -> b");
                all.entry(current.clone())
                    .or_default()
                    .forbidden
                    .insert((from.trim().to_string(), to.trim().to_string()));
            }
            "#" => {}
            other => panic!("unknown word `{other}` in DESIGN.md's imports block"),
        }
    }
    all
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source directory") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a source file (`implicit/avx2.rs` → `[implicit, avx2]`, `conv/mod.rs`
/// → `[conv]`, `lib.rs` → `[]`).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("file under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// The identifiers after each occurrence of `prefix` in `line`, with what precedes each.
fn paths_after<'a>(line: &'a str, prefix: &str) -> Vec<(&'a str, &'a str)> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = line[at..].find(prefix) {
        let start = at + i;
        let rest = &line[start + prefix.len()..];
        out.push((&line[..start], rest));
        at = start + prefix.len();
    }
    out
}

/// The leading identifier of `text`.
fn ident(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The top-level modules each file of the crate at `src` imports: `(file, from, to)`.
fn edges(src: &Path, modules: &BTreeSet<String>) -> Vec<(PathBuf, String, String)> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut out = Vec::new();
    for file in files {
        let path = module_path(src, &file);
        let Some(from) = path.first().cloned() else {
            continue; // lib.rs declares the modules; it is above them all.
        };
        let text = std::fs::read_to_string(&file).expect("readable source");
        for line in text.lines() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            let code = code.split(" //").next().unwrap_or(code);
            let mut targets = Vec::new();
            for (_, rest) in paths_after(code, "crate::") {
                targets.push(ident(rest).to_string());
            }
            // `super::` chains: resolved against the file's own module path.
            for (before, rest) in paths_after(code, "super::") {
                if before.ends_with("super::") {
                    continue; // counted from the chain's first `super::`
                }
                let mut depth = path.len().saturating_sub(1);
                let mut rest = rest;
                while let Some(r) = rest.strip_prefix("super::") {
                    depth = depth.saturating_sub(1);
                    rest = r;
                }
                if depth == 0 {
                    targets.push(ident(rest).to_string());
                }
            }
            for to in targets {
                if to != from && modules.contains(&to) {
                    out.push((file.clone(), from.clone(), to));
                }
            }
        }
    }
    out
}

/// The top-level modules of the crate at `src` (its `lib.rs`'s `mod` lines).
fn declared_modules(src: &Path) -> BTreeSet<String> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    lib.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")
                .map(|m| m.trim_end_matches(';').trim().to_string())
        })
        .collect()
}

#[test]
fn every_import_follows_the_direction_design_md_states() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let design = std::fs::read_to_string(root.join("DESIGN.md")).expect("DESIGN.md");
    let all = rules(&design);
    let mut problems = Vec::new();
    for krate in ["kiln-kernels", "kiln", "kiln-serve"] {
        let rules = all
            .get(krate)
            .unwrap_or_else(|| panic!("DESIGN.md's imports block has no `crate {krate}`"));
        let src = root.join("crates").join(krate).join("src");
        let modules = declared_modules(&src);
        for m in &modules {
            if !rules.layer.contains_key(m) {
                problems.push(format!("{krate}: module `{m}` is in no layer of DESIGN.md"));
            }
        }
        for m in rules.layer.keys() {
            if !modules.contains(m) {
                problems.push(format!(
                    "{krate}: DESIGN.md names `{m}`, which lib.rs lacks"
                ));
            }
        }
        let mut seen = BTreeSet::new();
        for (file, from, to) in edges(&src, &modules) {
            let (Some(lf), Some(lt)) = (rules.layer.get(&from), rules.layer.get(&to)) else {
                continue;
            };
            let why = if rules.forbidden.contains(&(from.clone(), to.clone())) {
                "a forbidden import"
            } else if lt >= lf {
                "an import that is not downward"
            } else {
                continue;
            };
            let rel = file
                .strip_prefix(&root)
                .unwrap_or(&file)
                .display()
                .to_string();
            if seen.insert((rel.clone(), to.clone())) {
                problems.push(format!("{krate}: {rel}: `{from}` imports `{to}`: {why}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "imports against DESIGN.md's dependency direction:\n{}",
        problems.join("\n")
    );
}

/// The checker itself finds an upward import and a forbidden one, and resolves `super::`.
#[test]
fn the_checker_catches_upward_and_forbidden_imports() {
    let dir = std::env::temp_dir().join(format!("kiln-imports-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("low")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod low;\npub mod high;\n").unwrap();
    std::fs::write(src.join("low/mod.rs"), "mod inner;\n").unwrap();
    std::fs::write(src.join("low/inner.rs"), "use super::super::high::X;\n").unwrap();
    std::fs::write(
        src.join("high.rs"),
        "use crate::low::Y; // fine\n// crate::nothing\n",
    )
    .unwrap();
    let modules = declared_modules(&src);
    let found: BTreeSet<(String, String)> = edges(&src, &modules)
        .into_iter()
        .map(|(_, f, t)| (f, t))
        .collect();
    let want: BTreeSet<(String, String)> = [("low", "high"), ("high", "low")]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(found, want);
    let rules = rules("```imports\ncrate x\nlayer low\nlayer high\nforbid high -> low\n```");
    let x = &rules["x"];
    assert!(x.layer["low"] < x.layer["high"]);
    assert!(x.forbidden.contains(&("high".into(), "low".into())));
    std::fs::remove_dir_all(&dir).unwrap();
}
