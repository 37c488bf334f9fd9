//! Register blocking shared by the SIMD kernels.

/// Walks a rectangle in register blocks of `r_full` rows × two channel blocks, with single
/// rows and single channel blocks at the edges: `f(i, b, full_rows, two_blocks)`.
pub(super) fn walk_blocks(
    rows: std::ops::Range<usize>,
    blocks: std::ops::Range<usize>,
    r_full: usize,
    mut f: impl FnMut(usize, usize, bool, bool),
) {
    let mut b = blocks.start;
    while b < blocks.end {
        let two = blocks.end - b >= 2;
        let mut i = rows.start;
        while i < rows.end {
            let full = rows.end - i >= r_full;
            f(i, b, full, two);
            i += if full { r_full } else { 1 };
        }
        b += if two { 2 } else { 1 };
    }
}
