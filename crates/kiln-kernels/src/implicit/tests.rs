use super::*;
use crate::base::testing::conv_shape as shape;
use crate::base::testing::{relative_error, values};

/// Direct f64 convolution over NHWC input, `[cout, cin, kh, kw]` weight: the reference.
fn reference(s: &ConvShape, x: &[f32], w: &[f32], bias: Option<&[f32]>, relu: bool) -> Vec<f64> {
    reference_grouped(s, 1, x, w, bias, relu)
}

/// [`reference`] with `groups`: weight `[cout, cin / groups, kh, kw]`, output channel `o`
/// reading the input channels of its group.
fn reference_grouped(
    s: &ConvShape,
    groups: usize,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    relu: bool,
) -> Vec<f64> {
    let (oh, ow) = (s.out_h(), s.out_w());
    let (cg, og) = (s.cin / groups, s.cout / groups);
    let mut out = Vec::with_capacity(s.output_len());
    for n in 0..s.batch {
        for oy in 0..oh {
            for ox in 0..ow {
                for o in 0..s.cout {
                    let mut acc = bias.map_or(0.0, |b| b[o] as f64);
                    for ky in 0..s.kh {
                        for kx in 0..s.kw {
                            let iy = (oy * s.stride[0] + ky * s.dilation[0]) as isize
                                - s.padding[0].0 as isize;
                            let ix = (ox * s.stride[1] + kx * s.dilation[1]) as isize
                                - s.padding[1].0 as isize;
                            if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize {
                                continue;
                            }
                            let px = (n * s.h + iy as usize) * s.w + ix as usize;
                            for c in 0..cg {
                                let xv = x[px * s.cin + (o / og) * cg + c];
                                let wv = w[((o * cg + c) * s.kh + ky) * s.kw + kx];
                                acc += xv as f64 * wv as f64;
                            }
                        }
                    }
                    out.push(if relu { acc.max(0.0) } else { acc });
                }
            }
        }
    }
    out
}

/// A square image under a square kernel, the same stride and padding on both axes, no
/// dilation.
fn square(
    batch: usize,
    cin: usize,
    side: usize,
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
) -> ConvShape {
    shape(
        batch,
        cin,
        [side, side],
        cout,
        [k, k],
        [stride, stride],
        [(pad, pad); 2],
        [1, 1],
    )
}

/// Every kernel this CPU runs matches the f64 reference to 1e-5 of the output's scale.
fn check(s: ConvShape, with_bias: bool, relu: bool) {
    let x = values(s.input_len(), 1);
    let w = values(s.weight_len(), 2);
    let b = values(s.cout, 3);
    let bias = with_bias.then_some(&b[..]);
    let want = reference(&s, &x, &w, bias, relu);
    for kernel in F32Kernel::all_supported() {
        let packed = ConvWeights::pack_for(kernel, [s.cout, s.cin, s.kh, s.kw], &w, bias);
        let mut out = vec![f32::NAN; s.output_len()];
        conv2d_nhwc(&s, &x, &packed, relu, &mut out);
        let err = relative_error(&out, &want);
        assert!(
            err <= 1e-5,
            "{} kernel, {s:?}: error {err:e}",
            kernel.name()
        );
    }
}

#[test]
fn w3_convolutions_match_the_f64_reference() {
    check(
        shape(1, 1, [28, 28], 32, [3, 3], [1, 1], [(0, 0); 2], [1, 1]),
        true,
        true,
    );
    check(
        shape(1, 32, [26, 26], 64, [3, 3], [1, 1], [(0, 0); 2], [1, 1]),
        true,
        true,
    );
    check(
        shape(3, 32, [26, 26], 64, [3, 3], [1, 1], [(0, 0); 2], [1, 1]),
        true,
        false,
    );
}

#[test]
fn padding_stride_and_dilation_match_the_f64_reference() {
    // ResNet's strided 3×3 with padding 1, odd sizes so tiles end mid-row.
    check(
        shape(2, 5, [9, 11], 7, [3, 3], [2, 2], [(1, 1), (1, 1)], [1, 1]),
        true,
        true,
    );
    // Asymmetric padding, dilation 2 in both directions (per-tap runs).
    check(
        shape(1, 3, [10, 9], 20, [3, 2], [1, 1], [(2, 0), (0, 1)], [2, 2]),
        false,
        false,
    );
    // Dilation in height only keeps whole-row runs.
    check(
        shape(2, 4, [8, 8], 33, [2, 3], [1, 2], [(1, 0), (1, 1)], [2, 1]),
        true,
        false,
    );
    // A 1×1 convolution and a 7×7 stem with stride 2.
    check(
        shape(2, 16, [5, 5], 40, [1, 1], [1, 1], [(0, 0); 2], [1, 1]),
        true,
        true,
    );
    check(
        shape(1, 3, [20, 18], 17, [7, 7], [2, 2], [(3, 3), (3, 3)], [1, 1]),
        true,
        true,
    );
}

#[test]
fn threads_split_rows_without_changing_the_result() {
    // Large enough to split over the pool (> SPLIT_MACS) with rows not a multiple of a tile.
    let s = shape(
        1,
        24,
        [31, 29],
        48,
        [3, 3],
        [1, 1],
        [(1, 1), (1, 1)],
        [1, 1],
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    pool.install(|| check(s, true, true));
}

#[test]
fn a_kernel_without_inputs_writes_its_bias() {
    let s = shape(1, 0, [4, 4], 3, [3, 3], [1, 1], [(0, 0); 2], [1, 1]);
    for kernel in F32Kernel::all_supported() {
        let packed = ConvWeights::pack_for(kernel, [3, 0, 3, 3], &[], Some(&[1.0, -2.0, 3.0]));
        let mut out = vec![f32::NAN; s.output_len()];
        conv2d_nhwc(&s, &[], &packed, true, &mut out);
        assert!(
            out.chunks(3).all(|px| px == [1.0, 0.0, 3.0]),
            "{}",
            kernel.name()
        );
    }
}

#[test]
fn linear_rows_match_the_f64_reference() {
    for (rows, inputs, outputs) in [(1, 9216, 128), (3, 70, 10), (13, 128, 33)] {
        let x = values(rows * inputs, 4);
        let w = values(inputs * outputs, 5);
        let b = values(outputs, 6);
        let packed = ConvWeights::linear(inputs, outputs, &w, Some(&b));
        let mut out = vec![f32::NAN; rows * outputs];
        linear_rows(rows, &x, &packed, true, &mut out);
        // ReLU(x · W + b + residual) in f64.
        let reference = |residual: Option<&[f32]>| -> Vec<f64> {
            (0..rows * outputs)
                .map(|i| {
                    let (r, o) = (i / outputs, i % outputs);
                    let dot: f64 = (0..inputs)
                        .map(|j| x[r * inputs + j] as f64 * w[j * outputs + o] as f64)
                        .sum();
                    let add = residual.map_or(0.0, |res| res[i] as f64);
                    (dot + b[o] as f64 + add).max(0.0)
                })
                .collect()
        };
        let want = reference(None);
        // Relative to the largest output, as the convolutions (9,216 f32 products summed).
        let err = relative_error(&out, &want);
        assert!(
            err <= 1e-5,
            "[{rows}, {inputs}] · [{inputs}, {outputs}]: error {err:e}"
        );
        // With a residual: into a new buffer and over the residual's own.
        let residual = values(rows * outputs, 7);
        let want = reference(Some(&residual));
        let act = Some(Activation::Relu);
        let apart = linear_rows_residual_new(rows, &x, &packed, Some(&residual), act);
        let onto = linear_rows_residual_onto(rows, &x, &packed, residual.clone(), act);
        for (got, how) in [(apart, "apart"), (onto, "onto")] {
            let err = relative_error(&got, &want);
            assert!(
                err <= 1e-5,
                "[{rows}, {inputs}] residual {how}: error {err:e}"
            );
        }
    }
}

/// `[b, oh, ow, c]` → 2×2 max pool with stride 2 (an odd last row or column dropped).
fn pool2(y: &[f64], [b, oh, ow, c]: [usize; 4]) -> Vec<f64> {
    let (ph, pw) = (oh / 2, ow / 2);
    let mut out = Vec::with_capacity(b * ph * pw * c);
    for n in 0..b {
        for py in 0..ph {
            for px in 0..pw {
                for ch in 0..c {
                    let at = |dy: usize, dx: usize| {
                        y[((n * oh + 2 * py + dy) * ow + 2 * px + dx) * c + ch]
                    };
                    out.push(at(0, 0).max(at(0, 1)).max(at(1, 0)).max(at(1, 1)));
                }
            }
        }
    }
    out
}

#[test]
fn convolution_relu_and_2x2_pool_in_one_pass_match_the_f64_reference() {
    let cases = [
        // W3's conv2 + pool, batch 2.
        shape(2, 32, [26, 26], 64, [3, 3], [1, 1], [(0, 0); 2], [1, 1]),
        // Odd output sizes (7 × 9: the last row and column dropped), padding, 40 channels.
        shape(3, 5, [7, 9], 40, [3, 3], [1, 1], [(1, 1), (1, 1)], [1, 1]),
        // Stride 2 and a 1-pixel pooled output.
        shape(1, 3, [6, 5], 17, [3, 3], [2, 2], [(0, 0); 2], [1, 1]),
    ];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for s in cases {
        let x = values(s.input_len(), 7);
        let w = values(s.weight_len(), 8);
        let b = values(s.cout, 9);
        let full = reference(&s, &x, &w, Some(&b), true);
        let want = pool2(&full, [s.batch, s.out_h(), s.out_w(), s.cout]);
        for kernel in F32Kernel::all_supported() {
            let packed = ConvWeights::pack_for(kernel, [s.cout, s.cin, s.kh, s.kw], &w, Some(&b));
            let got = pool.install(|| conv2d_nhwc_relu_pool2_new(&s, &x, &packed));
            let err = relative_error(&got, &want);
            assert!(
                err <= 1e-5,
                "{} kernel, {s:?}: error {err:e}",
                kernel.name()
            );
        }
    }
}

/// The store's epilogue (`act(conv + bias + residual)`) on every kernel, against the
/// reference: with and without a residual (ResNet's block ends), each activation the ONNX
/// executor fuses (the clamps in registers, the sigmoid family by the vector logistic), odd
/// channel counts so the masked loads and stores of a partial panel are covered, and batch
/// > 1 so tiles span images.
#[test]
fn the_store_adds_the_residual_and_applies_each_activation() {
    let acts = [
        None,
        Some(Activation::Relu),
        Some(Activation::Clip(-0.25, 0.5)),
        Some(Activation::Sigmoid),
        Some(Activation::Silu),
        Some(Activation::HardSigmoid(0.2, 0.5)),
        Some(Activation::HardSwish),
        Some(Activation::Gelu),
    ];
    for s in [
        shape(1, 16, [9, 9], 32, [3, 3], [1, 1], [(1, 1); 2], [1, 1]),
        shape(2, 8, [7, 6], 37, [3, 3], [2, 2], [(1, 1); 2], [1, 1]),
        shape(3, 5, [5, 5], 13, [1, 1], [1, 1], [(0, 0); 2], [1, 1]),
    ] {
        let x = values(s.input_len(), 4);
        let w = values(s.weight_len(), 5);
        let b = values(s.cout, 6);
        let residual = values(s.output_len(), 7);
        let conv = reference(&s, &x, &w, Some(&b), false);
        for kernel in F32Kernel::all_supported() {
            let packed = ConvWeights::pack_for(kernel, [s.cout, s.cin, s.kh, s.kw], &w, Some(&b));
            for (act, with_residual) in acts.iter().flat_map(|a| [(*a, false), (*a, true)]) {
                let want: Vec<f64> = conv
                    .iter()
                    .zip(&residual)
                    .map(|(y, r)| {
                        let v = if with_residual { y + *r as f64 } else { *y };
                        act.map_or(v, |a| a.reference(v))
                    })
                    .collect();
                let r = with_residual.then_some(&residual[..]);
                let got = conv2d_nhwc_fused_new(&s, &x, &packed, r, act);
                let err = relative_error(&got, &want);
                assert!(
                    err < 1e-5,
                    "{} {s:?} {act:?} residual {with_residual}: {err:.2e}",
                    kernel.name()
                );
                if with_residual {
                    // The sum written over the residual's own buffer.
                    let onto = conv2d_nhwc_fused_onto(&s, &x, &packed, residual.clone(), act);
                    let err = relative_error(&onto, &want);
                    assert!(
                        err < 1e-5,
                        "{} {s:?} {act:?} onto the residual: {err:.2e}",
                        kernel.name()
                    );
                }
            }
        }
    }
}

/// Grouped convolutions against a direct f64 loop on every SIMD kernel: groups narrower than
/// a panel (RegNet's width 8, ResNeXt's 4, a last panel that runs past the channels) and
/// wider than one (64 channels per group), with padding, stride and ReLU; and a grouping the
/// panels cannot hold is refused.
#[test]
fn grouped_convolutions_match_a_direct_loop() {
    let cases = [
        // (batch, cin, side, cout, groups, kernel, stride, pad)
        (1, 48, 9, 48, 6, 3, 1, 1),
        (2, 32, 7, 64, 8, 3, 2, 1),
        (1, 128, 5, 128, 2, 3, 1, 1),
        (1, 24, 6, 24, 3, 1, 1, 0),
    ];
    for (batch, cin, side, cout, groups, k, stride, pad) in cases {
        let s = square(batch, cin, side, cout, k, stride, pad);
        let cg = cin / groups;
        let x = values(s.input_len(), 8);
        let w = values(cout * cg * k * k, 9);
        let b = values(cout, 10);
        let want = reference_grouped(&s, groups, &x, &w, Some(&b), true);
        for kernel in F32Kernel::all_supported() {
            let Some(packed) =
                ConvWeights::pack_grouped_for(kernel, [cout, cg, k, k], groups, &w, Some(&b))
            else {
                assert_eq!(
                    kernel,
                    F32Kernel::Portable,
                    "{} refused a grouping",
                    kernel.name()
                );
                continue;
            };
            let got = conv2d_nhwc_new(&s, &x, &packed, true);
            let err = relative_error(&got, &want);
            assert!(
                err < 1e-5,
                "{} {s:?} groups {groups}: {err:.2e}",
                kernel.name()
            );
        }
    }
    // 12 output channels per group fit neither a 32- nor a 16-wide panel evenly.
    let w = values(24 * 2 * 9, 11);
    assert!(
        ConvWeights::pack_grouped_for(F32Kernel::detect(), [24, 2, 3, 3], 2, &w, None).is_none()
            || F32Kernel::detect() == F32Kernel::Portable
    );
}

/// Rows on the top and bottom border skip the kernel rows that read padding: the runs
/// [`kernel_rows`] gives are exactly the kernel rows inside the image (checked
/// against a scan of every kernel row), for strides, dilations, per-tap runs and padding
/// wider than the kernel's reach (rows that read nothing).
#[test]
fn border_rows_read_exactly_the_kernel_rows_inside_the_image() {
    let cases = [
        // (h, kh, stride, dilation, (top, bottom), per-tap runs)
        (7, 3, 1, 1, (1, 1), false),
        (224, 7, 2, 1, (3, 3), false),
        (14, 3, 2, 1, (1, 1), false),
        (9, 3, 1, 2, (2, 2), true),
        (5, 3, 1, 1, (4, 3), false),
        (6, 1, 1, 1, (0, 0), false),
        // A linear layer's rows: 1×1 images.
        (1, 1, 1, 1, (0, 0), false),
    ];
    for (h, kh, stride, dilation, padding, per_tap) in cases {
        let kw = 3;
        let s = shape(
            1,
            4,
            [h, 8],
            8,
            [kh, kw],
            [stride, 1],
            [padding, (1, 1)],
            [dilation, if per_tap { 2 } else { 1 }],
        );
        let geometry = Geometry::new(&s, s.cin);
        let per_row = if per_tap { kw } else { 1 };
        assert_eq!(geometry.runs.len(), kh * per_row);
        for oy in 0..s.out_h() {
            let inside: Vec<usize> = (0..kh)
                .filter(|ky| {
                    let y = (oy * stride + ky * dilation) as isize - padding.0 as isize;
                    (0..h as isize).contains(&y)
                })
                .collect();
            let want = match (inside.first(), inside.last()) {
                (Some(a), Some(b)) => a * per_row..(b + 1) * per_row,
                _ => {
                    let runs = kernel_rows(&s, oy, per_row);
                    assert!(
                        runs.is_empty(),
                        "{s:?} row {oy}: {runs:?} reads only padding"
                    );
                    continue;
                }
            };
            assert_eq!(kernel_rows(&s, oy, per_row), want, "{s:?} row {oy}");
        }
        // Segments cover two images' rows in order and end where the runs change; the
        // bottom rows of one image and the top rows of the next share one when they read
        // the same runs.
        let (pixels, ow) = (s.out_h() * s.out_w(), s.out_w());
        let runs_of = |r: usize| kernel_rows(&s, r % pixels / ow, per_row);
        let mut row = 0;
        while row < 2 * pixels {
            let (runs, end) = geometry.segment(row, 2 * pixels);
            assert!(end > row);
            assert!(
                (row..end).all(|r| runs_of(r) == runs),
                "{s:?} rows {row}..{end}"
            );
            assert!(
                end == 2 * pixels || runs_of(end) != runs,
                "{s:?} split at {end}"
            );
            row = end;
        }
    }
    // Output rows that read only padding still store their bias (and activation).
    check(
        shape(2, 3, [5, 6], 9, [3, 3], [1, 1], [(4, 3), (1, 1)], [1, 1]),
        true,
        true,
    );
    check(
        shape(1, 6, [7, 7], 40, [3, 3], [1, 1], [(1, 1); 2], [1, 1]),
        true,
        false,
    );
}

/// Tiles cover the rows in order, none over the full tile, sizes multiples of the unit and
/// within one unit of each other.
#[test]
fn tiles_split_rows_evenly() {
    for (n, full, unit) in [
        (0, 12, 1),
        (1, 12, 1),
        (13, 12, 1),
        (25, 12, 1),
        (49, 6, 1),
        (24, 12, 4),
        (20, 12, 4),
    ] {
        let mut sizes = Vec::new();
        let mut next = 0;
        walk_tiles(n, full, unit, |i, rows| {
            assert_eq!(i, next);
            next += rows;
            sizes.push(rows);
        });
        assert_eq!(next, n);
        assert_eq!(sizes.len(), n.div_ceil(full), "{n} rows: {sizes:?}");
        assert!(sizes.iter().all(|&r| r > 0 && r <= full && r % unit == 0));
        let (lo, hi) = (sizes.iter().min(), sizes.iter().max());
        assert!(
            hi.zip(lo).is_none_or(|(h, l)| h - l <= unit),
            "{n}: {sizes:?}"
        );
    }
}

#[test]
fn an_nchw_input_is_read_as_it_is_padded() {
    // RGB-like inputs of 1 to 4 channels (3 takes the vectorized interleave), with and without
    // padding, strided, a batch large enough to split over the pool.
    for cin in 1..=4 {
        for (padding, stride) in [([(1, 1), (1, 1)], [2, 2]), ([(0, 0); 2], [1, 1])] {
            let s = shape(2, cin, [19, 23], 16, [3, 3], stride, padding, [1, 1]);
            let nchw = values(s.input_len(), 1);
            let nhwc = crate::base::layout::nchw_to_nhwc(&nchw, [s.batch, cin, s.h, s.w]);
            let w = values(s.weight_len(), 2);
            let b = values(s.cout, 3);
            let want = reference(&s, &nhwc, &w, Some(&b), true);
            for kernel in F32Kernel::all_supported() {
                let packed = ConvWeights::pack_for(kernel, [s.cout, cin, 3, 3], &w, Some(&b));
                let out =
                    conv2d_nhwc_fused_from_nchw_new(&s, &nchw, &packed, Some(Activation::Relu));
                let err = relative_error(&out, &want);
                assert!(
                    err <= 1e-5,
                    "{} kernel, {s:?}: error {err:e}",
                    kernel.name()
                );
            }
        }
    }
}

/// Convolutions written into their channels of one concatenated image
/// (`conv2d_nhwc_into_channels`) equal each convolution alone, concatenated, on every SIMD
/// kernel this CPU runs: a 1×1 and a padded 3×3 over one input (SqueezeNet's fire module),
/// widths off the panel size, each with its own activation (in the store, and after it).
/// The portable kernel declines (the caller concatenates).
#[test]
fn convolutions_write_their_channels_of_a_concatenation() {
    let (batch, cin, side) = (2, 12, 9);
    let x = values(batch * side * side * cin, 3);
    // (cout, kernel, padding, activation)
    let layers = [
        (20, 1, 0, Some(Activation::Relu)),
        (37, 3, 1, Some(Activation::Silu)),
        (16, 3, 1, None),
    ];
    let channels: usize = layers.iter().map(|l| l.0).sum();
    for kernel in F32Kernel::all_supported() {
        let mut want = vec![0f32; batch * side * side * channels];
        let mut first = 0;
        let mut packed = Vec::new();
        for (i, &(cout, k, pad, act)) in layers.iter().enumerate() {
            let s = square(batch, cin, side, cout, k, 1, pad);
            let w = values(s.weight_len(), 10 + i as u64);
            let b = values(cout, 20 + i as u64);
            let weights = ConvWeights::pack_for(kernel, [cout, cin, k, k], &w, Some(&b));
            let alone = conv2d_nhwc_fused_new(&s, &x, &weights, None, act);
            for (px, values) in alone.chunks_exact(cout).enumerate() {
                want[px * channels + first..][..cout].copy_from_slice(values);
            }
            packed.push((s, weights, act, first));
            first += cout;
        }
        if kernel == F32Kernel::Portable {
            let (s, weights, act, first) = &packed[0];
            let mut out = vec![std::mem::MaybeUninit::new(0f32); want.len()];
            let wrote =
                conv2d_nhwc_into_channels(s, &x, weights, *act, (&mut out, channels, *first));
            assert!(!wrote, "the portable kernel declines");
            continue;
        }
        let got = crate::base::buffers::filled(want.len(), |out| {
            for (s, weights, act, first) in &packed {
                assert!(conv2d_nhwc_into_channels(
                    s,
                    &x,
                    weights,
                    *act,
                    (out, channels, *first)
                ));
            }
        });
        assert_eq!(got, want, "{kernel:?}");
    }
}

/// A small run without parallel work stays on the calling thread; one whose first run
/// split a linear layer over the pool runs on the pool from then on (where it has more
/// than one thread).
#[test]
fn small_runs_hop_onto_the_pool_only_when_their_work_splits() {
    use crate::base::spin::{HOP_MIN_BATCH, HOP_MIN_NODES, RunPlacement};
    let alone = RunPlacement::default();
    for _ in 0..3 {
        assert_eq!(alone.run(1, Some(1), rayon::current_thread_index), None);
    }
    // 1024 × 512 weights: above the size from which a linear layer splits at any batch.
    let (inputs, outputs) = (1024, 512);
    let weight: Vec<f32> = (0..inputs * outputs).map(|i| (i % 7) as f32).collect();
    let packed = ConvWeights::linear(inputs, outputs, &weight, None);
    let x = vec![1.0f32; inputs];
    let layer = || {
        let mut out = vec![0f32; outputs];
        linear_rows(1, &x, &packed, false, &mut out);
        (rayon::current_thread_index(), out[0])
    };
    let splitting = RunPlacement::default();
    let (first, value) = splitting.run(1, Some(1), layer);
    assert_eq!(first, None, "the first small run learns in place");
    assert_eq!(
        value,
        (0..inputs).map(|i| ((i * outputs) % 7) as f32).sum::<f32>()
    );
    let (second, _) = splitting.run(1, Some(1), layer);
    assert_eq!(second.is_some(), rayon::current_num_threads() > 1);
    // A large graph, or a large batch, goes to the pool without learning.
    let large = RunPlacement::default();
    assert!(
        large
            .run(HOP_MIN_NODES, Some(1), rayon::current_thread_index)
            .is_some()
    );
    assert!(
        large
            .run(1, Some(HOP_MIN_BATCH), rayon::current_thread_index)
            .is_some()
    );
}
