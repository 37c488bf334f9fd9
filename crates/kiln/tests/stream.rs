//! Real-time inference end to end: the zoo's stream models trained on the bundled MNIST (seen
//! as the stream shows digits), the synthetic video, and each technique alone and mixed
//! measured against the full model on every region of every frame: the accuracy band and the
//! share of work skipped. Speed itself is `kiln bench --mode stream`'s, not a test's.

use burn::tensor::Device;
use kiln::datasets::{Split, bundled};
use kiln::stream::{
    BurnClassifier, EarlyExit, Frame, FrameClassifier, FullDepth, GateConfig, MultiScale, Roi,
    StreamConfig, StreamProcessor, StreamRun, SyntheticVideo, VideoSpec, run_stream,
};

fn show(run: &StreamRun) {
    eprintln!(
        "{:<16} acc {:.4} agree {:?} frames {:?} regions {:?}",
        run.name, run.accuracy, run.agreement, run.frame_paths, run.region_paths
    );
}

#[test]
fn each_technique_and_their_mix_keep_accuracy_while_skipping_work() {
    let device = Device::flex();
    let train = bundled(Split::Train).unwrap();
    let test = bundled(Split::Test).unwrap();
    let spec = VideoSpec {
        frames: 300,
        ..VideoSpec::default()
    };
    let models = kiln::zoo::train_stream_models(&train, &test, &spec, 2, &device).unwrap();
    assert!(
        models.multi_exit_accuracy > 0.9,
        "{}",
        models.multi_exit_accuracy
    );
    assert!(models.coarse_accuracy > 0.85, "{}", models.coarse_accuracy);
    let video = SyntheticVideo::generate(&test, &spec).unwrap();
    let grid = StreamConfig {
        regions: Some(video.regions.clone()),
        ..StreamConfig::default()
    };
    let full = FullDepth(models.multi_exit.clone());
    let reference = run_stream("full", &video, &grid, &full, &device, None).unwrap();
    show(&reference);
    assert!(
        reference.accuracy > 0.85,
        "the full model knows the stream's digits"
    );
    assert_eq!(reference.region_share("full"), 1.0);
    let refp = Some(reference.predictions.as_slice());

    let temporal = StreamConfig {
        frame_gate: Some(GateConfig {
            threshold: 0.05,
            max_reuse_age: 30,
        }),
        ..grid.clone()
    };
    let roi = StreamConfig {
        region_gate: Some(GateConfig {
            threshold: 0.08,
            max_reuse_age: 30,
        }),
        ..grid.clone()
    };
    let early = EarlyExit::new(models.multi_exit.clone(), vec![0.9]).unwrap();
    let coarse = BurnClassifier::new(models.coarse.clone(), [1, 14, 14]);
    let multi = MultiScale::new(coarse, FullDepth(models.multi_exit.clone()), 0.9).unwrap();
    // (name, config, model, the path that must carry part of the work, its least share)
    let runs: Vec<(&str, &StreamConfig, &dyn FrameClassifier, &str, f64)> = vec![
        ("temporal", &temporal, &full, "reused", 0.25),
        ("roi", &roi, &full, "reused", 0.6),
        ("early-exit", &grid, &early, "exit0", 0.2),
        ("multi-scale", &grid, &multi, "coarse", 0.2),
        ("roi+early-exit", &roi, &early, "reused", 0.6),
    ];
    for (name, config, model, path, least) in runs {
        let run = run_stream(name, &video, config, model, &device, refp).unwrap();
        show(&run);
        let agreement = run.agreement.unwrap();
        assert!(
            agreement >= 0.98,
            "{name}: agreement with the full model {agreement}"
        );
        assert!(
            run.accuracy >= reference.accuracy - 0.01,
            "{name}: accuracy {} vs full {}",
            run.accuracy,
            reference.accuracy
        );
        let got = run.region_share(path);
        assert!(got >= least, "{name}: share of `{path}` {got} < {least}");
        if name == "roi+early-exit" {
            assert!(run.region_share("exit0") > 0.0, "the mix also exits early");
        }
    }
}

/// A model that answers class 0 with full confidence, counting its calls.
struct Counting {
    calls: std::cell::Cell<usize>,
}

impl FrameClassifier for Counting {
    fn input_shape(&self) -> [usize; 3] {
        [1, 4, 4]
    }

    fn classify(
        &self,
        images: burn::tensor::Tensor<4>,
    ) -> kiln::Result<Vec<kiln::stream::Prediction>> {
        self.calls.set(self.calls.get() + 1);
        let rows = images.dims()[0];
        Ok(vec![
            kiln::stream::Prediction {
                class: 0,
                confidence: 1.0,
                route: kiln::stream::Route::Full,
            };
            rows
        ])
    }
}

#[test]
fn bad_frames_regions_and_settings_get_clear_errors_and_leave_the_stream_usable() {
    let device = Device::flex();
    let model = Counting {
        calls: std::cell::Cell::new(0),
    };
    let config = StreamConfig {
        regions: Some(vec![Roi::new(0, 0, 4, 4), Roi::new(4, 0, 4, 4)]),
        region_gate: Some(GateConfig {
            threshold: 0.1,
            max_reuse_age: 5,
        }),
        ..StreamConfig::default()
    };
    let mut stream = StreamProcessor::new([1, 4, 8], &config, &device).unwrap();
    let frame = Frame::new([1, 4, 8], vec![0.0; 32]).unwrap();
    let first = stream.process(&frame, &model).unwrap();
    assert_eq!(first.regions.len(), 2);
    assert_eq!(model.calls.get(), 1, "both regions in one batch");

    let wrong = Frame::new([1, 8, 4], vec![0.0; 32]).unwrap();
    let err = stream.process(&wrong, &model).unwrap_err().to_string();
    assert!(
        err.contains("[1, 8, 4]") && err.contains("[1, 4, 8]"),
        "{err}"
    );
    // The stream goes on as before: an unchanged frame reuses both results.
    let again = stream.process(&frame, &model).unwrap();
    assert!(again.regions.iter().all(|r| !r.fresh));
    assert_eq!(model.calls.get(), 1);

    let err = Frame::new([1, 4, 8], vec![0.0; 31])
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs 32 values, got 31"), "{err}");
    let outside = StreamConfig {
        regions: Some(vec![Roi::new(6, 0, 4, 4)]),
        ..StreamConfig::default()
    };
    let err = StreamProcessor::new([1, 4, 8], &outside, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("outside the 8×4 frame"), "{err}");
    let nan_gate = StreamConfig {
        frame_gate: Some(GateConfig {
            threshold: f32::NAN,
            max_reuse_age: 1,
        }),
        ..StreamConfig::default()
    };
    assert!(StreamProcessor::new([1, 4, 8], &nan_gate, &device).is_err());

    let cnn = kiln::zoo::MultiExitCnn::new(&device);
    let err = EarlyExit::new(cnn.clone(), vec![0.5, 0.5])
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 exits needs 1"), "{err}");
    let err = EarlyExit::new(cnn.clone(), vec![1.5])
        .unwrap_err()
        .to_string();
    assert!(err.contains("outside [0, 1]"), "{err}");
    let coarse = BurnClassifier::new(kiln::zoo::CoarseCnn::new(&device), [1, 14, 14]);
    let err = MultiScale::new(coarse, FullDepth(cnn), 0.5);
    assert!(err.is_ok(), "14×14 under 28×28 is a factor of 2");
    let odd = BurnClassifier::new(kiln::zoo::CoarseCnn::new(&device), [1, 10, 10]);
    let err = MultiScale::new(odd, FullDepth(kiln::zoo::MultiExitCnn::new(&device)), 0.5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("integer factor"), "{err}");
}

#[test]
fn early_exit_answers_every_sample_from_the_right_exit_in_order() {
    let device = Device::flex();
    let cnn = kiln::zoo::MultiExitCnn::new(&device);
    let images = burn::tensor::Tensor::<4>::random(
        [6, 1, 28, 28],
        burn::tensor::Distribution::Normal(0.0, 1.0),
        &device,
    );
    let full = FullDepth(cnn.clone()).classify(images.clone()).unwrap();
    // Threshold 0: exit 0 answers all; threshold 1: (almost) all go deep and equal the full
    // network's answers, row for row.
    let none_deep = EarlyExit::new(cnn.clone(), vec![0.0]).unwrap();
    let p = none_deep.classify(images.clone()).unwrap();
    assert!(p.iter().all(|p| p.route == kiln::stream::Route::Exit(0)));
    let all_deep = EarlyExit::new(cnn, vec![1.0]).unwrap();
    let p = all_deep.classify(images).unwrap();
    assert_eq!(p.len(), 6);
    for (a, b) in p.iter().zip(&full) {
        if a.route == kiln::stream::Route::Exit(1) {
            assert_eq!(a.class, b.class);
            assert!((a.confidence - b.confidence).abs() < 1e-5);
        }
    }
}

/// A cascade of a coarse model and the full one answers exactly what the typed multi-scale
/// runner does (route `Exit(0)` = coarse, `Exit(1)` = fine).
#[test]
fn a_two_stage_cascade_equals_the_multi_scale_runner() {
    let device = Device::flex();
    let coarse = kiln::zoo::CoarseCnn::new(&device);
    let full = kiln::zoo::MultiExitCnn::new(&device);
    let images = burn::tensor::Tensor::<4>::random(
        [16, 1, 28, 28],
        burn::tensor::Distribution::Normal(0.0, 1.0),
        &device,
    );
    // The median of the coarse model's confidences splits the rows between the two stages.
    let mut confidences: Vec<f32> = BurnClassifier::new(coarse.clone(), [1, 14, 14])
        .classify(kiln::stream::downscale(images.clone(), 2).unwrap())
        .unwrap()
        .iter()
        .map(|p| p.confidence)
        .collect();
    confidences.sort_by(f32::total_cmp);
    let threshold = confidences[confidences.len() / 2];
    let multi = MultiScale::new(
        BurnClassifier::new(coarse.clone(), [1, 14, 14]),
        FullDepth(full.clone()),
        threshold,
    )
    .unwrap();
    let cascade = kiln::stream::Cascade::new(
        vec![kiln::stream::Stage {
            model: Box::new(BurnClassifier::new(coarse, [1, 14, 14])),
            threshold,
        }],
        Box::new(FullDepth(full)),
    )
    .unwrap();
    let a = multi.classify(images.clone()).unwrap();
    let b = cascade.classify(images).unwrap();
    let mut routes = std::collections::BTreeSet::new();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.class, y.class);
        assert!((x.confidence - y.confidence).abs() < 1e-6);
        let expected = match x.route {
            kiln::stream::Route::Coarse => kiln::stream::Route::Exit(0),
            _ => kiln::stream::Route::Exit(1),
        };
        assert_eq!(y.route, expected);
        routes.insert(format!("{:?}", y.route));
    }
    assert_eq!(
        routes.len(),
        2,
        "both stages answered some rows: {routes:?}"
    );
    let bad = kiln::stream::Cascade::new(
        vec![kiln::stream::Stage {
            model: Box::new(BurnClassifier::new(
                kiln::zoo::CoarseCnn::new(&device),
                [1, 10, 10],
            )),
            threshold: 0.5,
        }],
        Box::new(FullDepth(kiln::zoo::MultiExitCnn::new(&device))),
    )
    .unwrap_err()
    .to_string();
    assert!(
        bad.contains("cascade stage 0") && bad.contains("integer factor"),
        "{bad}"
    );
}

/// An imported ONNX classifier (a real torchvision-style export) is a stream's model like any
/// other; a model that is not one image classifier is refused by name.
#[test]
fn an_imported_onnx_classifier_serves_a_stream() {
    let device = Device::flex();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx");
    let model = kiln::onnx::OnnxModel::load(&dir.join("resnet.onnx"), &device).unwrap();
    let classifier = kiln::stream::OnnxClassifier::new(model).unwrap();
    let [c, h, w] = classifier.input_shape();
    // Two regions side by side, each the model's input size.
    let frame_shape = [c, h, 2 * w];
    let n: usize = frame_shape.iter().product();
    let pixels: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0)
        .collect();
    let frame = Frame::new(frame_shape, pixels).unwrap();
    let config = StreamConfig {
        regions: Some(vec![Roi::new(0, 0, w, h), Roi::new(w, 0, w, h)]),
        region_gate: Some(GateConfig {
            threshold: 0.01,
            max_reuse_age: 10,
        }),
        ..StreamConfig::default()
    };
    let mut stream = StreamProcessor::new(frame_shape, &config, &device).unwrap();
    let first = stream.process(&frame, &classifier).unwrap();
    let crops = kiln::stream::crop_batch(
        &frame,
        &[Roi::new(0, 0, w, h), Roi::new(w, 0, w, h)],
        [c, h, w],
        &device,
    )
    .unwrap();
    let direct = classifier.classify(crops).unwrap();
    for (r, d) in first.regions.iter().zip(&direct) {
        assert_eq!(r.prediction.class, d.class);
        assert!(r.fresh);
    }
    let again = stream.process(&frame, &classifier).unwrap();
    assert!(
        again.regions.iter().all(|r| !r.fresh),
        "an unchanged frame reuses"
    );

    let bert = kiln::onnx::OnnxModel::load(&dir.join("bert.onnx"), &device).unwrap();
    let err = kiln::stream::OnnxClassifier::new(bert)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a single-image classifier"), "{err}");
}

/// A region's result is never reused for more than its gate's age, even while the frame gate
/// keeps reusing whole frames (the region gates see none of those frames).
#[test]
fn reuse_ages_hold_across_the_frame_and_region_gates() {
    let device = Device::flex();
    let model = Counting {
        calls: std::cell::Cell::new(0),
    };
    let config = StreamConfig {
        regions: Some(vec![Roi::new(0, 0, 4, 4), Roi::new(4, 0, 4, 4)]),
        frame_gate: Some(GateConfig {
            threshold: 0.1,
            max_reuse_age: 100,
        }),
        region_gate: Some(GateConfig {
            threshold: 0.1,
            max_reuse_age: 2,
        }),
    };
    let mut stream = StreamProcessor::new([1, 4, 8], &config, &device).unwrap();
    let frame = Frame::new([1, 4, 8], vec![0.0; 32]).unwrap();
    let fresh: Vec<bool> = (0..8)
        .map(|_| stream.process(&frame, &model).unwrap().regions[0].fresh)
        .collect();
    assert_eq!(
        fresh,
        [true, false, false, true, false, false, true, false],
        "a static scene recomputes every third frame"
    );
    assert_eq!(model.calls.get(), 3);
}
