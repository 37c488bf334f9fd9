//! Mutation fuzzing for the parsers of outside input (Kiln's own tests and kiln-serve's use
//! it; so can a user's).
//!
//! Each target starts from a real, valid input. A case is a string of fuzzer bytes that
//! [`mutate`] decodes with [`arbitrary::Unstructured`] into one to four edits of that input
//! (bit flips, boundary bytes, huge or zero 8-byte length fields, truncation, duplicated and
//! inserted runs); the parser must give a clear error or a valid result, never a panic, never
//! a hang, and never more heap than the target's stated [`HeapLimit`]. Formats with a
//! trailing SHA-256 (checkpoints, graphs) re-seal half the cases so the parser behind the
//! checksum is reached.
//!
//! Why this shape: CI runs on stable Rust in bounded time, so [`run`] draws each case's bytes
//! from a seeded generator and runs a fixed number of them. Because a case is just bytes
//! decoded by `arbitrary` (the crate `cargo fuzz` targets use), the same function takes a
//! coverage-guided fuzzer's input unchanged, on a nightly toolchain:
//!
//! ```text
//! // fuzz/fuzz_targets/idx.rs (cargo fuzz init; cargo fuzz run idx)
//! libfuzzer_sys::fuzz_target!(|data: &[u8]| {
//!     let input = kiln::fuzz::mutate(SEED, data);
//!     let _ = kiln::datasets::idx::parse(&input, std::path::Path::new("fuzz"));
//! });
//! ```
//!
//! Cases per target: `KILN_FUZZ_CASES` (default [`DEFAULT_CASES`]), seed `KILN_FUZZ_SEED`. A
//! failing input is saved to the temp directory and named in the failure; kept in a
//! regressions directory (files named `<target>-...`), it is replayed first on every run.
//! The heap limit is checked when the process counts each thread's heap
//! ([`crate::observe::heap::CountingAlloc::per_thread`] installed, as Kiln's fuzz tests do),
//! on the parsing thread (other tests run beside it).

use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use arbitrary::Unstructured;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};

use crate::observe::heap;

/// Cases per target when `KILN_FUZZ_CASES` is not set: a few seconds for all targets in CI.
pub const DEFAULT_CASES: usize = 150;

/// Fuzzer bytes drawn per generated case: enough for four edits with inserted runs.
const CASE_BYTES: usize = 96;

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

/// `seed` with one to four edits decoded from the fuzzer bytes `data`: the same bytes give
/// the same input, whoever supplies them (this module's seeded generator, or a
/// coverage-guided fuzzer). Bytes that run out decode as zeros, so any `data` is valid.
pub fn mutate(seed: &[u8], data: &[u8]) -> Vec<u8> {
    let mut u = Unstructured::new(data);
    let mut out = seed.to_vec();
    let edits = u.int_in_range(1..=4u8).unwrap_or(1);
    for _ in 0..edits {
        // An exhausted `Unstructured` answers the smallest value: every call below has one.
        let index = |u: &mut Unstructured, len: usize| u.choose_index(len.max(1)).unwrap_or(0);
        let at = index(&mut u, out.len());
        let kind = u.choose_index(7).unwrap_or(0);
        match kind {
            0 if !out.is_empty() => out[at] ^= 1 << u.int_in_range(0..=7u8).unwrap_or(0),
            1 if !out.is_empty() => out[at] = BYTES[index(&mut u, BYTES.len())],
            2 if out.len() >= 8 => {
                let at = index(&mut u, out.len() - 7);
                let word = WORDS[index(&mut u, WORDS.len())];
                out[at..at + 8].copy_from_slice(&word.to_le_bytes());
            }
            3 => out.truncate(at),
            4 if !out.is_empty() => {
                let end = (at + u.int_in_range(1..=63usize).unwrap_or(1)).min(out.len());
                let run = out[at..end].to_vec();
                let to = index(&mut u, out.len() + 1);
                out.splice(to..to, run);
            }
            5 => {
                let len = u.int_in_range(1..=15usize).unwrap_or(1);
                let run: Vec<u8> = (0..len).map(|_| u.arbitrary().unwrap_or(0)).collect();
                let to = at.min(out.len());
                out.splice(to..to, run);
            }
            _ => {
                let to = index(&mut u, out.len() + 1);
                out.insert(to, BYTES[index(&mut u, BYTES.len())]);
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

/// The most heap one input may make a parser hold at once: `fixed + per_input_byte × len`.
///
/// Why a stated limit: a parser that sizes a buffer from a length field it read can be made
/// to allocate without bound by a few bytes of input. Each target states what its format
/// needs (a copy or two of the input, plus the decoded tensors), and [`run`] fails an input
/// that drives more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapLimit {
    /// Bytes allowed whatever the input's size (tables, thread pools, error messages).
    pub fixed: u64,
    /// Bytes allowed per byte of input (copies and decoded forms of what it holds).
    pub per_input_byte: u64,
}

impl HeapLimit {
    /// A limit of `fixed_mib` MiB plus `per_input_byte` bytes per input byte.
    pub const fn new(fixed_mib: u64, per_input_byte: u64) -> Self {
        HeapLimit {
            fixed: fixed_mib << 20,
            per_input_byte,
        }
    }

    /// The limit for an input of `len` bytes.
    pub fn bytes(&self, len: usize) -> u64 {
        self.fixed
            .saturating_add(self.per_input_byte.saturating_mul(len as u64))
    }
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
    /// The most heap one input may make the parser hold (checked when each thread's heap is counted).
    pub heap: HeapLimit,
}

/// What a [`run`] saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Inputs that parsed without error.
    pub accepted: usize,
    /// Inputs run (regressions and generated cases).
    pub inputs: usize,
    /// The largest heap growth one input caused, in bytes (`None`: the heap is not counted).
    pub heap_peak: Option<u64>,
    /// The largest share of its [`HeapLimit`] one input used (`None`: not counted).
    pub heap_share: Option<f64>,
}

/// How long one input may take before the run counts it as a hang.
pub const HANG_SECONDS: u64 = 30;

/// Aborts the process, naming the input, when no case finishes for [`HANG_SECONDS`]: a parser
/// that loops on some input must fail the run, not stall CI. Dropping it stops the watch and
/// removes the on-disk copy of the input under test.
struct Watchdog {
    current: PathBuf,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    finished: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Watchdog {
    fn start(target: String, current: PathBuf) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let finished = std::sync::Arc::new(AtomicUsize::new(0));
        let (d, f, path) = (done.clone(), finished.clone(), current.clone());
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
                        path.display()
                    );
                    std::process::abort();
                }
            }
        });
        Watchdog {
            current,
            done,
            finished,
        }
    }

    fn finished_one(&self) {
        self.finished
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        // Finished or failed by a panic (whose input is saved apart): the copy is not needed.
        let _ = std::fs::remove_file(&self.current);
    }
}

/// Saves a failing input under the temp directory and says where, for the failure message.
fn save_failing(target: &str, i: usize, input: &[u8]) -> String {
    let path = std::env::temp_dir().join(format!(
        "kiln-fuzz-{target}-crash-{}-{i:05}",
        std::process::id()
    ));
    if std::fs::write(&path, input).is_ok() {
        format!("saved to {}", path.display())
    } else {
        "could not be saved".into()
    }
}

/// Runs `parse` on the target's regression files and its generated cases. A panic, or an
/// input that made the parser hold more heap than [`Target::heap`] allows, fails with the
/// input saved under the temp directory and its path in the message; a hang (no input done
/// for [`HANG_SECONDS`]) aborts the process naming the saved input, as does an allocation an
/// untrusted length drove past what the machine has (the `WORDS` edits write such lengths);
/// an error must say something.
pub fn run<E: Display>(
    target: &Target<'_>,
    mut parse: impl FnMut(&[u8]) -> Result<(), E>,
) -> Summary {
    let mut rng = rng(target.name);
    let mut inputs = target
        .regressions
        .map(|dir| regressions(dir, target.name))
        .unwrap_or_default();
    for case in 0..target.cases {
        let data: Vec<u8> = (0..CASE_BYTES).map(|_| rng.random()).collect();
        let mutated = mutate(target.seed, &data);
        inputs.push(if target.sealed && case % 2 == 0 {
            reseal(mutated)
        } else {
            mutated
        });
    }
    let counted = heap::threads_counted();
    // The input under test, on disk, for a hang or an abort to point at.
    let current = std::env::temp_dir().join(format!(
        "kiln-fuzz-{}-current-{}",
        target.name,
        std::process::id()
    ));
    let watchdog = Watchdog::start(target.name.to_string(), current.clone());
    let mut summary = Summary {
        accepted: 0,
        inputs: inputs.len(),
        heap_peak: counted.then_some(0),
        heap_share: counted.then_some(0.0),
    };
    for (i, input) in inputs.iter().enumerate() {
        let _ = std::fs::write(&current, input);
        // Counted on this thread: other tests run beside this one.
        let (outcome, grown) =
            heap::thread_peak_during(|| catch_unwind(AssertUnwindSafe(|| parse(input))));
        watchdog.finished_one();
        match outcome {
            Ok(Ok(())) => summary.accepted += 1,
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
                panic!(
                    "{}: input {i} panicked ({what}); {} — keep it in the regressions \
                     directory as `{}-<what>` once fixed",
                    target.name,
                    save_failing(target.name, i, input),
                    target.name
                );
            }
        }
        if let Some(grown) = grown {
            let limit = target.heap.bytes(input.len());
            assert!(
                grown <= limit,
                "{}: input {i} ({} bytes) made the parser hold {grown} bytes of heap, over the \
                 stated limit of {limit} ({:?}); {} — keep it in the regressions directory as \
                 `{}-<what>` once fixed",
                target.name,
                input.len(),
                target.heap,
                save_failing(target.name, i, input),
                target.name
            );
            summary.heap_peak = summary.heap_peak.map(|p| p.max(grown));
            summary.heap_share = summary
                .heap_share
                .map(|s| s.max(grown as f64 / limit as f64));
        }
    }
    drop(watchdog);
    summary
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_are_decoded_from_the_fuzzer_bytes() {
        let seed = b"0123456789abcdefghijklmnopqrstuvwxyz0123456789";
        let mut r = rng("t");
        let data: Vec<u8> = (0..CASE_BYTES).map(|_| r.random()).collect();
        assert_eq!(
            mutate(seed, &data),
            mutate(seed, &data),
            "same bytes, same input"
        );
        // Every byte string is a valid case, the empty one included (one edit of zeros).
        assert_ne!(mutate(seed, &[]), seed.to_vec());
        let mut r = rng("t");
        let distinct: std::collections::HashSet<Vec<u8>> = (0..50)
            .map(|_| {
                let data: Vec<u8> = (0..CASE_BYTES).map(|_| r.random()).collect();
                mutate(seed, &data)
            })
            .collect();
        assert!(
            distinct.len() > 40,
            "cases barely differ: {}",
            distinct.len()
        );
        let mut sealed = vec![1u8; 40];
        sealed.extend_from_slice(&[0u8; 32]);
        let sealed = reseal(sealed);
        assert_eq!(&sealed[40..], Sha256::digest([1u8; 40]).as_slice());
    }

    #[test]
    fn heap_limit_scales_with_the_input() {
        let limit = HeapLimit::new(2, 3);
        assert_eq!(limit.bytes(0), 2 << 20);
        assert_eq!(limit.bytes(10), (2 << 20) + 30);
        assert_eq!(HeapLimit::new(1, u64::MAX).bytes(2), u64::MAX);
    }
}
