//! The real-time techniques around any [`FrameModel`] on one stream of frames: temporal
//! coherence (reuse the whole result when the frame is unchanged), regions of interest (run the
//! model only on the part of the frame that changed and paste its result back) and multi-scale
//! (run the model on a downscaled frame, and at full resolution only where it is unsure).
//!
//! Every decision is taken on a [`Thumb`]: the frame's luma averaged over small blocks, so the
//! gate's cost does not grow with the model's resolution (at 4K, the decoder's frame is first
//! reduced to the model's input, then to the thumbnail).

use serde::{Deserialize, Serialize};

use super::Frame;
use super::gate::GateConfig;
use super::per_frame::{FrameModel, FrameResult, OutputKind, paste};
use super::processor::FramePath;
use super::roi::{Roi, crop_resize};
use crate::error::{KilnError, Result};

/// A frame's luma at reduced resolution: what the gates compare.
#[derive(Debug, Clone, PartialEq)]
pub struct Thumb {
    /// Columns.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// Input pixels per thumbnail pixel along each side.
    pub block: usize,
    /// Luma in 0..1, row-major.
    pub values: Vec<f32>,
}

impl Thumb {
    /// The thumbnail of an interleaved RGB8 image `width × height`, each value the mean luma
    /// (BT.601 weights) of a `block × block` square; edge pixels that fill no whole block are
    /// left out.
    pub fn from_rgb8(rgb: &[u8], width: usize, height: usize, block: usize) -> Thumb {
        let block = block.max(1);
        let (tw, th) = (width / block, height / block);
        let mut values = vec![0f32; tw * th];
        let norm = 1.0 / (255.0 * (block * block) as f32);
        for ty in 0..th {
            let out = &mut values[ty * tw..(ty + 1) * tw];
            for y in ty * block..(ty + 1) * block {
                let row = &rgb[y * width * 3..(y * width + tw * block) * 3];
                for (o, px) in out.iter_mut().zip(row.chunks_exact(3 * block)) {
                    let mut s = 0u32;
                    for p in px.chunks_exact(3) {
                        s += 77 * u32::from(p[0]) + 150 * u32::from(p[1]) + 29 * u32::from(p[2]);
                    }
                    *o += s as f32 / 256.0;
                }
            }
            out.iter_mut().for_each(|v| *v *= norm);
        }
        Thumb {
            width: tw,
            height: th,
            block,
            values,
        }
    }
}

impl Thumb {
    /// The thumbnail of a model input `frame` `[C, H, W]`: each value the mean over the
    /// channels and a `block × block` square, in the frame's own units (for frames that
    /// arrive already normalized, as a server's requests do; thresholds are then in those
    /// units: ImageNet normalization scales a luma step of 1/255 by about 1/0.226).
    pub fn from_frame(frame: &Frame, block: usize) -> Thumb {
        let block = block.max(1);
        let [c, h, w] = frame.shape();
        let (tw, th) = (w / block, h / block);
        let mut values = vec![0f32; tw * th];
        let px = frame.pixels();
        for ch in 0..c {
            for ty in 0..th {
                let out = &mut values[ty * tw..(ty + 1) * tw];
                for y in ty * block..(ty + 1) * block {
                    let row = &px[(ch * h + y) * w..(ch * h + y) * w + tw * block];
                    for (o, b) in out.iter_mut().zip(row.chunks_exact(block)) {
                        *o += b.iter().sum::<f32>();
                    }
                }
            }
        }
        let norm = 1.0 / (c * block * block).max(1) as f32;
        values.iter_mut().for_each(|v| *v *= norm);
        Thumb {
            width: tw,
            height: th,
            block,
            values,
        }
    }
}

/// Regions of interest on a video: the thumbnail is cut into tiles, each compared with its
/// content when the model last ran on it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegionConfig {
    /// Tile side, in thumbnail pixels.
    pub tile: usize,
    /// A tile whose mean absolute luma difference is above this changed.
    pub threshold: f32,
    /// Context around the changed area that the model also sees (input pixels), so the
    /// pasted result does not suffer from the crop's borders.
    pub margin: usize,
    /// Crop corners and sides are multiples of this (input pixels): a model's total stride,
    /// so the crop's feature grid lines up with the whole frame's.
    pub align: usize,
    /// Above this share of the frame changed, the whole frame runs.
    pub max_area: f32,
    /// Frames a tile's result may be reused for before it must run again.
    pub max_reuse_age: u32,
}

impl Default for RegionConfig {
    fn default() -> Self {
        RegionConfig {
            tile: 4,
            threshold: 0.02,
            margin: 32,
            align: 32,
            max_area: 0.6,
            max_reuse_age: 60,
        }
    }
}

/// Multi-scale on a video: the model runs on the frame downscaled by `factor`; where it is
/// less sure than `confidence` (a mask's pixels, a class), it runs again at full resolution.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaleConfig {
    /// Downscale factor of the coarse pass (2 = half width and height).
    pub factor: usize,
    /// Softmax probability at or above which the coarse result is kept.
    pub confidence: f32,
}

/// The frame gate's tile side in thumbnail pixels when no regions are configured (16 input
/// pixels at the converter's 1/4-side thumbnail).
pub const GATE_TILE: usize = 4;

/// Which techniques a video stream uses.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VideoTechniques {
    /// Temporal coherence on the whole frame: the frame is reused when no tile of its
    /// thumbnail changed by more than the threshold (mean absolute luma difference in 0..1
    /// over the tile, against the last frame the model ran on).
    pub frame_gate: Option<GateConfig>,
    /// Regions of interest.
    pub regions: Option<RegionConfig>,
    /// Multi-scale.
    pub multiscale: Option<ScaleConfig>,
}

impl VideoTechniques {
    /// Tile side (thumbnail pixels) over which the frame gate measures change: the regions'
    /// tile, or [`GATE_TILE`] without regions.
    pub fn gate_tile(&self) -> usize {
        self.regions.map_or(GATE_TILE, |r| r.tile)
    }

    /// A short name for tables: `full`, `temporal`, `roi+multiscale`, ...
    pub fn name(&self) -> String {
        let mut parts = Vec::new();
        if self.frame_gate.is_some() {
            parts.push("temporal");
        }
        if self.regions.is_some() {
            parts.push("roi");
        }
        if self.multiscale.is_some() {
            parts.push("multiscale");
        }
        if parts.is_empty() {
            "full".into()
        } else {
            parts.join("+")
        }
    }

    /// An error naming the technique that cannot work with `model`.
    pub fn check(&self, model: &dyn FrameModel) -> Result<()> {
        self.check_for(model.kind(), model.fixed_size())
    }

    /// [`check`](Self::check) for a model whose results are `kind` and whose input must be
    /// `fixed_size` (`None`: any height and width).
    pub fn check_for(&self, kind: OutputKind, fixed_size: Option<(usize, usize)>) -> Result<()> {
        if let Some(g) = &self.frame_gate {
            g.validate()?;
        }
        let any_size = fixed_size.is_none();
        if let Some(r) = &self.regions {
            if r.tile == 0 || r.align == 0 || !(r.threshold.is_finite() && r.threshold >= 0.0) {
                return Err(KilnError::Stream(format!(
                    "regions: tile and align must be ≥ 1 and the threshold a finite value ≥ 0, got {r:?}"
                )));
            }
            if !any_size || matches!(kind, OutputKind::Classes) {
                return Err(KilnError::Stream(
                    "regions of interest run the model on crops: they need a model with dynamic \
                     height and width whose output is a mask, an image or boxes"
                        .into(),
                ));
            }
        }
        if let Some(s) = &self.multiscale {
            if s.factor < 2 {
                return Err(KilnError::Stream(format!(
                    "multiscale: the factor must be ≥ 2, got {}",
                    s.factor
                )));
            }
            if !any_size || !matches!(kind, OutputKind::Mask | OutputKind::Classes) {
                return Err(KilnError::Stream(
                    "multi-scale runs the model on a downscaled frame and reads its confidence: \
                     it needs a model with dynamic height and width whose output is a mask or \
                     classes"
                        .into(),
                ));
            }
        }
        Ok(())
    }
}

/// What one frame took.
#[derive(Debug, Clone, PartialEq)]
pub struct FrameStep {
    /// The frame's result, in input coordinates.
    pub result: FrameResult,
    /// How much of the frame the model ran on.
    pub path: FramePath,
    /// The part of the frame the model ran on at full resolution (`None` when reused, or
    /// when only the coarse pass ran).
    pub region: Option<Roi>,
    /// Input pixels the model ran on at full resolution (crops with their margins; 0 when
    /// reused).
    pub pixels_run: usize,
    /// Whether a coarse (downscaled) pass ran.
    pub coarse: bool,
}

/// One video stream's technique state; the model is passed per frame, so many streams share
/// one model.
#[derive(Debug, Clone)]
pub struct FrameStream {
    techniques: VideoTechniques,
    last: Option<FrameResult>,
    /// The input shape the last result belongs to.
    shape: Option<[usize; 3]>,
    /// The thumbnail as of the last computed frame (whole-frame gate).
    frame_ref: Option<Vec<f32>>,
    frame_age: u32,
    /// Each tile's thumbnail values when the model last ran on it.
    tile_ref: Option<Vec<f32>>,
    tile_age: Vec<u32>,
}

impl FrameStream {
    /// A stream with `techniques`, checked against `model`.
    pub fn new(techniques: VideoTechniques, model: &dyn FrameModel) -> Result<Self> {
        Self::for_output(techniques, model.kind(), model.fixed_size())
    }

    /// A stream with `techniques` for models of `kind` and `fixed_size` (see
    /// [`VideoTechniques::check_for`]): for state created before its model is at hand, as a
    /// server's sequence is.
    pub fn for_output(
        techniques: VideoTechniques,
        kind: OutputKind,
        fixed_size: Option<(usize, usize)>,
    ) -> Result<Self> {
        techniques.check_for(kind, fixed_size)?;
        Ok(FrameStream {
            techniques,
            last: None,
            shape: None,
            frame_ref: None,
            frame_age: 0,
            tile_ref: None,
            tile_age: Vec::new(),
        })
    }

    /// The techniques.
    pub fn techniques(&self) -> &VideoTechniques {
        &self.techniques
    }

    /// Processes the next frame (`input` for the model, `thumb` its thumbnail). A frame of a
    /// new shape starts over (full run); when the model fails, the stream forgets its last
    /// result so the next frame runs in full.
    pub fn process(
        &mut self,
        input: &Frame,
        thumb: &Thumb,
        model: &dyn FrameModel,
    ) -> Result<FrameStep> {
        let out = self.step(input, thumb, model);
        if out.is_err() {
            self.last = None;
        }
        out
    }

    fn step(&mut self, input: &Frame, thumb: &Thumb, model: &dyn FrameModel) -> Result<FrameStep> {
        if self.shape != Some(input.shape())
            || self.frame_ref.as_ref().map(Vec::len) != Some(thumb.values.len())
        {
            self.last = None;
        }
        let Some(last) = self.last.clone() else {
            return self.full(input, thumb, model);
        };
        // Temporal coherence: the whole frame unchanged since the last computed one.
        if let (Some(g), Some(r)) = (&self.techniques.frame_gate, &self.frame_ref)
            && self.frame_age < g.max_reuse_age
            && largest_change(r, thumb, self.techniques.gate_tile()) <= g.threshold
        {
            self.frame_age += 1;
            self.tile_age
                .iter_mut()
                .for_each(|a| *a = a.saturating_add(1));
            return Ok(FrameStep {
                result: last,
                path: FramePath::Reused,
                region: None,
                pixels_run: 0,
                coarse: false,
            });
        }
        let Some(rc) = self.techniques.regions else {
            return self.full(input, thumb, model);
        };
        let changed = self.changed_areas(&rc, thumb);
        if changed.is_empty() {
            // No tile changed: reuse, but the frame gate's reference follows this frame.
            self.frame_age += 1;
            return Ok(FrameStep {
                result: last,
                path: FramePath::Reused,
                region: None,
                pixels_run: 0,
                coarse: false,
            });
        }
        let [_, h, w] = input.shape();
        let crops = plan_crops(&changed, &rc, h, w);
        let area: usize = crops.iter().map(|c| c.crop.w * c.crop.h).sum();
        if area as f32 > rc.max_area * (w * h) as f32 {
            return self.full(input, thumb, model);
        }
        let mut result = last;
        for c in &crops {
            let part = run_one(model, &crop_frame(input, c.crop)?, false, "a region")?;
            for &r in &c.changed {
                // The result changes a little beyond the changed pixels (a moved object's
                // edge, the model's receptive field), so the inner half of the margin, which
                // the crop saw with context, is pasted too.
                let grown = grow_within(r, rc.margin / 2, c.crop);
                paste(&mut result, &part, c.crop, grown, (h, w))?;
            }
        }
        self.mark_computed(thumb, Some(&changed));
        self.last = Some(result.clone());
        Ok(FrameStep {
            result,
            path: FramePath::Partial,
            region: bounding_box(&changed),
            pixels_run: area,
            coarse: false,
        })
    }

    /// Runs the whole frame (coarse first under multi-scale).
    fn full(&mut self, input: &Frame, thumb: &Thumb, model: &dyn FrameModel) -> Result<FrameStep> {
        let [_, h, w] = input.shape();
        let (result, region, pixels_run, coarse) = match self.techniques.multiscale {
            Some(s) => {
                let (result, region, pixels) = multiscale(input, model, s)?;
                (result, region, pixels, true)
            }
            None => (
                run_one(model, input, false, "a frame")?,
                Some(Roi::new(0, 0, w, h)),
                w * h,
                false,
            ),
        };
        self.shape = Some(input.shape());
        self.mark_computed(thumb, None);
        self.last = Some(result.clone());
        Ok(FrameStep {
            result,
            path: FramePath::Full,
            region,
            pixels_run,
            coarse,
        })
    }

    /// The changed areas, in input pixels: one box per group of touching tiles (8-connected)
    /// that changed or aged out since the model last ran on them; empty when none did.
    fn changed_areas(&mut self, rc: &RegionConfig, thumb: &Thumb) -> Vec<Roi> {
        let Some(reference) = self.tile_ref.as_ref() else {
            return Vec::new();
        };
        let (tw, th) = (
            thumb.width.div_ceil(rc.tile),
            thumb.height.div_ceil(rc.tile),
        );
        let mut changed: Vec<bool> = tile_changes(reference, thumb, rc.tile)
            .into_iter()
            .zip(&self.tile_age)
            .map(|(mean, &age)| mean > rc.threshold || age >= rc.max_reuse_age)
            .collect();
        self.tile_age
            .iter_mut()
            .for_each(|a| *a = a.saturating_add(1));
        let scale = rc.tile * thumb.block;
        tile_groups(&mut changed, tw, th)
            .into_iter()
            .map(|(x0, y0, x1, y1)| {
                // Tiles at the thumbnail's right and bottom edges may be narrower.
                let px1 = (x1 * scale).min(thumb.width * thumb.block);
                let py1 = (y1 * scale).min(thumb.height * thumb.block);
                Roi::new(x0 * scale, y0 * scale, px1 - x0 * scale, py1 - y0 * scale)
            })
            .collect()
    }

    /// The model ran on `regions` (input pixels; `None` = everything): their tiles take this
    /// thumbnail as their reference, and so does the frame gate.
    fn mark_computed(&mut self, thumb: &Thumb, regions: Option<&[Roi]>) {
        self.frame_ref = Some(thumb.values.clone());
        self.frame_age = 0;
        let Some(rc) = self.techniques.regions else {
            return;
        };
        let tiles = thumb.width.div_ceil(rc.tile) * thumb.height.div_ceil(rc.tile);
        match (regions, self.tile_ref.as_mut()) {
            (Some(regions), Some(reference)) if reference.len() == thumb.values.len() => {
                let b = thumb.block;
                let tw = thumb.width.div_ceil(rc.tile);
                for r in regions {
                    let (x0, y0) = (r.x / b, r.y / b);
                    let (x1, y1) = (
                        ((r.x + r.w) / b).min(thumb.width),
                        ((r.y + r.h) / b).min(thumb.height),
                    );
                    for y in y0..y1 {
                        let row = y * thumb.width;
                        reference[row + x0..row + x1]
                            .copy_from_slice(&thumb.values[row + x0..row + x1]);
                    }
                    for ty in y0 / rc.tile..y1.div_ceil(rc.tile) {
                        for tx in x0 / rc.tile..x1.div_ceil(rc.tile) {
                            if let Some(a) = self.tile_age.get_mut(ty * tw + tx) {
                                *a = 0;
                            }
                        }
                    }
                }
            }
            _ => {
                self.tile_ref = Some(thumb.values.clone());
                self.tile_age = vec![0; tiles];
            }
        }
    }
}

/// The largest tile change (see [`tile_changes`]): a frame is only as unchanged as its most
/// changed part, which a mean over the whole frame would hide (a small object moving over a
/// still background barely moves the frame's mean).
fn largest_change(reference: &[f32], thumb: &Thumb, tile: usize) -> f32 {
    tile_changes(reference, thumb, tile)
        .into_iter()
        .fold(0.0, f32::max)
}

/// Each `tile × tile` tile's mean absolute difference between `thumb` and `reference` (a
/// thumbnail of the same size), row-major over the tiles; edge tiles may be smaller.
fn tile_changes(reference: &[f32], thumb: &Thumb, tile: usize) -> Vec<f32> {
    let (tw, th) = (thumb.width.div_ceil(tile), thumb.height.div_ceil(tile));
    let mut out = Vec::with_capacity(tw * th);
    for ty in 0..th {
        for tx in 0..tw {
            let (x0, y0) = (tx * tile, ty * tile);
            let (x1, y1) = ((x0 + tile).min(thumb.width), (y0 + tile).min(thumb.height));
            let mut diff = 0f32;
            for y in y0..y1 {
                let row = y * thumb.width;
                diff += thumb.values[row + x0..row + x1]
                    .iter()
                    .zip(&reference[row + x0..row + x1])
                    .map(|(a, b)| (a - b).abs())
                    .sum::<f32>();
            }
            out.push(diff / ((x1 - x0) * (y1 - y0)).max(1) as f32);
        }
    }
    out
}

/// The bounding boxes `(x0, y0, x1, y1)`, in tiles, of the 8-connected groups of set flags in
/// a `tw × th` grid (the flags are cleared on the way).
fn tile_groups(flags: &mut [bool], tw: usize, th: usize) -> Vec<(usize, usize, usize, usize)> {
    let mut groups = Vec::new();
    let mut todo = Vec::new();
    for start in 0..flags.len() {
        if !flags[start] {
            continue;
        }
        flags[start] = false;
        todo.push(start);
        let (mut x0, mut y0, mut x1, mut y1) = (usize::MAX, usize::MAX, 0, 0);
        while let Some(t) = todo.pop() {
            let (x, y) = (t % tw, t / tw);
            (x0, y0, x1, y1) = (x0.min(x), y0.min(y), x1.max(x + 1), y1.max(y + 1));
            for ny in y.saturating_sub(1)..(y + 2).min(th) {
                for nx in x.saturating_sub(1)..(x + 2).min(tw) {
                    let n = ny * tw + nx;
                    if flags[n] {
                        flags[n] = false;
                        todo.push(n);
                    }
                }
            }
        }
        groups.push((x0, y0, x1, y1));
    }
    groups
}

/// One model call of a partial frame: the crop it sees and the changed areas inside it whose
/// result is pasted back.
#[derive(Debug, Clone, PartialEq)]
struct PlannedCrop {
    crop: Roi,
    changed: Vec<Roi>,
}

/// The crops that cover `changed` in an `h × w` frame: each area grown by the margin and
/// aligned; two crops that overlap, or whose union is no larger than the two apart, become
/// one (a model call per crop has a fixed cost, and overlapping crops would run pixels twice).
fn plan_crops(changed: &[Roi], rc: &RegionConfig, h: usize, w: usize) -> Vec<PlannedCrop> {
    let mut crops: Vec<PlannedCrop> = changed
        .iter()
        .map(|&r| PlannedCrop {
            crop: expand_aligned(r, rc.margin, rc.align, h, w),
            changed: vec![r],
        })
        .collect();
    'merge: loop {
        for i in 0..crops.len() {
            for j in i + 1..crops.len() {
                let (a, b) = (crops[i].crop, crops[j].crop);
                let u = union(a, b);
                if overlaps(a, b) || u.w * u.h <= a.w * a.h + b.w * b.h {
                    let other = crops.swap_remove(j);
                    crops[i].crop = u;
                    crops[i].changed.extend(other.changed);
                    continue 'merge;
                }
            }
        }
        return crops;
    }
}

fn union(a: Roi, b: Roi) -> Roi {
    let (x0, y0) = (a.x.min(b.x), a.y.min(b.y));
    let (x1, y1) = ((a.x + a.w).max(b.x + b.w), (a.y + a.h).max(b.y + b.h));
    Roi::new(x0, y0, x1 - x0, y1 - y0)
}

fn overlaps(a: Roi, b: Roi) -> bool {
    a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h
}

/// `r` grown by `by` on every side, inside `bounds`.
fn grow_within(r: Roi, by: usize, bounds: Roi) -> Roi {
    let x0 = r.x.saturating_sub(by).max(bounds.x);
    let y0 = r.y.saturating_sub(by).max(bounds.y);
    let x1 = (r.x + r.w + by).min(bounds.x + bounds.w);
    let y1 = (r.y + r.h + by).min(bounds.y + bounds.h);
    Roi::new(x0, y0, x1.saturating_sub(x0), y1.saturating_sub(y0))
}

/// The box around all of `areas` (`None` when there are none).
fn bounding_box(areas: &[Roi]) -> Option<Roi> {
    areas.iter().copied().reduce(union)
}

/// `model`'s result for the one frame `frame`; an error naming `what` if it returns none.
fn run_one(
    model: &dyn FrameModel,
    frame: &Frame,
    confidence: bool,
    what: &str,
) -> Result<FrameResult> {
    model
        .run(&[frame], confidence)?
        .into_iter()
        .next()
        .ok_or_else(|| KilnError::Stream(format!("the model returned no result for {what}")))
}

/// `r` grown by `margin` on every side, its corners moved out to multiples of `align`, inside
/// an `h × w` frame.
fn expand_aligned(r: Roi, margin: usize, align: usize, h: usize, w: usize) -> Roi {
    let x0 = r.x.saturating_sub(margin) / align * align;
    let y0 = r.y.saturating_sub(margin) / align * align;
    let x1 = ((r.x + r.w + margin).div_ceil(align) * align).min(w);
    let y1 = ((r.y + r.h + margin).div_ceil(align) * align).min(h);
    Roi::new(x0, y0, x1 - x0, y1 - y0)
}

/// The region `r` of `frame`, copied (`crop_resize` at the region's own size is an exact
/// copy).
fn crop_frame(frame: &Frame, r: Roi) -> Result<Frame> {
    Frame::new(
        [frame.shape()[0], r.h, r.w],
        crop_resize(frame, r, r.h, r.w)?,
    )
}

/// `frame` averaged over `factor × factor` blocks (sides rounded down).
fn downscale_frame(frame: &Frame, factor: usize) -> Frame {
    let [c, h, w] = frame.shape();
    let (oh, ow) = (h / factor, w / factor);
    let px = frame.pixels();
    let mut out = vec![0f32; c * oh * ow];
    let norm = 1.0 / (factor * factor) as f32;
    for ch in 0..c {
        for oy in 0..oh {
            let dst = &mut out[(ch * oh + oy) * ow..(ch * oh + oy + 1) * ow];
            for y in oy * factor..(oy + 1) * factor {
                let row = &px[(ch * h + y) * w..(ch * h + y) * w + ow * factor];
                for (d, block) in dst.iter_mut().zip(row.chunks_exact(factor)) {
                    *d += block.iter().sum::<f32>();
                }
            }
            dst.iter_mut().for_each(|v| *v *= norm);
        }
    }
    Frame {
        shape: [c, oh, ow],
        pixels: out,
    }
}

/// Multi-scale on one frame: the coarse result, upsampled; the full-resolution model over the
/// bounding box of the pixels (or the class) the coarse pass is unsure of. Returns the result,
/// the unsure area and the pixels the full-resolution pass ran on.
fn multiscale(
    input: &Frame,
    model: &dyn FrameModel,
    s: ScaleConfig,
) -> Result<(FrameResult, Option<Roi>, usize)> {
    let [_, h, w] = input.shape();
    let small = downscale_frame(input, s.factor);
    let coarse = run_one(model, &small, true, "a frame")?;
    match coarse {
        FrameResult::Class(p) if p.confidence >= s.confidence => {
            Ok((FrameResult::Class(p), None, 0))
        }
        FrameResult::Mask {
            height: ch,
            width: cw,
            labels,
            confidence,
        } => {
            // Upsample (nearest) to the full model's output size: the input's.
            let mut full_labels = vec![0u16; h * w];
            let mut unsure: Option<(usize, usize, usize, usize)> = None;
            for y in 0..h {
                let sy = (y * ch / h).min(ch.saturating_sub(1));
                for x in 0..w {
                    let sx = (x * cw / w).min(cw.saturating_sub(1));
                    let i = sy * cw + sx;
                    full_labels[y * w + x] = labels[i];
                    if confidence.get(i).is_some_and(|&c| c < s.confidence) {
                        unsure = Some(match unsure {
                            None => (x, y, x + 1, y + 1),
                            Some((a, b, c, d)) => (a.min(x), b.min(y), c.max(x + 1), d.max(y + 1)),
                        });
                    }
                }
            }
            let mut result = FrameResult::Mask {
                height: h,
                width: w,
                labels: full_labels,
                confidence: Vec::new(),
            };
            let Some((x0, y0, x1, y1)) = unsure else {
                return Ok((result, None, 0));
            };
            let region = Roi::new(x0, y0, x1 - x0, y1 - y0);
            let crop = expand_aligned(region, 32, 32, h, w);
            let part = run_one(model, &crop_frame(input, crop)?, false, "a region")?;
            paste(&mut result, &part, crop, region, (h, w))?;
            Ok((result, Some(region), crop.w * crop.h))
        }
        _ => Ok((
            run_one(model, input, false, "a frame")?,
            Some(Roi::new(0, 0, w, h)),
            w * h,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A "model" whose mask marks the pixels brighter than 0.5 and counts its calls.
    struct Bright {
        calls: std::cell::Cell<usize>,
        pixels: std::cell::Cell<usize>,
    }

    impl FrameModel for Bright {
        fn kind(&self) -> OutputKind {
            OutputKind::Mask
        }
        fn channels(&self) -> usize {
            1
        }
        fn fixed_size(&self) -> Option<(usize, usize)> {
            None
        }
        fn run(&self, frames: &[&Frame], confidence: bool) -> Result<Vec<FrameResult>> {
            self.calls.set(self.calls.get() + 1);
            Ok(frames
                .iter()
                .map(|f| {
                    let [_, h, w] = f.shape();
                    self.pixels.set(self.pixels.get() + h * w);
                    FrameResult::Mask {
                        height: h,
                        width: w,
                        labels: f.pixels().iter().map(|&v| u16::from(v > 0.5)).collect(),
                        confidence: if confidence {
                            vec![1.0; h * w]
                        } else {
                            Vec::new()
                        },
                    }
                })
                .collect())
        }
    }

    fn frame_with_square(x: usize, y: usize) -> (Frame, Thumb) {
        frame_with_squares(&[(x, y)])
    }

    /// A 64 × 128 frame with an 8-pixel bright square at each `(x, y)`, and its thumbnail.
    fn frame_with_squares(at: &[(usize, usize)]) -> (Frame, Thumb) {
        let (h, w) = (64, 128);
        let mut px = vec![0f32; h * w];
        for &(x, y) in at {
            for yy in y..y + 8 {
                for xx in x..x + 8 {
                    px[yy * w + xx] = 1.0;
                }
            }
        }
        let rgb: Vec<u8> = px.iter().flat_map(|&v| [(v * 255.0) as u8; 3]).collect();
        (
            Frame::new([1, h, w], px).unwrap(),
            Thumb::from_rgb8(&rgb, w, h, 4),
        )
    }

    fn model() -> Bright {
        Bright {
            calls: 0.into(),
            pixels: 0.into(),
        }
    }

    #[test]
    fn a_frames_thumbnail_is_the_block_mean_over_its_channels() {
        let f = Frame::new([2, 2, 2], vec![1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 2.0]).unwrap();
        let t = Thumb::from_frame(&f, 2);
        assert_eq!((t.width, t.height, t.block), (1, 1, 2));
        assert!((t.values[0] - 0.75).abs() < 1e-6, "{:?}", t.values);
    }

    #[test]
    fn the_thumbnail_is_the_block_mean_of_luma() {
        let rgb = [255u8, 255, 255, 0, 0, 0, 255, 255, 255, 0, 0, 0];
        let t = Thumb::from_rgb8(&rgb, 2, 2, 2);
        assert_eq!((t.width, t.height), (1, 1));
        assert!((t.values[0] - 0.5).abs() < 0.01, "{:?}", t.values);
    }

    #[test]
    fn an_unchanged_frame_is_reused_and_a_moving_object_runs_only_its_region() {
        let m = model();
        let techniques = VideoTechniques {
            frame_gate: Some(GateConfig {
                threshold: 0.001,
                max_reuse_age: 100,
            }),
            regions: Some(RegionConfig {
                margin: 8,
                align: 8,
                ..RegionConfig::default()
            }),
            multiscale: None,
        };
        let mut s = FrameStream::new(techniques, &m).unwrap();
        let (f0, t0) = frame_with_square(8, 8);
        assert_eq!(s.process(&f0, &t0, &m).unwrap().path, FramePath::Full);
        assert_eq!(s.process(&f0, &t0, &m).unwrap().path, FramePath::Reused);
        assert_eq!(m.calls.get(), 1);
        // The square moves right by 16 pixels: a partial run over where it was and is.
        let (f1, t1) = frame_with_square(24, 8);
        let step = s.process(&f1, &t1, &m).unwrap();
        assert_eq!(step.path, FramePath::Partial);
        assert!(
            m.pixels.get() < 2 * 64 * 128,
            "ran {} pixels",
            m.pixels.get()
        );
        // The pasted result equals the whole-frame result.
        let full = m.run(&[&f1], false).unwrap().remove(0);
        assert_eq!(step.result, full);
    }

    #[test]
    fn objects_apart_run_as_separate_crops_and_a_small_move_is_not_hidden_by_the_frame_mean() {
        let m = model();
        let techniques = VideoTechniques {
            frame_gate: Some(GateConfig {
                threshold: 0.01,
                max_reuse_age: 100,
            }),
            regions: Some(RegionConfig {
                margin: 8,
                align: 8,
                max_area: 0.9,
                ..RegionConfig::default()
            }),
            multiscale: None,
        };
        let mut s = FrameStream::new(techniques, &m).unwrap();
        let (f0, t0) = frame_with_squares(&[(8, 8), (104, 48)]);
        s.process(&f0, &t0, &m).unwrap();
        // Both squares move 2 pixels: over the whole frame the mean changes by ~0.008, below
        // the gate's threshold, but their tiles changed.
        let (f1, t1) = frame_with_squares(&[(10, 8), (106, 48)]);
        let step = s.process(&f1, &t1, &m).unwrap();
        assert_eq!(step.path, FramePath::Partial);
        assert_eq!(m.calls.get(), 3, "one call per square");
        // Two crops far smaller than the box around both squares.
        let bbox = step.region.unwrap();
        assert!(bbox.w * bbox.h > 64 * 90, "{bbox:?}");
        assert!(step.pixels_run < bbox.w * bbox.h / 2, "{}", step.pixels_run);
        assert_eq!(step.result, m.run(&[&f1], false).unwrap().remove(0));
    }

    #[test]
    fn crops_that_overlap_or_cost_no_more_together_are_merged() {
        let rc = RegionConfig {
            margin: 8,
            align: 8,
            ..RegionConfig::default()
        };
        let near = [Roi::new(16, 16, 16, 16), Roi::new(40, 16, 16, 16)];
        let crops = plan_crops(&near, &rc, 64, 128);
        assert_eq!(crops.len(), 1);
        assert_eq!(crops[0].crop, Roi::new(8, 8, 56, 32));
        assert_eq!(crops[0].changed.len(), 2);
        let far = [Roi::new(0, 0, 16, 16), Roi::new(96, 48, 16, 16)];
        assert_eq!(plan_crops(&far, &rc, 64, 128).len(), 2);
    }

    #[test]
    fn touching_changed_tiles_form_one_group() {
        let mut flags = vec![
            true, true, false, false, //
            false, true, false, false, //
            false, false, false, true, //
        ];
        let groups = tile_groups(&mut flags, 4, 3);
        assert_eq!(groups, vec![(0, 0, 2, 2), (3, 2, 4, 3)]);
        assert!(flags.iter().all(|f| !f));
    }

    #[test]
    fn techniques_that_cannot_work_with_a_model_are_refused_by_name() {
        struct Fixed;
        impl FrameModel for Fixed {
            fn kind(&self) -> OutputKind {
                OutputKind::Classes
            }
            fn channels(&self) -> usize {
                3
            }
            fn fixed_size(&self) -> Option<(usize, usize)> {
                Some((224, 224))
            }
            fn run(&self, _: &[&Frame], _: bool) -> Result<Vec<FrameResult>> {
                Ok(Vec::new())
            }
        }
        let t = VideoTechniques {
            regions: Some(RegionConfig::default()),
            ..VideoTechniques::default()
        };
        let err = FrameStream::new(t, &Fixed).unwrap_err();
        assert!(err.to_string().contains("dynamic"), "{err}");
    }

    #[test]
    fn multiscale_keeps_a_confident_coarse_mask() {
        let m = model();
        let t = VideoTechniques {
            multiscale: Some(ScaleConfig {
                factor: 2,
                confidence: 0.9,
            }),
            ..VideoTechniques::default()
        };
        let mut s = FrameStream::new(t, &m).unwrap();
        let (f, th) = frame_with_square(16, 16);
        let step = s.process(&f, &th, &m).unwrap();
        assert!(step.coarse && step.region.is_none());
        // An 8-pixel square at an even position survives a ×2 downscale exactly.
        assert_eq!(step.result, m.run(&[&f], false).unwrap().remove(0));
    }
}
