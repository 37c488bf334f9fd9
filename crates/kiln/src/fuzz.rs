//! Seeded mutation fuzzing for the parsers of outside input (Kiln's own tests and kiln-serve's
//! use it; so can a user's).
//!
//! Why not a coverage-guided fuzzer: CI runs on stable Rust in bounded time. Each target here
//! starts from a real, valid input, applies a few seeded edits per case (bit flips, boundary
//! bytes, huge or zero 8-byte length fields, truncation, duplicated and inserted runs) and
//! requires a clear error or a valid result, never a panic. Formats with a trailing SHA-256
//! (checkpoints, graphs) re-seal half the cases so the parser behind the checksum is reached.
//!
//! Cases per target: `KILN_FUZZ_CASES` (default [`DEFAULT_CASES`]), seed `KILN_FUZZ_SEED`. A
//! panicking input is saved to the temp directory and named in the failure; kept in a
//! regressions directory (files named `<target>-...`), it is replayed first on every run.

use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};

/// Cases per target when `KILN_FUZZ_CASES` is not set: a few seconds for all targets in CI.
pub const DEFAULT_CASES: usize = 150;

/// Cases per target: `KILN_FUZZ_CASES`, else [`DEFAULT_CASES`].
pub fn cases() -> usize {
    std::env::var("KILN_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// The case generator of `target`: `KILN_FUZZ_SEED` (or a fixed seed) salted by the target's
/// name, so adding a target does not change the others' cases.
pub fn rng(target: &str) -> StdRng {
    let seed: u64 = std::env::var("KILN_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x6b69_6c6e);
    let salt = target
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
    StdRng::seed_from_u64(seed ^ salt)
}

/// Bytes that sit on the boundaries parsers get wrong.
const BYTES: [u8; 6] = [0x00, 0xff, 0x7f, 0x80, 0x01, b'9'];
/// Length fields that overflow, allocate without bound, or are empty.
const WORDS: [u64; 6] = [
    0,
    1,
    u64::MAX,
    1 << 40,
    u32::MAX as u64,
    0x7fff_ffff_ffff_ffff,
];

/// One to four random edits of `seed`.
pub fn mutate(seed: &[u8], rng: &mut StdRng) -> Vec<u8> {
    let mut out = seed.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        let at = rng.random_range(0..out.len().max(1));
        match rng.random_range(0..7) {
            0 if !out.is_empty() => out[at] ^= 1 << rng.random_range(0..8),
            1 if !out.is_empty() => out[at] = BYTES[rng.random_range(0..BYTES.len())],
            2 if out.len() >= 8 => {
                let at = rng.random_range(0..=out.len() - 8);
                let word = WORDS[rng.random_range(0..WORDS.len())];
                out[at..at + 8].copy_from_slice(&word.to_le_bytes());
            }
            3 => out.truncate(at),
            4 if !out.is_empty() => {
                let end = (at + rng.random_range(1..64)).min(out.len());
                let run = out[at..end].to_vec();
                let to = rng.random_range(0..=out.len());
                out.splice(to..to, run);
            }
            5 => {
                let run: Vec<u8> = (0..rng.random_range(1..16)).map(|_| rng.random()).collect();
                let to = at.min(out.len());
                out.splice(to..to, run);
            }
            _ => {
                let to = rng.random_range(0..=out.len());
                out.insert(to, BYTES[rng.random_range(0..BYTES.len())]);
            }
        }
    }
    out
}

/// Replaces a trailing SHA-256 by the digest of what precedes it.
pub fn reseal(mut bytes: Vec<u8>) -> Vec<u8> {
    if bytes.len() < 32 {
        return bytes;
    }
    let body = bytes.len() - 32;
    let digest = Sha256::digest(&bytes[..body]);
    bytes[body..].copy_from_slice(&digest);
    bytes
}

/// The inputs kept in `dir` for `target` (files named `<target>-...`), in name order.
pub fn regressions(dir: &Path, target: &str) -> Vec<Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let prefix = format!("{target}-");
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .collect();
    files.sort();
    files.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

/// One fuzz target.
#[derive(Debug, Clone)]
pub struct Target<'a> {
    /// Name: salts the seed, prefixes regression files and saved crashers.
    pub name: &'a str,
    /// The valid input the cases mutate.
    pub seed: &'a [u8],
    /// Whether the format ends in a SHA-256 of the rest (half the cases are re-sealed).
    pub sealed: bool,
    /// Mutated cases to run after the regressions.
    pub cases: usize,
    /// Directory of kept crashers to replay first.
    pub regressions: Option<&'a Path>,
}

/// How long one input may take before the run counts it as a hang.
pub const HANG_SECONDS: u64 = 30;

/// Aborts the process, naming the input, when no case finishes for [`HANG_SECONDS`]: a parser
/// that loops on some input must fail the run, not stall CI. Dropping it stops the watch.
struct Watchdog {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    finished: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Watchdog {
    fn start(target: String, current: PathBuf) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let finished = std::sync::Arc::new(AtomicUsize::new(0));
        let (d, f) = (done.clone(), finished.clone());
        std::thread::spawn(move || {
            let (mut seen, mut since) = (0, std::time::Instant::now());
            while !d.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let now = f.load(Ordering::Relaxed);
                if now != seen {
                    (seen, since) = (now, std::time::Instant::now());
                } else if since.elapsed().as_secs() >= HANG_SECONDS {
                    eprintln!(
                        "{target}: input {now} ran {HANG_SECONDS} s without finishing (a hang); \
                         it is saved at {} — keep it in the regressions directory once fixed",
                        current.display()
                    );
                    std::process::abort();
                }
            }
        });
        Watchdog { done, finished }
    }

    fn finished_one(&self) {
        self.finished
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Runs `parse` on the target's regression files and its mutated cases. A panic fails with
/// the input saved under the temp directory and its path in the message; a hang (no input
/// done for [`HANG_SECONDS`]) aborts the process naming the saved input, as does an
/// allocation an untrusted length drove past what the machine has (the `WORDS` edits write
/// such lengths); an error must say something. Returns how many inputs parsed without error.
pub fn run<E: Display>(
    target: &Target<'_>,
    mut parse: impl FnMut(&[u8]) -> Result<(), E>,
) -> usize {
    let mut rng = rng(target.name);
    let mut inputs = target
        .regressions
        .map(|dir| regressions(dir, target.name))
        .unwrap_or_default();
    for case in 0..target.cases {
        let mutated = mutate(target.seed, &mut rng);
        inputs.push(if target.sealed && case % 2 == 0 {
            reseal(mutated)
        } else {
            mutated
        });
    }
    // The input under test, on disk, for a hang or an abort to point at.
    let current = std::env::temp_dir().join(format!(
        "kiln-fuzz-{}-current-{}",
        target.name,
        std::process::id()
    ));
    let watchdog = Watchdog::start(target.name.to_string(), current.clone());
    let mut accepted = 0;
    for (i, input) in inputs.iter().enumerate() {
        let _ = std::fs::write(&current, input);
        let outcome = catch_unwind(AssertUnwindSafe(|| parse(input)));
        watchdog.finished_one();
        match outcome {
            Ok(Ok(())) => accepted += 1,
            Ok(Err(e)) => assert!(
                !e.to_string().trim().is_empty(),
                "{}: input {i} gave an empty error",
                target.name
            ),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                let path = std::env::temp_dir().join(format!(
                    "kiln-fuzz-{}-crash-{}-{i:05}",
                    target.name,
                    std::process::id()
                ));
                let saved = std::fs::write(&path, input).is_ok();
                panic!(
                    "{}: input {i} panicked ({what}); {} — keep it in the regressions \
                     directory as `{}-<what>` once fixed",
                    target.name,
                    if saved {
                        format!("saved to {}", path.display())
                    } else {
                        "could not be saved".into()
                    },
                    target.name
                );
            }
        }
    }
    drop(watchdog);
    let _ = std::fs::remove_file(&current);
    accepted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_are_seeded_and_reseal_fixes_the_digest() {
        let seed = b"0123456789abcdefghijklmnopqrstuvwxyz0123456789";
        let a = mutate(seed, &mut rng("t"));
        let b = mutate(seed, &mut rng("t"));
        assert_eq!(a, b, "same target, same cases");
        let mut sealed = vec![1u8; 40];
        sealed.extend_from_slice(&[0u8; 32]);
        let sealed = reseal(sealed);
        assert_eq!(&sealed[40..], Sha256::digest([1u8; 40]).as_slice());
    }
}
