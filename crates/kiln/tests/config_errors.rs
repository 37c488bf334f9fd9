//! Every kind of bad configuration gets an error that names the key, the value and what is
//! allowed.

use kiln::KilnConfig;
use kiln::KilnError;
use kiln::plan::{Hardware, resolve};

fn parse(text: &str) -> Result<KilnConfig, KilnError> {
    KilnConfig::from_toml_str(text, "kiln.toml")
}

fn message(err: KilnError) -> String {
    err.to_string()
}

#[test]
fn unknown_key_names_the_key_and_suggests_the_closest() {
    let err = parse("[train]\nepoch = 3\n").unwrap_err();
    assert!(matches!(err, KilnError::UnknownKey { .. }));
    let msg = message(err);
    assert!(msg.contains("`train.epoch`"), "{msg}");
    assert!(msg.contains("did you mean `train.epochs`"), "{msg}");
}

#[test]
fn unknown_table_is_an_unknown_key() {
    let msg = message(parse("[trian]\nepochs = 3\n").unwrap_err());
    assert!(msg.contains("`trian.epochs`"), "{msg}");
    assert!(msg.contains("train.epochs"), "{msg}");
}

#[test]
fn wrong_type_names_key_value_and_expected_type() {
    let msg = message(parse("[train]\nepochs = \"three\"\n").unwrap_err());
    assert!(msg.contains("train.epochs"), "{msg}");
    assert!(msg.contains("\"three\""), "{msg}");
    assert!(msg.contains("an integer in [1, 100000]"), "{msg}");
}

#[test]
fn out_of_range_value_is_rejected() {
    let msg = message(parse("[train]\nlr = -0.5\n").unwrap_err());
    assert!(msg.contains("train.lr") && msg.contains("-0.5"), "{msg}");
    assert!(msg.contains("a number in"), "{msg}");
    let msg = message(parse("[train]\nbatch_size = 0\n").unwrap_err());
    assert!(
        msg.contains("train.batch_size") && msg.contains('0'),
        "{msg}"
    );
}

#[test]
fn bad_enum_value_lists_the_choices() {
    let msg = message(parse("[train]\noptimizer = \"lbfgs\"\n").unwrap_err());
    assert!(msg.contains("one of adam, adamw, sgd"), "{msg}");
    let msg = message(parse("[precision]\npolicy = \"fp8\"\n").unwrap_err());
    assert!(
        msg.contains("precision.policy") && msg.contains("fp8"),
        "{msg}"
    );
}

#[test]
fn bad_level_lists_the_levels() {
    let msg = message(parse("level = \"turbo\"\n").unwrap_err());
    assert!(msg.contains("turbo"), "{msg}");
    assert!(msg.contains("basic, advanced, ultra, custom"), "{msg}");
}

#[test]
fn toml_syntax_error_names_the_file_and_position() {
    let msg = message(parse("[train\nepochs = 3\n").unwrap_err());
    assert!(msg.contains("kiln.toml"), "{msg}");
    assert!(msg.contains("line 1"), "{msg}");
}

#[test]
fn missing_file_is_an_io_error_with_the_path() {
    let msg = message(KilnConfig::load("/nonexistent/kiln.toml").unwrap_err());
    assert!(msg.contains("/nonexistent/kiln.toml"), "{msg}");
}

#[test]
fn flag_values_are_parsed_by_the_keys_type() {
    let mut c = KilnConfig::default();
    let msg = message(c.set("train.epochs", "two").unwrap_err());
    assert!(
        msg.contains("train.epochs") && msg.contains("\"two\""),
        "{msg}"
    );
    let msg = message(c.set("train.nope", "1").unwrap_err());
    assert!(msg.contains("unknown config key `train.nope`"), "{msg}");
    let msg = message(c.set_pair("train.lr").unwrap_err());
    assert!(msg.contains("key=value"), "{msg}");
    c.set_pair("train.lr = 0.01").unwrap();
}

#[test]
fn contradictory_settings_are_rejected_at_resolution() {
    let c = parse("[train]\ncheckpoint_every_steps = 10\n").unwrap();
    let msg = message(resolve(&c, &Hardware::probe()).unwrap_err());
    assert!(msg.contains("train.checkpoint_dir"), "{msg}");
}

#[test]
fn cuda_without_the_feature_says_how_to_get_it() {
    let c = parse("[device]\nbackend = \"cuda\"\n").unwrap();
    let hw = Hardware {
        cores: 2,
        cuda_compiled: false,
        cuda_driver: false,
        memory: None,
        gpu_count: 0,
        gpu_memory: None,
    };
    let msg = message(resolve(&c, &hw).unwrap_err());
    assert!(msg.contains("--features cuda"), "{msg}");
    // Built with CUDA but no driver: a clear error, not cudarc's panic on a worker thread.
    let hw = Hardware {
        cores: 2,
        cuda_compiled: true,
        cuda_driver: false,
        memory: None,
        gpu_count: 0,
        gpu_memory: None,
    };
    let msg = message(resolve(&c, &hw).unwrap_err());
    assert!(
        msg.contains("libcuda.so.1") && msg.contains("flex"),
        "{msg}"
    );
}

#[test]
fn bad_data_loader_values_name_what_is_allowed() {
    let msg = message(parse("[data]\nworkers = \"many\"\n").unwrap_err());
    assert!(msg.contains("data.workers"), "{msg}");
    assert!(msg.contains("\"auto\" or an integer in [0, 256]"), "{msg}");
    let msg = message(parse("[data]\nworkers = -1\n").unwrap_err());
    assert!(msg.contains("data.workers"), "{msg}");
    let msg = message(parse("[data]\naugment = \"mixup\"\n").unwrap_err());
    assert!(msg.contains("crop-flip"), "{msg}");
    let msg = message(parse("[data]\nprefetch_factor = 0\n").unwrap_err());
    assert!(msg.contains("an integer in [1, 64]"), "{msg}");
    assert!(parse("[data]\nworkers = \"auto\"\n").is_ok());
}
