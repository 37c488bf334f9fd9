//! Data parallelism across processes over MPI (the `mpi` build, Open MPI's `mpirun`):
//! `kiln train --processes 2` trains the model one process trains with twice the batch,
//! writes checkpoints once (rank 0) that both ranks resume from, synchronizes BatchNorm's
//! statistics, and aborts the job when one rank fails.
//! Run with `cargo test -p kiln-cli --features mpi --test mpi` (CI does, after installing
//! Debian's Open MPI).
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::{Command, Output};

use kiln::datasets::{Split, bundled};

#[path = "../../kiln/tests/common/test_dir.rs"]
mod test_dir;
use test_dir::TestDir;

fn kiln(args: &[&str]) -> Output {
    kiln_with_env(args, &[])
}

/// Runs `kiln` with these environment variables added.
fn kiln_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_LOG", "error")
        .envs(env.iter().copied())
        .output()
        .expect("run kiln")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `kiln train` on W1 for `max_steps` steps of accumulation 2 with clipping, in order, JSON
/// events.
fn train_args<'a>(
    dir: &'a str,
    batch: &'a str,
    max_steps: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut a = vec![
        "train",
        "--model",
        "mlp",
        "--batch-size",
        batch,
        "--accum",
        "2",
        "--epochs",
        "1",
        "--max-steps",
        max_steps,
        "--workers",
        "0",
        "--set",
        "train.grad_clip_norm=0.5",
        "--set",
        "data.shuffle=false",
        "--checkpoint-dir",
        dir,
        "--json",
    ];
    a.extend_from_slice(extra);
    a
}

/// The step events a run printed.
fn steps(o: &Output) -> Vec<serde_json::Value> {
    text(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .collect()
}

/// The newest checkpoint's weights in `dir`, and its step (the MLP's).
fn final_weights(dir: &Path) -> (u64, Vec<f32>) {
    final_weights_of(kiln::zoo::ModelKind::Mlp, dir)
}

/// The newest checkpoint's weights of a `kind` model in `dir`, and its step.
fn final_weights_of(kind: kiln::zoo::ModelKind, dir: &Path) -> (u64, Vec<f32>) {
    let latest = kiln::train::latest_checkpoint(dir).unwrap().unwrap();
    let step = kiln::train::Checkpoint::load(&latest)
        .unwrap()
        .state
        .global_step;
    let device = kiln::burn::tensor::Device::flex();
    let model = kiln::zoo::load_model(kind, 1, &latest, &device).unwrap();
    (step, kiln::train::flatten_params(&model))
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn two_processes_train_the_model_of_one_with_twice_the_batch_and_resume_together() {
    let dir = TestDir::new("mpi-train");
    let (single, ranks, stopped) = (dir.join("single"), dir.join("ranks"), dir.join("stopped"));
    let (single_s, ranks_s, stopped_s) = (
        single.to_str().unwrap(),
        ranks.to_str().unwrap(),
        stopped.to_str().unwrap(),
    );
    let one = kiln(&train_args(single_s, "32", "6", &["--threads", "1"]));
    assert!(one.status.success(), "{}", text(&one.stderr));
    let two = kiln(&train_args(ranks_s, "16", "6", &["--processes", "2"]));
    assert!(two.status.success(), "{}", text(&two.stderr));

    // Rank 0 alone reports: one run_finished line, step events with both ranks' times and
    // the samples of both.
    let finished = text(&two.stdout).matches("\"run_finished\"").count();
    assert_eq!(finished, 1, "{}", text(&two.stdout));
    let (a, b) = (steps(&one), steps(&two));
    assert_eq!(a.len(), 6);
    assert_eq!(b.len(), 6);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(y["samples"], 64);
        assert_eq!(y["rank_compute_ms"].as_array().map(Vec::len), Some(2));
        let (lx, ly) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
        assert!(
            (lx - ly).abs() <= 1e-5 * lx.abs().max(1.0),
            "loss {lx} vs {ly}"
        );
    }
    let (step_one, w_one) = final_weights(&single);
    let (step_two, w_two) = final_weights(&ranks);
    assert_eq!((step_one, step_two), (6, 6));
    let diff = max_difference(&w_one, &w_two);
    assert!(
        diff <= 1e-5,
        "2 ranks × 16 vs 1 × 32: weights differ by {diff}"
    );
    // Only rank 0 wrote a checkpoint (where the run stopped), and only one file is there.
    assert_eq!(text(&two.stdout).matches("\"checkpoint\"").count(), 1);
    assert_eq!(std::fs::read_dir(&ranks).unwrap().count(), 1);

    // Over TCP (the transport between machines) instead of shared memory: the same sums,
    // so the same weights bit for bit.
    let tcp_dir = dir.join("tcp");
    let tcp = kiln_with_env(
        &train_args(tcp_dir.to_str().unwrap(), "16", "6", &["--processes", "2"]),
        &[("OMPI_MCA_btl", "tcp,self")],
    );
    assert!(tcp.status.success(), "{}", text(&tcp.stderr));
    assert_eq!(max_difference(&final_weights(&tcp_dir).1, &w_two), 0.0);

    // Stopped at step 3, then both ranks resume from rank 0's checkpoint: bit for bit.
    let first = kiln(&train_args(stopped_s, "16", "3", &["--processes", "2"]));
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert_eq!(final_weights(&stopped).0, 3);
    let rest = kiln(&train_args(
        stopped_s,
        "16",
        "6",
        &["--processes", "2", "--resume", "latest"],
    ));
    assert!(rest.status.success(), "{}", text(&rest.stderr));
    let (step_resumed, w_resumed) = final_weights(&stopped);
    assert_eq!(step_resumed, 6);
    assert_eq!(
        max_difference(&w_resumed, &w_two),
        0.0,
        "a resumed 2-process run continues bit for bit"
    );
}

/// Runs `kiln args` under a 120 s `timeout` (a hang must fail the test, status 124, not
/// block it), asserts the job failed, and returns its stderr.
fn failed_job(args: &[&str]) -> String {
    let o = Command::new("timeout")
        .arg("120")
        .arg(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_LOG", "error")
        .output()
        .expect("run timeout kiln");
    let err = text(&o.stderr);
    assert_ne!(o.status.code(), Some(124), "the job hung: {err}");
    assert!(!o.status.success(), "{err}");
    err
}

#[test]
fn a_rank_that_fails_aborts_the_job_with_its_error_instead_of_a_hang() {
    let dir = TestDir::new("mpi-fault");
    // (1) Inside the trainer: rank 0 cannot write its step-2 checkpoint (a directory has the
    // file's name) while rank 1 goes on to step 3's all-reduce. (2) Outside it: rank 0
    // cannot create its run directory (a file is in the way) while rank 1 starts training.
    let ckpt = dir.join("ckpt");
    std::fs::create_dir_all(ckpt.join("step-00000002.kiln").join("x")).unwrap();
    let blocked = dir.join("not-a-dir");
    std::fs::write(&blocked, b"").unwrap();
    let cases: [(Vec<&str>, &str); 2] = [
        (
            vec!["--set", "train.checkpoint_every_steps=2"],
            "step-00000002.kiln",
        ),
        (vec!["--run-dir", blocked.to_str().unwrap()], "not-a-dir"),
    ];
    for (extra, named) in cases {
        let mut args = train_args(ckpt.to_str().unwrap(), "16", "6", &["--processes", "2"]);
        args.extend(extra);
        let err = failed_job(&args);
        assert!(err.contains("rank 0 of 2 failed"), "{err}");
        assert!(err.contains(named), "{err}");
        assert!(err.contains("aborting the MPI job"), "{err}");
    }
}

#[test]
fn a_rank_that_hangs_aborts_the_job_after_the_collective_timeout() {
    // Rank 0 opens its event log, a FIFO nobody reads: it blocks there for good (as on a stuck
    // file system) while rank 1 waits for it in the run's first all-reduce.
    let dir = TestDir::new("mpi-hang");
    let run_dir = dir.join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    let fifo = run_dir.join("events.jsonl");
    let made = Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("run mkfifo");
    assert!(made.success());
    let ckpt = dir.join("ckpt");
    let mut args = train_args(ckpt.to_str().unwrap(), "16", "4", &["--processes", "2"]);
    args.extend([
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--set",
        "train.collective_timeout_s=2",
    ]);
    let err = failed_job(&args);
    assert!(
        err.contains("rank 1 of 2: an MPI all-reduce waited 2s"),
        "{err}"
    );
    assert!(err.contains("aborting the MPI job"), "{err}");
}

#[test]
fn batch_norm_models_train_on_two_ranks_as_one_process_with_twice_the_batch() {
    // W5 (ResNet-18 with Kiln's BatchNorm): the statistics are summed over the ranks, so two
    // ranks × 8 normalize with the statistics of the 16 samples one process sees.
    let dir = TestDir::new("mpi-batchnorm");
    // A small copy of the bundled data, so that the final evaluation (1,000 test images
    // through ResNet-18 on one thread) does not dominate the test.
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    for (split, name, n) in [(Split::Train, "train", 96), (Split::Test, "test", 16)] {
        bundled(split)
            .unwrap()
            .take(n)
            .write_npy(
                &data.join(format!("{name}-images.npy")),
                &data.join(format!("{name}-labels.npy")),
            )
            .unwrap();
    }
    let (single, ranks) = (dir.join("single"), dir.join("ranks"));
    let (data_s, single_s, ranks_s) = (
        data.to_str().unwrap(),
        single.to_str().unwrap(),
        ranks.to_str().unwrap(),
    );
    // SGD: Adam would turn the last-bit differences of near-zero gradients (summed in
    // another order) into whole steps; SGD shows the gradients' equality directly.
    let resnet = |dir, batch, extra: &[&'static str]| {
        let mut a = train_args(dir, batch, "3", extra);
        a[2] = "resnet";
        a.extend(["--data", data_s, "--set", "train.optimizer=sgd"]);
        a
    };
    let one = kiln(&resnet(single_s, "16", &["--threads", "1"]));
    assert!(one.status.success(), "{}", text(&one.stderr));
    let two = kiln(&resnet(ranks_s, "8", &["--processes", "2"]));
    assert!(two.status.success(), "{}", text(&two.stderr));
    let (a, b) = (steps(&one), steps(&two));
    assert_eq!((a.len(), b.len()), (3, 3));
    for (x, y) in a.iter().zip(&b) {
        let (lx, ly) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
        assert!(
            (lx - ly).abs() <= 1e-5 * lx.abs().max(1.0),
            "loss {lx} vs {ly}"
        );
    }
    // Weights and running statistics (the checkpoint has both).
    let resnet_weights = |d: &Path| final_weights_of(kiln::zoo::ModelKind::ResNet, d).1;
    let diff = max_difference(&resnet_weights(&single), &resnet_weights(&ranks));
    eprintln!("ResNet, 2 ranks × 8 vs 1 × 16: largest difference {diff:e}");
    assert!(diff <= 1e-5, "weights differ by {diff}");
}

#[test]
fn ranks_launched_on_one_machine_share_its_cores_and_memory() {
    let plan = |local: &str| {
        let o = kiln_with_env(
            &["plan", "--json"],
            &[
                ("OMPI_COMM_WORLD_RANK", "1"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", local),
            ],
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // 4 ranks on 4 machines: each has its machine.
    let alone = plan("1");
    assert_eq!(alone["data_parallel"]["ranks"], 4);
    assert_eq!(alone["settings"]["device.threads"]["value"], cores);
    // 4 ranks on this one: a quarter of the cores (at least one) and of the memory each.
    let shared = plan("4");
    let threads = &shared["settings"]["device.threads"];
    assert_eq!(threads["value"], (cores / 4).max(1));
    assert!(
        threads["source"]
            .as_str()
            .unwrap()
            .contains("shared by 4 ranks"),
        "{threads}"
    );
    let mark = |p: &serde_json::Value| {
        p["settings"]["observe.memory_watermark_mib"]["value"]
            .as_i64()
            .unwrap()
    };
    assert!((mark(&shared) - mark(&alone) / 4).abs() <= 1);
}
