use super::*;

fn parse(text: &str) -> std::result::Result<ModelConfig, String> {
    ModelConfig::parse(text, Path::new("/models/m"))
}

#[test]
fn a_full_zoo_config_parses_with_paths_resolved() {
    let c = parse(
        r#"
backend = "zoo"
model = "cnn"
checkpoint = "ckpt/step-10.kiln"
passes = "strip,int8"
max_batch_size = 32
instances = 2
max_queue_size = 100
timeout_microseconds = 5000
[dynamic_batching]
max_queue_delay_microseconds = 250
preferred_batch_size = [32, 8]
"#,
    )
    .unwrap();
    assert_eq!(
        c.backend,
        BackendConfig::Zoo {
            model: "cnn".into(),
            checkpoint: PathBuf::from("/models/m/ckpt/step-10.kiln"),
            passes: "strip,int8".into(),
            input_shape: [1, 28, 28],
        }
    );
    assert_eq!(c.max_batch_size, 32);
    assert_eq!(c.instances, 2);
    assert_eq!(c.timeout, Some(Duration::from_micros(5000)));
    let b = c.dynamic_batching.unwrap();
    assert_eq!(b.preferred_batch_sizes, vec![8, 32]);
    assert_eq!(b.max_queue_delay, Duration::from_micros(250));
    assert!(c.kiln_kernels, "Kiln's kernels are on unless switched off");
}

#[test]
fn a_sequence_block_parses_into_stream_settings() {
    let c = parse(
        r#"
backend = "graph"
graph = "model.kgraph"
[sequence_batching]
frame_dims = [1, 56, 56]
regions = [[0, 0, 28, 28], [28, 28, 28, 28]]
region_gate = { threshold = 0.08, max_reuse_age = 30 }
max_sequence_idle_microseconds = 2000000
"#,
    )
    .unwrap();
    let seq = c.sequence.unwrap();
    assert_eq!(seq.frame_dims, [1, 56, 56]);
    assert_eq!(seq.max_idle, Duration::from_secs(2));
    let regions = seq.stream.regions.unwrap();
    assert_eq!(regions[1], kiln::stream::Roi::new(28, 28, 28, 28));
    assert_eq!(seq.stream.region_gate.unwrap().max_reuse_age, 30);
    assert!(seq.stream.frame_gate.is_none());
    assert!(seq.cascade.is_empty());
    assert!(
        parse("backend = \"graph\"\ngraph = \"g\"")
            .unwrap()
            .sequence
            .is_none()
    );
}

#[test]
fn version_policies_parse_and_select_like_tritons() {
    let policy = |text: &str| {
        parse(&format!("backend = \"identity\"\ndims = [4]\n{text}"))
            .unwrap()
            .version_policy
    };
    let on_disk = [1, 2, 5, 7];
    assert_eq!(policy(""), VersionPolicy::Latest(1));
    assert_eq!(policy("").select(&on_disk), vec![7]);
    let latest2 = policy("version_policy = { latest = 2 }");
    assert_eq!(latest2.select(&on_disk), vec![5, 7]);
    assert_eq!(latest2.select(&[3]), vec![3]);
    assert_eq!(
        policy("version_policy = \"all\"").select(&on_disk),
        on_disk.to_vec()
    );
    let specific = policy("version_policy = { specific = [2, 3, 7] }");
    assert_eq!(specific.select(&on_disk), vec![2, 7]);
}

#[test]
fn warmup_parses_with_defaults() {
    let c = parse("backend = \"identity\"\ndims = [4]\n[warmup]\ndata = \"random\"").unwrap();
    assert_eq!(
        c.warmup,
        Some(Warmup {
            batch_size: 1,
            count: 1,
            random: true
        })
    );
    assert!(
        parse("backend = \"identity\"\ndims = [4]")
            .unwrap()
            .warmup
            .is_none()
    );
}

#[test]
fn kiln_kernels_switch_per_model_where_a_model_runs_kernels() {
    let c = parse("backend = \"onnx\"\nfile = \"m.onnx\"\nkiln_kernels = false").unwrap();
    assert!(!c.kiln_kernels);
    let err = parse("backend = \"identity\"\ndims = [4]\nkiln_kernels = false").unwrap_err();
    assert!(
        err.contains("kiln_kernels") && err.contains("identity"),
        "{err}"
    );
}

#[test]
fn bad_configs_name_the_problem() {
    let cases = [
        (
            "backend = \"zoo\"\nmodel = \"cnn\"\ncheckpint = \"x\"",
            "unknown field `checkpint`",
        ),
        ("backend = \"tensorrt\"", "unknown backend `tensorrt`"),
        ("backend = \"zoo\"\nmodel = \"cnn\"", "needs `checkpoint`"),
        (
            "backend = \"identity\"\ndims = [4]\nmax_batch_size = 0",
            "max_batch_size",
        ),
        (
            "backend = \"identity\"\ndims = [4]\ndatatype = \"FP16\"",
            "FP16",
        ),
        (
            "backend = \"identity\"\ndims = [4]\nmax_batch_size = 8\n[dynamic_batching]\npreferred_batch_size = [16]",
            "preferred_batch_size 16",
        ),
        (
            "backend = \"identity\"\ndims = [4]\nmodel = \"cnn\"",
            "do not apply",
        ),
        (
            "backend = \"identity\"\ndims = [4]\ninstances = 0",
            "instances",
        ),
        (
            "backend = \"identity\"\ndims = [4]\nkind = \"KIND_TPU\"",
            "use KIND_CPU, KIND_GPU or KIND_AUTO",
        ),
        (
            "backend = \"graph\"\ngraph = \"g\"\n[sequence_batching]\nframe_dims = [1, 56, 56]\nregions = [[40, 0, 28, 28]]",
            "outside the 56×56 frame",
        ),
        (
            "backend = \"graph\"\ngraph = \"g\"\n[sequence_batching]\nframe_dims = [1, 56, 56]\nframe_gate = { threshold = -1.0, max_reuse_age = 3 }",
            "sequence_batching.frame_gate",
        ),
        (
            "backend = \"graph\"\ngraph = \"g\"\n[sequence_batching]\nframe_dims = [1, 56, 56]\nregoins = []",
            "unknown field `regoins`",
        ),
        (
            "backend = \"identity\"\ndims = [4]\n[sequence_batching]\nframe_dims = [1, 4, 4]",
            "not identity",
        ),
        (
            "backend = \"graph\"\ngraph = \"g\"\n[sequence_batching]\nframe_dims = [1, 56, 56]\ncascade = [{ graph = \"a\", file = \"b\", threshold = 0.5 }]",
            "exactly one of `graph`",
        ),
        (
            "backend = \"graph\"\ngraph = \"g\"\n[sequence_batching]\nframe_dims = [1, 56, 56]\ncascade = [{ graph = \"a\", threshold = 1.5 }]",
            "cascade[0].threshold 1.5",
        ),
        (
            "backend = \"onnx\"\nfile = \"m.onnx\"\n[sequence_batching]\nframe_dims = [3, 32, 32]\ntiles = { threshold = 0.1 }",
            "tiles belongs to a per-frame model",
        ),
        (
            "backend = \"onnx\"\nfile = \"m.onnx\"\n[sequence_batching]\nframe_dims = [3, 32, 32]\noutput = \"depth\"",
            "not one of classes, mask, image, boxes",
        ),
        (
            "backend = \"onnx\"\nfile = \"m.onnx\"\n[sequence_batching]\nframe_dims = [3, 32, 32]\noutput = \"mask\"\nregions = [[0, 0, 8, 8]]",
            "finds its regions itself",
        ),
        (
            "backend = \"onnx\"\nfile = \"m.onnx\"\n[sequence_batching]\nframe_dims = [3, 32, 32]\noutput = \"mask\"\ntiles = { thresold = 0.1 }",
            "unknown field `thresold`",
        ),
        (
            "backend = \"identity\"\ndims = [4]\nversion_policy = { latest = 0 }",
            "version_policy = { latest = N }",
        ),
        (
            "backend = \"identity\"\ndims = [4]\nversion_policy = \"newest\"",
            "is not a policy",
        ),
        (
            "backend = \"identity\"\ndims = [4]\nversion_policy = { specific = [0] }",
            "not a version number",
        ),
        (
            "backend = \"identity\"\ndims = [4]\nmax_batch_size = 4\n[warmup]\nbatch_size = 8",
            "warmup.batch_size 8",
        ),
        (
            "backend = \"identity\"\ndims = [4]\n[warmup]\ndata = \"ones\"",
            "warmup.data",
        ),
        (
            "backend = \"identity\"\ndims = [4]\n[warmup]\nbatchsize = 2",
            "unknown field `batchsize`",
        ),
        (
            "backend = \"graph\"\ngraph = \"g\"\n[sequence_batching]\nframe_dims = [1, 56, 56]\n[warmup]\ncount = 1",
            "not supported for stream models",
        ),
    ];
    for (text, expected) in cases {
        let err = parse(text).expect_err(text);
        assert!(
            err.contains(expected),
            "{text:?} → {err:?}, wanted {expected:?}"
        );
    }
}

/// `int8_layers` and `winograd_layers` (written by `kiln optimize --onnx` when a pass
/// measured faster on only some layers) parse for the onnx backend, an empty list included
/// (Winograd on no layer), and are refused, by name, for any other backend.
#[test]
fn layer_lists_belong_to_onnx_models() {
    for key in ["int8_layers", "winograd_layers"] {
        for (list, want) in [
            (
                r#"["/fc1/Gemm", "/fc2/Gemm"]"#,
                vec!["/fc1/Gemm", "/fc2/Gemm"],
            ),
            ("[]", Vec::new()),
        ] {
            let c = parse(&format!(
                "backend = \"onnx\"\nfile = \"model.onnx\"\npasses = \"fold,winograd,int8\"\n\
                 {key} = {list}\n"
            ))
            .unwrap();
            let BackendConfig::Onnx {
                int8_layers,
                winograd_layers,
                ..
            } = c.backend
            else {
                panic!("{:?}", c.backend);
            };
            let got = if key == "int8_layers" {
                int8_layers
            } else {
                winograd_layers
            };
            let want: Vec<String> = want.into_iter().map(String::from).collect();
            assert_eq!(got, Some(want), "{key}");
        }
        let err = parse(&format!(
            "backend = \"graph\"\ngraph = \"model.kgraph\"\n{key} = [\"fc1\"]\n"
        ))
        .unwrap_err();
        assert!(err.contains(key), "{err}");
    }
}
