//! One sample from file bytes to the model's input: plan the crop from the header, decode at
//! the smallest size that keeps the output's detail, crop and resize in one SIMD pass
//! (`fast_image_resize`: Pillow's convolution resampling, antialiased), then colour jitter,
//! flip, `(x/255 - mean) / std` and the layout change in one pass into the batch's slot.
//!
//! torchvision v2's pipeline makes three full-size copies (decode, crop, resize) and three
//! more at the output size (to tensor, jitter, normalize); this one makes the decode and one
//! output-size byte image.

use std::cell::RefCell;

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use super::crop::{CropBox, CropMode, decode_scale};
use super::decode::{self, DEFAULT_MAX_PIXELS, ImageError, Rgb8};
use super::jitter::ColorJitter;
use crate::data::SampleRng;

/// ImageNet's per-channel mean of x/255 (torchvision's and Albumentations' default).
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet's per-channel standard deviation of x/255.
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// How the output's values are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `[C, H, W]` (Burn's and PyTorch's default).
    Planar,
    /// `[H, W, C]` (channels-last).
    ChannelsLast,
}

/// A file-to-tensor transform with torchvision v2's semantics; see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageTransform {
    /// Output width and height.
    pub size: (usize, usize),
    /// Where the output's pixels come from.
    pub crop: CropMode,
    /// Probability of a horizontal flip (`RandomHorizontalFlip(p)`).
    pub hflip: f32,
    /// `ColorJitter`, if any.
    pub jitter: Option<ColorJitter>,
    /// `Normalize` mean of x/255, per channel.
    pub mean: [f32; 3],
    /// `Normalize` standard deviation, per channel.
    pub std: [f32; 3],
    /// The output layout.
    pub layout: Layout,
    /// Decode JPEG files at 1/2, 1/4 or 1/8 size when the crop still has the output's
    /// pixels at that size (off: always full size, as Pillow).
    pub decode_scaling: bool,
    /// Files whose header claims more pixels are refused (decompression bombs).
    pub max_pixels: u64,
}

impl ImageTransform {
    /// The ImageNet training transform at `size`: `RandomResizedCrop(size)`,
    /// `RandomHorizontalFlip()`, `Normalize(IMAGENET_MEAN, IMAGENET_STD)`.
    pub fn train(size: usize) -> Self {
        ImageTransform {
            size: (size, size),
            crop: CropMode::RANDOM_RESIZED,
            hflip: 0.5,
            jitter: None,
            mean: IMAGENET_MEAN,
            std: IMAGENET_STD,
            layout: Layout::Planar,
            decode_scaling: true,
            max_pixels: DEFAULT_MAX_PIXELS,
        }
    }

    /// The ImageNet evaluation transform at `size`: `Resize(size × 256/224)`,
    /// `CenterCrop(size)`, `Normalize`.
    pub fn eval(size: usize) -> Self {
        ImageTransform {
            crop: CropMode::ResizeCenterCrop {
                shorter: (size * 256).div_ceil(224),
            },
            hflip: 0.0,
            ..Self::train(size)
        }
    }

    /// Values per output sample.
    pub fn sample_len(&self) -> usize {
        self.size.0 * self.size.1 * 3
    }

    /// `[C, H, W]` of the output (the planar order, whatever the layout).
    pub fn item_shape(&self) -> [usize; 3] {
        [3, self.size.1, self.size.0]
    }

    /// A stable description: part of cache keys and the plan.
    pub fn describe(&self) -> String {
        format!(
            "{}->{}x{},hflip={},jitter={},mean={:?},std={:?},{:?},decode_scaling={}",
            self.crop.describe(),
            self.size.0,
            self.size.1,
            self.hflip,
            self.jitter.map_or("none".into(), |j| j.describe()),
            self.mean,
            self.std,
            self.layout,
            self.decode_scaling
        )
    }

    /// Decodes `bytes` and writes the transformed sample into `out` (length
    /// [`ImageTransform::sample_len`]); random choices come from `rng`.
    pub fn apply_bytes(
        &self,
        bytes: &[u8],
        rng: &mut SampleRng,
        out: &mut [f32],
    ) -> Result<(), ImageError> {
        let header = decode::probe(bytes, self.max_pixels)?;
        let (w, h) = header.size();
        let crop = self.crop.plan(w, h, self.size, rng);
        let scale = if self.decode_scaling {
            decode_scale(header.scales(), &crop, self.size)
        } else {
            1
        };
        let img = decode::decode(bytes, &header, scale)?;
        self.finish(&img, clamp_to(crop.scaled(scale), &img), rng, out)
    }

    /// The transform of an image already decoded (a packed dataset's).
    pub fn apply_image(&self, img: &Rgb8, rng: &mut SampleRng, out: &mut [f32]) {
        let crop = self.crop.plan(img.width, img.height, self.size, rng);
        // Only the output's size can fail, and it was checked when the transform was built.
        self.finish(img, clamp_to(crop, img), rng, out)
            .unwrap_or_else(|e| tracing::error!("resize failed: {e}"));
    }

    fn finish(
        &self,
        img: &Rgb8,
        crop: CropBox,
        rng: &mut SampleRng,
        out: &mut [f32],
    ) -> Result<(), ImageError> {
        let flip = self.hflip > 0.0 && rng.uniform() < self.hflip;
        let jitter = self.jitter.map(|j| j.sample(rng));
        let (ow, oh) = self.size;
        RESIZED.with(|cell| {
            let mut resized = cell.borrow_mut();
            resize_into(img, crop, ow, oh, &mut resized)?;
            match jitter {
                Some(j) => {
                    let mut unit: Vec<f32> = resized.iter().map(|&v| v as f32 / 255.0).collect();
                    j.apply(&mut unit);
                    self.store(&unit, 1.0, flip, out);
                }
                None => self.store_bytes(&resized, flip, out),
            }
            Ok(())
        })
    }

    /// Flip, normalize and lay out `src` (HWC bytes at the output size).
    fn store_bytes(&self, src: &[u8], flip: bool, out: &mut [f32]) {
        // Per channel: v * a + b == (v/255 - mean) / std.
        let a: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * self.std[c]));
        let b: [f32; 3] = std::array::from_fn(|c| -self.mean[c] / self.std[c]);
        let (w, h) = self.size;
        let plane = w * h;
        for y in 0..h {
            let row = &src[y * w * 3..(y + 1) * w * 3];
            for x in 0..w {
                let sx = if flip { w - 1 - x } else { x };
                let p = &row[sx * 3..sx * 3 + 3];
                match self.layout {
                    Layout::Planar => {
                        let i = y * w + x;
                        out[i] = p[0] as f32 * a[0] + b[0];
                        out[plane + i] = p[1] as f32 * a[1] + b[1];
                        out[2 * plane + i] = p[2] as f32 * a[2] + b[2];
                    }
                    Layout::ChannelsLast => {
                        let i = (y * w + x) * 3;
                        for c in 0..3 {
                            out[i + c] = p[c] as f32 * a[c] + b[c];
                        }
                    }
                }
            }
        }
    }

    /// [`Self::store_bytes`] for values already in `[0, 1]` (after a colour jitter).
    fn store(&self, src: &[f32], unit: f32, flip: bool, out: &mut [f32]) {
        let a: [f32; 3] = std::array::from_fn(|c| unit / self.std[c]);
        let b: [f32; 3] = std::array::from_fn(|c| -self.mean[c] / self.std[c]);
        let (w, h) = self.size;
        let plane = w * h;
        for y in 0..h {
            for x in 0..w {
                let sx = if flip { w - 1 - x } else { x };
                let s = (y * w + sx) * 3;
                for c in 0..3 {
                    let v = src[s + c] * a[c] + b[c];
                    match self.layout {
                        Layout::Planar => out[c * plane + y * w + x] = v,
                        Layout::ChannelsLast => out[(y * w + x) * 3 + c] = v,
                    }
                }
            }
        }
    }
}

thread_local! {
    /// Per worker: the resizer (its filter tables) and the output-size byte image, reused
    /// from sample to sample.
    static RESIZER: RefCell<Resizer> = RefCell::new(Resizer::new());
    static RESIZED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// A box clamped inside `img` (a box planned on the full size can overhang a reduced decode
/// by the rounding of its last block).
fn clamp_to(b: CropBox, img: &Rgb8) -> CropBox {
    let (w, h) = (img.width as f64, img.height as f64);
    let left = b.left.clamp(0.0, w - 1.0);
    let top = b.top.clamp(0.0, h - 1.0);
    CropBox {
        left,
        top,
        width: b.width.min(w - left).max(1.0),
        height: b.height.min(h - top).max(1.0),
    }
}

/// Crops `crop` out of `img` and resizes it to `ow × oh` into `out` (HWC bytes), Pillow's
/// bilinear convolution (antialiased when shrinking), in one pass.
pub fn resize_into(
    img: &Rgb8,
    crop: CropBox,
    ow: usize,
    oh: usize,
    out: &mut Vec<u8>,
) -> Result<(), ImageError> {
    let fail = |e: &dyn std::fmt::Display| ImageError::Corrupt {
        reason: format!("resize: {e}"),
    };
    let src = ImageRef::new(
        img.width as u32,
        img.height as u32,
        &img.pixels,
        PixelType::U8x3,
    )
    .map_err(|e| fail(&e))?;
    out.resize(ow * oh * 3, 0);
    let mut dst =
        Image::from_slice_u8(ow as u32, oh as u32, out, PixelType::U8x3).map_err(|e| fail(&e))?;
    let options = ResizeOptions::new()
        .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
        .crop(crop.left, crop.top, crop.width, crop.height);
    RESIZER.with(|r| {
        r.borrow_mut()
            .resize(&src, &mut dst, &options)
            .map_err(|e| fail(&e))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient(w: usize, h: usize) -> Rgb8 {
        let pixels = (0..h)
            .flat_map(|y| (0..w).flat_map(move |x| [(x * 255 / w) as u8, (y * 255 / h) as u8, 77]))
            .collect();
        Rgb8 {
            width: w,
            height: h,
            pixels,
        }
    }

    #[test]
    fn resize_only_normalizes_a_constant_channel_exactly() {
        let t = ImageTransform {
            crop: CropMode::Resize,
            hflip: 0.0,
            ..ImageTransform::train(32)
        };
        let mut out = vec![0f32; t.sample_len()];
        t.apply_image(&gradient(100, 80), &mut SampleRng::new(0, 0, 0), &mut out);
        let want = (77.0 / 255.0 - IMAGENET_MEAN[2]) / IMAGENET_STD[2];
        for v in &out[2 * 32 * 32..] {
            assert!((v - want).abs() < 1e-5, "{v} vs {want}");
        }
        // The red channel rises left to right.
        assert!(out[31] > out[0]);
    }

    #[test]
    fn flip_mirrors_and_channels_last_reorders() {
        let img = gradient(64, 64);
        let base = ImageTransform {
            crop: CropMode::Resize,
            hflip: 0.0,
            ..ImageTransform::train(16)
        };
        let flipped = ImageTransform {
            hflip: 1.0,
            ..base.clone()
        };
        let last = ImageTransform {
            layout: Layout::ChannelsLast,
            ..base.clone()
        };
        let run = |t: &ImageTransform| {
            let mut out = vec![0f32; t.sample_len()];
            t.apply_image(&img, &mut SampleRng::new(0, 0, 0), &mut out);
            out
        };
        let (a, b, c) = (run(&base), run(&flipped), run(&last));
        for y in 0..16 {
            for x in 0..16 {
                assert_eq!(a[y * 16 + x], b[y * 16 + 15 - x]);
                for ch in 0..3 {
                    assert_eq!(a[ch * 256 + y * 16 + x], c[(y * 16 + x) * 3 + ch]);
                }
            }
        }
    }
}
