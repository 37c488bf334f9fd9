use super::*;
use crate::base::shape::FLIPPED_MIN_CIN;
use crate::base::testing::{relative_error, values};
use crate::patches::{conv2d_nhwc_forward, pack_weight_for_nhwc};

/// Direct f64 convolution: the reference every kernel result is checked against.
/// Calls `f(output index, input index, weight index)` for every kernel tap that reads
/// inside the image: the direct convolution both references are built from.
fn for_each_tap(s: &ConvShape, mut f: impl FnMut(usize, usize, usize)) {
    let (oh, ow) = (s.out_h(), s.out_w());
    for n in 0..s.batch {
        for co in 0..s.cout {
            for oy in 0..oh {
                for ox in 0..ow {
                    let oi = ((n * s.cout + co) * oh + oy) * ow + ox;
                    for c in 0..s.cin {
                        for ki in 0..s.kh {
                            for kj in 0..s.kw {
                                let iy = (oy * s.stride[0] + ki * s.dilation[0]) as isize
                                    - s.padding[0].0 as isize;
                                let ix = (ox * s.stride[1] + kj * s.dilation[1]) as isize
                                    - s.padding[1].0 as isize;
                                if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize {
                                    continue;
                                }
                                let xi = ((n * s.cin + c) * s.h + iy as usize) * s.w + ix as usize;
                                f(oi, xi, ((co * s.cin + c) * s.kh + ki) * s.kw + kj);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Direct f64 convolution: the reference every kernel result is checked against.
fn reference_forward(s: &ConvShape, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f64> {
    let p = s.out_h() * s.out_w();
    let mut out: Vec<f64> = (0..s.output_len())
        .map(|oi| b.map_or(0.0, |b| b[(oi / p) % s.cout] as f64))
        .collect();
    for_each_tap(s, |oi, xi, wi| out[oi] += x[xi] as f64 * w[wi] as f64);
    out
}

/// f64 gradients of `Σ out · g` with respect to x and w, by the same direct loops.
fn reference_grads(s: &ConvShape, x: &[f32], w: &[f32], g: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let mut dx = vec![0f64; s.input_len()];
    let mut dw = vec![0f64; s.weight_len()];
    for_each_tap(s, |oi, xi, wi| {
        dx[xi] += g[oi] as f64 * w[wi] as f64;
        dw[wi] += g[oi] as f64 * x[xi] as f64;
    });
    (dx, dw)
}

fn shapes() -> Vec<ConvShape> {
    let base = ConvShape {
        batch: 3,
        cin: 4,
        h: 9,
        w: 8,
        cout: 5,
        kh: 3,
        kw: 3,
        stride: [1, 1],
        padding: [(0, 0), (0, 0)],
        dilation: [1, 1],
    };
    vec![
        base,
        // W3's conv2 at batch 1 (multi-threaded GEMM path).
        ConvShape {
            batch: 1,
            cin: 32,
            h: 26,
            w: 26,
            cout: 64,
            ..base
        },
        // ResNet's padded, strided 3×3 and its 1×1 shortcut.
        ConvShape {
            stride: [2, 2],
            padding: [(1, 1), (1, 1)],
            ..base
        },
        ConvShape {
            kh: 1,
            kw: 1,
            ..base
        },
        ConvShape {
            kh: 1,
            kw: 1,
            stride: [2, 2],
            ..base
        },
        // Asymmetric padding, dilation, non-square everything.
        ConvShape {
            kh: 2,
            kw: 3,
            stride: [1, 2],
            padding: [(0, 1), (2, 0)],
            dilation: [2, 1],
            ..base
        },
        // `same` padding at stride 1 (the contiguous unfold), also dilated and with a
        // kernel taller than the image.
        ConvShape {
            padding: [(1, 1), (1, 1)],
            ..base
        },
        ConvShape {
            kh: 3,
            kw: 5,
            padding: [(4, 0), (4, 4)],
            dilation: [2, 2],
            ..base
        },
        ConvShape {
            h: 2,
            w: 3,
            kh: 5,
            kw: 3,
            padding: [(2, 2), (1, 1)],
            ..base
        },
        // A kernel wider than the padded input leaves whole rows of padding only.
        ConvShape {
            h: 3,
            w: 2,
            kh: 3,
            kw: 3,
            padding: [(2, 2), (2, 2)],
            ..base
        },
    ]
}

/// The seeded input, weight and bias of shape `i` of [`shapes`].
fn operands(s: &ConvShape, i: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let i = i as u64;
    let x = values(s.input_len(), 1 + i);
    let w = values(s.weight_len(), 100 + i);
    (x, w, values(s.cout, 200 + i))
}

/// `[batch, c, h, w]` values as `[batch, h, w, c]`.
fn to_nhwc(x: &[f32], [b, c, h, w]: [usize; 4]) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    for n in 0..b {
        for ch in 0..c {
            for p in 0..h * w {
                y[(n * h * w + p) * c + ch] = x[(n * c + ch) * h * w + p];
            }
        }
    }
    y
}

#[test]
fn channels_last_forward_with_fused_relu_matches_an_f64_reference() {
    for (i, s) in shapes().into_iter().enumerate() {
        let (x, w, b) = operands(&s, i);
        let x_nhwc = to_nhwc(&x, [s.batch, s.cin, s.h, s.w]);
        let packed = pack_weight_for_nhwc([s.cout, s.cin, s.kh, s.kw], &w);
        let dims = [s.batch, s.cout, s.out_h(), s.out_w()];
        for (bias, relu) in [(Some(&b[..]), false), (None, false), (Some(&b[..]), true)] {
            let mut out = vec![f32::NAN; s.output_len()];
            conv2d_nhwc_forward(&s, &x_nhwc, &packed, bias, relu, &mut out);
            let want: Vec<f64> = reference_forward(&s, &x, &w, bias)
                .into_iter()
                .map(|v| if relu { v.max(0.0) } else { v })
                .collect();
            let want_f32: Vec<f32> = want.iter().map(|v| *v as f32).collect();
            let want_nhwc: Vec<f64> = to_nhwc(&want_f32, dims).iter().map(|v| *v as f64).collect();
            let err = relative_error(&out, &want_nhwc);
            assert!(
                err <= 1e-5,
                "shape {i} {s:?} bias {} relu {relu}: error {err:e}",
                bias.is_some()
            );
        }
    }
}

#[test]
fn forward_and_gradients_match_an_f64_reference() {
    for (i, s) in shapes().into_iter().enumerate() {
        let (x, w, b) = operands(&s, i);
        let g = values(s.output_len(), 300 + i as u64);

        let mut out = vec![f32::NAN; s.output_len()];
        conv2d_forward(&s, &x, &w, Some(&b), &mut out);
        let want = reference_forward(&s, &x, &w, Some(&b));
        let err = relative_error(&out, &want);
        assert!(err <= 1e-5, "shape {i} {s:?}: forward error {err:e}");
        // Into a fresh, unfilled vector: the same values, every one written.
        let fresh = conv2d_forward_new(&s, &x, &w, Some(&b));
        assert_eq!(fresh, out, "shape {i}: forward into a new vector");

        conv2d_forward(&s, &x, &w, None, &mut out);
        let want = reference_forward(&s, &x, &w, None);
        let err = relative_error(&out, &want);
        assert!(err <= 1e-5, "shape {i}: forward without bias error {err:e}");

        let (want_dx, want_dw) = reference_grads(&s, &x, &w, &g);
        let mut dx = vec![f32::NAN; s.input_len()];
        conv2d_input_grad(&s, &g, &w, &mut dx);
        let err = relative_error(&dx, &want_dx);
        assert!(err <= 1e-5, "shape {i}: input-gradient error {err:e}");
        let fresh = conv2d_input_grad_new(&s, &g, &w);
        assert_eq!(fresh, dx, "shape {i}: input gradient into a new vector");
        let mut dw = vec![f32::NAN; s.weight_len()];
        conv2d_weight_grad(&s, &x, &g, &mut dw);
        let err = relative_error(&dw, &want_dw);
        assert!(err <= 1e-5, "shape {i}: weight-gradient error {err:e}");
    }
}

/// The GEMM forward on every shape, also those the direct kernel takes on this CPU (so
/// the path AVX2 CPUs run for them stays tested on an AVX-512 machine).
#[test]
fn the_gemm_forward_matches_an_f64_reference_on_every_shape() {
    for (i, s) in shapes().into_iter().enumerate() {
        let (x, w, b) = operands(&s, i);
        let mut out = vec![f32::NAN; s.output_len()];
        let dims = check_forward(&s, &x, &w, out.len()).expect("a nonempty shape");
        forward_gemm(
            &s,
            (&x, &w, Some(&b)),
            dims,
            crate::base::buffers::as_uninit(&mut out),
        );
        let err = relative_error(&out, &reference_forward(&s, &x, &w, Some(&b)));
        assert!(err <= 1e-5, "shape {i} {s:?}: GEMM forward error {err:e}");
    }
}

#[test]
fn input_gradient_as_a_flipped_forward_matches_an_f64_reference() {
    let mut flipped = 0;
    let mut cases = shapes();
    // Padding wider than a 1×1 kernel's reach: rows of the output read padding only.
    cases.push(ConvShape {
        kh: 1,
        kw: 1,
        padding: [(1, 1), (1, 0)],
        ..cases[0]
    });
    for (i, s) in cases.into_iter().enumerate() {
        let s = ConvShape {
            cin: FLIPPED_MIN_CIN,
            ..s
        };
        flipped += usize::from(s.input_grad_as_forward().is_some());
        let x = values(s.input_len(), 1 + i as u64);
        let w = values(s.weight_len(), 100 + i as u64);
        let g = values(s.output_len(), 300 + i as u64);
        let (want_dx, _) = reference_grads(&s, &x, &w, &g);
        let mut dx = vec![f32::NAN; s.input_len()];
        conv2d_input_grad(&s, &g, &w, &mut dx);
        let err = relative_error(&dx, &want_dx);
        assert!(err <= 1e-5, "shape {i} {s:?}: input-gradient error {err:e}");
        assert_eq!(
            conv2d_input_grad_new(&s, &g, &w),
            dx,
            "shape {i}: into a new vector"
        );
    }
    // Every stride-1 shape but the one whose padding is wider than the kernel's reach.
    assert_eq!(flipped, 7, "shapes taking the flipped forward");
}

/// A late ResNet stage: 4×4 images (grouped several per GEMM) and a weight large enough
/// for the weight gradient to be split by input channels.
fn late_stage() -> ConvShape {
    ConvShape {
        batch: 5,
        cin: 64,
        h: 4,
        w: 4,
        cout: 512,
        padding: [(1, 1), (1, 1)],
        ..shapes()[0]
    }
}

#[test]
fn grouped_images_and_channel_split_match_an_f64_reference_on_any_thread_count() {
    // A 3×3 layer (its parts are stored transposed, `k > cout`) and a 1×1 layer with as
    // many outputs as inputs (stored as they are): both placed over several blocks of
    // output channels.
    let pointwise = ConvShape {
        cin: 512,
        kh: 1,
        kw: 1,
        padding: [(0, 0), (0, 0)],
        ..late_stage()
    };
    for s in [late_stage(), pointwise] {
        channel_split_matches_an_f64_reference(&s);
    }
}

fn channel_split_matches_an_f64_reference(s: &ConvShape) {
    let s = *s;
    assert!(
        s.weight_len() >= SPLIT_WEIGHT && s.cout > PLACE_ROWS,
        "the shape must take the channel split and place several blocks"
    );
    let x = values(s.input_len(), 7);
    let w = values(s.weight_len(), 8);
    let g = values(s.output_len(), 9);
    let want_out = reference_forward(&s, &x, &w, None);
    let (want_dx, want_dw) = reference_grads(&s, &x, &w, &g);
    let mut weight_grads = Vec::new();
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool");
        assert!(
            group_len(&s, threads) > 1,
            "{threads} threads: images must be grouped"
        );
        let (out, dx, dw) = pool.install(|| {
            let mut out = vec![f32::NAN; s.output_len()];
            conv2d_forward(&s, &x, &w, None, &mut out);
            let mut dx = vec![f32::NAN; s.input_len()];
            conv2d_input_grad(&s, &g, &w, &mut dx);
            let mut dw = vec![f32::NAN; s.weight_len()];
            conv2d_weight_grad(&s, &x, &g, &mut dw);
            (out, dx, dw)
        });
        for (what, got, want) in [("forward", &out, &want_out), ("dx", &dx, &want_dx)] {
            let err = relative_error(got, want);
            assert!(err <= 1e-5, "{threads} threads: {what} error {err:e}");
        }
        let err = relative_error(&dw, &want_dw);
        assert!(
            err <= 1e-5,
            "{threads} threads: weight-gradient error {err:e}"
        );
        weight_grads.push(dw);
    }
    // Split by channels, every weight element is summed in the same order whatever the
    // thread count.
    assert!(weight_grads[1] == weight_grads[2], "2 vs 3 threads differ");
}

#[test]
fn valid_range_keeps_reads_inside_the_row() {
    for w in 1..7 {
        for stride in 1..4 {
            for offset in -4isize..4 {
                let ow = 6;
                let (lo, hi) = valid_range(ow, stride, offset, w);
                for ox in 0..ow {
                    let ix = (ox * stride) as isize + offset;
                    let inside = ix >= 0 && ix < w as isize;
                    assert_eq!(
                        inside,
                        (lo..hi).contains(&ox),
                        "w {w} s {stride} o {offset}"
                    );
                }
            }
        }
    }
}
