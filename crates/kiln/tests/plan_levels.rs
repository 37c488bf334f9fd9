//! Plan resolution: level bundles, file and flag precedence, and probed values.

use kiln::KilnConfig;
use kiln::config::Level;
use kiln::guard::GuardPolicy;
use kiln::plan::{Hardware, Plan, Source, resolve};
use kiln::train::Schedule;

fn hw() -> Hardware {
    Hardware {
        cores: 7,
        cuda_compiled: false,
        cuda_driver: false,
        gpu_count: 0,
        gpu_memory: None,
        memory: Some((24 << 30, "physical memory")),
    }
}

/// [`hw`] with a cuda build, the driver and `gpus` GPUs of 80 GiB.
fn gpu_hw(gpus: usize) -> Hardware {
    Hardware {
        cuda_compiled: true,
        cuda_driver: true,
        gpu_count: gpus,
        gpu_memory: Some(80 << 30),
        ..hw()
    }
}

fn plan_at(level: Level) -> Plan {
    let mut c = KilnConfig::default();
    c.set_level(level);
    resolve(&c, &hw()).unwrap()
}

#[test]
fn basic_turns_every_technique_off() {
    let p = plan_at(Level::Basic);
    assert_eq!(p.train.schedule, Schedule::Constant);
    assert_eq!(p.train.warmup_steps, 0);
    assert_eq!(p.train.grad_clip_norm, None);
    assert!(!p.train.activation_checkpointing);
    assert_eq!(p.train.guard.policy, GuardPolicy::Abort);
    assert!(!p.train.guard.check_params);
    assert_eq!(p.get("train.schedule").unwrap().source, Source::Default);
}

#[test]
fn advanced_adds_warmup_cosine_and_clipping() {
    let p = plan_at(Level::Advanced);
    assert_eq!(p.train.schedule, Schedule::Cosine);
    assert_eq!(p.train.warmup_steps, 50);
    assert_eq!(p.train.grad_clip_norm, Some(1.0));
    assert!(!p.train.activation_checkpointing);
    assert_eq!(p.train.guard.policy, GuardPolicy::Skip);
    assert!(p.train.guard.check_params);
    assert_eq!(
        p.get("train.grad_clip_norm").unwrap().source,
        Source::Level(Level::Advanced)
    );
}

/// OOM-adaptive batching is on at advanced; the watermark it acts on must be too, derived
/// from the machine's memory with the probe named as its source.
#[test]
fn advanced_derives_a_memory_watermark_from_the_machine() {
    let p = plan_at(Level::Advanced);
    assert!(p.train.oom_adaptive);
    // 85% of 24 GiB = 20889.6 MiB, whole MiB.
    assert_eq!(p.train.memory_watermark, Some(20889 << 20));
    let s = p.get("observe.memory_watermark_mib").unwrap();
    assert_eq!(s.value.as_integer(), Some(20889));
    match &s.source {
        Source::Probe(why) => assert!(why.contains("85% of 24.0 GiB physical memory"), "{why}"),
        other => panic!("watermark source {other}"),
    }
    assert!(
        p.to_string()
            .contains("probe: 85% of 24.0 GiB physical memory")
    );
    // A file value wins over the probe; 0 turns it off; unknown memory turns auto off.
    let mut c = KilnConfig::default();
    c.set_level(Level::Advanced);
    c.set("observe.memory_watermark_mib", "0").unwrap();
    assert_eq!(resolve(&c, &hw()).unwrap().train.memory_watermark, None);
    let unknown = Hardware {
        memory: None,
        ..hw()
    };
    let p = resolve(&KilnConfig::default(), &unknown).unwrap();
    assert_eq!(p.train.memory_watermark, None);
}

/// A memory budget (`--memory-budget`, `device.memory_budget_mib`) takes the machine's place
/// under the auto watermark; a budget the machine cannot give is refused, naming both.
#[test]
fn a_memory_budget_sets_the_auto_watermark_and_an_impossible_one_is_refused() {
    let mut c = KilnConfig::default();
    c.set_level(Level::Advanced);
    c.set("device.memory_budget_mib", "2048").unwrap();
    let p = resolve(&c, &hw()).unwrap();
    assert_eq!(p.memory_budget, Some(2048 << 20));
    // 85% of 2048 MiB = 1740.8 MiB, whole MiB.
    assert_eq!(p.train.memory_watermark, Some(1740 << 20));
    match &p.get("observe.memory_watermark_mib").unwrap().source {
        Source::Probe(why) => assert!(
            why.contains("85% of 2.0 GiB memory budget (device.memory_budget_mib)"),
            "{why}"
        ),
        other => panic!("watermark source {other}"),
    }
    // Unknown machine memory: the budget alone decides.
    let unknown = Hardware {
        memory: None,
        ..hw()
    };
    assert_eq!(
        resolve(&c, &unknown).unwrap().train.memory_watermark,
        Some(1740 << 20)
    );
    c.set("device.memory_budget_mib", "65536").unwrap();
    let err = resolve(&c, &hw()).unwrap_err().to_string();
    assert!(
        err.contains("device.memory_budget_mib = 65536")
            && err.contains("24.0 GiB physical memory")
            && err.contains("set 0"),
        "{err}"
    );
}

#[test]
fn ultra_adds_activation_checkpointing() {
    let p = plan_at(Level::Ultra);
    assert!(p.train.activation_checkpointing);
    assert_eq!(p.train.schedule, Schedule::Cosine);
    assert_eq!(p.train.guard.policy, GuardPolicy::Rollback);
    assert_eq!(
        p.get("train.activation_checkpointing").unwrap().source,
        Source::Level(Level::Ultra)
    );
}

#[test]
fn custom_uses_only_what_the_file_says() {
    let c = KilnConfig::from_toml_str(
        "level = \"custom\"\n[train]\nschedule = \"cosine\"\nepochs = 5\n",
        "my.toml",
    )
    .unwrap();
    let p = resolve(&c, &hw()).unwrap();
    assert_eq!(p.level, Level::Custom);
    assert_eq!(p.train.schedule, Schedule::Cosine);
    assert_eq!(p.train.epochs, 5);
    // Not in the file: neutral defaults, no level techniques.
    assert_eq!(p.train.grad_clip_norm, None);
    assert_eq!(p.train.warmup_steps, 0);
    assert!(
        matches!(p.get("train.epochs").unwrap().source, Source::File(ref f) if f.ends_with("my.toml"))
    );
    assert!(matches!(p.level_source, Source::File(_)));
}

#[test]
fn flags_override_file_which_overrides_level() {
    let mut c = KilnConfig::from_toml_str(
        "level = \"advanced\"\n[train]\ngrad_clip_norm = 5.0\nlr = 0.01\n",
        "k.toml",
    )
    .unwrap();
    c.set("train.lr", "0.02").unwrap();
    let p = resolve(&c, &hw()).unwrap();
    assert_eq!(p.train.grad_clip_norm, Some(5.0));
    assert_eq!(p.train.lr, 0.02);
    assert_eq!(p.get("train.lr").unwrap().source, Source::Flag);
    assert!(matches!(
        p.get("train.grad_clip_norm").unwrap().source,
        Source::File(_)
    ));
    assert_eq!(
        p.get("train.warmup_steps").unwrap().source,
        Source::Level(Level::Advanced)
    );
}

#[test]
fn auto_values_come_from_the_probe() {
    let p = plan_at(Level::Basic);
    assert_eq!(p.threads, 7);
    assert!(matches!(
        p.get("device.threads").unwrap().source,
        Source::Probe(_)
    ));
    assert_eq!(p.backend.name(), "flex");
    let mut c = KilnConfig::default();
    c.set("device.threads", "3").unwrap();
    assert_eq!(resolve(&c, &hw()).unwrap().threads, 3);
}

#[test]
fn plan_prints_every_key_with_its_source() {
    let p = plan_at(Level::Ultra);
    let text = p.to_string();
    for key in kiln::plan::known_keys() {
        assert!(text.contains(key), "missing {key} in\n{text}");
    }
    assert!(text.contains("level ultra"));
    assert!(text.contains("probe: 7 CPU cores"));
    let json = p.to_json();
    assert_eq!(
        json["settings"]["train.activation_checkpointing"]["value"],
        true
    );
}

#[test]
fn data_loader_settings_resolve_per_level_and_from_the_file() {
    use kiln::data::Augment;
    let basic = plan_at(Level::Basic);
    assert_eq!(basic.train.workers, Some(0));
    assert_eq!(basic.train.prefetch_factor, 2);
    assert_eq!(basic.train.augment, Augment::None);
    // advanced measures the worker count at run time: `None` until the trainer probes it.
    let advanced = plan_at(Level::Advanced);
    assert_eq!(advanced.train.workers, None);
    assert_eq!(
        advanced.get("data.workers").unwrap().value.as_str(),
        Some("auto")
    );
    let c = KilnConfig::from_toml_str(
        "level = \"advanced\"\n[data]\nworkers = 3\nprefetch_factor = 4\naugment = \"crop-flip\"\n",
        "kiln.toml",
    )
    .unwrap();
    let p = resolve(&c, &hw()).unwrap();
    assert_eq!(p.train.workers, Some(3));
    assert_eq!(p.train.prefetch_factor, 4);
    assert_eq!(p.train.augment, Augment::CropFlip);
}

/// The inference passes come from the plan: the exact rewrites at basic (and custom), int8
/// added at advanced and ultra; the file overrides; a bad list names the key.
#[test]
fn inference_passes_resolve_per_level() {
    use kiln::infer::Pass;
    assert_eq!(
        plan_at(Level::Basic).infer_passes,
        [Pass::Strip, Pass::Fold]
    );
    assert_eq!(
        plan_at(Level::Custom).infer_passes,
        [Pass::Strip, Pass::Fold]
    );
    assert_eq!(plan_at(Level::Advanced).infer_passes, Pass::ALL);
    assert_eq!(plan_at(Level::Ultra).infer_passes, Pass::ALL);
    let mut c = KilnConfig::default();
    c.set("infer.passes", "fold,bf16").unwrap();
    let p = resolve(&c, &hw()).unwrap();
    assert_eq!(p.infer_passes, [Pass::Fold, Pass::Bf16]);
    c.set("infer.passes", "fold,int4").unwrap();
    let msg = resolve(&c, &hw()).unwrap_err().to_string();
    assert!(
        msg.contains("infer.passes") && msg.contains("int4"),
        "{msg}"
    );
}

/// Every name the schema accepts for an enum key resolves to that value, never to a silent
/// default: the plan reads each name back from the resolved options.
#[test]
fn every_enum_name_the_schema_accepts_resolves_to_itself() {
    use kiln::config::{Kind, schema::SETTINGS};
    for spec in SETTINGS {
        let Kind::Enum(names) = spec.kind else {
            continue;
        };
        for name in names {
            let mut c = KilnConfig::default();
            c.set(spec.key, name).unwrap();
            let plan = match resolve(&c, &hw()) {
                Ok(plan) => plan,
                // The names this machine's hardware stub (no GPU) cannot run.
                Err(e) if spec.key == "device.backend" && *name == "cuda" => {
                    assert!(e.to_string().contains("--features cuda"), "{e}");
                    continue;
                }
                Err(e) if spec.key == "train.data_parallel" && *name == "gpus" => {
                    assert!(e.to_string().contains("needs the cuda backend"), "{e}");
                    continue;
                }
                Err(e) => panic!("{} = {name}: {e}", spec.key),
            };
            let back = match spec.key {
                "train.optimizer" => plan.train.optimizer.name().to_string(),
                "train.schedule" => plan.train.schedule.name().to_string(),
                "precision.policy" => plan.train.precision.name().to_string(),
                "precision.loss_scaling" => plan.train.scaler.mode.name().to_string(),
                "guard.policy" => plan.train.guard.policy.name().to_string(),
                "train.model" => plan.model.name().to_string(),
                "data.last_batch" => plan.train.last_batch.name().to_string(),
                _ => plan
                    .get(spec.key)
                    .unwrap()
                    .value
                    .as_str()
                    .unwrap()
                    .to_string(),
            };
            // `auto` backends and last batches resolve to what the probe found.
            if *name != "auto" || !matches!(spec.key, "device.backend" | "data.last_batch") {
                assert_eq!(back, *name, "{}", spec.key);
            }
        }
    }
}

#[test]
fn the_plan_says_whether_burns_fusion_and_autotune_run_and_why() {
    let flex = plan_at(Level::Advanced);
    let g = &flex.graph_compilation;
    assert!(!g.fusion && !g.autotune);
    assert!(
        g.why.contains("eagerly") && g.why.contains("cuda build"),
        "{}",
        g.why
    );
    let shown = flex.to_string();
    assert!(
        shown.contains("burn fusion: off, autotune: off on flex"),
        "{shown}"
    );
    assert_eq!(flex.to_json()["graph_compilation"]["fusion"], false);
    // A cuda build on a machine with the driver: the CUDA backend gets both.
    let gpu = Hardware {
        cuda_compiled: true,
        cuda_driver: true,
        ..hw()
    };
    let mut c = KilnConfig::default();
    c.set("device.backend", "cuda").unwrap();
    let cuda = resolve(&c, &gpu).unwrap();
    assert!(cuda.graph_compilation.fusion && cuda.graph_compilation.autotune);
    assert!(
        cuda.to_string()
            .contains("burn fusion: on, autotune: on on cuda")
    );
}

/// On `cuda` the auto watermark and the budget are the GPU's memory, not the host's: a run
/// there adapts its batch before the device runs out, and a budget above host memory but
/// within the GPU's is accepted.
#[test]
fn on_cuda_the_watermark_and_the_budget_are_the_gpus_memory() {
    let gpu = gpu_hw(1);
    let mut c = KilnConfig::default();
    c.set_level(Level::Advanced);
    c.set("device.backend", "cuda").unwrap();
    let p = resolve(&c, &gpu).unwrap();
    assert_eq!(
        p.train.memory_watermark,
        Some(((80u64 << 10) as f64 * 0.85) as u64 * (1 << 20))
    );
    match &p.get("observe.memory_watermark_mib").unwrap().source {
        Source::Probe(why) => assert!(why.contains("85% of 80.0 GiB GPU memory"), "{why}"),
        other => panic!("watermark source {other}"),
    }
    assert_eq!(p.memory_limit(), Some((80 << 30, "GPU memory")));
    // 64 GiB: more than the host's 24 GiB, within the GPU's 80.
    c.set("device.memory_budget_mib", "65536").unwrap();
    assert_eq!(resolve(&c, &gpu).unwrap().memory_budget, Some(64 << 30));
    c.set("device.memory_budget_mib", "131072").unwrap();
    let err = resolve(&c, &gpu).unwrap_err().to_string();
    assert!(err.contains("80.0 GiB GPU memory"), "{err}");
    // `auto` picks cuda on such a machine, and the GPU's memory with it.
    let mut auto = KilnConfig::default();
    auto.set_level(Level::Advanced);
    assert_eq!(
        resolve(&auto, &gpu).unwrap().memory_limit(),
        Some((80 << 30, "GPU memory"))
    );
}

/// `train.data_parallel = "gpus"`: one rank per CUDA device the driver reports, shown in the
/// plan; on the CPU backend it is refused with what it needs.
#[test]
fn data_parallel_over_gpus_takes_every_cuda_device_or_says_why_not() {
    let gpus = gpu_hw(4);
    let mut c = KilnConfig::default();
    c.set("train.data_parallel", "gpus").unwrap();
    let p = resolve(&c, &gpus).unwrap();
    assert_eq!(p.data_parallel.gpus, Some(4));
    assert_eq!(p.to_json()["data_parallel"]["gpus"], 4);
    assert!(p.to_string().contains("one rank per GPU"), "{p}");
    let err = resolve(&c, &hw()).unwrap_err().to_string();
    assert!(err.contains("needs the cuda backend"), "{err}");
}

/// The kernel cache (issue 49, item 3) is on by default in the user's cache directory, the
/// plan says where, and a directory or `off` are taken as given; the step's sync interval
/// is auto by default and set by its key.
#[test]
fn the_kernel_cache_defaults_to_the_user_cache_and_the_plan_says_where() {
    let p = plan_at(Level::Basic);
    let cache = p
        .get("device.kernel_cache")
        .expect("the plan lists the key");
    if let Some(dir) = kiln::plan::autotune::user_kernel_cache() {
        assert_eq!(
            cache.value.as_str(),
            Some(dir.display().to_string().as_str())
        );
        assert!(matches!(&cache.source, Source::Probe(why) if why.contains("user cache")));
        assert!(dir.ends_with("kiln/cubecl"));
    }
    assert_eq!(p.train.sync_every, 0, "auto");
    let mut c = KilnConfig::default();
    c.set("device.kernel_cache", "off").unwrap();
    c.set("train.sync_every", "10").unwrap();
    let p = resolve(&c, &hw()).unwrap();
    let cache = p.get("device.kernel_cache").unwrap();
    assert_eq!(cache.value.as_str(), Some("off"));
    assert_eq!(p.train.sync_every, 10);
}

/// `data.last_batch = auto`: one shape per epoch on a GPU (padded), the short batch kept on
/// the CPU; the plan says why.
#[test]
fn the_last_batch_is_padded_on_a_gpu_and_kept_on_the_cpu() {
    let p = plan_at(Level::Basic);
    assert_eq!(p.train.last_batch, kiln::data::LastBatch::Keep);
    let mut c = KilnConfig::default();
    c.set("device.backend", "cuda").unwrap();
    let p = resolve(&c, &gpu_hw(1)).unwrap();
    assert_eq!(p.train.last_batch, kiln::data::LastBatch::Pad);
    let s = p.get("data.last_batch").unwrap();
    assert!(matches!(&s.source, Source::Probe(why) if why.contains("one shape per epoch")));
    c.set("data.last_batch", "drop").unwrap();
    assert_eq!(
        resolve(&c, &gpu_hw(1)).unwrap().train.last_batch,
        kiln::data::LastBatch::Drop
    );
}

#[test]
fn stream_settings_come_from_the_file_and_make_the_video_techniques() {
    use kiln::stream::{OverloadPolicy, StreamSettings};
    assert_eq!(plan_at(Level::Basic).stream, StreamSettings::default());
    let c = KilnConfig::from_toml_str(
        "[stream]\non_overload = \"drop-oldest\"\nqueue_frames = 2\ngate_threshold = 0.02\n\
         region_threshold = 0\nregion_margin = 16\nregion_max_age = 5\n",
        "kiln.toml",
    )
    .unwrap();
    let s = resolve(&c, &hw()).unwrap().stream;
    assert_eq!(s.on_overload, OverloadPolicy::DropOldest);
    assert_eq!(s.queue_frames, 2);
    let t = s.techniques();
    let (gate, regions) = (t.frame_gate.unwrap(), t.regions.unwrap());
    assert_eq!((gate.threshold, gate.max_reuse_age), (0.02, 5));
    // An integer literal is a float value; the crop aligns to the margin.
    assert_eq!(regions.threshold, 0.0);
    assert_eq!(
        (regions.margin, regions.align, regions.max_reuse_age),
        (16, 16, 5)
    );
    let err = KilnConfig::from_toml_str("[stream]\nqueue_frames = 0\n", "kiln.toml").unwrap_err();
    assert!(err.to_string().contains("stream.queue_frames"), "{err}");
}
