use super::*;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

/// The kernels this CPU runs (of those `Int8Kernel::detect` may pick).
fn supported_kernels() -> Vec<Int8Kernel> {
    let mut kernels = vec![Int8Kernel::Scalar];
    let best = Int8Kernel::detect();
    if best != Int8Kernel::Scalar {
        kernels.push(Int8Kernel::Avx2);
    }
    if matches!(best, Int8Kernel::Vnni512 | Int8Kernel::Amx) {
        kernels.push(Int8Kernel::Vnni512);
    }
    if best == Int8Kernel::Amx {
        kernels.push(Int8Kernel::Amx);
    }
    kernels
}

/// Every kernel this CPU has computes exactly the scalar integers, for odd shapes that
/// hit every remainder path and both partitionings (m ≥ n and m < n).
#[test]
fn every_kernel_computes_the_exact_integers() {
    let kernels = supported_kernels();
    let mut seed = 7;
    for (m, n, k) in [
        (1, 1, 1),
        (3, 5, 17),
        (64, 10, 100),
        (7, 130, 33),
        (130, 6, 200),
        // AMX: a partial pair of row tiles (20 = 16 + 4), K exactly one tile, and the
        // 64-row chunks of a large operand (600 × 1000: its last chunk 24 rows).
        (20, 40, 70),
        (150, 33, 64),
        (600, 20, 1000),
    ] {
        let xv: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
        let wv: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
        let quant = ActivationQuant::for_values(&xv);
        let qw = quantize_rows(&wv, n, k);
        for &kernel in &kernels {
            let a = QuantizedActivations::new(&xv, k, quant, kernel);
            // The operand's own quantization (AVX2's has 7-bit levels).
            assert_eq!(a.quant, quant.for_kernel(kernel));
            let qx: Vec<u8> = xv.iter().map(|v| a.quant.quantize(*v)).collect();
            let w = PackedWeights::new(&qw, kernel);
            let got = gemm(&a, &w);
            for i in 0..m {
                for j in 0..n {
                    let want: i32 = (0..k)
                        .map(|t| qx[i * k + t] as i32 * qw.values[j * k + t] as i32)
                        .sum();
                    assert_eq!(
                        got[i * n + j],
                        want,
                        "{kernel:?} ({m},{n},{k}) at ({i},{j})"
                    );
                }
            }
        }
    }
}

#[test]
fn dequantized_product_is_close_to_f32() {
    let mut seed = 3;
    let (m, n, k) = (8, 12, 300);
    let xv: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed).max(0.0)).collect(); // ReLU-like
    let wv: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed) * 0.1).collect();
    let quant = ActivationQuant::for_values(&xv);
    let kernel = Int8Kernel::detect();
    let a = QuantizedActivations::new(&xv, k, quant, kernel);
    let w = PackedWeights::new(&quantize_rows(&wv, n, k), kernel);
    let (y, range) = matmul_dequantized(&a, &w, None, None);
    assert_eq!(range, range_of(&y));
    let mut worst = 0f32;
    let mut norm = 0f32;
    for i in 0..m {
        for j in 0..n {
            let exact: f32 = (0..k).map(|t| xv[i * k + t] * wv[j * k + t]).sum();
            worst = worst.max((y[i * n + j] - exact).abs());
            norm = norm.max(exact.abs());
        }
    }
    assert!(worst / norm < 0.02, "relative error {}", worst / norm);
}

/// An activation in the epilogue (GELU, HardSwish; ReLU as the floor) gives the bits of the
/// plain product followed by the activation, and the range of what it stored, on every
/// kernel this CPU runs and with rows and channels enough to split into several rectangles;
/// so does a residual added there, before the activation.
#[test]
fn the_epilogue_applies_the_activation_and_measures_its_output() {
    let mut seed = 5;
    let (m, n, k) = (70, 150, 96);
    let xv: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
    let wv: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed) * 0.2).collect();
    let bias: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
    let quant = ActivationQuant::for_values(&xv);
    for kernel in supported_kernels() {
        let a = QuantizedActivations::new(&xv, k, quant, kernel);
        let w = PackedWeights::new(&quantize_rows(&wv, n, k), kernel);
        let (plain, _) = matmul_dequantized(&a, &w, Some(&bias), None);
        for act in [Activation::Gelu, Activation::HardSwish, Activation::Relu] {
            let (y, range) = matmul_dequantized(&a, &w, Some(&bias), Some(act));
            let mut want = plain.clone();
            crate::activation::activate(&mut want, act);
            assert_eq!(y, want, "{kernel:?} {act:?}");
            assert_eq!(range, range_of(&y), "{kernel:?} {act:?}");
        }
        // A residual in the epilogue: the plain product plus it, then the activation (a ReLU
        // no longer the store's floor), and the range of the sum.
        let residual: Vec<f32> = (0..m * n)
            .map(|i| ((i * 37) % 101) as f32 * 0.05 - 2.5)
            .collect();
        for act in [None, Some(Activation::Relu), Some(Activation::Gelu)] {
            let (y, range) = matmul_dequantized_residual(&a, &w, Some(&bias), Some(&residual), act);
            let mut want: Vec<f32> = plain.iter().zip(&residual).map(|(p, r)| p + r).collect();
            if let Some(act) = act {
                crate::activation::activate(&mut want, act);
            }
            assert_eq!(y, want, "{kernel:?} residual then {act:?}");
            assert_eq!(range, range_of(&y), "{kernel:?} residual then {act:?}");
        }
    }
}

#[test]
fn quantization_round_trips_within_half_a_step() {
    let w = [0.5f32, -1.0, 0.25, 0.0, 2.0, -2.0];
    let q = quantize_rows(&w, 2, 3);
    assert_eq!(q.values[1], -127);
    assert_eq!(q.values[4], 127);
    for r in 0..2 {
        for c in 0..3 {
            let back = q.values[r * 3 + c] as f32 * q.scales[r];
            assert!((back - w[r * 3 + c]).abs() <= q.scales[r] / 2.0 + 1e-7);
        }
    }
    let z = quantize_rows(&[0.0; 4], 1, 4);
    assert_eq!(z.scales, vec![1.0]);
    // Zero is exactly representable in the activations (padding relies on it).
    let p = ActivationQuant::for_values(&[-0.3, 0.0, 1.7]);
    assert_eq!(p.quantize(0.0), p.zero_point);
    assert_eq!(p.quantize(-0.3), 0);
    assert_eq!(p.quantize(1.7), 255);
    assert_eq!(round(2.5), 2.0);
    assert_eq!(round(-1.5), -2.0);
    assert_eq!(round(3.49), 3.0);
}

/// The implicit-GEMM convolution computes exactly the integers of a direct convolution
/// over the quantized input (zero point in the padding), for every kernel, with odd
/// channel counts, asymmetric padding, stride and dilation.
#[test]
fn implicit_gemm_conv_matches_direct_integer_convolution() {
    let mut kernels = vec![Int8Kernel::Scalar];
    if Int8Kernel::detect() != Int8Kernel::Scalar {
        kernels.push(Int8Kernel::Avx2);
    }
    if matches!(Int8Kernel::detect(), Int8Kernel::Vnni512 | Int8Kernel::Amx) {
        kernels.push(Int8Kernel::Vnni512);
    }
    if Int8Kernel::detect() == Int8Kernel::Amx {
        kernels.push(Int8Kernel::Amx);
    }
    let mut seed = 11;
    // Per-tap runs (dilation 2 along x) with 3 channels, and kernel-row runs (dilation 1)
    // with 1 channel (W3's first layer: K = 3 rows × 4) and with 5 channels.
    let cases = [([1usize, 2usize], 3usize), ([1, 1], 1), ([2, 1], 5)];
    for (dilation, ci) in cases {
        let (b, h, w, co) = (2, 7, 6, 5);
        let geometry = ConvGeometry {
            stride: [2, 1],
            pads: [1, 0, 2, 1],
            dilation,
            groups: 1,
            kernel: [3, 2],
        };
        let x: Vec<f32> = (0..b * ci * h * w).map(|_| lcg(&mut seed)).collect();
        let wv: Vec<f32> = (0..co * ci * 6).map(|_| lcg(&mut seed)).collect();
        let qw = quantize_rows(&wv, co, ci * 6);
        let quant = ActivationQuant::for_values(&x);
        for &kernel in &kernels {
            let kq = quant.for_kernel(kernel);
            let qx = |n: usize, c: usize, y: isize, xx: isize| -> i32 {
                if y < 0 || xx < 0 || y >= h as isize || xx >= w as isize {
                    kq.zero_point as i32
                } else {
                    kq.quantize(x[((n * ci + c) * h + y as usize) * w + xx as usize]) as i32
                }
            };
            let (a, ho, wo) = QuantizedActivations::for_conv(
                &x,
                [b, ci, h, w],
                ImageLayout::Nchw,
                &geometry,
                quant,
                kernel,
            );
            let span = |k: usize, d: usize| d * (k - 1) + 1;
            assert_eq!(
                (ho, wo),
                (
                    (10 - span(3, dilation[0])) / 2 + 1,
                    7 - span(2, dilation[1]) + 1
                )
            );
            let pw = pack_conv_weights(&qw, ci, &geometry, kernel);
            let acc = gemm(&a, &pw);
            // The same images stored channels-last give the same operand.
            let mut nhwc = vec![0f32; x.len()];
            for n in 0..b {
                for c in 0..ci {
                    for p in 0..h * w {
                        nhwc[(n * h * w + p) * ci + c] = x[(n * ci + c) * h * w + p];
                    }
                }
            }
            let (a_nhwc, ..) = QuantizedActivations::for_conv(
                &nhwc,
                [b, ci, h, w],
                ImageLayout::Nhwc,
                &geometry,
                quant,
                kernel,
            );
            assert_eq!(gemm(&a_nhwc, &pw), acc, "{kernel:?} channels-last");
            for n in 0..b {
                for oy in 0..ho {
                    for ox in 0..wo {
                        for o in 0..co {
                            let mut want = 0i32;
                            for c in 0..ci {
                                for ky in 0..3 {
                                    for kx in 0..2 {
                                        let y = (oy * 2 + ky * dilation[0]) as isize - 1;
                                        let xx = (ox + kx * dilation[1]) as isize;
                                        want += qx(n, c, y, xx)
                                            * qw.values[((o * ci + c) * 3 + ky) * 2 + kx] as i32;
                                    }
                                }
                            }
                            let row = (n * ho + oy) * wo + ox;
                            assert_eq!(
                                acc[row * co + o],
                                want,
                                "{kernel:?} d{dilation:?} ci{ci} n{n} ({oy},{ox}) o{o}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The AVX2 range scan equals the portable one (NaNs skipped, 0 always inside, every tail
/// length), and both equal a plain fold.
#[test]
fn range_scan_skips_nans_and_covers_zero() {
    let mut seed = 3;
    for len in [0, 1, 7, 8, 9, 31, 64, 100] {
        let mut x: Vec<f32> = (0..len).map(|_| lcg(&mut seed) * 4.0 + 1.0).collect();
        if len > 2 {
            x[len / 2] = f32::NAN;
        }
        let finite = x.iter().filter(|v| !v.is_nan());
        let want = finite.fold((0f32, 0f32), |(l, h), v| (l.min(*v), h.max(*v)));
        assert_eq!(min_max_portable(&x), want, "len {len}");
        assert_eq!(min_max(&x), want, "len {len}");
    }
    let big: Vec<f32> = (0..100_000).map(|i| (i as f32 - 30_000.0) / 7.0).collect();
    assert_eq!(range_of(&big), (-30_000.0 / 7.0, 69_999.0 / 7.0));
    assert_eq!(range_of(&[-2.0, -1.0]), (-2.0, 0.0));
}

/// The AVX2 epilogue writes the portable loop's values bit for bit (multiply then add, the
/// floor, the tail columns) and reports the range of what it wrote.
#[test]
fn dequantizing_epilogue_is_exact_and_measures_its_range() {
    let mut seed = 5;
    let (rows, cols, acc_stride, out_stride) = (5, 21, 24, 30);
    let acc: Vec<i32> = (0..rows * acc_stride)
        .map(|_| (lcg(&mut seed) * 20_000.0) as i32)
        .collect();
    let scale: Vec<f32> = (0..cols).map(|_| lcg(&mut seed).abs() * 1e-3).collect();
    let offset: Vec<f32> = (0..cols).map(|_| lcg(&mut seed)).collect();
    for floor in [0.0, f32::NEG_INFINITY] {
        let columns = Columns {
            scale: &scale,
            offset: &offset,
            floor,
        };
        let mut want = vec![f32::NAN; rows * out_stride];
        for r in 0..rows {
            for j in 0..cols {
                let v = acc[r * acc_stride + j] as f32 * scale[j] + offset[j];
                want[r * out_stride + j] = v.max(floor);
            }
        }
        let written: Vec<f32> = (0..rows)
            .flat_map(|r| want[r * out_stride..][..cols].to_vec())
            .collect();
        let mut out = vec![f32::NAN; rows * out_stride];
        // SAFETY: `out` holds rows × out_stride f32s.
        let range = unsafe {
            dequantize_rect(
                &acc,
                acc_stride,
                rows,
                &columns,
                out.as_mut_ptr(),
                out_stride,
            )
        };
        assert_eq!(
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "floor {floor}"
        );
        assert_eq!(range, range_of(&written), "floor {floor}");
        assert!(floor < 0.0 || range.0 == 0.0);
    }
}

/// The worst case for AVX2's `vpmaddubsw`: every activation at the top of its range and
/// every weight ±127 with the sign of its neighbour, so each i16 pair sum is as large as it
/// gets. 7-bit activations keep it exact (8-bit ones would saturate at 32767), and the
/// 7-bit operand covers the same range as the 8-bit one within one of its steps.
#[test]
fn avx2_pairs_never_saturate() {
    let (m, n, k) = (3, 9, 64);
    let xv: Vec<f32> = (0..m * k)
        .map(|i| if i % 7 == 0 { -0.5 } else { 4.0 })
        .collect();
    let wv: Vec<f32> = (0..n * k)
        .map(|i| if (i / k) % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    let quant = ActivationQuant::for_values(&xv);
    let qw = quantize_rows(&wv, n, k);
    for kernel in supported_kernels() {
        let a = QuantizedActivations::new(&xv, k, quant, kernel);
        assert!(a.quant.max_level <= kernel.max_activation());
        let got = gemm(&a, &PackedWeights::new(&qw, kernel));
        for i in 0..m {
            for j in 0..n {
                let want: i32 = (0..k)
                    .map(|t| a.quant.quantize(xv[i * k + t]) as i32 * qw.values[j * k + t] as i32)
                    .sum();
                assert_eq!(got[i * n + j], want, "{kernel:?} at ({i},{j})");
            }
        }
        // Dequantized, the 7-bit operand still represents the inputs within half a step.
        for v in &xv {
            let back = (a.quant.quantize(*v) as f32 - a.quant.zero_point as f32) * a.quant.scale;
            assert!(
                (back - v).abs() <= a.quant.scale * 0.5 + 1e-6,
                "{kernel:?}: {v} → {back}"
            );
        }
    }
}

/// A value just below a half rounds down whatever the zero point: ONNX's QuantizeLinear
/// rounds `x / scale` and then adds the zero point. Adding it first (`1.4999999 + 132` is
/// `133.5` in f32) rounded such values up, one step off ONNX Runtime on a QDQ model's input.
#[test]
fn quantization_rounds_before_adding_the_zero_point() {
    let quant = ActivationQuant {
        scale: 1.0,
        zero_point: 132,
        max_level: 255,
    };
    let below_half = 1.499_999_9_f32;
    assert_eq!(quant.quantize(below_half), 133);
    assert_eq!(quant.quantize(-below_half), 131);
    let src = [below_half, -below_half, 2.5, -2.5];
    let mut dst = [std::mem::MaybeUninit::new(0u8); 4];
    quantize_into(&src, &mut dst, 1.0, 132, 255.0);
    // SAFETY: every element was written above.
    let got: Vec<u8> = dst.iter().map(|v| unsafe { v.assume_init() }).collect();
    // Ties go to even, as ONNX's round does: 2.5 → 2, −2.5 → −2.
    assert_eq!(got, vec![133, 131, 134, 130]);
}
