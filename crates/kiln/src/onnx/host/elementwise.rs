//! Element-wise and per-channel steps on host values: activations, residual adds, binary
//! arithmetic with broadcasting along channels or rows.

use super::*;

/// `out + r`, then `act`, for a residual that was not summed in a kernel's
/// store: an image or NCHW value of `out`'s shape, a per-channel operand, or (numpy
/// broadcasting) anything else on values.
pub(super) fn add_residual(
    out: Image,
    r: Slot,
    act: Option<Activation>,
    device: &Device,
) -> Result<Vec<Slot>, OnnxError> {
    let [n, h, w, c] = out.dims;
    let r = match r {
        Slot::Value(v) if v.kind() == ValueKind::Float && v.dims() == [n, c, h, w] => {
            Slot::Image(Image::from_value(v)?)
        }
        other => other,
    };
    let mut operands = [Some(Slot::Image(out)), Some(r)];
    let sum = match binary(&mut operands, Arith::Add, false) {
        Some(sum) => sum?,
        None => {
            // `binary` leaves operands it cannot take: numpy broadcasting on values.
            let [Some(y), Some(r)] = operands else {
                return Err(OnnxError::Graph("a residual operand went missing".into()));
            };
            vec![Slot::Value(crate::onnx::ops::math::binary(
                crate::onnx::ops::math::Binary::Add,
                y.into_value(device)?,
                r.into_value(device)?,
            )?)]
        }
    };
    match act {
        None => Ok(sum),
        Some(act) => sum
            .into_iter()
            .map(|slot| activate_slot(slot, act))
            .collect(),
    }
}

/// `act` of `slot`, in place for an image or rows.
pub(super) fn activate_slot(slot: Slot, act: Activation) -> Result<Slot, OnnxError> {
    match slot {
        Slot::Image(image) => Ok(activated(image, act)),
        Slot::Rows(rows) => Ok(activated_rows(rows, act)),
        Slot::Value(v) => Ok(Slot::Value(crate::onnx::passes::activate(act, v)?)),
    }
}

/// `act` of an image or of rows (an activation node, or a step fused at load: SiLU, GELU);
/// `None` for a value, which the ONNX operator takes.
pub(in crate::onnx) fn unary(
    ins: &mut [Option<Slot>],
    act: Activation,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    // A value stays in its slot for the ONNX operator.
    if let Slot::Value(_) = ins.first()?.as_ref()? {
        return None;
    }
    match take(ins, 0)? {
        Slot::Image(image) => Some(Ok(vec![activated(image, act)])),
        Slot::Rows(rows) => Some(Ok(vec![activated_rows(rows, act)])),
        Slot::Value(_) => None,
    }
}

/// A fused QuantizeLinear → DequantizeLinear on a host image or rows, in place when this was
/// their last reader (a value is left to the value path).
pub(in crate::onnx) fn quantize_dequantize(
    ins: &mut [Option<Slot>],
    fq: &crate::onnx::ops::quant::QuantizeDequantize,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    if let Slot::Value(_) = ins.first()?.as_ref()? {
        return None;
    }
    match take(ins, 0)? {
        Slot::Image(image) => {
            let dims = image.dims;
            let mut data = image.into_vec();
            fq.apply(&mut data);
            Some(Ok(vec![Slot::Image(Image::new(data, dims))]))
        }
        Slot::Rows(rows) => Some(Ok(vec![Slot::Rows(rows.apply(|x| fq.apply(x)))])),
        Slot::Value(_) => None,
    }
}

/// `act` of every value of `rows` (in place when this was their last reader).
pub(super) fn activated_rows(rows: Rows, act: Activation) -> Slot {
    Slot::Rows(rows.apply(|x| activate(x, act)))
}

/// `act` of every value of `image` (in place when this was its last reader).
pub(super) fn activated(image: Image, act: Activation) -> Slot {
    let dims = image.dims;
    let mut data = image.into_vec();
    activate(&mut data, act);
    Slot::Image(Image::new(data, dims))
}

/// An operand of a per-channel operation: `[rows, channels]` values.
pub(super) fn per_channel(slot: &Slot, image: [usize; 4]) -> Option<Vec<f32>> {
    let [n, _, _, c] = image;
    match slot {
        // A squeeze-excitation gate left channels-last: `[n or 1, 1, 1, c]`.
        Slot::Image(g) => {
            let [gn, gh, gw, gc] = g.dims;
            (gh * gw == 1 && gc == c && (gn == n || gn == 1)).then(|| (*g.data).clone())
        }
        // A constant or gate in ONNX layout: `[c, 1, 1]`, `[1 or n, c, 1, 1]`, or a scalar.
        Slot::Value(v) if v.kind() == ValueKind::Float => {
            let dims = v.dims();
            if v.len() == 1 {
                return Some(vec![v.to_f32s().ok()?[0]; c]);
            }
            let fits = match dims.as_slice() {
                [vc, 1, 1] => *vc == c,
                [vn, vc, 1, 1] => *vc == c && (*vn == n || *vn == 1),
                _ => false,
            };
            fits.then(|| v.to_f32s().ok()).flatten()
        }
        Slot::Value(_) | Slot::Rows(_) => None,
    }
}

/// Element-wise arithmetic with an image operand: two images of one size, or an image and
/// a per-channel operand (a constant, a scalar or a squeeze-excitation gate) on either side.
pub(super) fn binary(
    ins: &mut [Option<Slot>],
    op: Arith,
    relu: bool,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let (a, b) = (ins.first()?.as_ref()?, ins.get(1)?.as_ref()?);
    if matches!(a, Slot::Rows(_)) || matches!(b, Slot::Rows(_)) {
        return binary_rows(ins, op, relu);
    }
    let row_for = |x: &Slot, v: &Slot| match x {
        Slot::Image(x) => per_channel(v, x.dims),
        Slot::Value(_) | Slot::Rows(_) => None,
    };
    // (which input is the full image, the other as per-channel rows, whether it comes first)
    let (x_at, rows, swap) = match (a, b) {
        (Slot::Image(a), Slot::Image(b)) if a.dims == b.dims => (0, None, false),
        _ => match row_for(a, b) {
            Some(rows) => (0, Some(rows), false),
            None => (1, Some(row_for(b, a)?), true),
        },
    };
    let other = take(ins, 1 - x_at)?;
    let Some(Slot::Image(x)) = take(ins, x_at) else {
        return None;
    };
    let dims = x.dims;
    let mut data = x.into_vec();
    match (rows, other) {
        (Some(rows), _) => {
            let [_, h, w, c] = dims;
            arith_channels_in_place(&mut data, &rows, [h * w, c], op, swap);
            if relu {
                activate(&mut data, Activation::Relu);
            }
        }
        (None, Slot::Image(o)) => arith_in_place(&mut data, &o.data, op, relu),
        (None, Slot::Value(_) | Slot::Rows(_)) => return None,
    }
    Some(Ok(vec![Slot::Image(Image::new(data, dims))]))
}

/// Element-wise arithmetic with a host-rows operand: two operands of one shape (rows, or
/// rows and a float value), or rows and an operand along their last axis (a bias, a layer
/// scale, a scalar) on either side; `None` for any other broadcast.
pub(super) fn binary_rows(
    ins: &mut [Option<Slot>],
    op: Arith,
    relu: bool,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let (a, b) = (ins.first()?.as_ref()?, ins.get(1)?.as_ref()?);
    // (which input is the rows, whether the other is the same shape, whether it comes first)
    let (x_at, same, swap) = match (a, b) {
        (Slot::Rows(x), other) if same_shape(other, &x.dims) => (0, true, false),
        (other, Slot::Rows(x)) if same_shape(other, &x.dims) => (1, true, true),
        (Slot::Rows(x), other) if along_last(other, x.last()) => (0, false, false),
        (other, Slot::Rows(x)) if along_last(other, x.last()) => (1, false, true),
        _ => return None,
    };
    let other = float_values(take(ins, 1 - x_at)?)?;
    let Some(Slot::Rows(x)) = take(ins, x_at) else {
        return None;
    };
    let dims = x.dims.clone();
    let c = x.last();
    let mut data = x.into_vec();
    let other = match other {
        Ok(v) => v,
        Err(e) => return Some(Err(e)),
    };
    if same {
        if swap && matches!(op, Arith::Sub | Arith::Div) {
            // `other ∘ rows`: not commutative, so into the other operand's buffer.
            let mut out = other;
            arith_in_place(&mut out, &data, op, relu);
            data = out;
        } else {
            arith_in_place(&mut data, &other, op, relu);
        }
    } else {
        let row = if other.len() == 1 {
            vec![other[0]; c]
        } else {
            other
        };
        arith_channels_in_place(&mut data, &row, [1, c], op, swap);
        if relu {
            activate(&mut data, Activation::Relu);
        }
    }
    Some(Ok(vec![Slot::Rows(Rows::new(data, dims))]))
}

/// Whether `slot` is a float operand of exactly `dims`.
pub(super) fn same_shape(slot: &Slot, dims: &[usize]) -> bool {
    match slot {
        Slot::Rows(r) => r.dims == dims,
        Slot::Value(v) => v.kind() == ValueKind::Float && v.dims() == dims,
        Slot::Image(_) => false,
    }
}

/// Whether `slot` is a float operand that broadcasts along the last axis of `c` values: a
/// scalar, or ones but for a last axis of `c` (`[c]`, `[1, 1, c]`).
pub(super) fn along_last(slot: &Slot, c: usize) -> bool {
    let dims = match slot {
        Slot::Rows(r) => r.dims.clone(),
        Slot::Value(v) if v.kind() == ValueKind::Float => v.dims(),
        _ => return false,
    };
    let len: usize = dims.iter().product();
    len == 1 || (dims.last() == Some(&c) && len == c)
}

/// A float operand's values (copied out of a value, shared rows cloned).
pub(super) fn float_values(slot: Slot) -> Option<Result<Vec<f32>, OnnxError>> {
    match slot {
        Slot::Rows(r) => Some(Ok(r.into_vec())),
        Slot::Value(v) => Some(v.to_f32s()),
        Slot::Image(_) => None,
    }
}
