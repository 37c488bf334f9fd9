//! What the kernel benchmarks share: the thread count from the command line and a timer.

use std::time::Instant;

/// The thread count (the first number among the arguments; `cargo bench` passes `--bench`
/// too), default 1, and a rayon pool of that size.
pub fn pool_from_args() -> (usize, rayon::ThreadPool) {
    let threads = number_arg(0).unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a thread pool");
    (threads, pool)
}

/// The `index`-th number among the command-line arguments (`cargo bench` passes `--bench`
/// and name filters too).
pub fn number_arg(index: usize) -> Option<usize> {
    std::env::args()
        .skip(1)
        .filter_map(|a| a.parse::<usize>().ok())
        .nth(index)
}

/// Whether a case named `name` runs: the arguments that are neither numbers nor flags
/// (`cargo bench` passes `--bench`) select the cases whose names contain one of them; none
/// selects every case. For A/B runs of one shape, repeated many times on a noisy machine.
#[allow(dead_code)]
pub fn name_selected(name: &str) -> bool {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-') && a.parse::<usize>().is_err())
        .collect();
    filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()))
}

/// Best of 5 repeats of `iters` calls, in ms per call, after 3 warm-up calls.
pub fn time(mut f: impl FnMut(), iters: usize) -> f64 {
    for _ in 0..3 {
        f();
    }
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() * 1e3 / iters as f64
        })
        .fold(f64::MAX, f64::min)
}

/// A convolution with square images and kernels, the same stride and padding on both axes.
// Each bench compiles this module on its own; the depthwise bench does not use this one.
#[allow(dead_code)]
pub fn square_conv(
    batch: usize,
    cin: usize,
    side: usize,
    cout: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
) -> kiln_kernels::base::shape::ConvShape {
    kiln_kernels::base::shape::ConvShape {
        batch,
        cin,
        h: side,
        w: side,
        cout,
        kh: kernel,
        kw: kernel,
        stride: [stride; 2],
        padding: [(pad, pad); 2],
        dilation: [1, 1],
    }
}
