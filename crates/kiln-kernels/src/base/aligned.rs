//! f32 buffers that start on a cache-line boundary.
//!
//! A 64-byte vector load that straddles two cache lines costs two L1 accesses; the register
//! tiles read their packed weights 64 bytes at a time, so an allocator's 16-byte alignment
//! made every such load a split one.

use std::fmt;
use std::ops::{Deref, DerefMut};

/// Values per cache line.
const LINE: usize = 16;

/// One cache line of values; its alignment is what the buffer is for.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([f32; LINE]);

/// A fixed-length f32 buffer whose first value is 64-byte aligned; derefs to `[f32]`.
#[derive(Clone, Default)]
pub struct AlignedF32 {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedF32 {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        AlignedF32 {
            lines: vec![Line([0.0; LINE]); len.div_ceil(LINE)],
            len,
        }
    }

    /// A copy of `values`.
    pub fn from_slice(values: &[f32]) -> Self {
        let mut buf = Self::zeroed(values.len());
        buf.copy_from_slice(values);
        buf
    }
}

impl Deref for AlignedF32 {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: `lines` holds `len.div_ceil(LINE) * LINE ≥ len` initialized f32 values laid
        // out contiguously (`Line` is `repr(C)` with no padding: 64 bytes of values).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for AlignedF32 {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

impl fmt::Debug for AlignedF32 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedF32")
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_line_aligned_and_keep_their_values() {
        for len in [0, 1, 15, 16, 17, 1000] {
            let values: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let buf = AlignedF32::from_slice(&values);
            assert_eq!(&buf[..], &values[..]);
            assert_eq!(buf.as_ptr() as usize % 64, 0);
        }
    }
}
