//! Observability end to end: TensorBoard event files hold the run's values (checked by
//! decoding them here and, where installed, by TensorBoard's own reader); memory watermark
//! events fire at the threshold and drive OOM-adaptive batching. The profiler's trace is
//! checked in `profile_trace.rs`.

mod common;

use burn::tensor::Device;
use kiln::burn;
use kiln::datasets::{Split, bundled};
use kiln::observe::tensorboard::masked_crc;
use kiln::observe::{Event, EventSink, FanOut, MemorySink, TensorBoardSink};
use kiln::train::TrainOptions;
use kiln::zoo::ModelKind;
use kiln::{Trainer, observe};

/// A tfevents record stream: (payload) per record, CRCs checked.
fn records(bytes: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(len_crc, masked_crc(len_bytes), "length CRC");
        let data = &bytes[at + 12..at + 12 + len];
        let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(crc, masked_crc(data), "data CRC");
        out.push(data);
        at += 16 + len;
    }
    out
}

/// Minimal protobuf reader: (field, wire type, value bytes or varint) for one message.
fn fields(mut b: &[u8]) -> Vec<(u64, u8, Vec<u8>, u64)> {
    fn varint(b: &mut &[u8]) -> u64 {
        let mut v = 0u64;
        let mut shift = 0;
        loop {
            let byte = b[0];
            *b = &b[1..];
            v |= ((byte & 0x7F) as u64) << shift;
            if byte < 0x80 {
                return v;
            }
            shift += 7;
        }
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b);
        let (field, wire) = (key >> 3, (key & 7) as u8);
        match wire {
            0 => {
                let v = varint(&mut b);
                out.push((field, 0, Vec::new(), v));
            }
            1 => {
                out.push((field, 1, b[..8].to_vec(), 0));
                b = &b[8..];
            }
            2 => {
                let n = varint(&mut b) as usize;
                out.push((field, 2, b[..n].to_vec(), 0));
                b = &b[n..];
            }
            5 => {
                out.push((field, 5, b[..4].to_vec(), 0));
                b = &b[4..];
            }
            w => panic!("unexpected wire type {w}"),
        }
    }
    out
}

/// (step, tag, value) of every scalar in an event file.
fn decoded_scalars(bytes: &[u8]) -> (Option<String>, Vec<(i64, String, f32)>) {
    let mut version = None;
    let mut out = Vec::new();
    for rec in records(bytes) {
        let event = fields(rec);
        let step = event.iter().find(|f| f.0 == 2).map_or(0, |f| f.3 as i64);
        for f in &event {
            if f.0 == 3 {
                version = Some(String::from_utf8(f.2.clone()).unwrap());
            }
            if f.0 == 5 {
                for value in fields(&f.2).into_iter().filter(|v| v.0 == 1) {
                    let v = fields(&value.2);
                    let tag = v.iter().find(|x| x.0 == 1).map(|x| x.2.clone());
                    let simple = v.iter().find(|x| x.0 == 2 && x.1 == 5);
                    if let (Some(tag), Some(simple)) = (tag, simple) {
                        let value = f32::from_le_bytes(simple.2[..4].try_into().unwrap());
                        out.push((step, String::from_utf8(tag).unwrap(), value));
                    }
                }
            }
        }
    }
    (version, out)
}

#[test]
fn tensorboard_event_files_hold_the_runs_values() {
    let dir = common::tempdir("observe", "tensorboard");
    let data = bundled(Split::Train).unwrap().take(192);
    let test = bundled(Split::Test).unwrap().take(100);
    let mut memory = MemorySink::default();
    let mut tb = TensorBoardSink::create(&dir).unwrap();
    let path = tb.path().unwrap().to_path_buf();
    {
        let mut fan = FanOut::new().with(&mut memory).with(&mut tb);
        let sink: &mut dyn EventSink = &mut fan;
        Trainer::new(
            TrainOptions {
                batch_size: 32,
                epochs: 2,
                ..TrainOptions::default()
            },
            Device::flex(),
            sink,
        )
        .with_plan(serde_json::json!({
            "level": "basic",
            "settings": {"train.lr": {"value": 0.001, "source": "default"}},
        }))
        .fit("mlp", |d| ModelKind::Mlp.init(d), &data, Some(&test))
        .unwrap();
    }
    drop(tb);
    let bytes = std::fs::read(&path).unwrap();
    let (version, scalars) = decoded_scalars(&bytes);
    assert_eq!(version.as_deref(), Some("brain.Event:2"));
    let steps: Vec<_> = memory.steps().cloned().collect();
    assert_eq!(steps.len(), 12);
    for s in &steps {
        let loss = scalars
            .iter()
            .find(|(step, tag, _)| *step == s.step as i64 && tag == "train/loss")
            .unwrap_or_else(|| panic!("no train/loss at step {}", s.step));
        assert_eq!(loss.2, s.loss);
    }
    let accuracy: Vec<f32> = memory
        .events
        .iter()
        .filter_map(|e| match e {
            Event::EpochEnd(e) => e.test_accuracy.map(|a| a as f32),
            _ => None,
        })
        .collect();
    let logged: Vec<f32> = scalars
        .iter()
        .filter(|(_, tag, _)| tag == "eval/accuracy")
        .map(|s| s.2)
        .collect();
    assert_eq!(logged, accuracy);

    // TensorBoard's own reader must see the same values and the plan text.
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_tb = std::process::Command::new(&python)
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_tb {
        assert!(
            std::env::var_os("KILN_REQUIRE_TENSORBOARD").is_none(),
            "KILN_REQUIRE_TENSORBOARD is set but `{python} -c 'import tensorboard'` fails"
        );
        eprintln!(
            "SKIPPED the TensorBoard reader check: tensorboard is not installed for `{python}` \
             (pip install tensorboard, or set KILN_PYTHON)"
        );
        return;
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tb_check.py");
    let out = std::process::Command::new(&python)
        .arg(script)
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(read["version"], "brain.Event:2");
    let tb_scalars = read["scalars"].as_array().unwrap();
    assert_eq!(
        tb_scalars.len(),
        scalars.len(),
        "TensorBoard sees every scalar"
    );
    for (mine, theirs) in scalars.iter().zip(tb_scalars) {
        assert_eq!(theirs[0].as_i64().unwrap(), mine.0);
        assert_eq!(theirs[1].as_str().unwrap(), mine.1);
        assert_eq!(theirs[2].as_f64().unwrap() as f32, mine.2);
    }
    let plan = read["texts"]["plan"].as_str().expect("plan text");
    assert!(plan.contains("| train.lr | 0.001 | default |"), "{plan}");
}

#[test]
fn memory_watermark_events_fire_at_the_threshold() {
    let rss = observe::memory::current_rss_bytes().expect("Linux /proc");
    // Below the current RSS: must fire after the first step, exactly once (RSS stays above).
    let (_, sink) = common::profiled_run(
        5,
        TrainOptions {
            memory_watermark: Some(rss / 2),
            ..TrainOptions::default()
        },
    );
    let marks: Vec<_> = sink
        .events
        .iter()
        .filter_map(|e| match e {
            Event::MemoryWatermark(m) => Some(m.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(marks.len(), 1, "{marks:?}");
    assert_eq!(marks[0].step, 1);
    assert_eq!(marks[0].threshold_bytes, rss / 2);
    assert!(marks[0].in_use_bytes >= marks[0].threshold_bytes);
    // Far above: never.
    let (_, sink) = common::profiled_run(
        5,
        TrainOptions {
            memory_watermark: Some(1 << 50),
            ..TrainOptions::default()
        },
    );
    assert!(
        !sink
            .events
            .iter()
            .any(|e| matches!(e, Event::MemoryWatermark(_)))
    );
}

#[test]
fn a_watermark_crossing_halves_the_micro_batch_and_keeps_the_effective_batch() {
    use kiln::train::flatten_params;
    let data = bundled(Split::Train).unwrap().take(320);
    let train = |watermark: Option<u64>| {
        let mut sink = MemorySink::default();
        let out = Trainer::new(
            TrainOptions {
                batch_size: 32,
                epochs: 2,
                eval_every_epochs: 0,
                workers: Some(2),
                memory_watermark: watermark,
                oom_adaptive: true,
                ..TrainOptions::default()
            },
            Device::flex(),
            &mut sink,
        )
        .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
        .unwrap();
        (flatten_params(&out.model), sink)
    };
    // Forced: a watermark under the current RSS crosses after the first step, and every
    // step after it (memory never falls below half of what is resident now), so the trainer
    // halves after each step until the micro-batch is 1: the watermark re-arms after each
    // halving instead of waiting for memory to fall below 90% (which retained pages never
    // let happen). Where the heap is counted it stops once the step fits: oom_adaptive.rs.
    let rss = observe::memory::current_rss_bytes().expect("Linux /proc");
    let (adapted, sink) = train(Some(rss / 2));
    let changes: Vec<_> = sink
        .events
        .iter()
        .filter_map(|e| match e {
            Event::BatchAdapted(b) => {
                Some((b.step, b.micro_batch, b.grad_accum_steps, b.effective_batch))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        changes,
        vec![
            (1, 16, 2, 32),
            (2, 8, 4, 32),
            (3, 4, 8, 32),
            (4, 2, 16, 32),
            (5, 1, 32, 32)
        ]
    );
    let samples: Vec<usize> = sink.steps().map(|s| s.samples).collect();
    assert_eq!(samples, vec![32; 20], "same steps, same samples per step");
    // The same trajectory as without adaptation, up to summation order.
    let (plain, _) = train(None);
    let (_, max_diff) = common::bitwise_differences(&adapted, &plain);
    assert!(max_diff < 1e-4, "adapted run drifted by {max_diff}");
}
