//! Operators that move, select or create elements without arithmetic: `Shape`, `Reshape`,
//! `Transpose`, `Slice`, `Gather`, `Concat`, `Split`, `Expand`, `Pad`, `Range`, ...

use burn::tensor::ops::PadMode;
use burn::tensor::{Device, Slice, Tensor, TensorData};

use super::super::OnnxError;
use super::super::value::{Value, ValueKind, with_rank};

/// `axis` (possibly negative) as an index into `rank` dimensions.
pub fn axis_index(axis: i64, rank: usize) -> Result<usize, OnnxError> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if (0..r).contains(&a) {
        Ok(a as usize)
    } else {
        Err(OnnxError::Shape(format!(
            "axis {axis} is out of range for rank {rank}"
        )))
    }
}

/// `Shape`: the dimensions `start..end` as integers.
pub fn shape(x: &Value, start: usize, end: usize, device: &Device) -> Value {
    shape_of(&x.onnx_dims(), start, end, device)
}

/// `Shape` of a value with ONNX dimensions `dims` (a host image's are its NCHW ones).
pub fn shape_of(dims: &[usize], start: usize, end: usize, device: &Device) -> Value {
    let end = end.min(dims.len());
    let start = start.min(end);
    Value::from_i64(
        dims[start..end].iter().map(|&d| d as i64).collect(),
        false,
        device,
    )
}

/// `Reshape` to an ONNX shape spec: `0` copies the input's dimension, one `-1` is inferred.
pub fn reshape(x: Value, spec: &[i64]) -> Result<Value, OnnxError> {
    let out = reshaped_dims(&x.onnx_dims(), spec)?;
    x.reshape(&out)
}

/// The dimensions `Reshape` to `spec` gives a value of ONNX dimensions `dims`.
pub fn reshaped_dims(dims: &[usize], spec: &[i64]) -> Result<Vec<usize>, OnnxError> {
    let total: usize = dims.iter().product();
    let mut out: Vec<usize> = Vec::with_capacity(spec.len());
    let mut infer = None;
    for (i, &s) in spec.iter().enumerate() {
        match s {
            0 => out.push(*dims.get(i).ok_or_else(|| {
                OnnxError::Shape(format!(
                    "reshape {dims:?} to {spec:?}: no dimension {i} to copy"
                ))
            })?),
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            s if s > 0 => out.push(s as usize),
            _ => {
                return Err(OnnxError::Shape(format!(
                    "reshape {dims:?} to {spec:?}: invalid dimension {s}"
                )));
            }
        }
    }
    if let Some(i) = infer {
        let known: usize = out.iter().product();
        if known == 0 || !total.is_multiple_of(known) {
            return Err(OnnxError::Shape(format!(
                "cannot reshape {dims:?} to {spec:?}"
            )));
        }
        out[i] = total / known;
    }
    Ok(out)
}

/// `Flatten` at `axis`: `[prod(dims[..axis]), prod(dims[axis..])]`.
pub fn flatten(x: Value, axis: usize) -> Result<Value, OnnxError> {
    let dims = x.onnx_dims();
    let axis = axis.min(dims.len());
    let outer = dims[..axis].iter().product();
    let inner = dims[axis..].iter().product();
    x.reshape(&[outer, inner])
}

/// `Transpose` by `perm` (reversed dimensions when empty).
pub fn transpose(x: Value, perm: &[i64]) -> Result<Value, OnnxError> {
    let rank = x.rank();
    let perm: Vec<usize> = if perm.is_empty() {
        (0..rank).rev().collect()
    } else {
        perm.iter()
            .map(|&p| axis_index(p, rank))
            .collect::<Result<_, _>>()?
    };
    if perm.len() != rank {
        return Err(OnnxError::Shape(format!(
            "transpose of rank {rank} with permutation {perm:?}"
        )));
    }
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        return Ok(x);
    }
    let kind = x.kind();
    Ok(with_rank!(rank, D => {
        let axes: [usize; D] = perm.as_slice().try_into().expect("length checked");
        match kind {
            ValueKind::Float => Value::float(x.f::<D>().permute(axes)),
            ValueKind::Int => Value::int(x.i::<D>().permute(axes)),
            ValueKind::Bool => Value::bool(x.b::<D>().permute(axes)),
        }
    }))
}

/// `Squeeze`: drops the listed 1-sized axes (every 1-sized axis when `axes` is `None`).
pub fn squeeze(x: Value, axes: Option<&[i64]>) -> Result<Value, OnnxError> {
    let dims = x.onnx_dims();
    let drop: Vec<usize> = match axes {
        Some(axes) => axes
            .iter()
            .map(|&a| axis_index(a, dims.len()))
            .collect::<Result<_, _>>()?,
        None => (0..dims.len()).filter(|&i| dims[i] == 1).collect(),
    };
    if let Some(&bad) = drop.iter().find(|&&i| dims[i] != 1) {
        return Err(OnnxError::Shape(format!(
            "cannot squeeze axis {bad} of size {} (shape {dims:?})",
            dims[bad]
        )));
    }
    let out: Vec<usize> = (0..dims.len())
        .filter(|i| !drop.contains(i))
        .map(|i| dims[i])
        .collect();
    x.reshape(&out)
}

/// `Unsqueeze`: inserts 1-sized axes at `axes` (positions in the output).
pub fn unsqueeze(x: Value, axes: &[i64]) -> Result<Value, OnnxError> {
    let dims = x.onnx_dims();
    let rank = dims.len() + axes.len();
    let mut at: Vec<usize> = axes
        .iter()
        .map(|&a| axis_index(a, rank))
        .collect::<Result<_, _>>()?;
    at.sort_unstable();
    let mut out = Vec::with_capacity(rank);
    let mut rest = dims.into_iter();
    for i in 0..rank {
        if at.binary_search(&i).is_ok() {
            out.push(1);
        } else {
            out.push(rest.next().ok_or_else(|| {
                OnnxError::Shape(format!("unsqueeze axes {axes:?} repeat an axis"))
            })?);
        }
    }
    x.reshape(&out)
}

/// `Concat` along `axis` (operands of mixed kinds are joined as floats).
pub fn concat(parts: Vec<Value>, axis: usize) -> Result<Value, OnnxError> {
    let kind = if parts.iter().any(|p| p.kind() == ValueKind::Float) {
        ValueKind::Float
    } else {
        parts.first().map(Value::kind).unwrap_or(ValueKind::Int)
    };
    let rank = parts.iter().map(Value::rank).max().unwrap_or(1);
    let parts: Vec<Value> = parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .map(|p| p.lift_to_rank(rank)?.to_kind(kind))
        .collect::<Result<_, _>>()?;
    if parts.is_empty() {
        return Err(OnnxError::Shape("concat of no non-empty inputs".into()));
    }
    if parts.len() == 1 {
        return Ok(parts.into_iter().next().expect("one part"));
    }
    Ok(with_rank!(rank, D => match kind {
        ValueKind::Float => Value::float(Tensor::cat(parts.into_iter().map(|p| p.f::<D>()).collect(), axis)),
        ValueKind::Int => Value::int(Tensor::cat(parts.into_iter().map(|p| p.i::<D>()).collect(), axis)),
        ValueKind::Bool => Value::bool(Tensor::cat(parts.into_iter().map(|p| p.b::<D>()).collect(), axis)),
    }))
}

/// Elements `start..start + len` along `axis`.
pub fn narrow(x: Value, axis: usize, start: usize, len: usize) -> Result<Value, OnnxError> {
    let kind = x.kind();
    Ok(with_rank!(x.rank(), D => match kind {
        ValueKind::Float => Value::float(x.f::<D>().narrow(axis, start, len)),
        ValueKind::Int => Value::int(x.i::<D>().narrow(axis, start, len)),
        ValueKind::Bool => Value::bool(x.b::<D>().narrow(axis, start, len)),
    }))
}

/// `Split` along `axis` into pieces of `sizes`.
pub fn split(x: Value, axis: usize, sizes: &[usize]) -> Result<Vec<Value>, OnnxError> {
    let dim = x.dims()[axis];
    if sizes.iter().sum::<usize>() != dim {
        return Err(OnnxError::Shape(format!(
            "split sizes {sizes:?} do not add up to dimension {axis} of size {dim}"
        )));
    }
    let mut at = 0;
    sizes
        .iter()
        .map(|&n| {
            let part = narrow(x.clone(), axis, at, n);
            at += n;
            part
        })
        .collect()
}

/// Sizes of `outputs` near-equal pieces of `dim` (the last one smaller), as ONNX splits.
pub fn even_split(dim: usize, outputs: usize) -> Vec<usize> {
    let outputs = outputs.max(1);
    let chunk = dim.div_ceil(outputs);
    let mut sizes = vec![chunk; outputs];
    let last = dim.saturating_sub(chunk * (outputs - 1));
    sizes[outputs - 1] = last;
    sizes
}

/// `Slice` with ONNX's clamping of `starts`/`ends` and negative `steps`.
pub fn slice(
    x: Value,
    starts: &[i64],
    ends: &[i64],
    axes: Option<&[i64]>,
    steps: Option<&[i64]>,
) -> Result<Value, OnnxError> {
    let dims = x.dims();
    let rank = dims.len();
    let mut ranges: Vec<Slice> = dims
        .iter()
        .map(|&d| Slice::new(0, Some(d as isize), 1))
        .collect();
    let mut flips = Vec::new();
    for (i, (&start, &end)) in starts.iter().zip(ends).enumerate() {
        let axis = match axes {
            Some(axes) => axis_index(*axes.get(i).unwrap_or(&(i as i64)), rank)?,
            None => i,
        };
        let step = steps.and_then(|s| s.get(i).copied()).unwrap_or(1);
        let d = dims[axis] as i64;
        if step == 0 {
            return Err(OnnxError::Shape("slice step 0".into()));
        }
        let norm = |v: i64| if v < 0 { v + d } else { v };
        if step > 0 {
            let r = slice_range(start, end, dims[axis]);
            ranges[axis] = Slice::new(r.start as isize, Some(r.end as isize), step as isize);
        } else {
            // Walk from `start` down to (not including) `end`; taken as the increasing
            // range with the same elements, then flipped.
            let s = norm(start).clamp(-1, d - 1);
            let e = norm(end).clamp(-1, d - 1);
            let n = if s > e { (s - e - 1) / -step + 1 } else { 0 };
            let low = s + step * (n - 1).max(0);
            let (lo, hi) = if n == 0 { (0, 0) } else { (low, s + 1) };
            ranges[axis] = Slice::new(lo as isize, Some(hi as isize), -step as isize);
            flips.push(axis);
        }
    }
    let kind = x.kind();
    let out = with_rank!(rank, D => match kind {
        ValueKind::Float => Value::float(x.f::<D>().slice(&ranges)),
        ValueKind::Int => Value::int(x.i::<D>().slice(&ranges)),
        ValueKind::Bool => Value::bool(x.b::<D>().slice(&ranges)),
    });
    flips.into_iter().try_fold(out, flip)
}

/// The elements a positive-step `Slice` from `start` to `end` (negative: from the end;
/// clamped to the axis) takes of an axis of `d`.
pub fn slice_range(start: i64, end: i64, d: usize) -> std::ops::Range<usize> {
    let d = d as i64;
    let norm = |v: i64| if v < 0 { v + d } else { v };
    let s = norm(start).clamp(0, d);
    s as usize..norm(end).clamp(s, d) as usize
}

/// The elements of `axis` in reverse order.
fn flip(x: Value, axis: usize) -> Result<Value, OnnxError> {
    let kind = x.kind();
    Ok(with_rank!(x.rank(), D => match kind {
        ValueKind::Float => Value::float(x.f::<D>().flip([axis])),
        ValueKind::Int => Value::int(x.i::<D>().flip([axis])),
        ValueKind::Bool => Value::bool(x.b::<D>().flip([axis])),
    }))
}

/// `Gather` along `axis`: the output's shape is `data[..axis] ++ indices ++ data[axis+1..]`.
/// Negative indices count from the end.
pub fn gather(data: Value, indices: Value, axis: usize) -> Result<Value, OnnxError> {
    let dims = data.dims();
    let size = dims[axis] as i64;
    let index_dims = indices.onnx_dims();
    let n = indices.len();
    let mut out: Vec<usize> = dims[..axis].to_vec();
    out.extend(&index_dims);
    out.extend(&dims[axis + 1..]);
    if n == 1 {
        // One index (a transformer's `select` of q, k or v, a class token): a narrowed view
        // of the data, no copy and no index arithmetic on tensors (ViT-B/16's 36 such
        // gathers took 2.3 ms per batch-1 run as `select`s, BENCHMARKS.md run 42).
        let i = indices.to_i64s()?[0];
        let at = if i < 0 { i + size } else { i };
        if !(0..size).contains(&at) {
            return Err(OnnxError::Shape(format!(
                "Gather index {i} outside axis {axis} of size {size}"
            )));
        }
        return narrow(data, axis, at as usize, 1)?.reshape(&out);
    }
    let flat = indices.to_kind(ValueKind::Int)?.reshape(&[n])?.i::<1>();
    let flat = flat
        .clone()
        .mask_where(flat.clone().lower_elem(0), flat + size);
    let kind = data.kind();
    let picked = with_rank!(data.rank(), D => match kind {
        ValueKind::Float => Value::float(data.f::<D>().select(axis, flat)),
        ValueKind::Int => Value::int(data.i::<D>().select(axis, flat)),
        ValueKind::Bool => Value::bool(data.b::<D>().select(axis, flat)),
    });
    picked.reshape(&out)
}

/// `x` broadcast to `dims` (same rank or lower).
pub fn expand_to(x: Value, dims: &[usize]) -> Result<Value, OnnxError> {
    let x = x.lift_to_rank(dims.len())?;
    if x.dims() == dims {
        return Ok(x);
    }
    let kind = x.kind();
    Ok(with_rank!(dims.len(), D => {
        let to: [usize; D] = dims.try_into().expect("length matched by with_rank");
        match kind {
            ValueKind::Float => Value::float(x.f::<D>().expand(to)),
            ValueKind::Int => Value::int(x.i::<D>().expand(to)),
            ValueKind::Bool => Value::bool(x.b::<D>().expand(to)),
        }
    }))
}

/// `Expand`: numpy broadcast of `x` with `shape`.
pub fn expand(x: Value, shape: &[i64]) -> Result<Value, OnnxError> {
    let rank = x.rank().max(shape.len());
    let x = x.lift_to_rank(rank)?;
    let mut target = vec![1usize; rank - shape.len()];
    target.extend(shape.iter().map(|&s| s.max(1) as usize));
    let dims = super::math::broadcast_dims(&x.dims(), &target)?;
    expand_to(x, &dims)
}

/// `ConstantOfShape`: `shape` filled with `value` (f32 zero when absent).
pub fn constant_of_shape(
    shape: &[i64],
    value: Option<&TensorData>,
    device: &Device,
) -> Result<Value, OnnxError> {
    let dims: Vec<usize> = shape.iter().map(|&s| s.max(0) as usize).collect();
    let n: usize = dims.iter().product();
    let (kind, fill) = match value {
        Some(v) => {
            let kind = super::super::value::kind_of(v.dtype())?;
            let f = v.iter::<f64>().next().unwrap_or(0.0);
            (kind, f)
        }
        None => (ValueKind::Float, 0.0),
    };
    let scalar = dims.is_empty();
    let dims = if scalar { vec![1] } else { dims };
    let data = match kind {
        ValueKind::Float => TensorData::new(vec![fill as f32; n.max(usize::from(scalar))], dims),
        ValueKind::Int => TensorData::new(vec![fill as i64; n.max(usize::from(scalar))], dims),
        ValueKind::Bool => TensorData::new(vec![fill != 0.0; n.max(usize::from(scalar))], dims),
    };
    Ok(Value::from_data(data, device)?.with_scalar(scalar))
}

/// `Range(start, limit, delta)` as integers or floats.
pub fn range(
    start: f64,
    limit: f64,
    delta: f64,
    int: bool,
    device: &Device,
) -> Result<Value, OnnxError> {
    if delta == 0.0 {
        return Err(OnnxError::Shape("range with delta 0".into()));
    }
    let n = ((limit - start) / delta).ceil().max(0.0) as usize;
    if n > 1 << 28 {
        return Err(OnnxError::Shape(format!("range of {n} elements")));
    }
    Ok(if int {
        let (s, d) = (start as i64, delta as i64);
        Value::from_i64((0..n as i64).map(|i| s + i * d).collect(), false, device)
    } else {
        let v: Vec<f32> = (0..n).map(|i| (start + i as f64 * delta) as f32).collect();
        Value::float(Tensor::<1>::from_data(TensorData::new(v, [n]), device))
    })
}

/// `Pad` with per-axis `(begin, end)` amounts.
pub fn pad(x: Value, pads: &[(usize, usize)], mode: PadMode) -> Result<Value, OnnxError> {
    let rank = x.rank();
    if pads.len() > rank {
        return Err(OnnxError::Shape(format!(
            "{} pad pairs for rank {rank}",
            pads.len()
        )));
    }
    if pads.iter().all(|&p| p == (0, 0)) {
        return Ok(x);
    }
    let mut full = vec![(0, 0); rank - pads.len()];
    full.extend_from_slice(pads);
    let x = x.to_kind(ValueKind::Float)?;
    Ok(with_rank!(rank, D => Value::float(x.f::<D>().pad(full.clone(), mode))))
}

/// `Size`: the element count as a scalar.
pub fn size(x: &Value, device: &Device) -> Value {
    Value::from_i64(vec![x.len() as i64], true, device)
}
