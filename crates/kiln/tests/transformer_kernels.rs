//! The transformer's kernels through `kiln::nn` (LayerNorm, GELU, ReLU, a `burn::nn`
//! layer's activation, softmax, scaled dot-product attention) against Burn's own ops computed in f64 — forward values and every
//! gradient under autodiff on `flex` — and the routes that must fall back to Burn.

use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, Distribution, FloatDType, Tensor, TensorData, activation};
use kiln::burn;
use kiln::nn;

/// Largest difference relative to the reference's largest magnitude.
fn rel<const D: usize>(got: Tensor<D>, want: Tensor<D>) -> f64 {
    let got = got.cast(FloatDType::F64);
    let scale = want.clone().abs().max().into_scalar::<f64>().max(1e-12);
    (got - want).abs().max().into_scalar::<f64>() / scale
}

fn random<const D: usize>(dims: [usize; D], std: f64, device: &Device) -> Tensor<D> {
    Tensor::random(dims, Distribution::Normal(0.0, std), device)
}

fn f64_of<const D: usize>(t: &Tensor<D>) -> Tensor<D> {
    t.clone().cast(FloatDType::F64).detach().require_grad()
}

const TOL: f64 = 1e-5;

#[test]
fn layer_norm_matches_burn_in_f64_forward_and_gradients() {
    let device = Device::flex().autodiff();
    for (dims, shifted) in [
        ([4, 9, 128], true),
        ([3, 5, 37], false),
        ([2, 1, 768], true),
    ] {
        let d = dims[2];
        let x = random(dims, 2.0, &device).add_scalar(3.0);
        let gamma = random([d], 1.0, &device).add_scalar(1.0);
        let beta = random([d], 1.0, &device);
        let g = random(dims, 1.0, &device);
        // Kiln in f32.
        let (xk, gk, bk) = (
            x.clone().require_grad(),
            gamma.clone().require_grad(),
            beta.clone().require_grad(),
        );
        let yk = nn::layer_norm(xk.clone(), gk.clone(), shifted.then(|| bk.clone()), 1e-5);
        let grads = (yk.clone() * g.clone()).sum().backward();
        // Burn in f64.
        let (xr, gr, br) = (f64_of(&x), f64_of(&gamma), f64_of(&beta));
        let yr = burn::tensor::module::layer_norm(
            xr.clone(),
            gr.clone(),
            shifted.then(|| br.clone()),
            1e-5,
        );
        let rgrads = (yr.clone() * g.cast(FloatDType::F64)).sum().backward();
        let case = format!("{dims:?} shift {shifted}");
        assert!(rel(yk.detach(), yr.detach()) < TOL, "{case}: forward");
        let dx = rel(xk.grad(&grads).unwrap(), xr.grad(&rgrads).unwrap());
        assert!(dx < TOL, "{case}: dx {dx:e}");
        let dg = rel(gk.grad(&grads).unwrap(), gr.grad(&rgrads).unwrap());
        assert!(dg < TOL, "{case}: dgamma {dg:e}");
        if shifted {
            let db = rel(bk.grad(&grads).unwrap(), br.grad(&rgrads).unwrap());
            assert!(db < TOL, "{case}: dbeta {db:e}");
        }
    }
}

#[test]
fn the_layer_norm_layer_is_burns_with_burns_record() {
    let device = Device::flex();
    let config = nn::LayerNormConfig::new(16).with_epsilon(1e-3);
    let ours = config.init(&device);
    assert_eq!(ours.epsilon, 1e-3);
    // Burn's layer with the same parameters computes the same values.
    let mut burn_layer = burn::nn::LayerNormConfig::new(16)
        .with_epsilon(1e-3)
        .init(&device);
    burn_layer.gamma = burn::module::Param::from_tensor(random([16], 1.0, &device));
    let ours = nn::LayerNorm {
        gamma: burn_layer.gamma.clone(),
        beta: burn_layer.beta.clone(),
        ..ours
    };
    let x = random([3, 16], 1.0, &device);
    let (a, b) = (ours.forward(x.clone()), burn_layer.forward(x));
    assert!(rel(a, b.cast(FloatDType::F64)) < TOL);
    let back = nn::LayerNorm::from_burn(burn_layer, 1e-3);
    assert_eq!(back.epsilon, 1e-3);
}

#[test]
fn gelu_and_softmax_match_burn_in_f64_forward_and_gradients() {
    let device = Device::flex().autodiff();
    let x = random([6, 7, 45], 3.0, &device);
    let g = random([6, 7, 45], 1.0, &device);
    type Op = fn(Tensor<3>) -> Tensor<3>;
    use burn::nn::activation::{Activation, Gelu, Relu, Tanh};
    let cases: [(&str, Op, Op); 8] = [
        ("gelu", nn::gelu, activation::gelu),
        ("relu", nn::relu, activation::relu),
        // A burn::nn layer's activation field: Kiln's kernels for ReLU and exact GELU,
        // Burn's own layer for the tanh-approximate GELU and the rest.
        (
            "activation relu",
            |t| nn::activation(&Activation::Relu(Relu::new()), t),
            activation::relu,
        ),
        (
            "activation gelu",
            |t| nn::activation(&Activation::Gelu(Gelu::new()), t),
            activation::gelu,
        ),
        (
            "activation gelu approximate",
            |t| nn::activation(&Activation::Gelu(Gelu { approximate: true }), t),
            activation::gelu_approximate,
        ),
        (
            "activation tanh",
            |t| nn::activation(&Activation::Tanh(Tanh::new()), t),
            activation::tanh,
        ),
        (
            "softmax last",
            |t| nn::softmax(t, 2),
            |t| activation::softmax(t, 2),
        ),
        // Not the last axis: Burn's op serves (and must still be right).
        (
            "softmax axis 1",
            |t| nn::softmax(t, 1),
            |t| activation::softmax(t, 1),
        ),
    ];
    for (name, kiln_op, burn_op) in cases {
        let xk = x.clone().require_grad();
        let yk = kiln_op(xk.clone());
        let grads = (yk.clone() * g.clone()).sum().backward();
        let xr = f64_of(&x);
        let yr = burn_op(xr.clone());
        let rgrads = (yr.clone() * g.clone().cast(FloatDType::F64))
            .sum()
            .backward();
        assert!(rel(yk.detach(), yr.detach()) < TOL, "{name}: forward");
        let dx = rel(xk.grad(&grads).unwrap(), xr.grad(&rgrads).unwrap());
        assert!(dx < TOL, "{name}: gradient {dx:e}");
    }
}

/// ReLU over a tensor large enough to split over the pool: forward and gradient exactly
/// Burn's (a comparison and a select: no rounding), zero gradient at zero as Burn's.
#[test]
fn relu_is_burns_forward_and_backward_in_parallel_chunks() {
    let device = Device::flex().autodiff();
    let dims = [4, 64, 1030];
    // Some exact zeros, where the gradient convention shows.
    let x = random(dims, 1.0, &device).mask_fill(random(dims, 1.0, &device).lower_elem(-1.0), 0.0);
    let g = random(dims, 1.0, &device);
    let run = |op: fn(Tensor<3>) -> Tensor<3>| {
        let xk = x.clone().require_grad();
        let y = op(xk.clone());
        let grads = (y.clone() * g.clone()).sum().backward();
        (y.detach().into_data(), xk.grad(&grads).unwrap().into_data())
    };
    let (ours, burns) = (run(nn::relu), run(activation::relu));
    assert_eq!(ours.0, burns.0, "forward");
    assert_eq!(ours.1, burns.1, "gradient");
}

/// Q, K, V cut from one packed projection as a model writes them (reshape, permute,
/// narrow: strided views), with a padding mask broadcast over heads and queries, the causal
/// mask, and a learned bias: the context and the gradients of the packed projection and
/// the bias against Burn's attention in f64.
#[test]
fn attention_matches_burn_in_f64_forward_and_gradients() {
    let device = Device::flex().autodiff();
    for (batch, tokens, heads, dk, masked, causal, biased) in [
        (2, 5, 3, 4, false, false, false),
        (3, 9, 4, 8, true, false, true),
        (2, 7, 2, 16, false, true, false),
        (4, 16, 4, 32, true, true, true),
    ] {
        let d = heads * dk;
        let packed = random([batch, tokens, 3 * d], 1.0, &device);
        let bias = random([1, heads, tokens, tokens], 0.5, &device);
        // The last two keys of batch element 0 are padding.
        let mut pad = vec![false; batch * tokens];
        pad[tokens - 2..tokens].fill(true);
        let mask = Tensor::<2, Bool>::from_data(TensorData::new(pad, [batch, tokens]), &device)
            .reshape([batch, 1, 1, tokens])
            .expand([batch, heads, tokens, tokens]);
        let g = random([batch, heads, tokens, dk], 1.0, &device);
        let split = |p: Tensor<3>| -> [Tensor<4>; 3] {
            let qkv = p
                .reshape([batch, tokens, 3, heads, dk])
                .permute([2, 0, 3, 1, 4]);
            std::array::from_fn(|i| {
                qkv.clone()
                    .narrow(0, i, 1)
                    .reshape([batch, heads, tokens, dk])
            })
        };
        let options = AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        };
        let (pk, bk) = (packed.clone().require_grad(), bias.clone().require_grad());
        let [q, k, v] = split(pk.clone());
        let mask_k = masked.then(|| mask.clone());
        let ctx = nn::attention(
            q,
            k,
            v,
            mask_k,
            biased.then(|| bk.clone().expand([batch, heads, tokens, tokens])),
            options,
        );
        let grads = (ctx.clone() * g.clone()).sum().backward();

        let (pr, br) = (f64_of(&packed), f64_of(&bias));
        let [q, k, v] = split(pr.clone());
        let want = burn::tensor::module::attention(
            q,
            k,
            v,
            masked.then(|| mask.clone()),
            biased.then(|| br.clone().expand([batch, heads, tokens, tokens])),
            options,
        );
        let rgrads = (want.clone() * g.cast(FloatDType::F64)).sum().backward();
        let case = format!(
            "b{batch} t{tokens} h{heads} d{dk} mask {masked} causal {causal} bias {biased}"
        );
        assert!(rel(ctx.detach(), want.detach()) < TOL, "{case}: context");
        let dp = rel(pk.grad(&grads).unwrap(), pr.grad(&rgrads).unwrap());
        assert!(dp < TOL, "{case}: packed projection's gradient {dp:e}");
        if biased {
            let db = rel(bk.grad(&grads).unwrap(), br.grad(&rgrads).unwrap());
            assert!(db < TOL, "{case}: bias gradient {db:e}");
        }
    }
}

#[test]
fn attention_without_autodiff_and_its_fallbacks_match_burn() {
    let device = Device::flex();
    let q = random([2, 3, 6, 8], 1.0, &device);
    let k = random([2, 3, 10, 8], 1.0, &device);
    let v = random([2, 3, 10, 5], 1.0, &device);
    let reference = |options| {
        burn::tensor::module::attention(
            q.clone().cast(FloatDType::F64),
            k.clone().cast(FloatDType::F64),
            v.clone().cast(FloatDType::F64),
            None,
            None,
            options,
        )
    };
    // Cross-attention with more keys than queries, causal at the bottom-right, a custom scale.
    let options = AttentionModuleOptions {
        scale: Some(0.3),
        is_causal: true,
        softcap: None,
    };
    let got = nn::attention(q.clone(), k.clone(), v.clone(), None, None, options);
    assert!(rel(got, reference(options)) < TOL, "kernel, no autodiff");
    // A softcap is Burn's business (its op serves).
    let capped = AttentionModuleOptions {
        softcap: Some(5.0),
        ..options
    };
    let got = nn::attention(q.clone(), k.clone(), v.clone(), None, None, capped);
    assert!(rel(got, reference(capped)) < TOL, "softcap through Burn");
    // Kiln's kernels switched off: Burn's op.
    let _off = kiln::kernels::Scope::enter(false);
    let got = nn::attention(q.clone(), k.clone(), v.clone(), None, None, options);
    assert!(rel(got, reference(options)) < TOL, "kernels off");
}

/// The packed form against splitting the projection, Burn's attention in f64 and merging
/// the heads: the context and the gradients of the projection and the bias, with and without
/// masks; and the same values through its fallback (Kiln's kernels off).
#[test]
fn qkv_attention_matches_the_split_attend_merge_composition_in_f64() {
    let device = Device::flex().autodiff();
    for (batch, tokens, heads, dk, masked, causal, biased) in [
        (2, 5, 3, 4, false, false, false),
        (3, 9, 4, 8, true, true, true),
        (1, 16, 2, 32, false, true, false),
    ] {
        let width = 3 * heads * dk;
        let qkv = random([batch, tokens, width], 1.0, &device);
        let bias = random([1, heads, tokens, tokens], 0.5, &device);
        let mut pad = vec![false; batch * tokens];
        pad[tokens - 1] = true;
        let mask = Tensor::<2, Bool>::from_data(TensorData::new(pad, [batch, tokens]), &device)
            .reshape([batch, 1, 1, tokens]);
        let g = random([batch, tokens, heads * dk], 1.0, &device);
        let options = AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        };
        let reference = || {
            let (pr, br) = (f64_of(&qkv), f64_of(&bias));
            let parts = pr
                .clone()
                .reshape([batch, tokens, 3, heads, dk])
                .permute([2, 0, 3, 1, 4]);
            let part = |i: usize| -> Tensor<4> {
                parts
                    .clone()
                    .narrow(0, i, 1)
                    .reshape([batch, heads, tokens, dk])
            };
            let ctx = burn::tensor::module::attention(
                part(0),
                part(1),
                part(2),
                masked.then(|| mask.clone().expand([batch, heads, tokens, tokens])),
                biased.then(|| br.clone().expand([batch, heads, tokens, tokens])),
                options,
            )
            .swap_dims(1, 2)
            .reshape([batch, tokens, heads * dk]);
            let grads = (ctx.clone() * g.clone().cast(FloatDType::F64))
                .sum()
                .backward();
            (ctx.detach(), pr.grad(&grads).unwrap(), br.grad(&grads))
        };
        let (want, want_dqkv, want_dbias) = reference();
        for kernels_on in [true, false] {
            let _scope = kiln::kernels::Scope::enter(kernels_on);
            let (pk, bk) = (qkv.clone().require_grad(), bias.clone().require_grad());
            let ctx = nn::qkv_attention(
                pk.clone(),
                heads,
                masked.then(|| mask.clone()),
                biased.then(|| bk.clone()),
                options,
            );
            let grads = (ctx.clone() * g.clone()).sum().backward();
            let case = format!(
                "b{batch} t{tokens} h{heads} d{dk} mask {masked} causal {causal} bias {biased} kernels {kernels_on}"
            );
            assert!(rel(ctx.detach(), want.clone()) < TOL, "{case}: context");
            let dp = rel(pk.grad(&grads).unwrap(), want_dqkv.clone());
            assert!(dp < TOL, "{case}: projection's gradient {dp:e}");
            if biased {
                let db = rel(bk.grad(&grads).unwrap(), want_dbias.clone().unwrap());
                assert!(db < TOL, "{case}: bias gradient {db:e}");
            }
        }
    }
}

/// Q, K, V as the head views `reshape([b, t, h, d]).swap_dims(1, 2)` of three projections
/// (Burn's MultiHeadAttention's form, and W4's), the context merged back with
/// `swap_dims(1, 2).reshape`: values and the three projections' gradients against Burn in f64.
#[test]
fn attention_on_head_views_of_token_ordered_projections_matches_burn() {
    let device = Device::flex().autodiff();
    let (batch, tokens, heads, dk) = (3, 11, 4, 8);
    let d = heads * dk;
    let xs: Vec<Tensor<3>> = (0..3)
        .map(|_| random([batch, tokens, d], 1.0, &device))
        .collect();
    let g = random([batch, tokens, d], 1.0, &device);
    let heads_of = |x: Tensor<3>| x.reshape([batch, tokens, heads, dk]).swap_dims(1, 2);
    let merge = |c: Tensor<4>| c.swap_dims(1, 2).reshape([batch, tokens, d]);
    let ours: Vec<Tensor<3>> = xs.iter().map(|x| x.clone().require_grad()).collect();
    let ctx = merge(nn::attention(
        heads_of(ours[0].clone()),
        heads_of(ours[1].clone()),
        heads_of(ours[2].clone()),
        None,
        None,
        Default::default(),
    ));
    let grads = (ctx.clone() * g.clone()).sum().backward();
    let refs: Vec<Tensor<3>> = xs.iter().map(f64_of).collect();
    let want = merge(burn::tensor::module::attention(
        heads_of(refs[0].clone()),
        heads_of(refs[1].clone()),
        heads_of(refs[2].clone()),
        None,
        None,
        Default::default(),
    ));
    let rgrads = (want.clone() * g.cast(FloatDType::F64)).sum().backward();
    assert!(rel(ctx.detach(), want.detach()) < TOL, "context");
    for (i, (a, b)) in ours.iter().zip(&refs).enumerate() {
        let err = rel(a.grad(&grads).unwrap(), b.grad(&rgrads).unwrap());
        assert!(err < TOL, "projection {i}'s gradient {err:e}");
    }
}
