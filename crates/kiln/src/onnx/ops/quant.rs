//! `QuantizeLinear` and `DequantizeLinear` on values, per tensor or per axis: the reference
//! semantics every quantized model reduces to (`lower_quant.rs` rewrites the QOperator and
//! dynamic forms into them). The static int8 pass takes the common chains off these onto
//! Kiln's integer kernels; what remains (a residual sum's requantization, a layer the
//! kernels do not take) runs here, on the host, in one pass per node.

use burn::tensor::{Device, TensorData};
use onnx_ir::DType;

use super::super::OnnxError;
use super::super::value::Value;

/// The integer range of a quantized element type.
pub fn quant_range(dtype: DType) -> Result<(i64, i64), OnnxError> {
    Ok(match dtype {
        DType::U8 => (0, 255),
        DType::I8 => (-128, 127),
        DType::U16 => (0, 65_535),
        DType::I16 => (-32_768, 32_767),
        DType::I32 => (i32::MIN as i64, i32::MAX as i64),
        other => {
            return Err(OnnxError::Unsupported(format!(
                "quantization to {other:?} (Kiln runs uint8, int8, uint16, int16 and int32)"
            )));
        }
    })
}

/// For each flat position of a tensor shaped `dims`, the index of its quantization
/// parameter: 0 per tensor, else its coordinate along `axis` (negative from the end).
fn parameter_index(
    dims: &[usize],
    params: usize,
    axis: i64,
    what: &str,
) -> Result<impl Fn(usize) -> usize + use<>, OnnxError> {
    let rank = dims.len() as i64;
    let per_tensor = params == 1;
    let a = if axis < 0 { axis + rank } else { axis };
    if !per_tensor && !(0..rank).contains(&a) {
        return Err(OnnxError::Shape(format!(
            "{what}: axis {axis} is outside a tensor of rank {rank}"
        )));
    }
    let a = a.max(0) as usize;
    let (len, inner) = if per_tensor {
        (1, 1)
    } else {
        (dims[a], dims[a + 1..].iter().product::<usize>())
    };
    if !per_tensor && len != params {
        return Err(OnnxError::Shape(format!(
            "{what}: {params} scales for an axis of {len} (shape {dims:?}, axis {axis})"
        )));
    }
    Ok(move |i: usize| if per_tensor { 0 } else { (i / inner) % len })
}

/// Zero points as integers (absent: 0 for each scale).
fn zero_points(zero: Option<&Value>, scales: usize) -> Result<Vec<i64>, OnnxError> {
    match zero {
        Some(z) => {
            let z = z.to_i64s()?;
            if z.len() != scales {
                return Err(OnnxError::Shape(format!(
                    "{} zero points for {scales} scales",
                    z.len()
                )));
            }
            Ok(z)
        }
        None => Ok(vec![0; scales]),
    }
}

/// `QuantizeLinear`: `saturate(round_half_even(x / scale) + zero)` into `dtype`'s range.
pub fn quantize_linear(
    x: &Value,
    scale: &Value,
    zero: Option<&Value>,
    axis: i64,
    dtype: DType,
    device: &Device,
) -> Result<Value, OnnxError> {
    let (lo, hi) = quant_range(dtype)?;
    let scales = scale.to_f32s()?;
    let zeros = zero_points(zero, scales.len())?;
    let dims = x.onnx_dims();
    let param = parameter_index(&dims, scales.len(), axis, "QuantizeLinear")?;
    let values = x.to_f32s()?;
    let q: Vec<i64> = values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let p = param(i);
            let r = (v / scales[p]).round_ties_even();
            // NaN saturates to the zero point's side as ONNX Runtime does (to 0 then + zero).
            let r = if r.is_nan() { 0.0 } else { r };
            (r as i64).saturating_add(zeros[p]).clamp(lo, hi)
        })
        .collect();
    Value::from_data(TensorData::new(q, dims), device)
}

/// `DequantizeLinear`: `(x − zero) · scale`, in f32 as ONNX Runtime computes it.
pub fn dequantize_linear(
    x: &Value,
    scale: &Value,
    zero: Option<&Value>,
    axis: i64,
    device: &Device,
) -> Result<Value, OnnxError> {
    let scales = scale.to_f32s()?;
    let zeros = zero_points(zero, scales.len())?;
    let dims = x.onnx_dims();
    let param = parameter_index(&dims, scales.len(), axis, "DequantizeLinear")?;
    let values = x.to_i64s()?;
    let f: Vec<f32> = values
        .iter()
        .enumerate()
        .map(|(i, &q)| {
            let p = param(i);
            (q - zeros[p]) as f32 * scales[p]
        })
        .collect();
    Value::from_data(TensorData::new(f, dims), device)
}

/// A `QuantizeLinear` whose only reader is a `DequantizeLinear` of the same per-tensor grid,
/// fused at load: the value rounded to the grid in f32, in one pass, in whatever layout the
/// host holds it (the pair's int8 tensor between them is never made).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantizeDequantize {
    /// The grid's step.
    pub scale: f32,
    /// The zero point.
    pub zero: f32,
    /// The quantized type's range.
    pub lo: f32,
    /// The quantized type's range.
    pub hi: f32,
}

impl QuantizeDequantize {
    /// Each value to `(saturate(round_half_even(x / scale) + zero) − zero) · scale`: what the
    /// two nodes compute (`x / scale` divided, as ONNX Runtime does, so the grid point is the
    /// same one).
    pub fn apply(&self, x: &mut [f32]) {
        const MAGIC: f32 = 12_582_912.0; // 1.5 · 2²³: rounds half to even below 2²²
        let Self {
            scale,
            zero,
            lo,
            hi,
        } = *self;
        let (below, above) = (lo - zero, hi - zero);
        for v in x.iter_mut() {
            // Saturated before rounding (the bounds are integers, so it is the same), which
            // keeps the magic add exact and the loop branch-free; `max`/`min`, not `clamp`:
            // a NaN goes to the range's low end.
            #[allow(clippy::manual_clamp)]
            let q = (*v / scale).max(below).min(above);
            let y = (q + MAGIC) - MAGIC;
            *v = y * scale;
        }
    }

    /// The pair on a value (off the host path).
    pub fn run(&self, x: &Value) -> Result<Value, OnnxError> {
        let mut values = x.to_f32s()?;
        self.apply(&mut values);
        Value::from_data(TensorData::new(values, x.onnx_dims()), &x.device())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(v: Vec<i64>, dims: &[usize]) -> Value {
        Value::from_data(TensorData::new(v, dims.to_vec()), &Device::default()).unwrap()
    }

    fn floats(v: Vec<f32>, dims: &[usize]) -> Value {
        Value::from_data(TensorData::new(v, dims.to_vec()), &Device::default()).unwrap()
    }

    #[test]
    fn quantize_rounds_half_to_even_and_saturates() {
        let d = Device::default();
        let x = floats(vec![0.25, 0.75, -3.0, 300.0, 1.0, -0.1], &[6]);
        let s = floats(vec![0.5], &[]);
        let z = ints(vec![10], &[]);
        let q = quantize_linear(&x, &s, Some(&z), 1, DType::U8, &d).unwrap();
        // 0.5 → 0 (even), 1.5 → 2, −6, 600 saturates, 2, −0.2 → 0.
        assert_eq!(q.to_i64s().unwrap(), vec![10, 12, 4, 255, 12, 10]);
        let q = quantize_linear(&x, &s, None, 1, DType::I8, &d).unwrap();
        assert_eq!(q.to_i64s().unwrap(), vec![0, 2, -6, 127, 2, 0]);
    }

    #[test]
    fn the_fused_pair_equals_quantize_then_dequantize() {
        let d = Device::default();
        let values: Vec<f32> = (0..400)
            .map(|i| (i as f32 - 200.0) * 0.0173 + 0.25)
            .collect();
        let x = floats(values.clone(), &[4, 100]);
        let s = floats(vec![0.05], &[]);
        let z = ints(vec![-7], &[]);
        let q = quantize_linear(&x, &s, Some(&z), 1, DType::I8, &d).unwrap();
        let want = dequantize_linear(&q, &s, Some(&z), 1, &d).unwrap();
        let fused = QuantizeDequantize {
            scale: 0.05,
            zero: -7.0,
            lo: -128.0,
            hi: 127.0,
        };
        let got = fused.run(&x).unwrap();
        assert_eq!(got.to_f32s().unwrap(), want.to_f32s().unwrap());
        assert_eq!(got.dims(), vec![4, 100]);
    }

    #[test]
    fn per_axis_parameters_follow_the_axis() {
        let d = Device::default();
        // [2 channels, 3] along axis 0; then along axis 1 of a [3, 2].
        let q = ints(vec![1, 2, 3, 4, 5, 6], &[2, 3]);
        let s = floats(vec![1.0, 10.0], &[2]);
        let z = ints(vec![0, 1], &[2]);
        let f = dequantize_linear(&q, &s, Some(&z), 0, &d).unwrap();
        assert_eq!(f.to_f32s().unwrap(), vec![1.0, 2.0, 3.0, 30.0, 40.0, 50.0]);
        let q = ints(vec![1, 2, 3, 4, 5, 6], &[3, 2]);
        let f = dequantize_linear(&q, &s, Some(&z), -1, &d).unwrap();
        assert_eq!(f.to_f32s().unwrap(), vec![1.0, 10.0, 3.0, 30.0, 5.0, 50.0]);
        // A scale count that fits no axis is an error naming both.
        let bad = floats(vec![1.0, 2.0, 3.0], &[3]);
        let err = dequantize_linear(&q, &bad, None, 1, &d).unwrap_err();
        assert!(
            err.to_string().contains("3 scales for an axis of 2"),
            "{err}"
        );
    }
}
