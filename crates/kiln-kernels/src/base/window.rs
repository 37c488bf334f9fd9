//! The geometry of a pooling or depthwise window over a channels-last image.

/// The geometry of a pooling or depthwise window over a channels-last image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window2d {
    /// `[batch, h, w, channels]` of the input.
    pub dims: [usize; 4],
    /// Kernel height and width.
    pub kernel: [usize; 2],
    /// Stride (rows, columns).
    pub stride: [usize; 2],
    /// Dilation (rows, columns).
    pub dilation: [usize; 2],
    /// `[(top, bottom), (left, right)]`.
    pub pads: [(usize, usize); 2],
    /// Output size rounded up (ONNX `ceil_mode`): a last window may start in the bottom or
    /// right padding's shadow, but never past the input and its begin padding.
    pub ceil_mode: bool,
}

impl Window2d {
    /// Output length along `axis` (0: rows, 1: columns), padding and ceil mode included.
    pub fn out_len(&self, axis: usize) -> usize {
        let input = self.dims[1 + axis];
        let (begin, end) = self.pads[axis];
        let span = (self.kernel[axis] - 1) * self.dilation[axis] + 1;
        let padded = input + begin + end;
        if padded < span {
            return 0;
        }
        let steps = padded - span;
        let stride = self.stride[axis];
        let mut out = if self.ceil_mode {
            steps.div_ceil(stride) + 1
        } else {
            steps / stride + 1
        };
        // ONNX and PyTorch: the last window must start inside the input or its begin pad.
        if self.ceil_mode && (out - 1) * stride >= input + begin {
            out -= 1;
        }
        out
    }

    /// `[batch, oh, ow, channels]` of the output.
    pub fn out_dims(&self) -> [usize; 4] {
        [self.dims[0], self.out_len(0), self.out_len(1), self.dims[3]]
    }

    /// The kernel taps of output index `o` on `axis` that land inside the input, and the
    /// input index of the first: taps `k0..k1` read input `i0 + (k − k0)·dilation`.
    #[inline(always)]
    pub fn valid_taps(&self, axis: usize, o: usize) -> (usize, usize, usize) {
        let input = self.dims[1 + axis] as isize;
        let (start, begin) = ((o * self.stride[axis]) as isize, self.pads[axis].0 as isize);
        let d = self.dilation[axis] as isize;
        let first = start - begin;
        // The first tap k with first + k·d ≥ 0, and one past the last with first + k·d < input.
        let k0 = if first >= 0 { 0 } else { (-first + d - 1) / d };
        let k1 = if first >= input {
            0
        } else {
            ((input - first + d - 1) / d).min(self.kernel[axis] as isize)
        };
        let k0 = k0.min(k1);
        (k0 as usize, k1 as usize, (first + k0 * d).max(0) as usize)
    }

    /// For average pooling with the padding counted: window cells inside the padded input
    /// (ONNX: a ceil-mode window's part past the end padding does not count).
    pub fn padded_cells(&self, axis: usize, o: usize) -> usize {
        let (input, (begin, end)) = (self.dims[1 + axis], self.pads[axis]);
        let start = o * self.stride[axis];
        let stop =
            (start + (self.kernel[axis] - 1) * self.dilation[axis] + 1).min(input + begin + end);
        (stop - start).div_ceil(self.dilation[axis])
    }
}
