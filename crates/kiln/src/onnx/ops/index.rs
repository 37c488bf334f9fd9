//! Indexing operators on the host: GatherElements, ScatterElements, GatherND, ScatterND,
//! TopK, CumSum, OneHot, NonZero, plus Tile, Trilu and DepthToSpace/SpaceToDepth on Burn's
//! tensors.
//!
//! The host operators read their operands once, index in plain loops and upload the
//! result: their tensors are index-sized (a model's masks, its top-k, a slot written in
//! place), and the exact ONNX semantics — negative indices, reductions, tie order — are
//! easier to state over flat buffers than over Burn's per-rank calls.

use burn::tensor::{Device, TensorData};
use onnx_ir::node::depth_to_space::DepthToSpaceMode;

use super::super::OnnxError;
use super::super::value::{Value, ValueKind, with_rank};
use super::shape;

/// A value's elements on the host, of the kind it holds.
#[derive(Debug, Clone)]
pub enum Elems {
    /// Floats.
    F(Vec<f32>),
    /// Integers.
    I(Vec<i64>),
    /// Booleans.
    B(Vec<bool>),
}

/// A value read to the host: its ONNX dimensions and elements.
#[derive(Debug, Clone)]
pub struct Host {
    /// ONNX dimensions (`[]` for a scalar).
    pub dims: Vec<usize>,
    /// The elements in row-major order.
    pub elems: Elems,
}

/// Applies `$body` to the element vector of `$elems` whatever its kind, rebuilding the same
/// kind (`$v` is bound mutably).
macro_rules! each_kind {
    ($elems:expr, $v:ident => $body:expr) => {
        match $elems {
            Elems::F($v) => Elems::F($body),
            Elems::I($v) => Elems::I($body),
            Elems::B($v) => Elems::B($body),
        }
    };
}

impl Host {
    /// Reads `v` to the host.
    pub fn read(v: &Value) -> Result<Self, OnnxError> {
        let dims = v.onnx_dims();
        let data = v.data()?;
        let fail = |e| OnnxError::Shape(format!("reading a tensor to the host: {e:?}"));
        let elems = match v.kind() {
            ValueKind::Float => Elems::F(data.convert::<f32>().try_into_vec().map_err(fail)?),
            ValueKind::Int => Elems::I(data.convert::<i64>().try_into_vec().map_err(fail)?),
            ValueKind::Bool => Elems::B(data.convert::<bool>().try_into_vec().map_err(fail)?),
        };
        Ok(Host { dims, elems })
    }

    /// Uploads to `device`.
    pub fn upload(self, device: &Device) -> Result<Value, OnnxError> {
        let dims = self.dims;
        let data = match self.elems {
            Elems::F(v) => TensorData::new(v, dims),
            Elems::I(v) => TensorData::new(v, dims),
            Elems::B(v) => TensorData::new(v, dims),
        };
        Value::from_data(data, device)
    }

    fn len(&self) -> usize {
        self.dims.iter().product()
    }
}

/// Row-major strides of `dims`.
pub fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// An index into an axis of `dim` values, negative counting from the end.
fn wrap(i: i64, dim: usize, what: &str) -> Result<usize, OnnxError> {
    let j = if i < 0 { i + dim as i64 } else { i };
    if j < 0 || j >= dim as i64 {
        return Err(OnnxError::Shape(format!(
            "{what}: index {i} is out of range for an axis of {dim}"
        )));
    }
    Ok(j as usize)
}

fn check_rank(a: &[usize], b: &[usize], what: &str) -> Result<(), OnnxError> {
    if a.len() != b.len() {
        return Err(OnnxError::Shape(format!(
            "{what}: operands of ranks {} and {} ({a:?}, {b:?})",
            a.len(),
            b.len()
        )));
    }
    Ok(())
}

/// For each flat position of `dims`, the flat offset in a tensor of `strides` with axis
/// `axis` replaced by `pick(position)`.
fn remap_axis(
    dims: &[usize],
    source_strides: &[usize],
    axis: usize,
    mut pick: impl FnMut(usize) -> Result<usize, OnnxError>,
) -> Result<Vec<usize>, OnnxError> {
    let n: usize = dims.iter().product();
    let own = strides(dims);
    let mut out = Vec::with_capacity(n);
    for flat in 0..n {
        let mut offset = 0;
        for (d, (&s, &t)) in own.iter().zip(source_strides).enumerate() {
            let coord = (flat / s) % dims[d];
            offset += if d == axis {
                pick(flat)? * t
            } else {
                coord * t
            };
        }
        out.push(offset);
    }
    Ok(out)
}

/// `GatherElements`: `out[i…] = data[i… with axis replaced by indices[i…]]`.
pub fn gather_elements(data: Value, indices: Value, axis: usize) -> Result<Value, OnnxError> {
    let device = data.device();
    let d = Host::read(&data)?;
    let idx = indices.to_i64s()?;
    let idims = indices.onnx_dims();
    check_rank(&d.dims, &idims, "GatherElements")?;
    let dim = d.dims[axis];
    let offsets = remap_axis(&idims, &strides(&d.dims), axis, |f| {
        wrap(idx[f], dim, "GatherElements")
    })?;
    let elems = each_kind!(d.elems, v => offsets.iter().map(|&o| v[o]).collect());
    Host { dims: idims, elems }.upload(&device)
}

/// How a scatter combines an update with the value in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// The update replaces the value.
    None,
    /// Sum.
    Add,
    /// Product.
    Mul,
    /// Larger of the two.
    Max,
    /// Smaller of the two.
    Min,
}

fn combine_f(r: Reduction, a: f32, b: f32) -> f32 {
    match r {
        Reduction::None => b,
        Reduction::Add => a + b,
        Reduction::Mul => a * b,
        Reduction::Max => a.max(b),
        Reduction::Min => a.min(b),
    }
}

fn combine_i(r: Reduction, a: i64, b: i64) -> i64 {
    match r {
        Reduction::None => b,
        Reduction::Add => a.wrapping_add(b),
        Reduction::Mul => a.wrapping_mul(b),
        Reduction::Max => a.max(b),
        Reduction::Min => a.min(b),
    }
}

/// Writes `updates` into a copy of `data` at the flat `offsets` (one per update).
fn scatter_into(
    data: Host,
    updates: Host,
    offsets: &[usize],
    reduction: Reduction,
) -> Result<Host, OnnxError> {
    let elems = match (data.elems, updates.elems) {
        (Elems::F(mut v), Elems::F(u)) => {
            for (&o, &x) in offsets.iter().zip(&u) {
                v[o] = combine_f(reduction, v[o], x);
            }
            Elems::F(v)
        }
        (Elems::I(mut v), Elems::I(u)) => {
            for (&o, &x) in offsets.iter().zip(&u) {
                v[o] = combine_i(reduction, v[o], x);
            }
            Elems::I(v)
        }
        (Elems::B(mut v), Elems::B(u)) => {
            for (&o, &x) in offsets.iter().zip(&u) {
                v[o] = match reduction {
                    Reduction::Add | Reduction::Max => v[o] | x,
                    Reduction::Mul | Reduction::Min => v[o] & x,
                    Reduction::None => x,
                };
            }
            Elems::B(v)
        }
        _ => {
            return Err(OnnxError::Shape(
                "a scatter's updates differ in element type from its data".into(),
            ));
        }
    };
    Ok(Host {
        dims: data.dims,
        elems,
    })
}

fn same_kind(updates: Value, data: &Value) -> Result<Value, OnnxError> {
    updates.to_kind(data.kind())
}

/// `ScatterElements`: a copy of `data` with `data[i… with axis replaced by indices[i…]]`
/// combined with `updates[i…]`.
pub fn scatter_elements(
    data: Value,
    indices: Value,
    updates: Value,
    axis: usize,
    reduction: Reduction,
) -> Result<Value, OnnxError> {
    let device = data.device();
    let updates = same_kind(updates, &data)?;
    let d = Host::read(&data)?;
    let u = Host::read(&updates)?;
    let idx = indices.to_i64s()?;
    check_rank(&d.dims, &u.dims, "ScatterElements")?;
    if idx.len() != u.len() {
        return Err(OnnxError::Shape(format!(
            "ScatterElements: {} indices for {} updates",
            idx.len(),
            u.len()
        )));
    }
    let dim = d.dims[axis];
    let offsets = remap_axis(&u.dims, &strides(&d.dims), axis, |f| {
        wrap(idx[f], dim, "ScatterElements")
    })?;
    scatter_into(d, u, &offsets, reduction)?.upload(&device)
}

/// The flat offsets and slice length GatherND / ScatterND address: `indices`'s last axis
/// (length `k`) indexes `data`'s first `k` axes after `batch_dims` batch axes.
fn nd_offsets(
    data_dims: &[usize],
    idims: &[usize],
    idx: &[i64],
    batch_dims: usize,
    what: &str,
) -> Result<(Vec<usize>, usize), OnnxError> {
    let k = *idims
        .last()
        .ok_or_else(|| OnnxError::Shape(format!("{what}: indices of rank 0")))?;
    if batch_dims + k > data_dims.len() || batch_dims >= idims.len() {
        return Err(OnnxError::Shape(format!(
            "{what}: indices {idims:?} with {batch_dims} batch axes do not fit data {data_dims:?}"
        )));
    }
    let ds = strides(data_dims);
    let slice: usize = data_dims[batch_dims + k..].iter().product();
    let batch: usize = idims[..batch_dims].iter().product();
    let per_batch: usize = idims[batch_dims..idims.len() - 1].iter().product();
    let batch_stride = if batch_dims == 0 {
        0
    } else {
        ds[batch_dims - 1]
    };
    let mut offsets = Vec::with_capacity(batch * per_batch);
    for b in 0..batch {
        for j in 0..per_batch {
            let tuple = &idx[(b * per_batch + j) * k..][..k];
            let mut o = b * batch_stride;
            for (a, &i) in tuple.iter().enumerate() {
                o += wrap(i, data_dims[batch_dims + a], what)? * ds[batch_dims + a];
            }
            offsets.push(o);
        }
    }
    Ok((offsets, slice))
}

/// `GatherND` (with `batch_dims`).
pub fn gather_nd(data: Value, indices: Value, batch_dims: usize) -> Result<Value, OnnxError> {
    let device = data.device();
    let d = Host::read(&data)?;
    let idims = indices.onnx_dims();
    let idx = indices.to_i64s()?;
    let (offsets, slice) = nd_offsets(&d.dims, &idims, &idx, batch_dims, "GatherND")?;
    let k = idims[idims.len() - 1];
    let mut dims = idims[..idims.len() - 1].to_vec();
    dims.extend_from_slice(&d.dims[batch_dims + k..]);
    let elems = each_kind!(d.elems, v => offsets
        .iter()
        .flat_map(|&o| v[o..o + slice].iter().copied())
        .collect());
    Host { dims, elems }.upload(&device)
}

/// `ScatterND`: a copy of `data` with each indexed slice combined with its update.
pub fn scatter_nd(
    data: Value,
    indices: Value,
    updates: Value,
    reduction: Reduction,
) -> Result<Value, OnnxError> {
    let device = data.device();
    let updates = same_kind(updates, &data)?;
    let d = Host::read(&data)?;
    let u = Host::read(&updates)?;
    let idims = indices.onnx_dims();
    let idx = indices.to_i64s()?;
    let (starts, slice) = nd_offsets(&d.dims, &idims, &idx, 0, "ScatterND")?;
    if starts.len() * slice != u.len() {
        return Err(OnnxError::Shape(format!(
            "ScatterND: updates {:?} for {} slices of {slice}",
            u.dims,
            starts.len()
        )));
    }
    let offsets: Vec<usize> = starts
        .iter()
        .flat_map(|&s| (s..s + slice).collect::<Vec<_>>())
        .collect();
    scatter_into(d, u, &offsets, reduction)?.upload(&device)
}

/// `TopK`: the `k` largest (or smallest) along `axis` and their indices; ties keep the
/// lower index first, as ONNX specifies.
pub fn top_k(x: Value, k: usize, axis: usize, largest: bool) -> Result<Vec<Value>, OnnxError> {
    let device = x.device();
    let kind = x.kind();
    let dims = x.onnx_dims();
    let dim = *dims
        .get(axis)
        .ok_or_else(|| OnnxError::Shape(format!("TopK axis {axis} of {dims:?}")))?;
    if k > dim {
        return Err(OnnxError::Shape(format!(
            "TopK: k = {k} exceeds the axis's {dim} values"
        )));
    }
    let values = x.to_kind(ValueKind::Float)?.to_f32s()?;
    let inner: usize = dims[axis + 1..].iter().product();
    let outer: usize = dims[..axis].iter().product();
    let mut out_v = vec![0f32; outer * k * inner];
    let mut out_i = vec![0i64; outer * k * inner];
    let mut order: Vec<usize> = Vec::with_capacity(dim);
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| values[(o * dim + j) * inner + i];
            order.clear();
            order.extend(0..dim);
            // NaN counts as the largest value (as ONNX Runtime orders it).
            let key = |j: usize| {
                let v = at(j);
                if v.is_nan() { f32::INFINITY } else { v }
            };
            order.sort_by(|&a, &b| {
                let c = key(a).total_cmp(&key(b));
                let c = if largest { c.reverse() } else { c };
                c.then(a.cmp(&b))
            });
            for (r, &j) in order.iter().take(k).enumerate() {
                out_v[(o * k + r) * inner + i] = at(j);
                out_i[(o * k + r) * inner + i] = j as i64;
            }
        }
    }
    let mut out_dims = dims;
    out_dims[axis] = k;
    let v = Host {
        dims: out_dims.clone(),
        elems: Elems::F(out_v),
    }
    .upload(&device)?
    .to_kind(kind)?;
    let i = Host {
        dims: out_dims,
        elems: Elems::I(out_i),
    }
    .upload(&device)?;
    Ok(vec![v, i])
}

/// `CumSum` along `axis`, optionally exclusive and/or reversed.
pub fn cum_sum(x: Value, axis: usize, exclusive: bool, reverse: bool) -> Result<Value, OnnxError> {
    let device = x.device();
    let h = Host::read(&x)?;
    let dims = h.dims.clone();
    let dim = *dims
        .get(axis)
        .ok_or_else(|| OnnxError::Shape(format!("CumSum axis {axis} of {dims:?}")))?;
    let inner: usize = dims[axis + 1..].iter().product();
    let outer: usize = dims[..axis].iter().product();
    macro_rules! scan {
        ($v:ident, $zero:expr) => {{
            let mut out = $v.clone();
            for o in 0..outer {
                for i in 0..inner {
                    let mut acc = $zero;
                    for step in 0..dim {
                        let j = if reverse { dim - 1 - step } else { step };
                        let at = (o * dim + j) * inner + i;
                        if exclusive {
                            out[at] = acc;
                            acc += $v[at];
                        } else {
                            acc += $v[at];
                            out[at] = acc;
                        }
                    }
                }
            }
            out
        }};
    }
    let elems = match h.elems {
        Elems::F(v) => Elems::F(scan!(v, 0f32)),
        Elems::I(v) => Elems::I(scan!(v, 0i64)),
        Elems::B(_) => return Err(OnnxError::Unsupported("CumSum of booleans".into())),
    };
    Host { dims, elems }.upload(&device)
}

/// `OneHot`: `values[1]` where the index (negative counting from `depth`) equals the
/// position on the new axis, `values[0]` elsewhere; out-of-range indices give a row of
/// `values[0]`.
pub fn one_hot(
    indices: Value,
    depth: usize,
    values: [f32; 2],
    axis: i64,
    kind: ValueKind,
) -> Result<Value, OnnxError> {
    let device = indices.device();
    let idims = indices.onnx_dims();
    let idx = indices.to_kind(ValueKind::Float)?.to_f32s()?;
    let rank = idims.len() + 1;
    let axis = shape::axis_index(axis, rank)?;
    let outer: usize = idims[..axis].iter().product();
    let inner: usize = idims[axis..].iter().product();
    let mut out = vec![values[0]; outer * depth * inner];
    for o in 0..outer {
        for i in 0..inner {
            let raw = idx[o * inner + i] as i64;
            let j = if raw < 0 { raw + depth as i64 } else { raw };
            if (0..depth as i64).contains(&j) {
                out[(o * depth + j as usize) * inner + i] = values[1];
            }
        }
    }
    let mut dims = idims;
    dims.insert(axis, depth);
    Host {
        dims,
        elems: Elems::F(out),
    }
    .upload(&device)?
    .to_kind(kind)
}

/// `NonZero`: the coordinates of the non-zero elements, `[rank, count]`, in row-major order.
pub fn non_zero(x: Value) -> Result<Value, OnnxError> {
    let device = x.device();
    let dims = x.onnx_dims();
    let flags: Vec<bool> = x.to_kind(ValueKind::Bool)?.data().and_then(|d| {
        d.convert::<bool>()
            .try_into_vec()
            .map_err(|e| OnnxError::Shape(format!("{e:?}")))
    })?;
    let st = strides(&dims);
    let hits: Vec<usize> = (0..flags.len()).filter(|&f| flags[f]).collect();
    let rank = dims.len().max(1);
    let mut out = vec![0i64; rank * hits.len()];
    for (n, &f) in hits.iter().enumerate() {
        for d in 0..dims.len() {
            out[d * hits.len() + n] = ((f / st[d]) % dims[d]) as i64;
        }
    }
    Host {
        dims: vec![rank, hits.len()],
        elems: Elems::I(out),
    }
    .upload(&device)
}

/// `Tile`: each axis repeated `repeats[axis]` times.
pub fn tile(x: Value, repeats: &[usize]) -> Result<Value, OnnxError> {
    let rank = x.rank();
    if repeats.len() != rank {
        return Err(OnnxError::Shape(format!(
            "Tile: {} repeats for a rank-{rank} input",
            repeats.len()
        )));
    }
    let kind = x.kind();
    let scalar = x.is_scalar();
    Ok(with_rank!(rank, D => match kind {
        ValueKind::Float => Value::float(x.f::<D>().repeat(repeats)),
        ValueKind::Int => Value::int(x.i::<D>().repeat(repeats)),
        ValueKind::Bool => Value::bool(x.b::<D>().repeat(repeats)),
    })
    .with_scalar(scalar))
}

/// `Trilu`: the upper (or lower) triangle of the last two axes from diagonal `k`, zeros
/// elsewhere.
pub fn trilu(x: Value, upper: bool, k: i64) -> Result<Value, OnnxError> {
    let rank = x.rank();
    if rank < 2 {
        return Err(OnnxError::Shape(format!(
            "Trilu takes a tensor of rank ≥ 2; got {:?}",
            x.dims()
        )));
    }
    let kind = x.kind();
    let x = if kind == ValueKind::Bool {
        x.to_kind(ValueKind::Int)?
    } else {
        x
    };
    let out = with_rank!(rank, D => match x.kind() {
        ValueKind::Float => {
            let t = x.f::<D>();
            Value::float(if upper { t.triu(k) } else { t.tril(k) })
        }
        _ => {
            let t = x.i::<D>();
            Value::int(if upper { t.triu(k) } else { t.tril(k) })
        }
    });
    out.to_kind(kind)
}

/// `DepthToSpace` (DCR or CRD order) of an `[N, C, H, W]` tensor.
pub fn depth_to_space(x: Value, block: usize, mode: DepthToSpaceMode) -> Result<Value, OnnxError> {
    let [n, c, h, w] = four(&x, "DepthToSpace")?;
    let b = block;
    if b == 0 || !c.is_multiple_of(b * b) {
        return Err(OnnxError::Shape(format!(
            "DepthToSpace: {c} channels do not divide into blocks of {b}×{b}"
        )));
    }
    let cc = c / (b * b);
    let (split, perm): (Vec<usize>, [i64; 6]) = match mode {
        DepthToSpaceMode::Dcr => (vec![n, b, b, cc, h, w], [0, 3, 4, 1, 5, 2]),
        DepthToSpaceMode::Crd => (vec![n, cc, b, b, h, w], [0, 1, 4, 2, 5, 3]),
    };
    let y = shape::transpose(x.reshape(&split)?, &perm)?;
    y.reshape(&[n, cc, h * b, w * b])
}

/// `SpaceToDepth` of an `[N, C, H, W]` tensor (the inverse of DCR DepthToSpace).
pub fn space_to_depth(x: Value, block: usize) -> Result<Value, OnnxError> {
    let [n, c, h, w] = four(&x, "SpaceToDepth")?;
    let b = block;
    if b == 0 || !h.is_multiple_of(b) || !w.is_multiple_of(b) {
        return Err(OnnxError::Shape(format!(
            "SpaceToDepth: {h}×{w} does not divide into blocks of {b}×{b}"
        )));
    }
    let y = shape::transpose(x.reshape(&[n, c, h / b, b, w / b, b])?, &[0, 3, 5, 1, 2, 4])?;
    y.reshape(&[n, c * b * b, h / b, w / b])
}

fn four(x: &Value, what: &str) -> Result<[usize; 4], OnnxError> {
    x.dims()
        .try_into()
        .map_err(|d: Vec<usize>| OnnxError::Shape(format!("{what} takes [N, C, H, W]; got {d:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floats(v: Vec<f32>, dims: &[usize]) -> Value {
        Value::from_data(TensorData::new(v, dims.to_vec()), &Device::default()).unwrap()
    }

    fn ints(v: Vec<i64>, dims: &[usize]) -> Value {
        Value::from_data(TensorData::new(v, dims.to_vec()), &Device::default()).unwrap()
    }

    #[test]
    fn gather_and_scatter_elements_follow_the_onnx_examples() {
        // ONNX's GatherElements example 1 (axis 1) and ScatterElements example 2.
        let data = floats(vec![1., 2., 3., 4.], &[2, 2]);
        let out = gather_elements(data, ints(vec![0, 0, 1, 0], &[2, 2]), 1).unwrap();
        assert_eq!(out.to_f32s().unwrap(), vec![1., 1., 4., 3.]);
        let data = floats(vec![1., 2., 3., 4., 5.], &[1, 5]);
        let out = scatter_elements(
            data,
            ints(vec![1, 3], &[1, 2]),
            floats(vec![1.1, 2.1], &[1, 2]),
            1,
            Reduction::None,
        )
        .unwrap();
        assert_eq!(out.to_f32s().unwrap(), vec![1., 1.1, 3., 2.1, 5.]);
        let data = floats(vec![1., 2., 3., 4., 5.], &[1, 5]);
        let out = scatter_elements(
            data,
            ints(vec![1, -4], &[1, 2]),
            floats(vec![1.0, 2.0], &[1, 2]),
            1,
            Reduction::Add,
        )
        .unwrap();
        assert_eq!(out.to_f32s().unwrap(), vec![1., 5., 3., 4., 5.]);
    }

    #[test]
    fn gather_nd_and_scatter_nd_follow_the_onnx_examples() {
        // GatherND example 3: data [2,2,2], indices [[[0,1]],[[1,0]]] -> [[[2,3]],[[4,5]]].
        let data = ints((0..8).collect(), &[2, 2, 2]);
        let out = gather_nd(data.clone(), ints(vec![0, 1, 1, 0], &[2, 1, 2]), 0).unwrap();
        assert_eq!(out.dims(), vec![2, 1, 2]);
        assert_eq!(out.to_i64s().unwrap(), vec![2, 3, 4, 5]);
        // batch_dims = 1: indices [[1],[0]] -> [[2,3],[4,5]].
        let out = gather_nd(data, ints(vec![1, 0], &[2, 1]), 1).unwrap();
        assert_eq!(out.to_i64s().unwrap(), vec![2, 3, 4, 5]);
        // ScatterND example 1.
        let data = floats((1..=8).map(|v| v as f32).collect(), &[8]);
        let out = scatter_nd(
            data,
            ints(vec![4, 3, 1, 7], &[4, 1]),
            floats(vec![9., 10., 11., 12.], &[4]),
            Reduction::None,
        )
        .unwrap();
        assert_eq!(
            out.to_f32s().unwrap(),
            vec![1., 11., 3., 10., 9., 6., 7., 12.]
        );
    }

    #[test]
    fn top_k_keeps_the_lower_index_on_ties_and_cum_sum_scans_both_ways() {
        let x = floats(vec![1., 3., 3., 2., 0., 5.], &[2, 3]);
        let out = top_k(x, 2, 1, true).unwrap();
        assert_eq!(out[0].to_f32s().unwrap(), vec![3., 3., 5., 2.]);
        assert_eq!(out[1].to_i64s().unwrap(), vec![1, 2, 2, 0]);
        let x = floats(vec![1., 2., 3.], &[3]);
        let c = |e, r| cum_sum(x.clone(), 0, e, r).unwrap().to_f32s().unwrap();
        assert_eq!(c(false, false), vec![1., 3., 6.]);
        assert_eq!(c(true, false), vec![0., 1., 3.]);
        assert_eq!(c(false, true), vec![6., 5., 3.]);
        assert_eq!(c(true, true), vec![5., 3., 0.]);
    }

    #[test]
    fn one_hot_non_zero_and_depth_to_space() {
        let out = one_hot(
            ints(vec![1, -1, 7], &[3]),
            3,
            [0., 1.],
            -1,
            ValueKind::Float,
        )
        .unwrap();
        assert_eq!(
            out.to_f32s().unwrap(),
            vec![0., 1., 0., 0., 0., 1., 0., 0., 0.]
        );
        let nz = non_zero(floats(vec![1., 0., 0., 2.], &[2, 2])).unwrap();
        assert_eq!(nz.dims(), vec![2, 2]);
        assert_eq!(nz.to_i64s().unwrap(), vec![0, 1, 0, 1]);
        // PixelShuffle(2) on 4 channels of 1×1 (CRD): the channels become a 2×2 block.
        let x = floats(vec![1., 2., 3., 4.], &[1, 4, 1, 1]);
        let y = depth_to_space(x.clone(), 2, DepthToSpaceMode::Crd).unwrap();
        assert_eq!(y.dims(), vec![1, 1, 2, 2]);
        assert_eq!(y.to_f32s().unwrap(), vec![1., 2., 3., 4.]);
        let back = space_to_depth(y, 2).unwrap();
        assert_eq!(back.to_f32s().unwrap(), vec![1., 2., 3., 4.]);
    }
}
