//! `root/<class>/**/*.{jpg,jpeg,png,webp}` as torchvision's `ImageFolder` reads it: classes
//! are the sorted names of `root`'s subdirectories, each class's files are walked with
//! symbolic links followed, directories in sorted order, files sorted within each.

use std::path::{Path, PathBuf};

use super::files::{Entry, ImageFiles, Location, Order};
use crate::error::{KilnError, Result};

/// The extensions an image folder's files are taken by (case-insensitive).
pub const IMAGE_EXTENSIONS: &[&str] = &["jpg", "jpeg", "png", "webp"];

/// Extensions torchvision also takes that Kiln does not decode: counted, reported once.
const OTHER_IMAGE_EXTENSIONS: &[&str] = &["bmp", "ppm", "pgm", "tif", "tiff", "gif"];

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> KilnError + '_ {
    move |source| KilnError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn extension(path: &Path) -> Option<String> {
    path.extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase())
}

/// Every file under `dir` as torchvision's `sorted(os.walk(dir, followlinks=True))` lists
/// them: directories by path, files sorted within each.
fn walk(dir: &Path, out: &mut Vec<(String, Vec<PathBuf>)>, depth: usize) -> Result<()> {
    if depth > 64 {
        return Err(KilnError::BadData {
            path: dir.to_path_buf(),
            problem: "directories nested over 64 deep (a symbolic link loop?)".into(),
        });
    }
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    for item in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let item = item.map_err(io_error(dir))?;
        let path = item.path();
        // `metadata` follows symbolic links, as `followlinks=True`.
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => dirs.push(path),
            Ok(_) => files.push(path),
            // A dangling link or an unreadable entry: listed, so reading it reports why.
            Err(_) => files.push(path),
        }
    }
    files.sort();
    out.push((dir.display().to_string(), files));
    dirs.sort();
    for d in dirs {
        walk(&d, out, depth + 1)?;
    }
    Ok(())
}

impl ImageFiles {
    /// The image folder at `root` (see the module docs). Errors: `root` missing or not a
    /// directory, no class directories, a class with no image file.
    pub fn folder(root: impl AsRef<Path>) -> Result<ImageFiles> {
        let root = root.as_ref();
        let mut classes: Vec<String> = Vec::new();
        for item in std::fs::read_dir(root).map_err(io_error(root))? {
            let item = item.map_err(io_error(root))?;
            if std::fs::metadata(item.path()).is_ok_and(|m| m.is_dir()) {
                classes.push(item.file_name().to_string_lossy().into_owned());
            }
        }
        classes.sort();
        if classes.is_empty() {
            return Err(KilnError::BadData {
                path: root.to_path_buf(),
                problem: "no class directories: an image folder is root/<class>/<image>.jpg \
                          (one subdirectory per class)"
                    .into(),
            });
        }
        let mut entries = Vec::new();
        let mut other = 0usize;
        for (label, class) in classes.iter().enumerate() {
            let mut listing = Vec::new();
            walk(&root.join(class), &mut listing, 0)?;
            listing.sort_by(|a, b| a.0.cmp(&b.0));
            let before = entries.len();
            for path in listing.into_iter().flat_map(|(_, files)| files) {
                match extension(&path) {
                    Some(e) if IMAGE_EXTENSIONS.contains(&e.as_str()) => entries.push(Entry {
                        location: Location::File(path),
                        label,
                        annotation: None,
                    }),
                    Some(e) if OTHER_IMAGE_EXTENSIONS.contains(&e.as_str()) => other += 1,
                    _ => {}
                }
            }
            if entries.len() == before {
                return Err(KilnError::BadData {
                    path: root.join(class),
                    problem: format!(
                        "class `{class}` has no image file ({})",
                        IMAGE_EXTENSIONS.join(", ")
                    ),
                });
            }
        }
        if other > 0 {
            tracing::warn!(
                "{}: {other} files with extensions Kiln does not decode ({}) were left out; \
                 convert them to JPEG, PNG or WebP",
                root.display(),
                OTHER_IMAGE_EXTENSIONS.join(", ")
            );
        }
        ImageFiles::from_parts(
            root.display().to_string(),
            classes,
            entries,
            Vec::new(),
            Order::Permuted,
        )
    }
}
