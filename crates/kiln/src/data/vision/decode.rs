//! Image files to 8-bit RGB: JPEG (baseline and progressive; grayscale, YCbCr and CMYK), PNG
//! and WebP, sniffed from their bytes (never from the file name), EXIF orientation applied,
//! and a pixel limit checked from the header before any pixel is decoded.
//!
//! Why two JPEG decoders: `zune-jpeg` is the fastest pure-Rust decoder at full size (SIMD
//! IDCT and colour conversion), but it cannot decode at a reduced size; `jpeg-decoder` can —
//! its scaled IDCT produces the image at 1/2, 1/4 or 1/8 of its size straight from the DCT
//! coefficients, which skips most of the IDCT and upsampling work when the target is far
//! smaller than the file (what DALI and FFCV do). [`decode`] takes the scale the caller
//! chose and uses whichever decoder serves it (docs/data.md has the measurement).

use std::fmt;
use std::io::Cursor;

use image::metadata::Orientation;

/// Pillow's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS × 2`, where Pillow raises):
/// a file whose header claims more pixels is refused before it is decoded.
pub const DEFAULT_MAX_PIXELS: u64 = 178_956_970;

/// Why an image file cannot be used; the dataset adds the file's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageError {
    /// The file is empty.
    Empty,
    /// The bytes are not a JPEG, PNG or WebP file (whatever the name says).
    NotAnImage {
        /// What the first bytes look like.
        found: String,
    },
    /// The header claims more pixels than the limit allows.
    TooLarge {
        /// Width the header claims.
        width: u64,
        /// Height the header claims.
        height: u64,
        /// The limit in pixels.
        limit: u64,
    },
    /// The decoder failed: truncated or corrupt data, an unsupported variant.
    Corrupt {
        /// The decoder's words.
        reason: String,
    },
    /// The file could not be read.
    Unreadable {
        /// The operating system's words.
        reason: String,
    },
}

impl fmt::Display for ImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageError::Empty => write!(f, "the file is empty"),
            ImageError::NotAnImage { found } => write!(
                f,
                "not a JPEG, PNG or WebP image (the file starts with {found}); remove it or \
                 convert it"
            ),
            ImageError::TooLarge {
                width,
                height,
                limit,
            } => write!(
                f,
                "{width}×{height} = {} pixels is over the limit of {limit} (a decompression \
                 bomb, or raise data.max_image_pixels)",
                width * height
            ),
            ImageError::Corrupt { reason } => {
                write!(f, "corrupt or truncated image data: {reason}")
            }
            ImageError::Unreadable { reason } => write!(f, "cannot read the file: {reason}"),
        }
    }
}

impl std::error::Error for ImageError {}

/// An 8-bit RGB image, rows top to bottom, `[R, G, B]` per pixel (height × width × 3).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rgb8 {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// `height × width × 3` bytes.
    pub pixels: Vec<u8>,
}

/// The container format, read from the magic bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// JPEG (JFIF, EXIF, Adobe).
    Jpeg,
    /// PNG.
    Png,
    /// WebP (lossy or lossless).
    Webp,
}

/// What the header says, read without decoding pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The format.
    pub format: Format,
    /// Width as stored (before orientation).
    pub stored_width: usize,
    /// Height as stored.
    pub stored_height: usize,
    /// The EXIF orientation (JPEG only; others are as stored).
    pub orientation: Orientation,
}

impl Header {
    /// Width and height as displayed: after the EXIF orientation (90° turns swap them).
    pub fn size(&self) -> (usize, usize) {
        if swaps_axes(self.orientation) {
            (self.stored_height, self.stored_width)
        } else {
            (self.stored_width, self.stored_height)
        }
    }

    /// The reduced sizes worth decoding this file at (1 = full size): JPEG's scaled IDCT at
    /// 1/4 and 1/8. Not 1/2: measured on ImageNet-sized files (one Zen 4 core),
    /// jpeg-decoder at 1/2 takes 1.48 ms, as long as its own full decode (1.51) and longer
    /// than zune-jpeg's full decode (0.95) — entropy decoding dominates — while at 1/4 and
    /// 1/8 it takes 0.86 and 0.82 ms (`benches/image_decoders.rs`). [`decode`] itself
    /// accepts 2.
    pub fn scales(&self) -> &'static [usize] {
        match self.format {
            Format::Jpeg => &[1, 4, 8],
            Format::Png | Format::Webp => &[1],
        }
    }
}

fn swaps_axes(o: Orientation) -> bool {
    matches!(
        o,
        Orientation::Rotate90
            | Orientation::Rotate270
            | Orientation::Rotate90FlipH
            | Orientation::Rotate270FlipH
    )
}

/// The format of `bytes`, from their magic numbers.
pub fn sniff(bytes: &[u8]) -> Result<Format, ImageError> {
    if bytes.is_empty() {
        return Err(ImageError::Empty);
    }
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Ok(Format::Jpeg)
    } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Ok(Format::Png)
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Ok(Format::Webp)
    } else {
        let head = &bytes[..bytes.len().min(8)];
        let found = if head.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
            format!("{:?}", String::from_utf8_lossy(head))
        } else {
            head.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        Err(ImageError::NotAnImage { found })
    }
}

fn corrupt(e: impl fmt::Display) -> ImageError {
    ImageError::Corrupt {
        reason: e.to_string(),
    }
}

/// Reads the header of `bytes` (format, stored size, orientation) and checks the pixel limit.
pub fn probe(bytes: &[u8], max_pixels: u64) -> Result<Header, ImageError> {
    let format = sniff(bytes)?;
    let (w, h, orientation) = match format {
        Format::Jpeg => {
            check_jpeg_complete(bytes)?;
            // The decoder's own size limit (16384) would answer first; the pixel limit below
            // is the one that says what to do.
            let options = zune_core::options::DecoderOptions::default()
                .set_max_width(usize::from(u16::MAX))
                .set_max_height(usize::from(u16::MAX));
            let mut d = zune_jpeg::JpegDecoder::new_with_options(
                zune_core::bytestream::ZCursor::new(bytes),
                options,
            );
            d.decode_headers().map_err(corrupt)?;
            let info = d.info().ok_or_else(|| corrupt("no frame header"))?;
            let orientation = d
                .exif()
                .and_then(|e| Orientation::from_exif_chunk(e))
                .unwrap_or(Orientation::NoTransforms);
            (info.width as usize, info.height as usize, orientation)
        }
        Format::Png | Format::Webp => {
            let reader = image::ImageReader::with_format(Cursor::new(bytes), image_format(format));
            let (w, h) = reader.into_dimensions().map_err(corrupt)?;
            (w as usize, h as usize, Orientation::NoTransforms)
        }
    };
    if w == 0 || h == 0 {
        return Err(corrupt(format!("the header says {w}×{h} pixels")));
    }
    if (w as u64) * (h as u64) > max_pixels {
        return Err(ImageError::TooLarge {
            width: w as u64,
            height: h as u64,
            limit: max_pixels,
        });
    }
    Ok(Header {
        format,
        stored_width: w,
        stored_height: h,
        orientation,
    })
}

/// A JPEG cut short (a partial download, a full disk) decodes "successfully" in most decoders,
/// its missing rows grey; Pillow refuses it ("image file is truncated") and so does Kiln. In
/// entropy-coded data `FF` is always followed by `00` or a restart marker, so an `FF D9` after
/// the first start-of-scan can only be the end-of-image marker: without one the file is cut.
fn check_jpeg_complete(bytes: &[u8]) -> Result<(), ImageError> {
    let find = |marker: u8| bytes.windows(2).position(|p| p == [0xFF, marker]);
    let last_eoi = bytes.windows(2).rposition(|p| p == [0xFF, 0xD9]);
    match (find(0xDA), last_eoi) {
        (Some(sos), Some(eoi)) if eoi > sos => Ok(()),
        (None, _) => Err(corrupt("truncated: no start-of-scan marker")),
        _ => Err(corrupt(
            "truncated: the data ends before the end-of-image marker",
        )),
    }
}

fn image_format(format: Format) -> image::ImageFormat {
    match format {
        Format::Jpeg => image::ImageFormat::Jpeg,
        Format::Png => image::ImageFormat::Png,
        Format::Webp => image::ImageFormat::WebP,
    }
}

/// Decodes `bytes` (whose header is `header`, from [`probe`]) at 1/`scale` of its size
/// (`scale` one of [`Header::scales`]; JPEG only, others decode at full size) to RGB, with
/// the EXIF orientation applied. The result is `ceil(size / scale)` on each axis.
pub fn decode(bytes: &[u8], header: &Header, scale: usize) -> Result<Rgb8, ImageError> {
    let stored = match header.format {
        Format::Jpeg if scale > 1 => decode_jpeg_scaled(bytes, header, scale)?,
        Format::Jpeg => decode_jpeg_full(bytes)?,
        Format::Png | Format::Webp => {
            let mut reader =
                image::ImageReader::with_format(Cursor::new(bytes), image_format(header.format));
            let mut limits = image::Limits::default();
            limits.max_alloc = Some(header_bytes(header).saturating_mul(4));
            reader.limits(limits);
            let img = reader.decode().map_err(corrupt)?.into_rgb8();
            let (w, h) = img.dimensions();
            Rgb8 {
                width: w as usize,
                height: h as usize,
                pixels: img.into_raw(),
            }
        }
    };
    Ok(orient(stored, header.orientation))
}

/// Bytes of the decoded image at full size (RGBA 16-bit worst case), for the decoder's
/// allocation limit.
fn header_bytes(header: &Header) -> u64 {
    (header.stored_width as u64) * (header.stored_height as u64) * 8
}

fn decode_jpeg_full(bytes: &[u8]) -> Result<Rgb8, ImageError> {
    let options = zune_core::options::DecoderOptions::default()
        .jpeg_set_out_colorspace(zune_core::colorspace::ColorSpace::RGB)
        .set_max_width(usize::from(u16::MAX))
        .set_max_height(usize::from(u16::MAX));
    let mut d = zune_jpeg::JpegDecoder::new_with_options(
        zune_core::bytestream::ZCursor::new(bytes),
        options,
    );
    let pixels = d.decode().map_err(corrupt)?;
    let info = d.info().ok_or_else(|| corrupt("no frame header"))?;
    let (width, height) = (info.width as usize, info.height as usize);
    if pixels.len() != width * height * 3 {
        return Err(corrupt(format!(
            "decoded {} bytes for {width}×{height} RGB",
            pixels.len()
        )));
    }
    Ok(Rgb8 {
        width,
        height,
        pixels,
    })
}

fn decode_jpeg_scaled(bytes: &[u8], header: &Header, scale: usize) -> Result<Rgb8, ImageError> {
    let mut d = jpeg_decoder::Decoder::new(Cursor::new(bytes));
    d.read_info().map_err(corrupt)?;
    let info = d.info().ok_or_else(|| corrupt("no frame header"))?;
    if info.pixel_format == jpeg_decoder::PixelFormat::CMYK32 {
        // The scaled decoder leaves Adobe's CMYK conversion to the caller; the full-size
        // decoder does it, and a CMYK file is rare enough not to need the shortcut.
        return decode_jpeg_full(bytes);
    }
    let want = |n: usize| u16::try_from(n.div_ceil(scale)).unwrap_or(u16::MAX);
    let (w, h) = d
        .scale(want(header.stored_width), want(header.stored_height))
        .map_err(corrupt)?;
    let raw = d.decode().map_err(corrupt)?;
    let (width, height) = (w as usize, h as usize);
    let n = width * height;
    let info = d.info().ok_or_else(|| corrupt("no frame header"))?;
    let pixels = match info.pixel_format {
        jpeg_decoder::PixelFormat::RGB24 if raw.len() == n * 3 => raw,
        jpeg_decoder::PixelFormat::L8 if raw.len() == n => {
            raw.iter().flat_map(|&v| [v, v, v]).collect()
        }
        jpeg_decoder::PixelFormat::L16 if raw.len() == n * 2 => raw
            .chunks_exact(2)
            .flat_map(|p| {
                let v = p[0]; // big-endian: the high byte
                [v, v, v]
            })
            .collect(),
        other => {
            return Err(corrupt(format!(
                "{other:?}: {} bytes for {width}×{height}",
                raw.len()
            )));
        }
    };
    Ok(Rgb8 {
        width,
        height,
        pixels,
    })
}

/// Applies an EXIF orientation: the image as a viewer displays it.
pub fn orient(img: Rgb8, o: Orientation) -> Rgb8 {
    if o == Orientation::NoTransforms {
        return img;
    }
    let (w, h) = (img.width, img.height);
    let (ow, oh) = if swaps_axes(o) { (h, w) } else { (w, h) };
    let mut out = vec![0u8; img.pixels.len()];
    for y in 0..h {
        for x in 0..w {
            // Where stored pixel (x, y) lands in the displayed image.
            let (dx, dy) = match o {
                Orientation::NoTransforms => (x, y),
                Orientation::FlipHorizontal => (w - 1 - x, y),
                Orientation::Rotate180 => (w - 1 - x, h - 1 - y),
                Orientation::FlipVertical => (x, h - 1 - y),
                Orientation::Rotate90FlipH => (y, x),
                Orientation::Rotate90 => (h - 1 - y, x),
                Orientation::Rotate270FlipH => (h - 1 - y, w - 1 - x),
                Orientation::Rotate270 => (y, w - 1 - x),
            };
            let s = (y * w + x) * 3;
            let d = (dy * ow + dx) * 3;
            out[d..d + 3].copy_from_slice(&img.pixels[s..s + 3]);
        }
    }
    Rgb8 {
        width: ow,
        height: oh,
        pixels: out,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jpeg(w: u32, h: u32, quality: u8) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([
                (x * 255 / w) as u8,
                (y * 255 / h) as u8,
                ((x + y) % 256) as u8,
            ])
        });
        let mut out = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality)
            .encode_image(&img)
            .unwrap();
        out
    }

    #[test]
    fn scaled_decoding_gives_the_ceiling_size_and_close_pixels() {
        let bytes = jpeg(203, 150, 95);
        let header = probe(&bytes, DEFAULT_MAX_PIXELS).unwrap();
        assert_eq!(header.size(), (203, 150));
        let full = decode(&bytes, &header, 1).unwrap();
        assert_eq!((full.width, full.height), (203, 150));
        for scale in [2, 4, 8] {
            let small = decode(&bytes, &header, scale).unwrap();
            assert_eq!(
                (small.width, small.height),
                (203usize.div_ceil(scale), 150usize.div_ceil(scale))
            );
            // A smooth image: a scaled pixel is the mean of its block of full-size pixels.
            let (x, y) = (small.width / 2, small.height / 2);
            let mut mean = [0f64; 3];
            for dy in 0..scale {
                for dx in 0..scale {
                    let p = ((y * scale + dy) * full.width + x * scale + dx) * 3;
                    for (c, m) in mean.iter_mut().enumerate() {
                        *m += full.pixels[p + c] as f64 / (scale * scale) as f64;
                    }
                }
            }
            let p = (y * small.width + x) * 3;
            for (c, m) in mean.iter().enumerate() {
                let d = (small.pixels[p + c] as f64 - m).abs();
                assert!(d < 12.0, "scale {scale} channel {c}: {d}");
            }
        }
    }

    #[test]
    fn orientations_move_pixels_where_a_viewer_shows_them() {
        // 3×2 image with distinct pixels: value = index.
        let img = Rgb8 {
            width: 3,
            height: 2,
            pixels: (0..6u8).flat_map(|v| [v, v, v]).collect(),
        };
        let at = |i: &Rgb8, x: usize, y: usize| i.pixels[(y * i.width + x) * 3];
        let r90 = orient(img.clone(), Orientation::Rotate90);
        assert_eq!((r90.width, r90.height), (2, 3));
        // Clockwise: the bottom-left stored pixel (3) becomes the top-left.
        assert_eq!(at(&r90, 0, 0), 3);
        assert_eq!(at(&r90, 1, 0), 0);
        let r270 = orient(img.clone(), Orientation::Rotate270);
        assert_eq!(at(&r270, 0, 0), 2);
        let flip = orient(img.clone(), Orientation::FlipHorizontal);
        assert_eq!(at(&flip, 0, 0), 2);
        let r180 = orient(img, Orientation::Rotate180);
        assert_eq!(at(&r180, 0, 0), 5);
    }

    #[test]
    fn bad_bytes_are_named_errors() {
        assert_eq!(sniff(&[]), Err(ImageError::Empty));
        assert!(matches!(
            probe(b"hello, world", DEFAULT_MAX_PIXELS),
            Err(ImageError::NotAnImage { .. })
        ));
        let bytes = jpeg(64, 48, 90);
        let truncated = &bytes[..bytes.len() / 2];
        let err = probe(truncated, DEFAULT_MAX_PIXELS).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
        // Past the marker check, a corrupt scan is an error or an image, never a panic.
        let header = probe(&bytes, DEFAULT_MAX_PIXELS).unwrap();
        let mut damaged = bytes.clone();
        let mid = damaged.len() / 2;
        damaged[mid..mid + 40].fill(0x5A);
        for scale in [1, 2] {
            if let Ok(img) = decode(&damaged, &header, scale) {
                assert_eq!(img.width, 64usize.div_ceil(scale));
            }
        }
        assert!(matches!(
            probe(&bytes, 64 * 48 - 1),
            Err(ImageError::TooLarge { .. })
        ));
        assert!(probe(&bytes[..20], DEFAULT_MAX_PIXELS).is_err());
    }
}
