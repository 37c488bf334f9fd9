//! Per-sample normalizations: InstanceNormalization (what PyTorch's InstanceNorm and
//! GroupNorm both export to) and GroupNormalization.

use super::super::OnnxError;
use super::super::value::{Value, ValueKind};

/// Normalizes each of `rows` rows of `x` (reshaped `[rows, len]`) to zero mean and unit
/// variance (biased, as every ONNX normalization), then scales and shifts per channel:
/// `x` is `[N, C, ...]`, `scale`/`bias` hold one value per channel.
fn normalize_rows(
    x: Value,
    rows: usize,
    scale: Value,
    bias: Value,
    epsilon: f64,
    what: &str,
) -> Result<Value, OnnxError> {
    let dims = x.dims();
    if dims.len() < 2 {
        return Err(OnnxError::Shape(format!(
            "{what} takes [N, C, ...]; got {dims:?}"
        )));
    }
    let (n, c) = (dims[0], dims[1]);
    let total: usize = dims.iter().product();
    if rows == 0 || !total.is_multiple_of(rows) {
        return Err(OnnxError::Shape(format!("{what}: {dims:?} in {rows} rows")));
    }
    let x2 = x
        .to_kind(ValueKind::Float)?
        .reshape(&[rows, total / rows])?
        .f::<2>();
    let mean = x2.clone().mean_dim(1);
    let centered = x2 - mean;
    let var = centered.clone().powf_scalar(2.0).mean_dim(1);
    let normed = centered / (var + epsilon).sqrt();
    let spatial = total / (n * c).max(1);
    let per_channel = |v: Value, name: &str| -> Result<_, OnnxError> {
        if v.len() != c {
            return Err(OnnxError::Shape(format!(
                "{what}: {name} of {} values for {c} channels",
                v.len()
            )));
        }
        Ok(v.to_kind(ValueKind::Float)?.reshape(&[1, c, 1])?.f::<3>())
    };
    let (scale, bias) = (per_channel(scale, "scale")?, per_channel(bias, "bias")?);
    let y = normed.reshape([n, c, spatial]) * scale + bias;
    Value::float(y).reshape(&dims)
}

/// `InstanceNormalization`: each (sample, channel) plane normalized on its own.
pub fn instance_norm(
    x: Value,
    scale: Value,
    bias: Value,
    epsilon: f64,
) -> Result<Value, OnnxError> {
    let dims = x.dims();
    let rows = dims.iter().take(2).product();
    normalize_rows(x, rows, scale, bias, epsilon, "InstanceNormalization")
}

/// `GroupNormalization`: each sample's channels normalized in `groups` groups; `scale` and
/// `bias` per channel (opset 21) or per group (opset 18, expanded to the channels).
pub fn group_norm(
    x: Value,
    scale: Value,
    bias: Value,
    groups: usize,
    epsilon: f64,
) -> Result<Value, OnnxError> {
    let dims = x.dims();
    let (n, c) = (
        dims.first().copied().unwrap_or(0),
        dims.get(1).copied().unwrap_or(0),
    );
    if groups == 0 || !c.is_multiple_of(groups) {
        return Err(OnnxError::Shape(format!(
            "GroupNormalization: {c} channels in {groups} groups"
        )));
    }
    let expand = |v: Value| -> Result<Value, OnnxError> {
        if v.len() == groups && groups != c {
            let g = v.to_kind(ValueKind::Float)?.reshape(&[groups, 1])?.f::<2>();
            Value::float(g.repeat(&[1, c / groups])).reshape(&[c])
        } else {
            Ok(v)
        }
    };
    normalize_rows(
        x,
        n * groups,
        expand(scale)?,
        expand(bias)?,
        epsilon,
        "GroupNormalization",
    )
}
