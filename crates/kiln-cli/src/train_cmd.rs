//! `kiln train`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use kiln::Trainer;
use kiln::data::Dataset;
use kiln::datasets::{self, Split};
use kiln::distributed::{Collective, DeviceGroup};
use kiln::observe::{EventSink, FanOut, JsonLinesSink, NullSink, TensorBoardSink, memory};
use kiln::plan::Plan;
use kiln::train::TrainOutcome;
use kiln::zoo::ZooModel;

use crate::TrainArgs;
use crate::launch;
use crate::progress::ProgressSink;

pub fn run(args: TrainArgs) -> Result<()> {
    if let Some(n) = args.processes.map(usize::from)
        && n > 1
        && kiln::distributed::launcher_world().is_none()
    {
        let code = launch::relaunch(n)?;
        if code != 0 {
            bail!("{n} ranks under mpirun: exit status {code} (each rank's error is above)");
        }
        return Ok(());
    }
    let plan = args.config.resolve()?;
    plan.apply_runtime_for_training();
    let collective = launch::join(&plan)?;
    let result = train_rank(&args, &plan, collective.clone());
    if let (Err(e), Some(c)) = (&result, &collective) {
        // A rank that fails outside the trainer (its data, its output files) must not leave
        // the others waiting in a collective: under MPI this aborts the job.
        c.abandon(&format!("{e:#}"));
    }
    result
}

/// Trains this process's rank (all of it without data parallelism) and prints the summary.
fn train_rank(
    args: &TrainArgs,
    plan: &Plan,
    collective: Option<Arc<dyn Collective>>,
) -> Result<()> {
    // Rank 0 reports for all (events, files, the summary); the other ranks train quietly.
    let leader = collective.as_ref().is_none_or(|c| c.rank() == 0);
    let (train, test): datasets::DatasetPair = match &plan.data_dir {
        Some(dir) => {
            let (pair, classes) = datasets::open_data(dir, &plan.images)?;
            if let Some(classes) = classes {
                check_image_model(plan, &classes)?;
            }
            pair
        }
        None => (
            Box::new(datasets::bundled(Split::Train)?),
            Box::new(datasets::bundled(Split::Test)?),
        ),
    };
    let resume = match args.resume.as_deref() {
        None => None,
        Some("latest") => {
            let Some(dir) = &plan.train.checkpoint_dir else {
                bail!(
                    "--resume latest needs --checkpoint-dir (or train.checkpoint_dir) to look in"
                );
            };
            let found = kiln::train::latest_checkpoint(dir)?
                .with_context(|| format!("no checkpoint (step-*.kiln) in {}", dir.display()))?;
            Some(found)
        }
        Some(path) => Some(PathBuf::from(path)),
    };

    let mut json_sink;
    let mut progress_sink;
    let mut tensorboard = match &args.tensorboard {
        Some(dir) if leader => Some(TensorBoardSink::create(dir)?),
        _ => None,
    };
    let mut quiet = NullSink;
    let people: &mut dyn EventSink = if !leader {
        &mut quiet
    } else if args.json {
        json_sink = JsonLinesSink::new(std::io::stdout());
        &mut json_sink
    } else {
        eprintln!(
            "kiln: training {} ({}) on {} samples, level {}, backend {}, {} threads",
            plan.model.name(),
            plan.model.workload(),
            train.len(),
            plan.level,
            plan.backend.name(),
            plan.threads
        );
        progress_sink = ProgressSink::new();
        &mut progress_sink
    };
    let mut run_log = match &args.run_dir {
        Some(dir) if leader => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let path = dir.join("events.jsonl");
            let file = std::fs::File::create(&path)
                .with_context(|| format!("creating {}", path.display()))?;
            Some(JsonLinesSink::new(std::io::LineWriter::new(file)))
        }
        _ => None,
    };
    let mut fan = FanOut::new().with(people);
    if let Some(log) = run_log.as_mut() {
        fan = fan.with(log);
    }
    if let Some(tb) = tensorboard.as_mut() {
        if let Some(path) = tb.path() {
            tracing::info!("TensorBoard events: {}", path.display());
        }
        fan = fan.with(tb);
    }
    let sink: &mut dyn EventSink = &mut fan;
    let run = Rank {
        plan,
        resume: resume.as_deref(),
        train: &*train,
        test: &*test,
    };
    let outcome = match plan.data_parallel.gpus {
        Some(n) => fit_on_gpus(&run, n, sink)?,
        None => run.fit(plan.backend.device(), collective, sink)?,
    };
    if !args.json && leader {
        let s = &outcome.summary;
        println!(
            "done: {} steps, test accuracy {}, {:.0} samples/s, data wait {:.1}%, wall {:.1}s, peak RSS {}",
            s.steps,
            s.test_accuracy
                .map_or("n/a".into(), |a| format!("{:.2}%", a * 100.0)),
            s.samples_per_s,
            s.data_wait_share * 100.0,
            s.wall_seconds,
            s.peak_rss_bytes.map_or("n/a".into(), memory::human_bytes),
        );
        if let Some(ms) = s.first_step_ms {
            // On a GPU the first step compiles kernels unless device.kernel_cache has them.
            println!("first step: {ms:.0} ms");
        }
        if let Some(ckpt) = &s.last_checkpoint {
            println!("last checkpoint: {ckpt}");
        }
    }
    Ok(())
}

/// Image files reach a zoo model only where it fits them: the ResNet (W5) takes any channel
/// count and size; every zoo model predicts 10 classes.
fn check_image_model(plan: &Plan, classes: &[String]) -> Result<()> {
    if plan.model != kiln::zoo::ModelKind::ResNet {
        bail!(
            "image files are 3×{s}×{s} images; of the zoo's models only --model resnet (W5) \
             takes them (the others are defined on 1×28×28 MNIST). Your own model trains on \
             them through the library: docs/data.md",
            s = plan.images.size
        );
    }
    if classes.len() > kiln::zoo::NUM_CLASSES {
        bail!(
            "the data has {} classes but the zoo's models predict {}: train your own model on \
             it through the library (docs/own-model.md)",
            classes.len(),
            kiln::zoo::NUM_CLASSES
        );
    }
    Ok(())
}

/// What every rank of this run trains with: the plan, the checkpoint to resume from, the data.
struct Rank<'a> {
    plan: &'a Plan,
    resume: Option<&'a Path>,
    train: &'a dyn Dataset,
    test: &'a dyn Dataset,
}

impl Rank<'_> {
    /// Trains the plan's model on `device` as one rank of `collective` (none: one process),
    /// reporting to `sink`.
    fn fit(
        &self,
        device: kiln::burn::tensor::Device,
        collective: Option<Arc<dyn Collective>>,
        sink: &mut dyn EventSink,
    ) -> kiln::Result<TrainOutcome<ZooModel>> {
        let model = self.plan.model;
        let mut trainer =
            Trainer::new(self.plan.train.clone(), device, sink).with_plan(self.plan.to_json());
        if let Some(path) = self.resume {
            trainer = trainer.resume_from(path);
        }
        if let Some(c) = collective {
            trainer = trainer.with_collective(c);
        }
        let channels = self.train.item_shape()[0];
        trainer.fit(
            model.name(),
            |d| model.init_for_channels(channels, d),
            self.train,
            Some(self.test),
        )
    }
}

/// `train.data_parallel = "gpus"`: one rank per CUDA device as threads of this process (a
/// [`DeviceGroup`]), rank 0 on this thread reporting to `sink`, the others quiet; returns
/// rank 0's outcome (every rank ends with the same model).
fn fit_on_gpus(
    run: &Rank<'_>,
    gpus: usize,
    sink: &mut dyn EventSink,
) -> Result<TrainOutcome<ZooModel>> {
    let devices: Vec<_> = kiln::distributed::cuda_devices()
        .into_iter()
        .take(gpus)
        .collect();
    let mut members = DeviceGroup::with_timeout(devices, run.plan.collective_timeout)?.into_iter();
    let leader = members.next().context("a device group has a first rank")?;
    let fit = |member: DeviceGroup, sink: &mut dyn EventSink| {
        let device = member.device().clone();
        run.fit(device, Some(Arc::new(member)), sink)
    };
    std::thread::scope(|s| {
        let others: Vec<_> = members
            .map(|member| s.spawn(|| fit(member, &mut NullSink)))
            .collect();
        let outcome = fit(leader, sink);
        // A rank that fails releases the others with `PeerLost`; report the failure itself.
        let mut failures = Vec::new();
        for (rank, handle) in others.into_iter().enumerate() {
            let rank = rank + 1;
            match handle.join() {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => failures.push((rank, e)),
                Err(_) => bail!("GPU rank {rank} panicked"),
            }
        }
        match outcome.map_err(|e| failures.insert(0, (0, e))) {
            Ok(outcome) if failures.is_empty() => Ok(outcome),
            _ => {
                let (rank, e) = root_failure(failures);
                Err(e).with_context(|| format!("GPU rank {rank}"))
            }
        }
    })
}

/// The failure that stopped a group of ranks: the first that is not a consequence of another
/// rank's ([`kiln::KilnError::PeerLost`]), else the first. `failures` is not empty.
fn root_failure(mut failures: Vec<(usize, kiln::KilnError)>) -> (usize, kiln::KilnError) {
    let i = failures
        .iter()
        .position(|(_, e)| !matches!(e, kiln::KilnError::PeerLost(_)))
        .unwrap_or(0);
    failures.swap_remove(i)
}
