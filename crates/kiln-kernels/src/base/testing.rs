//! Helpers the kernels' unit tests share.

/// `len` seeded values in [-1, 1).
pub(crate) fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Largest error relative to the reference's scale (max |ref|), so values near zero after
/// cancellation do not make the ratio meaningless; infinite where a value is NaN (an output
/// never written stays NaN in the tests that prefill with it, and `max` would skip it).
pub(crate) fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "result and reference lengths");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-12);
    got.iter().zip(want).fold(0f64, |m, (g, w)| {
        let diff = (*g as f64 - w).abs();
        if diff.is_nan() {
            f64::INFINITY
        } else {
            m.max(diff)
        }
    }) / scale
}

/// A convolution's shape from its dimensions, in the order the tests list them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv_shape(
    batch: usize,
    cin: usize,
    [h, w]: [usize; 2],
    cout: usize,
    [kh, kw]: [usize; 2],
    stride: [usize; 2],
    padding: [(usize, usize); 2],
    dilation: [usize; 2],
) -> crate::base::shape::ConvShape {
    crate::base::shape::ConvShape {
        batch,
        cin,
        h,
        w,
        cout,
        kh,
        kw,
        stride,
        padding,
        dilation,
    }
}

/// A square pooling or depthwise window over `dims` (`[batch, h, w, channels]`).
pub(crate) fn window(
    dims: [usize; 4],
    k: usize,
    s: usize,
    p: (usize, usize),
    ceil: bool,
) -> crate::base::window::Window2d {
    crate::base::window::Window2d {
        dims,
        kernel: [k, k],
        stride: [s, s],
        dilation: [1, 1],
        pads: [p, p],
        ceil_mode: ceil,
    }
}
