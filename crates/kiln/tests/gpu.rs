//! What runs on a GPU: data parallelism over Burn's own device collective (`DeviceGroup`,
//! NCCL on CUDA) and the memory watermark read from the device's pool. The GPU tests are
//! compiled with the `cuda` feature (CI builds without it; `tools/gpu-check.sh` runs them on
//! a GPU machine) and say so, without failing, on a cuda build that finds no driver — unless
//! `KILN_REQUIRE_GPU=1` (the GPU script sets it), which turns a missing GPU, driver or cuda
//! build into a failure, so a lease never passes by running nothing. The refusals run
//! everywhere.

/// Whether the run demands a GPU (`KILN_REQUIRE_GPU=1`).
fn gpu_required() -> bool {
    std::env::var("KILN_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// With `KILN_REQUIRE_GPU=1`, a test binary built without the `cuda` feature fails instead
/// of passing with its GPU tests compiled out.
#[test]
fn a_required_gpu_is_never_skipped() {
    let cuda_build = cfg!(feature = "cuda-eager");
    assert!(
        cuda_build || !gpu_required(),
        "KILN_REQUIRE_GPU=1 but this test binary was built without the cuda feature: \
         build it with `cargo test -p kiln --features cuda --test gpu`"
    );
}

mod common;

use kiln::burn::tensor::Device;
use kiln::distributed::DeviceGroup;

#[test]
fn a_device_group_refuses_the_cpu_backend_and_empty_or_repeated_devices() {
    let err = |devices: Vec<Device>| match DeviceGroup::new(devices) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    let cpu = err(vec![Device::flex()]);
    assert!(
        cpu.contains("no device collective") && cpu.contains("CUDA"),
        "{cpu}"
    );
    assert!(
        cpu.contains("ThreadGroup") || cpu.contains("MPI"),
        "names the CPU's engines: {cpu}"
    );
    assert!(err(Vec::new()).contains("at least one device"));
    #[cfg(feature = "cuda-eager")]
    {
        let twice = err(vec![Device::cuda(0), Device::cuda(0)]);
        assert!(twice.contains("named twice"), "{twice}");
    }
}

#[cfg(feature = "cuda-eager")]
mod on_cuda {
    use std::sync::Arc;

    use kiln::Trainer;
    use kiln::burn::optim::GradientsParams;
    use kiln::burn::tensor::{Device, DeviceType, Tensor};
    use kiln::datasets::{Split, bundled};
    use kiln::distributed::{Collective, DeviceGroup, GradReducer};
    use kiln::observe::MemorySink;
    use kiln::plan::Hardware;
    use kiln::train::{TrainOptions, flatten_params};
    use kiln::zoo::ModelKind;

    use super::common;

    /// The CUDA devices, or `None` (said on stderr) on a machine without the driver.
    fn gpus() -> Option<Vec<Device>> {
        if !Hardware::probe().cuda_driver {
            assert!(
                !super::gpu_required(),
                "KILN_REQUIRE_GPU=1 but there is no NVIDIA driver (libcuda.so.1) on this machine"
            );
            eprintln!("no NVIDIA driver on this machine: the GPU test has nothing to run on");
            return None;
        }
        let devices: Vec<Device> = Device::enumerate(DeviceType::Cuda).into_iter().collect();
        assert!(!devices.is_empty(), "a driver but no CUDA device");
        Some(devices)
    }

    fn options(batch_size: usize) -> TrainOptions {
        TrainOptions {
            epochs: 1,
            batch_size,
            grad_accum_steps: 2,
            lr: 3e-3,
            grad_clip_norm: Some(0.5),
            seed: 5,
            eval_every_epochs: 0,
            workers: Some(0),
            max_steps: Some(6),
            ..TrainOptions::default()
        }
    }

    fn train(
        options: TrainOptions,
        device: Device,
        collective: Option<Arc<dyn Collective>>,
    ) -> (Vec<f32>, MemorySink) {
        let data = bundled(Split::Train).unwrap().take(400);
        let mut sink = MemorySink::default();
        let mut trainer = Trainer::new(options, device, &mut sink);
        if let Some(c) = collective {
            trainer = trainer.with_collective(c);
        }
        let outcome = trainer
            .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
            .unwrap();
        (flatten_params(&outcome.model), sink)
    }

    /// Every GPU of the machine as one rank (one suffices to run the path: NCCL with a
    /// single rank): N ranks of micro-batch b train the model one process trains on one GPU
    /// with N·b, the gradients summed on the devices by Burn's collective.
    #[test]
    fn a_device_group_trains_the_model_of_one_process() {
        let Some(devices) = gpus() else { return };
        let n = devices.len();
        eprintln!("{n} CUDA device(s)");
        let (single, single_sink) = train(options(16 * n), devices[0].clone(), None);
        let group = DeviceGroup::new(devices).unwrap();
        let ranks: Vec<(Vec<f32>, MemorySink)> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .map(|member| {
                    s.spawn(move || {
                        let device = member.device().clone();
                        train(options(16), device, Some(Arc::new(member)))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (weights, sink) = &ranks[0];
        let steps: Vec<_> = sink.steps().collect();
        assert_eq!(steps.len(), 6);
        assert!(
            steps.iter().all(|s| s.reduce_ms.is_some()),
            "every step went through the device collective"
        );
        for (a, b) in single_sink.steps().zip(sink.steps()) {
            assert!(
                (a.loss - b.loss).abs() <= 1e-4 * a.loss.abs().max(1.0),
                "step {}: loss {} vs {}",
                a.step,
                a.loss,
                b.loss
            );
        }
        let (_, max_diff) = common::bitwise_differences(&single, weights);
        let scale = single.iter().fold(0f32, |m, w| m.max(w.abs()));
        eprintln!("max weight difference {max_diff:e} (largest weight {scale})");
        assert!(max_diff <= 1e-4 * scale.max(1.0), "{max_diff} vs {scale}");
    }

    /// The reducer's device path cuts the gradients into buckets (here of at most 1000
    /// values, so the MLP's layers span several and share none) and puts every value back
    /// where it was: on one GPU the sum over the group is the gradient itself.
    #[test]
    fn buckets_on_the_device_put_every_gradient_back_in_place() {
        let Some(devices) = gpus() else { return };
        let device = devices[0].clone();
        let group = DeviceGroup::new(vec![device.clone()]).unwrap();
        let member = &group[0];
        let model = ModelKind::Mlp.init(&device.clone().autodiff());
        let x = Tensor::<4>::random(
            [8, 1, 28, 28],
            kiln::burn::tensor::Distribution::Default,
            &device.clone().autodiff(),
        );
        let grads = {
            use kiln::zoo::Classifier;
            let loss = model.forward(x).powf_scalar(2.0).mean();
            GradientsParams::from_grads(loss.backward(), &model)
        };
        let before = host_grads(&model, &grads);
        let reduced = GradReducer {
            bucket_floats: 1000,
        }
        .reduce(&model, grads, member)
        .unwrap();
        let after = host_grads(&model, &reduced);
        assert_eq!(before.len(), after.len());
        assert!(!before.is_empty());
        for (i, (a, b)) in before.iter().zip(&after).enumerate() {
            assert_eq!(a, b, "parameter {i}'s gradient changed");
        }
    }

    /// Each parameter's gradient as host values, in visit order.
    fn host_grads<M: kiln::burn::module::Module>(
        model: &M,
        grads: &GradientsParams,
    ) -> Vec<Vec<f32>> {
        use kiln::burn::module::{ModuleVisitor, Param};
        struct Read<'a>(&'a GradientsParams, Vec<Vec<f32>>);
        impl ModuleVisitor for Read<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(g) = self.0.get::<D>(param.id) {
                    self.1
                        .push(g.into_data().convert::<f32>().try_to_vec::<f32>().unwrap());
                }
            }
        }
        let mut r = Read(grads, Vec::new());
        model.visit(&mut r);
        r.1
    }

    /// On a GPU the watermark reads the device pool's reserved bytes (not host memory), and
    /// re-arming works there: the pool releases the larger micro-batch's pages after each
    /// halving. A watermark below any reading halves more than once, down to a micro-batch
    /// of 1, with the effective batch unchanged and every step training all of it.
    #[test]
    fn on_a_gpu_the_watermark_reads_device_memory_and_halves_more_than_once() {
        let Some(devices) = gpus() else { return };
        let mut sink = MemorySink::default();
        let data = bundled(Split::Train).unwrap().take(256);
        Trainer::new(
            TrainOptions {
                batch_size: 32,
                grad_accum_steps: 1,
                epochs: 1,
                max_steps: Some(5),
                eval_every_epochs: 0,
                workers: Some(0),
                memory_watermark: Some(1 << 20),
                oom_adaptive: true,
                ..TrainOptions::default()
            },
            devices[0].clone(),
            &mut sink,
        )
        .fit("mlp", |d| ModelKind::Mlp.init(d), &data, None)
        .unwrap();
        let readings: Vec<u64> = common::watermark_events(&sink)
            .iter()
            .map(|m| m.in_use_bytes)
            .collect();
        let micros: Vec<usize> = common::batch_adaptations(&sink)
            .iter()
            .map(|b| b.micro_batch)
            .collect();
        eprintln!("device readings {readings:?}, micro-batches {micros:?}");
        assert!(micros.len() >= 2, "adapts more than once: {micros:?}");
        assert!(micros.windows(2).all(|w| w[1] * 2 == w[0]), "{micros:?}");
        assert!(
            readings.iter().all(|&r| r >= 1 << 20),
            "each crossing names a device reading above the mark: {readings:?}"
        );
        let device_now = devices[0]
            .memory_pool_usage()
            .expect("CUDA reports its pool")
            .bytes_reserved;
        assert!(device_now > 0);
        assert!(
            sink.steps().all(|s| s.samples == 32),
            "whole batch each step"
        );
    }
}
