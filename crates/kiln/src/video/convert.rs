//! A decoded frame (YUV, any size) to the model's input: libswscale converts the colours and
//! resizes in one SIMD pass into an RGB image of the model's size (stretched, or letterboxed
//! with the aspect kept), then one more pass normalizes it into `[3, H, W]` f32 and averages
//! its luma into the gate's [`Thumb`]. A frame-size change mid-stream rebuilds the scaler.

use ffmpeg::format::Pixel;
use ffmpeg::frame;
use ffmpeg::software::scaling::{Context as Scaler, Flags};
use ffmpeg_next as ffmpeg;
use serde::{Deserialize, Serialize};

use crate::error::{KilnError, Result};
use crate::names::config_names;
use crate::stream::{Frame, Thumb};

/// How a frame is fitted to the model's input size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fit {
    /// Resized to exactly the input size (the aspect ratio may change).
    Stretch,
    /// Resized to fit inside with its aspect kept, centred, the rest padded.
    Letterbox,
}

config_names!(Fit {
    Stretch => "stretch",
    Letterbox => "letterbox",
});

/// The model input a frame becomes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Preprocess {
    /// Input width.
    pub width: usize,
    /// Input height.
    pub height: usize,
    /// Stretch or letterbox.
    pub fit: Fit,
    /// Per-channel mean subtracted from RGB in 0..1.
    pub mean: [f32; 3],
    /// Per-channel standard deviation divided by.
    pub std: [f32; 3],
    /// Letterbox padding, in 0..1 before normalization.
    pub pad: f32,
    /// Input pixels per thumbnail pixel.
    pub thumb_block: usize,
}

impl Preprocess {
    /// ImageNet normalization at `width × height`, stretched, with a 1/4-side thumbnail.
    pub fn imagenet(width: usize, height: usize) -> Self {
        Preprocess {
            width,
            height,
            fit: Fit::Stretch,
            mean: [0.485, 0.456, 0.406],
            std: [0.229, 0.224, 0.225],
            pad: 114.0 / 255.0,
            thumb_block: 4,
        }
    }

    /// Where a `src_w × src_h` frame lands in the input: `(x, y, w, h)`.
    pub fn placement(&self, src_w: usize, src_h: usize) -> (usize, usize, usize, usize) {
        match self.fit {
            Fit::Stretch => (0, 0, self.width, self.height),
            Fit::Letterbox => {
                let s = (self.width as f64 / src_w as f64).min(self.height as f64 / src_h as f64);
                let w = ((src_w as f64 * s).round() as usize).clamp(1, self.width);
                let h = ((src_h as f64 * s).round() as usize).clamp(1, self.height);
                ((self.width - w) / 2, (self.height - h) / 2, w, h)
            }
        }
    }
}

/// The reusable conversion state of one stream.
pub struct Converter {
    spec: Preprocess,
    scaler: Option<(Scaler, (Pixel, u32, u32))>,
    rgb: frame::Video,
    /// Interleaved RGB of the whole input (letterbox padding included).
    canvas: Vec<u8>,
    /// Times the source frame size or format changed after the first frame.
    size_changes: u64,
}

impl Converter {
    /// A converter to `spec`; an error for an empty input size.
    pub fn new(spec: Preprocess) -> Result<Self> {
        if spec.width == 0 || spec.height == 0 || spec.std.contains(&0.0) {
            return Err(KilnError::Stream(format!(
                "the model input must be at least 1×1 with non-zero std, got {}×{} std {:?}",
                spec.width, spec.height, spec.std
            )));
        }
        let pad = (spec.pad.clamp(0.0, 1.0) * 255.0).round() as u8;
        Ok(Converter {
            canvas: vec![pad; spec.width * spec.height * 3],
            spec,
            scaler: None,
            rgb: frame::Video::empty(),
            size_changes: 0,
        })
    }

    /// The spec.
    pub fn spec(&self) -> &Preprocess {
        &self.spec
    }

    /// Times the source size or pixel format changed mid-stream.
    pub fn size_changes(&self) -> u64 {
        self.size_changes
    }

    /// `decoded` as the model's input and its thumbnail.
    pub fn convert(&mut self, decoded: &frame::Video) -> Result<(Frame, Thumb)> {
        let key = (decoded.format(), decoded.width(), decoded.height());
        let (sw, sh) = (decoded.width() as usize, decoded.height() as usize);
        let (px, py, pw, ph) = self.spec.placement(sw, sh);
        if self.scaler.as_ref().map(|(_, k)| *k) != Some(key) {
            if self.scaler.is_some() {
                self.size_changes += 1;
                tracing::info!(
                    from = ?self.scaler.as_ref().map(|(_, k)| (k.1, k.2)),
                    to = ?(key.1, key.2),
                    "video frame size changed mid-stream; rescaling to the same model input"
                );
                let pad = (self.spec.pad.clamp(0.0, 1.0) * 255.0).round() as u8;
                self.canvas.fill(pad);
            }
            let scaler = Scaler::get(
                key.0,
                key.1,
                key.2,
                Pixel::RGB24,
                pw as u32,
                ph as u32,
                Flags::BILINEAR,
            )
            .map_err(|e| {
                KilnError::Stream(format!(
                    "cannot convert {:?} frames of {}×{} to RGB: {e}",
                    key.0, key.1, key.2
                ))
            })?;
            self.scaler = Some((scaler, key));
            self.rgb = frame::Video::empty();
        }
        let (scaler, _) = self
            .scaler
            .as_mut()
            .ok_or_else(|| KilnError::Stream("internal: the scaler was not built".into()))?;
        scaler
            .run(decoded, &mut self.rgb)
            .map_err(|e| KilnError::Stream(format!("converting a frame to RGB: {e}")))?;
        // The scaler's rows are padded to its stride; copy them into place on the canvas.
        let stride = self.rgb.stride(0);
        let data = self.rgb.data(0);
        let w = self.spec.width;
        for y in 0..ph {
            let dst = ((py + y) * w + px) * 3;
            self.canvas[dst..dst + pw * 3].copy_from_slice(&data[y * stride..y * stride + pw * 3]);
        }
        let input = normalize(&self.canvas, &self.spec);
        let thumb = Thumb::from_rgb8(&self.canvas, w, self.spec.height, self.spec.thumb_block);
        Ok((input, thumb))
    }
}

/// Interleaved RGB8 to normalized planar `[3, H, W]` f32.
pub fn normalize(rgb: &[u8], spec: &Preprocess) -> Frame {
    let n = spec.width * spec.height;
    let mut out = vec![0f32; 3 * n];
    let (r, rest) = out.split_at_mut(n);
    let (g, b) = rest.split_at_mut(n);
    let scale: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * spec.std[c]));
    let shift: [f32; 3] = std::array::from_fn(|c| -spec.mean[c] / spec.std[c]);
    for (i, px) in rgb.chunks_exact(3).enumerate().take(n) {
        r[i] = f32::from(px[0]) * scale[0] + shift[0];
        g[i] = f32::from(px[1]) * scale[1] + shift[1];
        b[i] = f32::from(px[2]) * scale[2] + shift[2];
    }
    // The shape and length agree by construction.
    Frame {
        shape: [3, spec.height, spec.width],
        pixels: out,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letterbox_keeps_the_aspect_and_centres() {
        let mut p = Preprocess::imagenet(512, 512);
        p.fit = Fit::Letterbox;
        assert_eq!(p.placement(1920, 1080), (0, 112, 512, 288));
        p.fit = Fit::Stretch;
        assert_eq!(p.placement(1920, 1080), (0, 0, 512, 512));
    }

    #[test]
    fn normalization_is_per_channel() {
        let mut p = Preprocess::imagenet(1, 1);
        p.mean = [0.5, 0.0, 0.0];
        p.std = [0.5, 1.0, 2.0];
        let f = normalize(&[255, 255, 0], &p);
        assert_eq!(f.pixels(), &[1.0, 1.0, 0.0]);
    }
}
