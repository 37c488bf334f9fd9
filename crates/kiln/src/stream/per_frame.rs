//! Any per-frame model, not only classifiers: what a model returns for one frame
//! ([`FrameResult`]: a class, a segmentation mask, an image, or boxes) and the
//! [`FrameModel`] contract the video techniques drive, with [`OnnxFrameModel`] for an
//! imported ONNX file.
//!
//! Results live in the model's input coordinates (the frame as resized or letterboxed for the
//! model), so a region of interest computed on a crop pastes straight back.

use burn::tensor::TensorData;
use serde::{Deserialize, Serialize};

use super::roi::Roi;
use super::{Frame, Prediction, Route, top1_rows};
use crate::error::{KilnError, Result};
use crate::names::config_names;
use crate::onnx::OnnxModel;

/// How a model's output is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputKind {
    /// `[B, K]` logits: one class per frame.
    Classes,
    /// `[B, K, H, W]` logits: a class per pixel (semantic segmentation).
    Mask,
    /// `[B, C, H, W]` values: an image per frame (enhancement, depth, super-resolution).
    Image,
    /// `[B, N, 6]` rows `x1, y1, x2, y2, score, class` in input pixels (an end-to-end
    /// detector's output, after its own non-maximum suppression).
    Boxes,
}

config_names!(OutputKind {
    Classes => "classes",
    Mask => "mask",
    Image => "image",
    Boxes => "boxes",
});

impl OutputKind {
    /// The kind an output of `dims` most likely is, for a model with `channels` input
    /// channels: rank 2 classes, rank 3 ending in 6 boxes, rank 4 an image when it has the
    /// input's channel count, a mask otherwise; `None` when nothing fits.
    pub fn guess(dims: &[Option<usize>], channels: usize) -> Option<OutputKind> {
        match dims.len() {
            2 => Some(OutputKind::Classes),
            3 if dims[2] == Some(6) => Some(OutputKind::Boxes),
            4 if dims[1] == Some(channels) || dims[1] == Some(1) => Some(OutputKind::Image),
            4 => Some(OutputKind::Mask),
            _ => None,
        }
    }
}

/// One detection, in input pixels.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Detection {
    /// Left, top, right, bottom.
    pub bbox: [f32; 4],
    /// The detector's score.
    pub score: f32,
    /// The class index.
    pub class: usize,
}

impl Detection {
    /// The centre `(x, y)`.
    pub fn centre(&self) -> (f32, f32) {
        (
            (self.bbox[0] + self.bbox[2]) / 2.0,
            (self.bbox[1] + self.bbox[3]) / 2.0,
        )
    }

    /// Intersection over union with `other` (0 for disjoint or empty boxes).
    pub fn iou(&self, other: &Detection) -> f32 {
        let [ax0, ay0, ax1, ay1] = self.bbox;
        let [bx0, by0, bx1, by1] = other.bbox;
        let iw = (ax1.min(bx1) - ax0.max(bx0)).max(0.0);
        let ih = (ay1.min(by1) - ay0.max(by0)).max(0.0);
        let inter = iw * ih;
        let union = (ax1 - ax0).max(0.0) * (ay1 - ay0).max(0.0)
            + (bx1 - bx0).max(0.0) * (by1 - by0).max(0.0)
            - inter;
        if union > 0.0 { inter / union } else { 0.0 }
    }
}

/// A model's result for one frame.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FrameResult {
    /// A classification.
    Class(Prediction),
    /// A class per pixel, row-major `height × width`, and (when asked for) the softmax
    /// probability of each pixel's class.
    Mask {
        /// Rows.
        height: usize,
        /// Columns.
        width: usize,
        /// The arg-max class of each pixel.
        labels: Vec<u16>,
        /// The arg-max probability of each pixel (empty unless confidence was asked for).
        #[serde(skip)]
        confidence: Vec<f32>,
    },
    /// An image `[C, H, W]`.
    Image {
        /// `[C, H, W]`.
        shape: [usize; 3],
        /// The values, row-major.
        #[serde(skip)]
        values: Vec<f32>,
    },
    /// Detections.
    Boxes(Vec<Detection>),
}

impl FrameResult {
    /// `(height, width)` of a dense result (mask or image); `None` for classes and boxes.
    pub fn dense_size(&self) -> Option<(usize, usize)> {
        match self {
            FrameResult::Mask { height, width, .. } => Some((*height, *width)),
            FrameResult::Image { shape, .. } => Some((shape[1], shape[2])),
            _ => None,
        }
    }
}

/// A model that runs on whole frames (or crops of them) and returns one [`FrameResult`] each.
pub trait FrameModel {
    /// What its results are.
    fn kind(&self) -> OutputKind;

    /// Input channels.
    fn channels(&self) -> usize;

    /// The fixed `(height, width)` its input must have; `None` when any size runs (a fully
    /// convolutional model exported with dynamic height and width), which regions of
    /// interest and multi-scale need.
    fn fixed_size(&self) -> Option<(usize, usize)>;

    /// Runs on `frames` (all of one shape, `[C, H, W]`); `confidence` asks masks for their
    /// per-pixel probability.
    fn run(&self, frames: &[&Frame], confidence: bool) -> Result<Vec<FrameResult>>;
}

/// An imported ONNX model as a [`FrameModel`]: its first input takes the frames, its first
/// output is read as `kind`.
#[derive(Debug)]
pub struct OnnxFrameModel {
    model: OnnxModel,
    kind: OutputKind,
    channels: usize,
    fixed: Option<(usize, usize)>,
    /// Boxes scoring below this are left out.
    pub score_threshold: f32,
}

impl OnnxFrameModel {
    /// Wraps `model`; `kind` reads its first output (`None`: guessed from the output's
    /// declared shape). An error names what does not fit: no image input, an input of
    /// another rank, an output no kind reads.
    pub fn new(model: OnnxModel, kind: Option<OutputKind>) -> Result<Self> {
        let input = model.inputs().first().ok_or_else(|| {
            KilnError::Stream(format!("the ONNX model `{}` has no inputs", model.name()))
        })?;
        if input.dims.len() != 4 {
            return Err(KilnError::Stream(format!(
                "the ONNX model `{}` takes `{}` of rank {}; a per-frame model takes images \
                 [batch, channels, height, width]",
                model.name(),
                input.name,
                input.dims.len()
            )));
        }
        let channels = input.dims[1].ok_or_else(|| {
            KilnError::Stream(format!(
                "the channel axis of `{}` is dynamic; export the model with a fixed channel count",
                input.name
            ))
        })?;
        let fixed = match (input.dims[2], input.dims[3]) {
            (Some(h), Some(w)) => Some((h, w)),
            _ => None,
        };
        let output = model.outputs().first().ok_or_else(|| {
            KilnError::Stream(format!("the ONNX model `{}` has no outputs", model.name()))
        })?;
        let kind = match kind.or_else(|| OutputKind::guess(&output.dims, channels)) {
            Some(k) => k,
            None => {
                return Err(KilnError::Stream(format!(
                    "cannot tell how to read output `{}` of rank {}; name its kind (classes, \
                     mask, image, boxes)",
                    output.name,
                    output.dims.len()
                )));
            }
        };
        Ok(OnnxFrameModel {
            model,
            kind,
            channels,
            fixed,
            score_threshold: 0.25,
        })
    }

    /// The wrapped model.
    pub fn model(&self) -> &OnnxModel {
        &self.model
    }
}

impl FrameModel for OnnxFrameModel {
    fn kind(&self) -> OutputKind {
        self.kind
    }

    fn channels(&self) -> usize {
        self.channels
    }

    fn fixed_size(&self) -> Option<(usize, usize)> {
        self.fixed
    }

    fn run(&self, frames: &[&Frame], confidence: bool) -> Result<Vec<FrameResult>> {
        let Some(first) = frames.first() else {
            return Ok(Vec::new());
        };
        let shape = first.shape();
        let mut values = Vec::with_capacity(frames.len() * first.pixels().len());
        for f in frames {
            if f.shape() != shape {
                return Err(KilnError::Stream(format!(
                    "a batch mixes frames of {:?} and {:?}",
                    shape,
                    f.shape()
                )));
            }
            values.extend_from_slice(f.pixels());
        }
        let input = TensorData::new(values, [frames.len(), shape[0], shape[1], shape[2]]);
        let mut outputs = self.model.run_data(vec![input])?;
        if outputs.is_empty() {
            return Err(KilnError::Stream("the model returned no outputs".into()));
        }
        let out = outputs.swap_remove(0);
        let dims: Vec<usize> = out.shape().to_vec();
        let data = out
            .try_into_vec_as::<f32>()
            .map_err(|e| KilnError::Stream(format!("reading the model's output: {e:?}")))?;
        read_output(
            self.kind,
            &dims,
            &data,
            frames.len(),
            confidence,
            self.score_threshold,
        )
    }
}

/// Splits a batch output of `dims` into one result per frame.
pub fn read_output(
    kind: OutputKind,
    dims: &[usize],
    data: &[f32],
    batch: usize,
    confidence: bool,
    score_threshold: f32,
) -> Result<Vec<FrameResult>> {
    let expect = |rank: usize| -> Result<()> {
        if dims.len() != rank || dims[0] != batch {
            return Err(KilnError::Stream(format!(
                "a {} output must be of rank {rank} with the batch ({batch}) first, got {dims:?}",
                kind.name()
            )));
        }
        Ok(())
    };
    match kind {
        OutputKind::Classes => {
            expect(2)?;
            Ok(top1_rows(data, dims[1], Route::Full)
                .into_iter()
                .map(FrameResult::Class)
                .collect())
        }
        OutputKind::Mask => {
            expect(4)?;
            let (k, h, w) = (dims[1], dims[2], dims[3]);
            Ok(data
                .chunks_exact(k * h * w)
                .map(|logits| argmax_mask(logits, k, h, w, confidence))
                .collect())
        }
        OutputKind::Image => {
            expect(4)?;
            let shape = [dims[1], dims[2], dims[3]];
            Ok(data
                .chunks_exact(shape.iter().product())
                .map(|v| FrameResult::Image {
                    shape,
                    values: v.to_vec(),
                })
                .collect())
        }
        OutputKind::Boxes => {
            expect(3)?;
            if dims[2] != 6 {
                return Err(KilnError::Stream(format!(
                    "box rows must be x1, y1, x2, y2, score, class (6 values), got {}",
                    dims[2]
                )));
            }
            Ok(data
                .chunks_exact(dims[1] * 6)
                .map(|rows| {
                    FrameResult::Boxes(
                        rows.chunks_exact(6)
                            .filter(|r| r[4].is_finite() && r[4] >= score_threshold)
                            .map(|r| Detection {
                                bbox: [r[0], r[1], r[2], r[3]],
                                score: r[4],
                                class: r[5].max(0.0) as usize,
                            })
                            .collect(),
                    )
                })
                .collect())
        }
    }
}

/// The arg-max class of each pixel of `[K, H, W]` logits, and its softmax probability when
/// `confidence` is set. Channel-major scan: each logit plane is read once, in order.
fn argmax_mask(logits: &[f32], k: usize, h: usize, w: usize, confidence: bool) -> FrameResult {
    let n = h * w;
    let mut best = logits[..n].to_vec();
    let mut labels = vec![0u16; n];
    for c in 1..k {
        let plane = &logits[c * n..(c + 1) * n];
        for ((b, l), &v) in best.iter_mut().zip(labels.iter_mut()).zip(plane) {
            if v > *b {
                *b = v;
                *l = c as u16;
            }
        }
    }
    let confidence = if confidence {
        let mut sum = vec![0f32; n];
        for c in 0..k {
            let plane = &logits[c * n..(c + 1) * n];
            for ((s, &b), &v) in sum.iter_mut().zip(&best).zip(plane) {
                *s += (v - b).exp();
            }
        }
        sum.iter().map(|s| 1.0 / s).collect()
    } else {
        Vec::new()
    };
    FrameResult::Mask {
        height: h,
        width: w,
        labels,
        confidence,
    }
}

/// Pastes `part` (the result of running on the crop `crop` of a `frame_h × frame_w` input)
/// into `into` (the whole frame's result) over `region` (inside `crop`), in input pixels.
/// Dense results scale by their size relative to the input; boxes whose centre lies in
/// `region` are replaced by the crop's boxes whose centre lies there.
pub fn paste(
    into: &mut FrameResult,
    part: &FrameResult,
    crop: Roi,
    region: Roi,
    frame: (usize, usize),
) -> Result<()> {
    let mismatch = || KilnError::Stream("a region's result is not of the frame's kind".into());
    match (into, part) {
        (FrameResult::Boxes(all), FrameResult::Boxes(new)) => {
            let inside = |d: &Detection| {
                let (x, y) = d.centre();
                x >= region.x as f32
                    && x < (region.x + region.w) as f32
                    && y >= region.y as f32
                    && y < (region.y + region.h) as f32
            };
            all.retain(|d| !inside(d));
            let (dx, dy) = (crop.x as f32, crop.y as f32);
            all.extend(
                new.iter()
                    .map(|d| Detection {
                        bbox: [
                            d.bbox[0] + dx,
                            d.bbox[1] + dy,
                            d.bbox[2] + dx,
                            d.bbox[3] + dy,
                        ],
                        ..*d
                    })
                    .filter(inside),
            );
            Ok(())
        }
        (
            FrameResult::Mask {
                height,
                width,
                labels,
                confidence,
            },
            FrameResult::Mask {
                height: ph,
                width: pw,
                labels: pl,
                confidence: pc,
            },
        ) => {
            let (fh, fw) = frame;
            let (sy, sx) = (*height as f32 / fh as f32, *width as f32 / fw as f32);
            let copy = pc.len() == pl.len() && confidence.len() == labels.len();
            for_each_pasted(
                (*height, *width),
                (*ph, *pw),
                crop,
                region,
                (sy, sx),
                |dst, src| {
                    labels[dst] = pl[src];
                    if copy {
                        confidence[dst] = pc[src];
                    }
                },
            );
            Ok(())
        }
        (
            FrameResult::Image { shape, values },
            FrameResult::Image {
                shape: ps,
                values: pv,
            },
        ) => {
            if shape[0] != ps[0] {
                return Err(mismatch());
            }
            let (fh, fw) = frame;
            let (sy, sx) = (shape[1] as f32 / fh as f32, shape[2] as f32 / fw as f32);
            let (plane, pplane) = (shape[1] * shape[2], ps[1] * ps[2]);
            for c in 0..shape[0] {
                let (dst, src) = (
                    &mut values[c * plane..(c + 1) * plane],
                    &pv[c * pplane..(c + 1) * pplane],
                );
                for_each_pasted(
                    (shape[1], shape[2]),
                    (ps[1], ps[2]),
                    crop,
                    region,
                    (sy, sx),
                    |d, s| dst[d] = src[s],
                );
            }
            Ok(())
        }
        (FrameResult::Class(p), FrameResult::Class(q)) => {
            *p = *q;
            Ok(())
        }
        _ => Err(mismatch()),
    }
}

/// Calls `f(dst, src)` for each pixel of `region` in a dense result of `size` (whole frame,
/// scaled by `scale` from input pixels) and its source in a crop result of `part_size`.
fn for_each_pasted(
    size: (usize, usize),
    part_size: (usize, usize),
    crop: Roi,
    region: Roi,
    scale: (f32, f32),
    mut f: impl FnMut(usize, usize),
) {
    let (sy, sx) = scale;
    let to = |v: usize, s: f32| (v as f32 * s).round() as usize;
    let (y0, y1) = (to(region.y, sy), to(region.y + region.h, sy).min(size.0));
    let (x0, x1) = (to(region.x, sx), to(region.x + region.w, sx).min(size.1));
    let (cy, cx) = (to(crop.y, sy), to(crop.x, sx));
    for y in y0..y1 {
        let py = y.saturating_sub(cy).min(part_size.0.saturating_sub(1));
        for x in x0..x1 {
            let px = x.saturating_sub(cx).min(part_size.1.saturating_sub(1));
            f(y * size.1 + x, py * part_size.1 + px);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_read_by_their_shape() {
        assert_eq!(
            OutputKind::guess(&[None, Some(10)], 3),
            Some(OutputKind::Classes)
        );
        assert_eq!(
            OutputKind::guess(&[None, Some(21), None, None], 3),
            Some(OutputKind::Mask)
        );
        assert_eq!(
            OutputKind::guess(&[None, Some(3), None, None], 3),
            Some(OutputKind::Image)
        );
        assert_eq!(
            OutputKind::guess(&[None, None, Some(6)], 3),
            Some(OutputKind::Boxes)
        );
        assert_eq!(OutputKind::guess(&[None], 3), None);
    }

    #[test]
    fn a_mask_is_the_per_pixel_argmax_with_its_probability() {
        // K=2, 1×2 pixels: pixel 0 class 1, pixel 1 class 0.
        let logits = [0.0, 1.0, 1.0, 0.0];
        let r = read_output(OutputKind::Mask, &[1, 2, 1, 2], &logits, 1, true, 0.0).unwrap();
        let FrameResult::Mask {
            labels, confidence, ..
        } = &r[0]
        else {
            panic!("{r:?}")
        };
        assert_eq!(labels, &vec![1, 0]);
        let p = 1.0 / (1.0 + (-1.0f32).exp());
        assert!((confidence[0] - p).abs() < 1e-6 && (confidence[1] - p).abs() < 1e-6);
    }

    #[test]
    fn boxes_below_the_score_threshold_are_left_out_and_bad_rows_refused() {
        let rows = [0., 0., 4., 4., 0.9, 2., 1., 1., 2., 2., 0.1, 0.];
        let r = read_output(OutputKind::Boxes, &[1, 2, 6], &rows, 1, false, 0.25).unwrap();
        assert_eq!(
            r[0],
            FrameResult::Boxes(vec![Detection {
                bbox: [0., 0., 4., 4.],
                score: 0.9,
                class: 2
            }])
        );
        let err = read_output(OutputKind::Boxes, &[1, 2, 5], &rows[..10], 1, false, 0.2);
        assert!(err.unwrap_err().to_string().contains("6 values"));
    }

    #[test]
    fn a_crop_result_pastes_into_the_frame_at_its_place() {
        let mut whole = FrameResult::Mask {
            height: 4,
            width: 4,
            labels: vec![0; 16],
            confidence: Vec::new(),
        };
        // A 2×2 crop at (1, 1) whose result is all 7s; paste only its top-left pixel region.
        let part = FrameResult::Mask {
            height: 2,
            width: 2,
            labels: vec![7; 4],
            confidence: Vec::new(),
        };
        paste(
            &mut whole,
            &part,
            Roi::new(1, 1, 2, 2),
            Roi::new(1, 1, 2, 1),
            (4, 4),
        )
        .unwrap();
        let FrameResult::Mask { labels, .. } = whole else {
            unreachable!()
        };
        assert_eq!(&labels[4..8], &[0, 7, 7, 0]);
        assert_eq!(labels.iter().filter(|&&l| l == 7).count(), 2);

        let mut boxes = FrameResult::Boxes(vec![
            Detection {
                bbox: [0., 0., 2., 2.],
                score: 1.0,
                class: 0,
            },
            Detection {
                bbox: [10., 10., 12., 12.],
                score: 1.0,
                class: 0,
            },
        ]);
        let found = FrameResult::Boxes(vec![Detection {
            bbox: [1., 1., 3., 3.],
            score: 0.8,
            class: 1,
        }]);
        paste(
            &mut boxes,
            &found,
            Roi::new(8, 8, 8, 8),
            Roi::new(8, 8, 8, 8),
            (16, 16),
        )
        .unwrap();
        let FrameResult::Boxes(b) = boxes else {
            unreachable!()
        };
        // The box in the region is replaced by the crop's, offset by the crop's corner.
        assert_eq!(b.len(), 2);
        assert_eq!(b[1].bbox, [9., 9., 11., 11.]);
        assert_eq!(b[0].bbox, [0., 0., 2., 2.]);
    }
}
