//! A disk that fills up for real: a tmpfs of a few MB mounted for the test, filled by training
//! checkpoints and by the disk cache until a write fails part-way. The previous checkpoint and
//! the cache's entries stay valid, nothing half-written is left, the error names the full file
//! system, and training resumes once there is room.
//!
//! Mounting needs root (CI runs as root). Elsewhere each test says SKIPPED loudly and passes;
//! `KILN_REQUIRE_TMPFS=1` (set by `.ci/run`) makes a failed mount fail the test instead.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::tensor::Device;
use kiln::data::DiskCache;
use kiln::datasets::{Split, bundled};
use kiln::observe::NullSink;
use kiln::train::{Checkpoint, OptimizerKind, TrainOptions, checkpoints_in};
use kiln::zoo::ModelKind;
use kiln::{KilnError, Trainer, burn};

/// A tmpfs mounted on a test directory, unmounted when dropped.
struct Tmpfs {
    dir: common::TestDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `bytes` on a fresh directory, or says why not: `None` (after a loud
    /// SKIPPED line) where mounting is not allowed, a panic where `KILN_REQUIRE_TMPFS` is set.
    fn mount(name: &str, bytes: u64) -> Option<Tmpfs> {
        let dir = common::tempdir("tmpfs", name);
        let output = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={bytes},mode=0700"),
                "tmpfs",
            ])
            .arg(dir.path())
            .output();
        let why = match &output {
            Ok(o) if o.status.success() => return Some(Tmpfs { dir }),
            Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
            Err(e) => format!("cannot run mount: {e}"),
        };
        assert!(
            std::env::var_os("KILN_REQUIRE_TMPFS").is_none(),
            "KILN_REQUIRE_TMPFS is set but a tmpfs cannot be mounted: {why}"
        );
        eprintln!(
            "\n*** SKIPPED {name}: mounting a {bytes}-byte tmpfs failed ({why}); this test needs \
             root (CI runs it with KILN_REQUIRE_TMPFS=1) ***\n"
        );
        None
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

fn options(dir: PathBuf) -> TrainOptions {
    TrainOptions {
        epochs: 1,
        batch_size: 32,
        optimizer: OptimizerKind::Adam,
        seed: 5,
        checkpoint_dir: Some(dir),
        checkpoint_every_steps: Some(1),
        keep_checkpoints: 0,
        ..TrainOptions::default()
    }
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_checkpoint_that_fills_the_disk_fails_naming_it_and_the_previous_one_resumes() {
    let data = bundled(Split::Train).unwrap().take(32 * 6);
    let kind = ModelKind::Mlp;
    // One checkpoint's size, measured on the ordinary temp dir.
    let probe = common::tempdir("tmpfs", "ckpt-size");
    let mut sink = NullSink;
    let one_step = TrainOptions {
        max_steps: Some(1),
        ..options(probe.to_path_buf())
    };
    Trainer::new(one_step, Device::flex(), &mut sink)
        .fit(kind.name(), |d| kind.init(d), &data, None)
        .unwrap();
    let size = std::fs::metadata(probe.join(Checkpoint::file_name(1)))
        .unwrap()
        .len();
    // Room for two checkpoints and part of a third: the third write fails part-way.
    let Some(disk) = Tmpfs::mount("ckpt", size * 5 / 2 + 4096) else {
        return;
    };
    let dir = disk.path().to_path_buf();
    let Err(err) = Trainer::new(options(dir.clone()), Device::flex(), &mut sink).fit(
        kind.name(),
        |d| kind.init(d),
        &data,
        None,
    ) else {
        panic!("a {size}-byte checkpoint per step cannot fit three times in the tmpfs");
    };
    let msg = err.to_string();
    eprintln!("checkpoint on a full disk: {msg}");
    assert!(matches!(err, KilnError::Io { .. }), "{msg}");
    assert!(msg.contains("step-00000003.kiln"), "{msg}");
    assert!(
        msg.contains(&format!(
            "the tmpfs file system mounted at {}",
            dir.display()
        )) && msg.contains("is full"),
        "the error does not name the full disk: {msg}"
    );
    // The two that fit are intact and nothing half-written is left.
    assert_eq!(
        files_in(&dir),
        vec![Checkpoint::file_name(1), Checkpoint::file_name(2)]
    );
    let last = dir.join(Checkpoint::file_name(2));
    assert_eq!(Checkpoint::load(&last).unwrap().state.global_step, 2);
    // With room made (the oldest deleted, one checkpoint kept from now on), the run resumes
    // from the last good checkpoint and finishes.
    std::fs::remove_file(dir.join(Checkpoint::file_name(1))).unwrap();
    let keep_one = TrainOptions {
        keep_checkpoints: 1,
        ..options(dir.clone())
    };
    let resumed = Trainer::new(keep_one, Device::flex(), &mut sink)
        .resume_from(last)
        .fit(kind.name(), |d| kind.init(d), &data, None)
        .unwrap();
    assert_eq!(resumed.summary.steps, 6);
    let kept: Vec<u64> = checkpoints_in(&dir)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(kept, vec![6]);
}

#[test]
fn a_cache_write_that_fills_the_disk_keeps_every_earlier_entry_valid() {
    let Some(disk) = Tmpfs::mount("cache", 1 << 20) else {
        return;
    };
    // A capacity far above the disk's size, so the disk fills before eviction would start.
    let cache = DiskCache::open(disk.path(), 1 << 30).unwrap();
    let payload = |i: usize| -> Vec<u8> { (0..60_000).map(|k| (k * 31 + i * 7) as u8).collect() };
    let mut stored = 0;
    let err = loop {
        assert!(stored < 100, "a 1 MiB tmpfs took 100 entries of 60 kB");
        match cache.put(&format!("entry{stored}"), &payload(stored)) {
            Ok(()) => stored += 1,
            Err(e) => break e,
        }
    };
    assert!(stored >= 2, "the tmpfs held only {stored} entries");
    let msg = err.to_string();
    eprintln!("cache on a full disk after {stored} entries: {msg}");
    assert!(
        msg.contains(&format!("entry{stored}"))
            && msg.contains(&format!(
                "the tmpfs file system mounted at {}",
                disk.path().display()
            )),
        "the error does not name the entry and the full disk: {msg}"
    );
    // No temp file of the failed write is left, and every earlier entry reads back verified,
    // from this cache and from one reopened on the directory.
    let names = files_in(disk.path());
    assert!(
        !names.iter().any(|n| n.contains(".tmp.")),
        "a temp file was left: {names:?}"
    );
    assert_eq!(names.len(), stored);
    let reopened = DiskCache::open(disk.path(), 1 << 30).unwrap();
    assert_eq!(reopened.len(), stored);
    for i in 0..stored {
        let key = format!("entry{i}");
        assert_eq!(
            cache.get(&key).as_deref(),
            Some(payload(i).as_slice()),
            "{key}"
        );
        assert_eq!(
            reopened.get(&key).as_deref(),
            Some(payload(i).as_slice()),
            "{key}"
        );
    }
    assert_eq!(reopened.stats().corrupt, 0);
}
