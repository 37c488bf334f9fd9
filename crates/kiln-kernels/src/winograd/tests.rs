use super::*;
use crate::base::testing::conv_shape as shape;
use crate::base::testing::{relative_error, values};

/// What a test asks of the store, besides the shape.
#[derive(Clone, Copy, Default)]
struct Case {
    bias: bool,
    act: Option<Activation>,
    pool: bool,
    residual: bool,
    residual_in_output: bool,
    /// Extra channels per output pixel (a slice of a wider output), written from channel 0.
    wider: usize,
}

/// f64 direct convolution (NHWC input, `[cout, cin, 3, 3]` weight) with the case's
/// epilogue: the reference.
fn reference(s: &ConvShape, x: &[f32], w: &[f32], b: &[f32], r: &[f32], case: Case) -> Vec<f64> {
    let (oh, ow) = (s.out_h(), s.out_w());
    let mut out = vec![0f64; s.batch * oh * ow * s.cout];
    for n in 0..s.batch {
        for oy in 0..oh {
            for ox in 0..ow {
                for o in 0..s.cout {
                    let mut acc = if case.bias { b[o] as f64 } else { 0.0 };
                    for ky in 0..3 {
                        for kx in 0..3 {
                            let iy = (oy + ky) as isize - s.padding[0].0 as isize;
                            let ix = (ox + kx) as isize - s.padding[1].0 as isize;
                            if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize {
                                continue;
                            }
                            let px = (n * s.h + iy as usize) * s.w + ix as usize;
                            for c in 0..s.cin {
                                acc += x[px * s.cin + c] as f64
                                    * w[((o * s.cin + c) * 3 + ky) * 3 + kx] as f64;
                            }
                        }
                    }
                    let at = ((n * oh + oy) * ow + ox) * s.cout + o;
                    if case.residual || case.residual_in_output {
                        acc += r[at] as f64;
                    }
                    out[at] = case.act.map_or(acc, |a| a.reference(acc));
                }
            }
        }
    }
    if !case.pool {
        return out;
    }
    // ReLU, then the maximum of each whole 2×2 window.
    let (ph, pw) = (oh / 2, ow / 2);
    let mut pooled = Vec::with_capacity(s.batch * ph * pw * s.cout);
    for n in 0..s.batch {
        for py in 0..ph {
            for px in 0..pw {
                for o in 0..s.cout {
                    let at = |y: usize, x: usize| out[((n * oh + y) * ow + x) * s.cout + o];
                    let m = [(0, 0), (0, 1), (1, 0), (1, 1)]
                        .iter()
                        .map(|&(dy, dx)| at(2 * py + dy, 2 * px + dx))
                        .fold(0f64, f64::max);
                    pooled.push(m);
                }
            }
        }
    }
    pooled
}

/// Every SIMD kernel's Winograd convolution of `s` with `case` matches the f64 reference
/// to 1e-5 of the output's scale, and writes nothing outside its channels.
fn check(s: ConvShape, case: Case) {
    let x = values(s.input_len(), 1);
    let w = values(s.weight_len(), 2);
    let b = values(s.cout, 3);
    let r = values(s.output_len(), 4);
    let want = reference(&s, &x, &w, &b, &r, case);
    let pixels = want.len() / s.cout;
    let stride = s.cout + case.wider;
    for kernel in F32Kernel::all_supported() {
        let Some(width) = kernel.panel_width() else {
            continue;
        };
        let transformed = WinogradWeights::transform(kernel, s.cout, s.cin, |o, c, ky, kx| {
            w[((o * s.cin + c) * 3 + ky) * 3 + kx]
        })
        .expect("a SIMD kernel");
        let mut bias = vec![0f32; s.cout.div_ceil(width) * width];
        if case.bias {
            bias[..s.cout].copy_from_slice(&b);
        }
        // Prefilled: NaN where the output goes (a value never written stays NaN), the
        // residual there when the output is the residual, and 7 in the other channels.
        let mut out = vec![7f32; pixels * stride];
        for p in 0..pixels {
            for o in 0..s.cout {
                out[p * stride + o] = if case.residual_in_output {
                    r[p * s.cout + o]
                } else {
                    f32::NAN
                };
            }
        }
        let store = Store {
            bias: &bias,
            act: case.act,
            pool: case.pool,
            residual: case.residual.then_some(&r[..]),
            residual_in_output: case.residual_in_output,
            serial: false,
            out_stride: stride,
        };
        // SAFETY: `out` holds every output pixel's `stride` values.
        unsafe { conv(&s, &x, &transformed, store, out.as_mut_ptr()) };
        let got: Vec<f32> = (0..pixels)
            .flat_map(|p| out[p * stride..][..s.cout].to_vec())
            .collect();
        let err = relative_error(&got, &want);
        assert!(
            err <= 1e-5,
            "{} kernel, {s:?}: error {err:e}",
            kernel.name()
        );
        for p in 0..pixels {
            assert!(
                out[p * stride + s.cout..][..case.wider]
                    .iter()
                    .all(|&v| v == 7.0),
                "{} kernel wrote outside its channels",
                kernel.name()
            );
        }
    }
}

fn square(batch: usize, cin: usize, side: usize, cout: usize, pad: usize) -> ConvShape {
    shape(
        batch,
        cin,
        [side, side],
        cout,
        [3, 3],
        [1, 1],
        [(pad, pad); 2],
        [1, 1],
    )
}

#[test]
fn plain_convolutions_match_the_f64_reference() {
    let bias = Case {
        bias: true,
        ..Case::default()
    };
    // W3's second layer (no padding) and ResNet's `same` layers.
    check(square(1, 32, 26, 64, 0), bias);
    check(square(2, 64, 8, 64, 1), bias);
    // Odd sizes (a last tile half outside the output), channels that fill no vector or
    // panel, one-sided padding, no bias.
    check(
        shape(2, 19, [7, 9], 40, [3, 3], [1, 1], [(1, 0), (0, 1)], [1, 1]),
        Case::default(),
    );
    check(square(3, 24, 5, 70, 1), bias);
    check(square(1, 16, 3, 17, 2), bias);
}

#[test]
fn epilogues_match_the_f64_reference() {
    let s = shape(2, 20, [9, 10], 36, [3, 3], [1, 1], [(1, 1), (1, 1)], [1, 1]);
    for act in [
        Some(Activation::Relu),
        Some(Activation::HardSwish),
        Some(Activation::Silu),
    ] {
        check(
            s,
            Case {
                bias: true,
                act,
                ..Case::default()
            },
        );
    }
    let residual = Case {
        bias: true,
        act: Some(Activation::Relu),
        residual: true,
        ..Case::default()
    };
    check(s, residual);
    check(
        s,
        Case {
            residual: false,
            residual_in_output: true,
            ..residual
        },
    );
    check(
        s,
        Case {
            bias: true,
            act: Some(Activation::Clip(0.0, 6.0)),
            wider: 5,
            ..Case::default()
        },
    );
}

#[test]
fn the_pooled_store_keeps_whole_windows_only() {
    let pool = Case {
        bias: true,
        act: Some(Activation::Relu),
        pool: true,
        ..Case::default()
    };
    // W3's second layer: 24×24 → 12×12; odd outputs drop their last row and column.
    check(square(2, 32, 26, 64, 0), pool);
    check(
        shape(1, 17, [9, 12], 33, [3, 3], [1, 1], [(0, 0), (1, 1)], [1, 1]),
        pool,
    );
}

#[test]
fn nan_inputs_reach_the_outputs_they_touch() {
    // A NaN pixel spreads to the outputs whose window holds it and no further than the
    // tiles whose input tile holds it (the transforms mix a tile's 16 inputs).
    let s = square(1, 16, 8, 32, 1);
    let mut x = values(s.input_len(), 1);
    x[(3 * 8 + 3) * 16] = f32::NAN;
    let w = values(s.weight_len(), 2);
    for kernel in F32Kernel::all_supported() {
        let Some(width) = kernel.panel_width() else {
            continue;
        };
        let t = WinogradWeights::transform(kernel, 32, 16, |o, c, ky, kx| {
            w[((o * 16 + c) * 3 + ky) * 3 + kx]
        })
        .expect("a SIMD kernel");
        let bias = vec![0f32; 32usize.div_ceil(width) * width];
        let mut out = vec![0f32; s.output_len()];
        let store = Store {
            bias: &bias,
            act: None,
            pool: false,
            residual: None,
            residual_in_output: false,
            serial: true,
            out_stride: 32,
        };
        // SAFETY: `out` holds the output.
        unsafe { conv(&s, &x, &t, store, out.as_mut_ptr()) };
        assert!(out[(3 * 8 + 3) * 32].is_nan(), "{}", kernel.name());
        assert!(out[0].is_finite() && out[(7 * 8 + 7) * 32].is_finite());
    }
}

#[test]
fn only_wide_enough_3x3_stride_1_layers_take_the_winograd_path() {
    let k = F32Kernel::detect();
    if k.panel_width().is_none() {
        assert!(!applies(&square(1, 32, 26, 64, 0), k, false));
        return;
    }
    // W3's second layer, ResNet-18's 56² and 28² layers at batch 1.
    assert!(applies(&square(1, 32, 26, 64, 0), k, true));
    assert!(applies(&square(1, 64, 56, 64, 1), k, false));
    assert!(applies(&square(1, 128, 28, 128, 1), k, false));
    // W3's first layer (one input channel), a strided layer, a 1×1 layer, a 512-channel 7×7
    // layer at batch 1 (16 tiles: the weight's reading is the cost).
    assert!(!applies(&square(1, 1, 28, 32, 0), k, false));
    let strided = shape(1, 64, [56, 56], 128, [3, 3], [2, 2], [(1, 1); 2], [1, 1]);
    assert!(!applies(&strided, k, false));
    let pointwise = shape(1, 64, [56, 56], 64, [1, 1], [1, 1], [(0, 0); 2], [1, 1]);
    assert!(!applies(&pointwise, k, false));
    assert!(!applies(&square(1, 512, 7, 512, 1), k, false));
}

#[test]
fn the_training_forward_on_nchw_matches_the_f64_reference_in_any_parts() {
    // 5 images of 10×11 → 10×11 (padding 1), 24 → 40 channels, in parts of 1, 2 (the last
    // part short) and all 5 images.
    let s = shape(
        5,
        24,
        [10, 11],
        40,
        [3, 3],
        [1, 1],
        [(1, 1), (1, 1)],
        [1, 1],
    );
    if F32Kernel::detect().panel_width().is_none() {
        return;
    }
    assert!(applies_nchw(&s));
    let x = values(s.input_len(), 1);
    let w = values(s.weight_len(), 2);
    let b = values(s.cout, 3);
    let nhwc = crate::base::layout::nchw_to_nhwc(&x, [5, 24, 10, 11]);
    let case = Case {
        bias: true,
        ..Case::default()
    };
    let want_nhwc = reference(&s, &nhwc, &w, &b, &[], case);
    // The reference back to NCHW.
    let mut want = vec![0f64; want_nhwc.len()];
    for n in 0..5 {
        for p in 0..110 {
            for o in 0..40 {
                want[(n * 40 + o) * 110 + p] = want_nhwc[(n * 110 + p) * 40 + o];
            }
        }
    }
    let per_image = 24 * 110 + 40 * 110;
    for images in [1, 2, 5] {
        let mut out = vec![f32::NAN; s.output_len()];
        nchw_in_parts(
            &s,
            (&x, &w, Some(&b)),
            crate::base::buffers::as_uninit(&mut out),
            images * per_image,
        );
        let err = relative_error(&out, &want);
        assert!(err <= 1e-5, "parts of {images} images: error {err:e}");
    }
}

/// f64 weight gradient of an NCHW convolution: `dW[o][c][ky][kx] = Σ x · dy`.
fn reference_weight_grad(s: &ConvShape, x: &[f32], dy: &[f32]) -> Vec<f64> {
    let (oh, ow) = (s.out_h(), s.out_w());
    let mut dw = vec![0f64; s.weight_len()];
    for n in 0..s.batch {
        for o in 0..s.cout {
            for c in 0..s.cin {
                for ky in 0..3 {
                    for kx in 0..3 {
                        let mut acc = 0f64;
                        for oy in 0..oh {
                            for ox in 0..ow {
                                let iy = (oy + ky) as isize - s.padding[0].0 as isize;
                                let ix = (ox + kx) as isize - s.padding[1].0 as isize;
                                if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize {
                                    continue;
                                }
                                let xv =
                                    x[((n * s.cin + c) * s.h + iy as usize) * s.w + ix as usize];
                                acc +=
                                    xv as f64 * dy[((n * s.cout + o) * oh + oy) * ow + ox] as f64;
                            }
                        }
                        dw[((o * s.cin + c) * 3 + ky) * 3 + kx] += acc;
                    }
                }
            }
        }
    }
    dw
}

#[test]
fn the_weight_gradient_matches_the_f64_reference_on_every_kernel_and_in_parts() {
    // Odd output sizes (a last tile half outside), one-sided padding, channels that fill no
    // vector or register tile; parts of 1 and 2 images and the whole batch.
    for s in [
        shape(3, 19, [10, 9], 21, [3, 3], [1, 1], [(1, 0), (1, 1)], [1, 1]),
        shape(4, 16, [8, 8], 40, [3, 3], [1, 1], [(1, 1), (1, 1)], [1, 1]),
        shape(
            1,
            32,
            [16, 16],
            64,
            [3, 3],
            [1, 1],
            [(0, 0), (0, 0)],
            [1, 1],
        ),
    ] {
        let x = values(s.input_len(), 5);
        let dy = values(s.output_len(), 6);
        let want = reference_weight_grad(&s, &x, &dy);
        let per_image = s.input_len() / s.batch + s.output_len() / s.batch;
        if F32Kernel::detect().panel_width().is_some() {
            assert!(
                applies_weight_grad(&s),
                "{s:?} should take the Winograd path"
            );
        }
        for kernel in F32Kernel::all_supported() {
            if kernel.panel_width().is_none() {
                continue;
            }
            for images in [1, 2, s.batch] {
                let mut dw = vec![f32::NAN; s.weight_len()];
                weight_grad::weight_grad_in_parts(
                    kernel,
                    &s,
                    (&x, &dy),
                    &mut dw,
                    images * per_image,
                );
                let err = relative_error(&dw, &want);
                assert!(
                    err <= 1e-5,
                    "{} kernel, {s:?}, parts of {images}: error {err:e}",
                    kernel.name()
                );
            }
        }
    }
}
