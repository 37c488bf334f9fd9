//! Kiln's device-side optimizers against Burn's: the fused flex Adam to the bit, the generic
//! tensor-op forms within f32 rounding, a skipped step leaving everything as it was, and
//! Burn's record layout kept.

use super::*;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamState, AdamWConfig, AdaptiveMomentumState, SgdConfig};
use burn::tensor::{Distribution, TensorData};

fn values<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.to_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 values")
}

fn adam(decay: f32, decoupled: bool) -> DeviceAdam {
    DeviceAdam {
        betas: ADAM_BETAS,
        epsilon: ADAM_EPSILON,
        weight_decay: decay,
        decoupled,
    }
}

/// A parameter large enough to split over the threads and three gradients for it.
fn problem(device: &Device) -> (Tensor<2>, Vec<Tensor<2>>) {
    let shape = [300, 700];
    let init = Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), device);
    let grads = (0..3)
        .map(|_| Tensor::random(shape, Distribution::Normal(0.0, 0.1), device))
        .collect();
    (init, grads)
}

/// Runs three updates with `ours` and `burn`, returning both parameters and the start.
fn race<O: Optimizer, P: Optimizer>(ours: &O, burn: &P) -> [Vec<f32>; 3] {
    let device = Device::flex();
    let (init, grads) = problem(&device);
    let mut a = (init.clone(), None);
    let mut b = (init.clone(), None);
    for (i, g) in grads.into_iter().enumerate() {
        let lr = 1e-3 * (i + 1) as f64;
        a = ours.step(lr, a.0, g.clone(), a.1);
        b = burn.step(lr, b.0, g, b.1);
    }
    [values(&a.0), values(&b.0), values(&init)]
}

/// The largest difference of the two runs' updates, relative to the largest update: the
/// parameters themselves agree to their own rounding, which would hide a wrong update.
fn update_error([a, b, init]: &[Vec<f32>; 3]) -> f32 {
    let largest = b
        .iter()
        .zip(init)
        .map(|(y, i)| (y - i).abs())
        .fold(0.0, f32::max);
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    worst / largest
}

#[test]
fn fused_adam_matches_burns_adam_to_the_bit() {
    for decay in [0.0, 0.01] {
        let decay_config = (decay > 0.0).then(|| WeightDecayConfig::new(decay));
        let burn = AdamConfig::new()
            .with_epsilon(ADAM_EPSILON)
            .with_weight_decay(decay_config)
            .build();
        let [ours, theirs, _] = race(&adam(decay, false), &burn);
        assert!(ours == theirs, "decay {decay}: parameters differ");
    }
}

#[test]
fn tensor_op_forms_match_burns_optimizers() {
    // Kiln's kernels off: the generic path every other device takes.
    let _burn_only = kernels::Scope::enter(false);
    let burn_adam = AdamConfig::new()
        .with_epsilon(ADAM_EPSILON)
        .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
        .build();
    let err = update_error(&race(&adam(0.01, false), &burn_adam));
    assert!(err < 1e-4, "Adam: updates differ by {err} of the largest");

    let burn_adamw = AdamWConfig::new()
        .with_epsilon(ADAM_EPSILON)
        .with_weight_decay(0.05)
        .build();
    let err = update_error(&race(&adam(0.05, true), &burn_adamw));
    assert!(err < 1e-4, "AdamW: updates differ by {err} of the largest");

    let burn_sgd = SgdConfig::new()
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_dampening(0.0),
        ))
        .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
        .build();
    let sgd = DeviceSgd {
        momentum: 0.9,
        weight_decay: 0.01,
    };
    let [ours, theirs, _] = race(&sgd, &burn_sgd);
    assert!(ours == theirs, "SGD differs from Burn's");
}

/// Steps with `apply` = 1, 0, 1 under a step context: the skipped step changes nothing, so
/// the run equals two plain steps.
fn skip_is_a_select(optim: &impl Optimizer) {
    let device = Device::flex();
    let (init, grads) = problem(&device);
    let step = |apply: f32, p, g, s| {
        let _ctx = context::enter(StepContext {
            apply: Tensor::full([1], apply, &device),
            grad_factor: None,
        });
        optim.step(1e-2, p, g, s)
    };
    let nan = Tensor::<2>::full([300, 700], f32::NAN, &device);
    let (p, s) = step(1.0, init.clone(), grads[0].clone(), None);
    let before = values(&p);
    let (p, s) = step(0.0, p, nan, s);
    assert!(values(&p) == before, "a skipped step changed the parameter");
    let (skipped_run, _) = step(1.0, p, grads[1].clone(), s);
    let (p, s) = optim.step(1e-2, init, grads[0].clone(), None);
    let (plain_run, _) = optim.step(1e-2, p, grads[1].clone(), s);
    assert!(
        values(&skipped_run) == values(&plain_run),
        "the step after a skip is not the next plain step"
    );
}

#[test]
fn a_skipped_step_leaves_parameter_and_state_unchanged() {
    for kiln in [true, false] {
        let _scope = kernels::Scope::enter(kiln);
        skip_is_a_select(&adam(0.01, false));
        skip_is_a_select(&adam(0.01, true));
        skip_is_a_select(&DeviceSgd {
            momentum: 0.9,
            weight_decay: 0.0,
        });
    }
}

#[test]
fn a_skipped_first_step_leaves_no_state_behind() {
    let device = Device::flex();
    let (init, grads) = problem(&device);
    for kiln in [true, false] {
        let _scope = kernels::Scope::enter(kiln);
        let optim = adam(0.0, false);
        let (p, s) = {
            let _ctx = context::enter(StepContext {
                apply: Tensor::zeros([1], &device),
                grad_factor: None,
            });
            optim.step(1e-2, init.clone(), grads[0].clone(), None)
        };
        assert!(values(&p) == values(&init));
        let state = s.expect("a state");
        assert_eq!(state.time.into_scalar::<f32>(), 0.0, "kiln kernels {kiln}");
    }
}

#[test]
fn records_keep_burns_layout() {
    let device = Device::flex();
    let m = Tensor::<2>::random([2, 3], Distribution::Default, &device);
    let burn = AdamState::new(AdaptiveMomentumState::new(7, m.clone(), m.clone()));
    let mut theirs = StateSink::default();
    burn.state_flatten("p", &mut theirs);
    let ours = DeviceAdamState {
        time: Tensor::from_data(TensorData::new(vec![7.0f32], [1]), &device),
        moment_1: m.clone(),
        moment_2: m,
    };
    let mut mine = StateSink::default();
    ours.state_flatten("p", &mut mine);
    let names = |s: &StateSink| {
        let mut n: Vec<String> = s.tensors.iter().map(|(k, _)| k.clone()).collect();
        n.extend(s.scalars.iter().map(|(k, v)| format!("{k}={v:?}")));
        n.sort();
        n
    };
    assert_eq!(names(&mine), names(&theirs));
    // And a Burn record loads as Kiln's state.
    let mut src = StateSource::new(theirs.scalars.into_iter().collect());
    for (k, v) in theirs.tensors {
        src.insert_tensor(k, v);
    }
    let back = DeviceAdamState::<2>::state_unflatten("p", &mut src, &device).expect("loads");
    assert_eq!(back.time.into_scalar::<f32>(), 7.0);
}
