//! Regions of interest: run the model only on the regions that changed (or that a detector
//! proposed), all of them as one batch, and map each result back to its place in the frame.
//!
//! A region is a rectangle in frame coordinates. [`crop_batch`] cuts the regions out of a
//! frame, resizes each to the model's input (bilinear, so a detector's box of any size
//! works), and stacks them into one `[N, C, H, W]` batch: one model call per frame whatever the
//! number of regions. [`RegionTracker`] keeps a [`FrameGate`] per region of a fixed layout
//! (cameras watching lanes, shelves, seats; a grid) and says which regions changed.

use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use super::Frame;
use super::gate::{FrameGate, GateConfig, GateDecision};
use crate::error::{KilnError, Result};

/// A rectangle in frame coordinates (pixels): left, top, width, height.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Roi {
    /// Left column.
    pub x: usize,
    /// Top row.
    pub y: usize,
    /// Width in pixels.
    pub w: usize,
    /// Height in pixels.
    pub h: usize,
}

impl Roi {
    /// The rectangle `(x, y, w, h)`.
    pub fn new(x: usize, y: usize, w: usize, h: usize) -> Self {
        Roi { x, y, w, h }
    }

    /// The whole of a `[C, H, W]` frame.
    pub fn whole(shape: [usize; 3]) -> Self {
        Roi::new(0, 0, shape[2], shape[1])
    }

    /// Tiles of `tile_h × tile_w` covering a `height × width` frame row by row (a remainder
    /// narrower than a tile is left out: it has no full region).
    pub fn grid(height: usize, width: usize, tile_h: usize, tile_w: usize) -> Vec<Roi> {
        if tile_h == 0 || tile_w == 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for ty in 0..height / tile_h {
            for tx in 0..width / tile_w {
                out.push(Roi::new(tx * tile_w, ty * tile_h, tile_w, tile_h));
            }
        }
        out
    }

    /// An error unless the region is non-empty and inside a `[C, H, W]` frame.
    pub fn check_inside(&self, shape: [usize; 3]) -> Result<()> {
        let [_, h, w] = shape;
        if self.w == 0 || self.h == 0 || self.x + self.w > w || self.y + self.h > h {
            return Err(KilnError::Stream(format!(
                "region {self:?} is empty or outside the {w}×{h} frame; regions must lie inside it"
            )));
        }
        Ok(())
    }
}

/// The region `roi` of `frame`, resized to `out_h × out_w` (bilinear, half-pixel centres as in
/// ONNX `Resize`; an exact copy when the sizes agree), as `[C, out_h, out_w]` values.
pub fn crop_resize(frame: &Frame, roi: Roi, out_h: usize, out_w: usize) -> Result<Vec<f32>> {
    let [c, fh, fw] = frame.shape();
    roi.check_inside(frame.shape())?;
    let px = frame.pixels();
    let mut out = Vec::with_capacity(c * out_h * out_w);
    if roi.h == out_h && roi.w == out_w {
        for ch in 0..c {
            for y in 0..out_h {
                let row = (ch * fh + roi.y + y) * fw + roi.x;
                out.extend_from_slice(&px[row..row + out_w]);
            }
        }
        return Ok(out);
    }
    let (sy, sx) = (roi.h as f32 / out_h as f32, roi.w as f32 / out_w as f32);
    // Source coordinate and blend weight of each output column / row, computed once.
    let axis = |n: usize, scale: f32, start: usize, len: usize| -> Vec<(usize, usize, f32)> {
        (0..n)
            .map(|i| {
                let s = ((i as f32 + 0.5) * scale - 0.5).clamp(0.0, (len - 1) as f32);
                let lo = s.floor() as usize;
                let hi = (lo + 1).min(len - 1);
                (start + lo, start + hi, s - lo as f32)
            })
            .collect()
    };
    let cols = axis(out_w, sx, roi.x, roi.w);
    let rows = axis(out_h, sy, roi.y, roi.h);
    for ch in 0..c {
        let plane = &px[ch * fh * fw..(ch + 1) * fh * fw];
        for &(y0, y1, fy) in &rows {
            for &(x0, x1, fx) in &cols {
                let top = plane[y0 * fw + x0] * (1.0 - fx) + plane[y0 * fw + x1] * fx;
                let bottom = plane[y1 * fw + x0] * (1.0 - fx) + plane[y1 * fw + x1] * fx;
                out.push(top * (1.0 - fy) + bottom * fy);
            }
        }
    }
    Ok(out)
}

/// The regions of `frame`, each resized to `input` (`[C, H, W]`, the model's input shape), as
/// one batch `[regions, C, H, W]` on `device`.
pub fn crop_batch(
    frame: &Frame,
    rois: &[Roi],
    input: [usize; 3],
    device: &Device,
) -> Result<Tensor<4>> {
    let [c, h, w] = input;
    if frame.shape()[0] != c {
        return Err(KilnError::Stream(format!(
            "the frame has {} channels but the model expects {c}",
            frame.shape()[0]
        )));
    }
    let mut values = Vec::with_capacity(rois.len() * c * h * w);
    for roi in rois {
        values.extend(crop_resize(frame, *roi, h, w)?);
    }
    Ok(Tensor::from_data(
        TensorData::new(values, [rois.len(), c, h, w]),
        device,
    ))
}

/// A fixed layout of regions with a change gate each: which regions need the model this frame.
#[derive(Debug, Clone)]
pub struct RegionTracker {
    regions: Vec<Roi>,
    gates: Vec<FrameGate>,
}

impl RegionTracker {
    /// A tracker for `regions` of frames of `shape`, each gated by `gate`.
    pub fn new(regions: Vec<Roi>, shape: [usize; 3], gate: GateConfig) -> Result<Self> {
        if regions.is_empty() {
            return Err(KilnError::Stream(
                "a region layout needs at least one region".into(),
            ));
        }
        for r in &regions {
            r.check_inside(shape)?;
        }
        let gates = regions
            .iter()
            .map(|_| FrameGate::new(gate))
            .collect::<Result<Vec<_>>>()?;
        Ok(RegionTracker { regions, gates })
    }

    /// The layout.
    pub fn regions(&self) -> &[Roi] {
        &self.regions
    }

    /// Indices of the regions whose content changed beyond the gate (or whose result reached
    /// its reuse age); their gates take this frame as the new reference.
    pub fn changed(&mut self, frame: &Frame) -> Result<Vec<usize>> {
        let mut out = Vec::new();
        for (i, (roi, gate)) in self.regions.iter().zip(&mut self.gates).enumerate() {
            let values = crop_resize(frame, *roi, roi.h, roi.w)?;
            if gate.check(&values) == GateDecision::Compute {
                out.push(i);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(shape: [usize; 3]) -> Frame {
        let n: usize = shape.iter().product();
        Frame::new(shape, (0..n).map(|i| i as f32).collect()).unwrap()
    }

    #[test]
    fn an_equal_size_crop_is_an_exact_copy_of_the_region() {
        let f = ramp([2, 4, 5]);
        let out = crop_resize(&f, Roi::new(1, 2, 3, 2), 2, 3).unwrap();
        // Channel 0 rows 2..4, columns 1..4; channel 1 the same 20 values later.
        assert_eq!(
            out,
            vec![11., 12., 13., 16., 17., 18., 31., 32., 33., 36., 37., 38.]
        );
    }

    #[test]
    fn resizing_a_linear_ramp_stays_on_the_ramp() {
        // Values = column index: bilinear sampling of a linear function is exact inside.
        let f = Frame::new([1, 8, 8], (0..64).map(|i| (i % 8) as f32).collect()).unwrap();
        let out = crop_resize(&f, Roi::new(0, 0, 8, 8), 4, 4).unwrap();
        assert_eq!(&out[..4], &[0.5, 2.5, 4.5, 6.5]);
    }

    #[test]
    fn regions_outside_the_frame_are_refused_by_name() {
        let f = ramp([1, 4, 4]);
        let err = crop_resize(&f, Roi::new(2, 0, 3, 1), 1, 3).unwrap_err();
        assert!(err.to_string().contains("outside the 4×4 frame"), "{err}");
        assert!(crop_resize(&f, Roi::new(0, 0, 0, 1), 1, 1).is_err());
    }

    #[test]
    fn the_tracker_reports_only_the_regions_that_changed() {
        let shape = [1, 4, 8];
        let gate = GateConfig {
            threshold: 0.05,
            max_reuse_age: 100,
        };
        let mut t = RegionTracker::new(Roi::grid(4, 8, 4, 4), shape, gate).unwrap();
        let mut f = Frame::new(shape, vec![0.0; 32]).unwrap();
        assert_eq!(t.changed(&f).unwrap(), vec![0, 1], "first frame: all");
        assert!(t.changed(&f).unwrap().is_empty());
        f.pixels[5] = 4.0; // row 0, column 5: the right tile
        assert_eq!(t.changed(&f).unwrap(), vec![1]);
    }
}
