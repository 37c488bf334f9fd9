//! Kiln's convolution extension against Burn's own `conv2d` through the public `Tensor` API:
//! forward values and the gradients of input, weight and bias on the `flex` device with
//! autodiff, plus the routes that must fall back to Burn (groups, low precision).

use burn::tensor::module::conv2d as burn_conv2d;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Device, Distribution, FloatDType, Tensor};
use kiln::burn;
use kiln::kernels;

fn max_relative(a: Tensor<4>, b: Tensor<4>) -> f32 {
    let scale = b.clone().abs().max().into_scalar::<f32>().max(1e-12);
    (a - b).abs().max().into_scalar::<f32>() / scale
}

fn max_relative_1d(a: Tensor<1>, b: Tensor<1>) -> f32 {
    let scale = b.clone().abs().max().into_scalar::<f32>().max(1e-12);
    (a - b).abs().max().into_scalar::<f32>() / scale
}

/// Forward and all three gradients of `sum(conv(x) · g)`, through `conv`.
fn run(
    conv: impl Fn(Tensor<4>, Tensor<4>, Option<Tensor<1>>) -> Tensor<4>,
    (x, w, b, g): (&Tensor<4>, &Tensor<4>, &Tensor<1>, &Tensor<4>),
) -> (Tensor<4>, Tensor<4>, Tensor<4>, Tensor<1>) {
    let x = x.clone().require_grad();
    let w = w.clone().require_grad();
    let b = b.clone().require_grad();
    let out = conv(x.clone(), w.clone(), Some(b.clone()));
    let grads = (out.clone() * g.clone()).sum().backward();
    let dx = x.grad(&grads).expect("x gradient");
    let dw = w.grad(&grads).expect("weight gradient");
    let db = b.grad(&grads).expect("bias gradient");
    (out.detach(), dx, dw, db)
}

#[test]
fn kiln_conv_matches_burn_forward_and_gradients_under_autodiff() {
    let device = Device::flex().autodiff();
    for (stride, padding, dilation, batch) in [
        ([1, 1], [(0, 0), (0, 0)], [1, 1], 4),
        ([2, 2], [(1, 1), (1, 1)], [1, 1], 3),
        ([1, 2], [(0, 1), (2, 0)], [2, 1], 1),
    ] {
        let options = ConvOptions::new_with_padding(stride, padding, dilation, 1);
        let x = Tensor::<4>::random([batch, 3, 11, 10], Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<4>::random([6, 3, 3, 3], Distribution::Normal(0.0, 0.3), &device);
        let b = Tensor::<1>::random([6], Distribution::Normal(0.0, 0.3), &device);
        let out_shape = burn_conv2d(x.clone(), w.clone(), Some(b.clone()), options.clone()).dims();
        let g = Tensor::<4>::random(out_shape, Distribution::Normal(0.0, 1.0), &device);

        let inputs = (&x, &w, &b, &g);
        let want = run(|x, w, b| burn_conv2d(x, w, b, options.clone()), inputs);
        let got = run(|x, w, b| kernels::conv2d(x, w, b, options.clone()), inputs);
        let case = format!("stride {stride:?} padding {padding:?} dilation {dilation:?}");
        assert!(max_relative(got.0, want.0) <= 1e-5, "{case}: forward");
        assert!(
            max_relative(got.1, want.1) <= 1e-5,
            "{case}: input gradient"
        );
        assert!(
            max_relative(got.2, want.2) <= 1e-5,
            "{case}: weight gradient"
        );
        assert!(
            max_relative_1d(got.3, want.3) <= 1e-5,
            "{case}: bias gradient"
        );
    }
}

#[test]
fn kiln_conv_without_bias_or_autodiff_matches_burn() {
    let device = Device::flex();
    assert!(kernels::serves(&device) && kernels::serves(&device.clone().autodiff()));
    let options = ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
    let x = Tensor::<4>::random([2, 4, 7, 7], Distribution::Normal(0.0, 1.0), &device);
    let w = Tensor::<4>::random([5, 4, 3, 3], Distribution::Normal(0.0, 0.3), &device);
    let want = burn_conv2d(x.clone(), w.clone(), None, options.clone());
    let got = kernels::conv2d(x, w, None, options);
    assert!(max_relative(got, want) <= 1e-5);
}

#[test]
fn grouped_and_low_precision_convolutions_fall_back_to_burn() {
    let device = Device::flex();
    // Groups: Kiln's kernel has none, Burn's op runs (same result by construction).
    let options = ConvOptions::new([1, 1], [0, 0], [1, 1], 2);
    let x = Tensor::<4>::random([2, 4, 6, 6], Distribution::Normal(0.0, 1.0), &device);
    let w = Tensor::<4>::random([4, 2, 3, 3], Distribution::Normal(0.0, 0.3), &device);
    let got = kernels::conv2d(x.clone(), w.clone(), None, options.clone());
    assert_eq!(got.dims(), [2, 4, 4, 4]);
    let want = burn_conv2d(x.clone(), w.clone(), None, options);
    assert!(max_relative(got, want) <= 1e-6);

    // bf16 inputs: Burn's op in bf16, compared with f32 at bf16's tolerance.
    let options = ConvOptions::new([1, 1], [0, 0], [1, 1], 1);
    let w = Tensor::<4>::random([3, 4, 3, 3], Distribution::Normal(0.0, 0.3), &device);
    let want = burn_conv2d(x.clone(), w.clone(), None, options.clone());
    let got = kernels::conv2d(
        x.cast(FloatDType::BF16),
        w.cast(FloatDType::BF16),
        None,
        options,
    )
    .cast(FloatDType::F32);
    assert!(max_relative(got, want) <= 2e-2);
}

/// Depthwise convolutions (one filter per channel: MobileNet's 3×3 and 5×5, strides 1 and 2)
/// run Kiln's kernel and match Burn's op forward and in all three gradients under autodiff.
#[test]
fn kiln_depthwise_conv_matches_burn_forward_and_gradients_under_autodiff() {
    let device = Device::flex().autodiff();
    for (k, stride, pad) in [(3, 1, 1), (3, 2, 1), (5, 1, 2), (5, 2, 2)] {
        let channels = 6;
        let options = ConvOptions::new([stride, stride], [pad, pad], [1, 1], channels);
        let x = Tensor::<4>::random(
            [2, channels, 9, 10],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        let w = Tensor::<4>::random([channels, 1, k, k], Distribution::Normal(0.0, 0.3), &device);
        let b = Tensor::<1>::random([channels], Distribution::Normal(0.0, 0.3), &device);
        let out_dims = burn_conv2d(x.clone(), w.clone(), Some(b.clone()), options.clone()).dims();
        let g = Tensor::<4>::random(out_dims, Distribution::Normal(0.0, 1.0), &device);
        let grads_of = |conv: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<1>) -> Tensor<4>| {
            let (x, w, b) = (
                x.clone().require_grad(),
                w.clone().require_grad(),
                b.clone().require_grad(),
            );
            let out = conv(x.clone(), w.clone(), b.clone());
            let grads = (out.clone() * g.clone()).sum().backward();
            (
                out.detach(),
                x.grad(&grads).expect("x gradient"),
                w.grad(&grads).expect("weight gradient"),
                b.grad(&grads).expect("bias gradient"),
            )
        };
        let want = grads_of(&|x, w, b| burn_conv2d(x, w, Some(b), options.clone()));
        let got = grads_of(&|x, w, b| kernels::conv2d(x, w, Some(b), options.clone()));
        let case = format!("{k}×{k} stride {stride}");
        assert!(max_relative(got.0, want.0) <= 1e-5, "{case}: forward");
        assert!(
            max_relative(got.1, want.1) <= 1e-5,
            "{case}: input gradient"
        );
        assert!(
            max_relative(got.2, want.2) <= 1e-5,
            "{case}: weight gradient"
        );
        let as4 = |t: Tensor<1>| t.reshape([1, channels, 1, 1]);
        assert!(
            max_relative(as4(got.3), as4(want.3)) <= 1e-5,
            "{case}: bias gradient"
        );
    }
}

#[test]
fn kiln_max_pool_matches_burn_forward_and_gradient_under_autodiff() {
    use burn::tensor::module::max_pool2d;
    use burn::tensor::ops::MaxPoolOptions;
    let device = Device::flex().autodiff();
    for (kernel, stride) in [([2, 2], [2, 2]), ([3, 2], [1, 2])] {
        let x = Tensor::<4>::random([3, 4, 9, 8], Distribution::Normal(0.0, 1.0), &device);
        let options = MaxPoolOptions::new(kernel).with_stride(stride);
        let out_shape = max_pool2d(x.clone(), options.clone()).dims();
        let g = Tensor::<4>::random(out_shape, Distribution::Normal(0.0, 1.0), &device);
        let grad_of = |pool: &dyn Fn(Tensor<4>) -> Tensor<4>| {
            let x = x.clone().require_grad();
            let out = pool(x.clone());
            let grads = (out.clone() * g.clone()).sum().backward();
            (out.detach(), x.grad(&grads).expect("x gradient"))
        };
        let want = grad_of(&|x| max_pool2d(x, options.clone()));
        let got = grad_of(&|x| kernels::max_pool2d(x, kernel, stride));
        assert!(
            max_relative(got.0, want.0) == 0.0,
            "{kernel:?}/{stride:?}: forward"
        );
        assert!(
            max_relative(got.1, want.1) <= 1e-6,
            "{kernel:?}/{stride:?}: gradient"
        );
    }
}

/// Global average pooling (`kiln::nn::global_avg_pool`, and `kiln::nn::AdaptiveAvgPool2d`
/// to `[1, 1]`) against Burn's mean computed in f64: forward and the input's gradient within
/// 1e-5, on planes of a register's width, with tails, and a single pixel; another output
/// size and f64 input take Burn's ops and give exactly Burn's values.
#[test]
fn global_average_pooling_matches_burn_in_f64_forward_and_gradient() {
    use burn::tensor::module::adaptive_avg_pool2d;
    let device = Device::flex().autodiff();
    let rel = |a: Tensor<2>, b: Tensor<2>| -> f64 {
        let scale = b.clone().abs().max().into_scalar::<f64>().max(1e-12);
        (a.cast(FloatDType::F64) - b)
            .abs()
            .max()
            .into_scalar::<f64>()
            / scale
    };
    for dims in [[4, 16, 8, 8], [3, 5, 7, 7], [2, 3, 1, 1], [32, 40, 9, 11]] {
        let [b, c, h, w] = dims;
        let x = Tensor::<4>::random(dims, Distribution::Normal(1.0, 2.0), &device);
        let g = Tensor::<2>::random([b, c], Distribution::Normal(0.0, 1.0), &device);
        // Kiln in f32, through the function and the layer.
        let layer = kiln::nn::AdaptiveAvgPool2dConfig::new([1, 1]).init();
        for pooled in [
            &|x: Tensor<4>| kiln::nn::global_avg_pool(x) as Tensor<2>,
            &|x: Tensor<4>| layer.forward(x).reshape([b, c]) as Tensor<2>,
        ] as [&dyn Fn(Tensor<4>) -> Tensor<2>; 2]
        {
            let xk = x.clone().require_grad();
            let yk = pooled(xk.clone());
            let dk = xk.grad(&(yk.clone() * g.clone()).sum().backward()).unwrap();
            // Burn's mean in f64.
            let xr = x.clone().cast(FloatDType::F64).detach().require_grad();
            let yr: Tensor<2> = xr.clone().flatten::<3>(2, 3).mean_dim(2).reshape([b, c]);
            let dr = xr
                .grad(
                    &(yr.clone() * g.clone().cast(FloatDType::F64))
                        .sum()
                        .backward(),
                )
                .unwrap();
            assert!(rel(yk.detach(), yr.detach()) <= 1e-5, "{dims:?}: forward");
            let flat = |t: Tensor<4>| t.reshape([b * c, h * w]);
            assert!(rel(flat(dk), flat(dr)) <= 1e-5, "{dims:?}: gradient");
        }
    }
    // Other output sizes and dtypes: Burn's op, bit for bit.
    let x = Tensor::<4>::random([2, 3, 8, 8], Distribution::Normal(0.0, 1.0), &device);
    let layer = kiln::nn::AdaptiveAvgPool2dConfig::new([2, 2]).init();
    let want = adaptive_avg_pool2d(x.clone(), [2, 2]);
    assert_eq!(max_relative(layer.forward(x.clone()), want), 0.0);
    let x64 = x.cast(FloatDType::F64);
    let want: Tensor<2> = x64.clone().flatten::<3>(2, 3).mean_dim(2).reshape([2, 3]);
    let got = kiln::nn::global_avg_pool(x64);
    assert_eq!(got.dtype(), want.dtype());
    assert_eq!(rel(got, want), 0.0);
}

#[test]
fn kiln_linear_matches_burn_forward_and_gradients_under_autodiff() {
    use burn::tensor::module::linear;
    let device = Device::flex().autodiff();
    let x = Tensor::<3>::random([4, 6, 20], Distribution::Normal(0.0, 1.0), &device);
    let w = Tensor::<2>::random([20, 9], Distribution::Normal(0.0, 0.3), &device);
    let b = Tensor::<1>::random([9], Distribution::Normal(0.0, 0.3), &device);
    let g = Tensor::<3>::random([4, 6, 9], Distribution::Normal(0.0, 1.0), &device);
    for with_bias in [true, false] {
        let run = |f: &dyn Fn(Tensor<3>, Tensor<2>, Option<Tensor<1>>) -> Tensor<3>| {
            let (x, w, b) = (
                x.clone().require_grad(),
                w.clone().require_grad(),
                b.clone().require_grad(),
            );
            let y = f(x.clone(), w.clone(), with_bias.then(|| b.clone()));
            let grads = (y.clone() * g.clone()).sum().backward();
            let db = with_bias.then(|| b.grad(&grads).expect("bias gradient"));
            let dx = x.grad(&grads).expect("x gradient");
            let dw = w.grad(&grads).expect("weight gradient");
            (y.detach(), dx, dw, db)
        };
        let want = run(&|x, w, b| linear(x, w, b));
        let got = run(&|x, w, b| kernels::linear(x, w, b));
        let rel = |a: Tensor<3>, b: Tensor<3>| max_relative(a.unsqueeze(), b.unsqueeze());
        assert!(rel(got.0, want.0) <= 1e-5, "bias {with_bias}: forward");
        assert!(
            rel(got.1, want.1) <= 1e-5,
            "bias {with_bias}: input gradient"
        );
        let dw = max_relative(got.2.unsqueeze(), want.2.unsqueeze());
        assert!(dw <= 1e-5, "bias {with_bias}: weight gradient");
        if let (Some(a), Some(b)) = (got.3, want.3) {
            assert!(max_relative_1d(a, b) <= 1e-5, "bias gradient");
        }
    }
}
