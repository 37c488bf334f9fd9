//! Register blocking shared by the SIMD kernels.

/// Walks a rectangle in register blocks of up to `r_full` rows × two channel blocks, a single
/// channel block at the edge: `f(i, b, rows, two_blocks)`. The rows left after the full blocks
/// form one smaller block (not single rows: a 64-row chunk in 6-row blocks left 4 rows that
/// ran at a third of the speed, 12% of BERT-base's int8 GEMM time under `perf`).
pub(super) fn walk_blocks(
    rows: std::ops::Range<usize>,
    blocks: std::ops::Range<usize>,
    r_full: usize,
    mut f: impl FnMut(usize, usize, usize, bool),
) {
    let mut b = blocks.start;
    while b < blocks.end {
        let two = blocks.end - b >= 2;
        let mut i = rows.start;
        while i < rows.end {
            let r = (rows.end - i).min(r_full);
            f(i, b, r, two);
            i += r;
        }
        b += if two { 2 } else { 1 };
    }
}

/// Calls `$block::<R, C>($args)` for the block [`walk_blocks`] gave: `R = $r` (one of the
/// listed row counts) and `C` 2 or 1 channel blocks as `$two` says.
macro_rules! run_block {
    ($block:ident, $r:expr, $two:expr, $args:tt, [$($rows:literal)*]) => {
        match ($r, $two) {
            $(($rows, true) => $block::<$rows, 2> $args,
              ($rows, false) => $block::<$rows, 1> $args,)*
            (r, _) => unreachable!("no {r}-row block"),
        }
    };
}
pub(super) use run_block;
