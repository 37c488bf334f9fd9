//! Values on the host between image layers: a channels-last [`Image`], a batch of [`Rows`]
//! (a linear layer's input and output), and the [`Slot`] a step reads and writes.

use super::*;

/// A float image `[n, h, w, c]` on the host, channels-last. Shared (`Arc`) so a value read
/// by two layers (a residual block's input) is not copied; its last reader takes it and may
/// write in place.
#[derive(Debug, Clone)]
pub(in crate::onnx) struct Image {
    pub(super) data: Arc<Vec<f32>>,
    pub(super) dims: [usize; 4],
}

impl Image {
    pub(super) fn new(data: Vec<f32>, dims: [usize; 4]) -> Self {
        Image {
            data: Arc::new(data),
            dims,
        }
    }

    /// An NCHW float value as an image.
    pub(super) fn from_value(v: Value) -> Result<Image, OnnxError> {
        let dims = v.dims();
        // A graph's input image is converted straight out of the backend's buffer: one pass
        // instead of a copy out and a transpose of the copy.
        if let Some(image) = v.with_f32_view(|x| Image::from_nchw(Cow::Borrowed(x), dims.clone())) {
            return image;
        }
        Image::from_nchw(Cow::Owned(v.to_kind(ValueKind::Float)?.to_f32s()?), dims)
    }

    /// NCHW float values of `dims` as an image (owned values are kept as they are where
    /// both layouts coincide; borrowed ones are copied once either way).
    pub(super) fn from_nchw(values: Cow<'_, [f32]>, dims: Vec<usize>) -> Result<Image, OnnxError> {
        let [n, c, h, w]: [usize; 4] = dims.try_into().map_err(|d| {
            OnnxError::Shape(format!("an image layer takes [N, C, H, W]; got {d:?}"))
        })?;
        // With one pixel (or one channel) both layouts hold the same sequence.
        let data = if h * w == 1 || c == 1 {
            values.into_owned()
        } else {
            nchw_to_nhwc(&values, [n, c, h, w])
        };
        Ok(Image::new(data, [n, h, w, c]))
    }

    /// The image as an NCHW value on `device`.
    pub(in crate::onnx) fn into_value(self, device: &Device) -> Result<Value, OnnxError> {
        let [n, h, w, c] = self.dims;
        Ok(Value::float(Tensor::<4>::from_data(
            TensorData::new(self.into_nchw(), [n, c, h, w]),
            device,
        )))
    }

    /// The values in NCHW order (transposed, except where both layouts coincide).
    pub(super) fn into_nchw(self) -> Vec<f32> {
        let [_, h, w, c] = self.dims;
        if h * w == 1 || c == 1 {
            self.into_vec()
        } else {
            nhwc_to_nchw(&self.data, self.dims)
        }
    }

    /// The values, copied only when another reader still holds them.
    pub(super) fn into_vec(self) -> Vec<f32> {
        owned_or_shared(self.data, |owned| owned, <[f32]>::to_vec)
    }
}

/// A float value of any rank on the host in ONNX's own row-major layout: what a linear layer
/// or LayerNorm on the host leaves, and what the transpose `[0, 2, 3, 1]` makes of an image
/// (its data as they are). The host layers after it (linear layers, LayerNorm, element-wise
/// arithmetic and activations, the transpose back to an image) read it without converting:
/// ConvNeXt's blocks and transformers' MLPs are such chains, and each Burn tensor between
/// two host layers cost two copies (BENCHMARKS.md run 33).
#[derive(Debug, Clone)]
pub(in crate::onnx) struct Rows {
    pub(super) data: Arc<Vec<f32>>,
    pub(super) dims: Vec<usize>,
    /// `(min(x, 0), max(x, 0))` of the values when the step that wrote them measured it (an
    /// int8 layer's epilogue): the next int8 layer quantizes with it instead of scanning.
    pub(super) range: Option<(f32, f32)>,
}

impl Rows {
    pub(super) fn new(data: Vec<f32>, dims: Vec<usize>) -> Self {
        Rows {
            data: Arc::new(data),
            dims,
            range: None,
        }
    }

    /// The length of the last axis (the one linear layers and LayerNorm work along).
    pub(super) fn last(&self) -> usize {
        self.dims.last().copied().unwrap_or(1)
    }

    /// The values, copied only when another reader still holds them.
    pub(super) fn into_vec(self) -> Vec<f32> {
        owned_or_shared(self.data, |owned| owned, <[f32]>::to_vec)
    }

    /// `f` over the values (in place when this was their last reader), as rows of the same
    /// shape.
    pub(super) fn apply(self, f: impl FnOnce(&mut [f32])) -> Rows {
        let dims = self.dims.clone();
        let mut data = self.into_vec();
        f(&mut data);
        Rows::new(data, dims)
    }

    /// The value on `device`.
    pub(in crate::onnx) fn into_value(self, device: &Device) -> Result<Value, OnnxError> {
        let dims = self.dims.clone();
        Value::from_data(TensorData::new(self.into_vec(), dims), device)
    }

    /// Input `i` of a host step as rows: host rows as they are, a float value copied out.
    pub(super) fn from_slot(ins: &mut [Option<Slot>], i: usize) -> Option<Result<Rows, OnnxError>> {
        match take(ins, i)? {
            Slot::Rows(rows) => Some(Ok(rows)),
            Slot::Value(v) => Some(v.to_f32s().map(|data| Rows::new(data, v.dims()))),
            Slot::Image(_) => None,
        }
    }
}

/// A value between steps: an ONNX value, or an image a host layer left channels-last.
#[derive(Debug, Clone)]
// Values are the common case and the slots few (one per graph value): boxing them would cost
// an allocation per value per run for no saving that matters.
#[allow(clippy::large_enum_variant)]
pub(in crate::onnx) enum Slot {
    /// A tensor on the model's device, in ONNX layout.
    Value(Value),
    /// A host image, channels-last.
    Image(Image),
    /// A host value in ONNX layout.
    Rows(Rows),
}

impl Slot {
    /// The slot as an ONNX value (an image transposed back to NCHW).
    pub(in crate::onnx) fn into_value(self, device: &Device) -> Result<Value, OnnxError> {
        match self {
            Slot::Value(v) => Ok(v),
            Slot::Image(image) => image.into_value(device),
            Slot::Rows(rows) => rows.into_value(device),
        }
    }

    pub(super) fn into_image(self) -> Result<Image, OnnxError> {
        match self {
            Slot::Image(image) => Ok(image),
            Slot::Value(v) => Image::from_value(v),
            Slot::Rows(rows) => {
                let dims = rows.dims.clone();
                Image::from_nchw(Cow::Owned(rows.into_vec()), dims)
            }
        }
    }

    /// Whether the slot is a float tensor whose last axis has `len` values (a host row
    /// layer's input).
    pub(super) fn has_rows_of(&self, len: usize) -> bool {
        match self {
            Slot::Rows(r) => r.dims.len() >= 2 && r.last() == len,
            Slot::Value(v) => {
                v.kind() == ValueKind::Float && v.rank() >= 2 && v.dims().last() == Some(&len)
            }
            Slot::Image(_) => false,
        }
    }
}
