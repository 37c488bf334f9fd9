//! A tensor of any rank and kind flowing through an imported ONNX graph.
//!
//! Burn's `Tensor<D, K>` fixes rank and kind in the type, an ONNX graph fixes them per value
//! at load time. [`Value`] keeps Burn's rank-free bridge handle with its kind, and
//! [`with_rank!`] turns a run-time rank back into the const generic for each Burn call (ranks
//! 1 to 8). ONNX scalars (rank 0, which Burn has no tensor for) are held as one-element rank-1
//! tensors marked `scalar`: broadcasting treats `[1]` as a scalar, so the arithmetic agrees.

use burn::backend::{BackendTensor, DispatchTensorKind};
use burn::tensor::DispatchTensor;
use burn::tensor::kind::BridgeTensor;
use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

use super::OnnxError;

/// Values from which a strided view is copied by Kiln's parallel copy (below, Burn's own
/// copy on one thread costs less than handing work to the pool).
const STRIDED_COPY_MIN: usize = 1 << 16;

/// Expands `$body` once per supported rank with `$D` bound to that rank as a `const`.
macro_rules! with_rank {
    ($rank:expr, $D:ident => $body:expr) => {
        match $rank {
            1 => {
                const $D: usize = 1;
                $body
            }
            2 => {
                const $D: usize = 2;
                $body
            }
            3 => {
                const $D: usize = 3;
                $body
            }
            4 => {
                const $D: usize = 4;
                $body
            }
            5 => {
                const $D: usize = 5;
                $body
            }
            6 => {
                const $D: usize = 6;
                $body
            }
            7 => {
                const $D: usize = 7;
                $body
            }
            8 => {
                const $D: usize = 8;
                $body
            }
            r => return Err($crate::onnx::OnnxError::Rank(r)),
        }
    };
}
pub(crate) use with_rank;

/// The element kind of a [`Value`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// Floating point.
    Float,
    /// Integer (index, shape arithmetic).
    Int,
    /// Boolean (masks, comparisons).
    Bool,
}

/// A tensor of run-time rank and kind on a device.
#[derive(Debug, Clone)]
pub struct Value {
    tensor: BridgeTensor,
    kind: ValueKind,
    /// An ONNX rank-0 value held as `[1]`.
    scalar: bool,
}

impl Value {
    /// Wraps a float tensor.
    pub fn float<const D: usize>(t: Tensor<D>) -> Self {
        Value::wrap(t.into_bridge(), ValueKind::Float)
    }

    /// Wraps an integer tensor.
    pub fn int<const D: usize>(t: Tensor<D, Int>) -> Self {
        Value::wrap(t.into_bridge(), ValueKind::Int)
    }

    /// Wraps a boolean tensor.
    pub fn bool<const D: usize>(t: Tensor<D, Bool>) -> Self {
        Value::wrap(t.into_bridge(), ValueKind::Bool)
    }

    fn wrap(tensor: BridgeTensor, kind: ValueKind) -> Self {
        // Burn 0.22's integer comparisons tag their boolean result as an int bridge tensor,
        // which `Tensor::from_bridge` then refuses; re-tag by the kind the value holds.
        let tagged = match kind {
            ValueKind::Float => tensor.is_float(),
            ValueKind::Int => tensor.is_int(),
            ValueKind::Bool => tensor.is_bool(),
        };
        let tensor = if tagged {
            tensor
        } else {
            let inner: DispatchTensor = tensor.into();
            match kind {
                ValueKind::Float => BridgeTensor::float(inner),
                ValueKind::Int => BridgeTensor::int(inner),
                ValueKind::Bool => BridgeTensor::bool(inner),
            }
        };
        Value {
            tensor,
            kind,
            scalar: false,
        }
    }

    /// Uploads host data (any element type; floats become f32, integers i64, booleans bool).
    /// Rank-0 data becomes a scalar value.
    pub fn from_data(data: TensorData, device: &Device) -> Result<Self, OnnxError> {
        let (bytes, shape, dtype) = data.into_parts();
        let scalar = shape.is_empty();
        let dims: Vec<usize> = if scalar { vec![1] } else { shape.to_vec() };
        let kind = kind_of(dtype)?;
        let data = TensorData::try_from_bytes(bytes, dims.clone(), dtype)
            .map_err(|e| OnnxError::Shape(format!("constant of shape {dims:?}: {e}")))?;
        let value = with_rank!(dims.len(), D => match kind {
            ValueKind::Float => Value::float(Tensor::<D>::from_data(data.convert::<f32>(), device)),
            ValueKind::Int => Value::int(Tensor::<D, Int>::from_data(saturate(data.convert::<i64>())?, device)),
            ValueKind::Bool => Value::bool(Tensor::<D, Bool>::from_data(data.convert::<bool>(), device)),
        });
        Ok(value.with_scalar(scalar))
    }

    /// Host integers as a rank-1 int value (`scalar`: as an ONNX scalar).
    pub fn from_i64(values: Vec<i64>, scalar: bool, device: &Device) -> Self {
        let n = values.len();
        let values = values.into_iter().map(saturate_one).collect::<Vec<_>>();
        Value::int(Tensor::<1, Int>::from_data(
            TensorData::new(values, [n]),
            device,
        ))
        .with_scalar(scalar)
    }

    /// Marks the value as an ONNX scalar (or not).
    pub fn with_scalar(mut self, scalar: bool) -> Self {
        self.scalar = scalar && self.len() == 1;
        self
    }

    /// Whether the value is an ONNX scalar.
    pub fn is_scalar(&self) -> bool {
        self.scalar
    }

    /// The element kind.
    pub fn kind(&self) -> ValueKind {
        self.kind
    }

    /// Burn's rank (1 for scalars).
    pub fn rank(&self) -> usize {
        self.tensor.rank()
    }

    /// The dimensions (`[1]` for scalars).
    pub fn dims(&self) -> Vec<usize> {
        self.tensor.shape().to_vec()
    }

    /// The ONNX shape (`[]` for scalars).
    pub fn onnx_dims(&self) -> Vec<usize> {
        if self.scalar { Vec::new() } else { self.dims() }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.dims().iter().product()
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device the value lives on.
    pub fn device(&self) -> Device {
        match self.kind {
            ValueKind::Float => self.clone().f::<1>().device(),
            ValueKind::Int => self.clone().i::<1>().device(),
            ValueKind::Bool => self.clone().b::<1>().device(),
        }
    }

    /// The value as a float tensor of rank `D` (the caller matched the kind and rank).
    pub fn f<const D: usize>(self) -> Tensor<D> {
        Tensor::from_bridge(self.tensor)
    }

    /// The value as an int tensor of rank `D`.
    pub fn i<const D: usize>(self) -> Tensor<D, Int> {
        Tensor::from_bridge(self.tensor)
    }

    /// The value as a bool tensor of rank `D`.
    pub fn b<const D: usize>(self) -> Tensor<D, Bool> {
        Tensor::from_bridge(self.tensor)
    }

    /// The value converted to `kind` (floats truncate toward zero into integers; non-zero is
    /// true).
    pub fn to_kind(self, kind: ValueKind) -> Result<Self, OnnxError> {
        if self.kind == kind {
            return Ok(self);
        }
        let scalar = self.scalar;
        let out = with_rank!(self.rank(), D => match (self.kind, kind) {
            (ValueKind::Float, ValueKind::Int) => Value::int(self.f::<D>().int()),
            (ValueKind::Float, ValueKind::Bool) => Value::bool(self.f::<D>().not_equal_elem(0.0)),
            (ValueKind::Int, ValueKind::Float) => Value::float(self.i::<D>().float()),
            (ValueKind::Int, ValueKind::Bool) => Value::bool(self.i::<D>().not_equal_elem(0)),
            (ValueKind::Bool, ValueKind::Float) => Value::float(self.b::<D>().float()),
            (ValueKind::Bool, ValueKind::Int) => Value::int(self.b::<D>().int()),
            _ => unreachable!("same kinds returned above"),
        });
        Ok(out.with_scalar(scalar))
    }

    /// The same elements with dimensions `dims` (their product must match).
    pub fn reshape(self, dims: &[usize]) -> Result<Self, OnnxError> {
        if dims.iter().product::<usize>() != self.len() {
            return Err(OnnxError::Shape(format!(
                "cannot reshape {:?} ({} elements) to {dims:?}",
                self.dims(),
                self.len()
            )));
        }
        if dims.is_empty() {
            return Ok(self.with_scalar(true));
        }
        // A strided view with a contiguous last axis is copied over the pool (Burn copies on
        // one thread).
        let this = match self.contiguous_copy() {
            Some(copy) => Value::from_data(TensorData::new(copy, self.dims()), &self.device())?,
            None => self,
        };
        let kind = this.kind;
        // Burn's reshape reads the source shape at run time, so the source is labelled with
        // the target rank: one dispatch instead of one per (source, target) pair.
        Ok(with_rank!(dims.len(), D => {
            let to: [usize; D] = dims.try_into().expect("length matched by with_rank");
            match kind {
                ValueKind::Float => Value::float(this.f::<D>().reshape(to)),
                ValueKind::Int => Value::int(this.i::<D>().reshape(to)),
                ValueKind::Bool => Value::bool(this.b::<D>().reshape(to)),
            }
        }))
    }

    /// The value with leading 1-sized dimensions added up to `rank` (numpy broadcasting).
    pub fn lift_to_rank(self, rank: usize) -> Result<Self, OnnxError> {
        let dims = self.dims();
        if dims.len() >= rank {
            return Ok(self);
        }
        let mut lifted = vec![1; rank - dims.len()];
        lifted.extend(dims);
        self.reshape(&lifted)
    }

    /// The elements as host integers (any kind; floats truncate).
    pub fn to_i64s(&self) -> Result<Vec<i64>, OnnxError> {
        self.data()?
            .convert::<i64>()
            .try_into_vec::<i64>()
            .map_err(|e| OnnxError::Shape(format!("reading integers: {e:?}")))
    }

    /// The elements as host floats (any kind).
    pub fn to_f32s(&self) -> Result<Vec<f32>, OnnxError> {
        // One copy of the backend's buffer when it can be read in place; `data` makes three
        // (Burn's `into_data` of a shared tensor, and twice more between byte and f32
        // vectors): 1.5 ms for ResNet-18's input at batch 8 (BENCHMARKS.md run 40).
        if let Some(values) = self.with_f32_view(<[f32]>::to_vec) {
            return Ok(values);
        }
        // A large strided view with a contiguous last axis: over the pool, as `reshape`.
        if let Some(values) = self.contiguous_copy() {
            return Ok(values);
        }
        self.data()?
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| OnnxError::Shape(format!("reading floats: {e:?}")))
    }

    /// The values of an f32 view on `flex` that is strided with a contiguous last axis, of at
    /// least [`STRIDED_COPY_MIN`] values, copied into row-major order over the pool
    /// ([`kiln_kernels::strided`]); `None` for anything else (a
    /// contiguous tensor needs no copy, a small one is not worth the pool).
    fn contiguous_copy(&self) -> Option<Vec<f32>> {
        if self.kind != ValueKind::Float || self.len() < STRIDED_COPY_MIN {
            return None;
        }
        let inner: DispatchTensor = self.tensor.clone().into();
        let DispatchTensorKind::Flex(BackendTensor::Float(t)) = &inner.kind else {
            return None;
        };
        let layout = t.layout();
        if t.dtype() != DType::F32 || t.is_contiguous() {
            return None;
        }
        let strides: Vec<usize> = layout
            .strides()
            .iter()
            .map(|&s| usize::try_from(s).ok())
            .collect::<Option<_>>()?;
        kiln_kernels::strided::contiguous(
            t.storage::<f32>(),
            layout.start_offset(),
            layout.shape(),
            &strides,
        )
    }

    /// `f` of the values of an f32 tensor on `flex` in row-major order, read in place (its
    /// buffer is host memory already); `None` for another kind, dtype or device, or a
    /// strided view.
    pub fn with_f32_view<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
        if self.kind != ValueKind::Float {
            return None;
        }
        let inner: DispatchTensor = self.tensor.clone().into();
        match &inner.kind {
            DispatchTensorKind::Flex(BackendTensor::Float(t)) => t.as_slice::<f32>().map(f),
            _ => None,
        }
    }

    /// `f` of the values as host floats: read in place where [`Value::with_f32_view`] can,
    /// else from a copy ([`Value::to_f32s`]).
    pub fn with_f32s<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R, OnnxError> {
        let mut f = Some(f);
        let mut once = |v: &[f32]| f.take().map(|f| f(v));
        if let Some(Some(r)) = self.with_f32_view(&mut once) {
            return Ok(r);
        }
        let values = self.to_f32s()?;
        once(&values).ok_or_else(|| OnnxError::Graph("a value was read twice".into()))
    }

    /// The elements on the host, with the ONNX shape.
    pub fn data(&self) -> Result<TensorData, OnnxError> {
        let data = with_rank!(self.rank(), D => match self.kind {
            ValueKind::Float => self.clone().f::<D>().into_data(),
            ValueKind::Int => self.clone().i::<D>().into_data(),
            ValueKind::Bool => self.clone().b::<D>().into_data(),
        });
        let (bytes, _, dtype) = data.into_parts();
        TensorData::try_from_bytes(bytes, self.onnx_dims(), dtype)
            .map_err(|e| OnnxError::Shape(format!("reading a value: {e}")))
    }
}

/// `v` clamped to the i32 range. Burn's CPU backend holds integers as i32; ONNX files use
/// i64 extremes (`INT64_MAX` as a slice end, `INT64_MIN` as "from the start") as open bounds,
/// which stay open bounds once clamped.
fn saturate_one(v: i64) -> i64 {
    v.clamp(i32::MIN as i64, i32::MAX as i64)
}

fn saturate(data: TensorData) -> Result<TensorData, OnnxError> {
    let shape = data.shape().clone();
    let values: Vec<i64> = data
        .try_into_vec::<i64>()
        .map_err(|e| OnnxError::Shape(format!("reading integers: {e:?}")))?
        .into_iter()
        .map(saturate_one)
        .collect();
    Ok(TensorData::new(values, shape))
}

/// The kind holding `dtype`'s values.
pub fn kind_of(dtype: DType) -> Result<ValueKind, OnnxError> {
    if dtype.is_float() {
        Ok(ValueKind::Float)
    } else if dtype.is_int() || dtype.is_uint() {
        Ok(ValueKind::Int)
    } else if dtype.is_bool() {
        Ok(ValueKind::Bool)
    } else {
        Err(OnnxError::Unsupported(format!("element type {dtype:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_read_in_place_when_contiguous_and_copied_in_order_from_a_view() {
        let device = Device::default();
        let values: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let t = Tensor::<2>::from_data(TensorData::new(values.clone(), [2, 3]), &device);
        let dense = Value::float(t.clone());
        assert_eq!(dense.with_f32_view(<[f32]>::to_vec), Some(values.clone()));
        assert_eq!(dense.to_f32s().unwrap(), values);
        // A transposed view is strided: not readable in place, and `to_f32s` still returns
        // its values in row-major order of the view.
        let strided = Value::float(t.transpose());
        assert_eq!(strided.with_f32_view(<[f32]>::to_vec), None);
        assert_eq!(
            strided.to_f32s().unwrap(),
            vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
        // `with_f32s`: in place or from that copy, the same values either way.
        assert_eq!(dense.with_f32s(<[f32]>::to_vec).unwrap(), values);
        assert_eq!(
            strided.with_f32s(<[f32]>::to_vec).unwrap(),
            vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
        let ints = Value::from_i64(vec![1, 2], false, &device);
        assert_eq!(ints.with_f32_view(<[f32]>::len), None);
    }

    /// A large view with a contiguous last axis (a transformer's head split) reshapes through
    /// Kiln's parallel copy, to the same values as Burn's own reshape; a transposed last axis
    /// and a small view stay on Burn's.
    #[test]
    fn strided_views_reshape_to_burns_values() {
        let device = Device::default();
        let dims = [197, 12, 64];
        let values: Vec<f32> = (0..197 * 12 * 64).map(|i| i as f32).collect();
        let t = Tensor::<3>::from_data(TensorData::new(values, dims), &device);
        for perm in [[1, 0, 2], [0, 2, 1]] {
            let view = Value::float(t.clone().permute(perm));
            let copied = view.contiguous_copy();
            assert_eq!(copied.is_some(), perm == [1, 0, 2], "{perm:?}");
            let want = t.clone().permute(perm).reshape([12 * 197 * 64]).into_data();
            assert_eq!(
                view.to_f32s().unwrap(),
                want.clone().try_into_vec::<f32>().unwrap(),
                "{perm:?}"
            );
            let got = view.reshape(&[12 * 197 * 64]).unwrap().data().unwrap();
            assert_eq!(got, want, "{perm:?}");
        }
        let small = Value::float(Tensor::<2>::ones([4, 3], &device).transpose());
        assert_eq!(small.contiguous_copy(), None);
    }
}
