//! Element-wise operators: arithmetic and comparisons with numpy broadcasting, activations,
//! and `Where`.

use burn::tensor::Tensor;
use burn::tensor::activation;

use super::super::OnnxError;
use super::super::value::{Value, ValueKind, with_rank};

/// A two-operand element-wise operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    /// ONNX `Mod` with `fmod = 0` (the result takes the divisor's sign).
    Mod,
    /// ONNX `Mod` with `fmod = 1` (the result takes the dividend's sign).
    Fmod,
    Max,
    Min,
    Equal,
    Less,
    LessOrEqual,
    Greater,
    GreaterOrEqual,
    And,
    Or,
    Xor,
}

impl Binary {
    fn is_logical(self) -> bool {
        matches!(self, Binary::And | Binary::Or | Binary::Xor)
    }
}

/// Brings `a` and `b` to one rank (leading 1s), keeping the scalar mark only when both are.
fn same_rank(a: Value, b: Value) -> Result<(Value, Value, bool), OnnxError> {
    let scalar = a.is_scalar() && b.is_scalar();
    let rank = a.rank().max(b.rank());
    Ok((a.lift_to_rank(rank)?, b.lift_to_rank(rank)?, scalar))
}

/// The numpy-broadcast shape of `a` and `b` (same rank).
pub fn broadcast_dims(a: &[usize], b: &[usize]) -> Result<Vec<usize>, OnnxError> {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| match (x, y) {
            (x, y) if x == y => Ok(x),
            (1, y) => Ok(y),
            (x, 1) => Ok(x),
            _ => Err(OnnxError::Shape(format!(
                "shapes {a:?} and {b:?} do not broadcast"
            ))),
        })
        .collect()
}

/// `a op b` with numpy broadcasting. Mixed int/float operands compute in float; comparisons
/// give booleans.
pub fn binary(op: Binary, a: Value, b: Value) -> Result<Value, OnnxError> {
    if op == Binary::Pow {
        return pow(a, b);
    }
    let (a, b, scalar) = same_rank(a, b)?;
    broadcast_dims(&a.dims(), &b.dims())?;
    let kind = if op.is_logical() {
        ValueKind::Bool
    } else if a.kind() == ValueKind::Float || b.kind() == ValueKind::Float {
        ValueKind::Float
    } else {
        ValueKind::Int
    };
    let (a, b) = (a.to_kind(kind)?, b.to_kind(kind)?);
    let out = with_rank!(a.rank(), D => match kind {
        ValueKind::Float => float_binary::<D>(op, a.f::<D>(), b.f::<D>()),
        ValueKind::Int => int_binary::<D>(op, a, b),
        ValueKind::Bool => bool_binary::<D>(op, a, b),
    });
    Ok(out?.with_scalar(scalar))
}

/// The comparison arms shared by every kind: `Some(bool tensor)` for a comparison.
macro_rules! compare {
    ($op:expr, $a:expr, $b:expr) => {
        match $op {
            Binary::Equal => Some($a.equal($b)),
            Binary::Less => Some($a.lower($b)),
            Binary::LessOrEqual => Some($a.lower_equal($b)),
            Binary::Greater => Some($a.greater($b)),
            Binary::GreaterOrEqual => Some($a.greater_equal($b)),
            _ => None,
        }
    };
}

fn float_binary<const D: usize>(
    op: Binary,
    a: Tensor<D>,
    b: Tensor<D>,
) -> Result<Value, OnnxError> {
    Ok(match op {
        Binary::Add => Value::float(a + b),
        Binary::Sub => Value::float(a - b),
        Binary::Mul => Value::float(a * b),
        Binary::Div => Value::float(a / b),
        Binary::Mod => Value::float(a.remainder(b)),
        Binary::Fmod => Value::float(a.fmod(b)),
        Binary::Max => Value::float(a.max_pair(b)),
        Binary::Min => Value::float(a.min_pair(b)),
        _ => match compare!(op, a, b) {
            Some(mask) => Value::bool(mask),
            None => unreachable!("Pow and the logical operators are handled by binary()"),
        },
    })
}

fn int_binary<const D: usize>(op: Binary, a: Value, b: Value) -> Result<Value, OnnxError> {
    let (a, b) = (a.i::<D>(), b.i::<D>());
    Ok(match op {
        Binary::Add => Value::int(a + b),
        Binary::Sub => Value::int(a - b),
        Binary::Mul => Value::int(a * b),
        // ONNX integer division truncates toward zero, as Rust's does; Burn's integer
        // division floors, which differs for operands of opposite signs.
        Binary::Div => {
            let q = a.clone().float().div(b.clone().float());
            Value::int(
                q.clone()
                    .floor()
                    .mask_where(q.clone().lower_elem(0.0), q.ceil())
                    .int(),
            )
        }
        Binary::Mod => Value::int(a.remainder(b)),
        Binary::Fmod => {
            let r = a.clone().remainder(b.clone());
            // remainder takes the divisor's sign; fmod the dividend's.
            let fix = r
                .clone()
                .not_equal_elem(0)
                .bool_and(a.lower_elem(0).not_equal(b.clone().lower_elem(0)));
            Value::int(r.clone().mask_where(fix, r - b))
        }
        Binary::Max => Value::int(a.max_pair(b)),
        Binary::Min => Value::int(a.min_pair(b)),
        _ => match compare!(op, a, b) {
            Some(mask) => Value::bool(mask),
            None => unreachable!("Pow and the logical operators are handled by binary()"),
        },
    })
}

fn bool_binary<const D: usize>(op: Binary, a: Value, b: Value) -> Result<Value, OnnxError> {
    let (a, b) = (a.b::<D>(), b.b::<D>());
    Ok(match op {
        Binary::And => Value::bool(a.bool_and(b)),
        Binary::Or => Value::bool(a.bool_or(b)),
        Binary::Xor => Value::bool(a.not_equal(b)),
        Binary::Equal => Value::bool(a.equal(b)),
        other => {
            return Err(OnnxError::Unsupported(format!(
                "{other:?} on boolean tensors"
            )));
        }
    })
}

/// `Pow`: a scalar exponent goes through `powf_scalar` (exact for integral exponents of
/// negative bases, which `exp(b·ln a)` is not), squares through a multiply.
fn pow(a: Value, b: Value) -> Result<Value, OnnxError> {
    let int_base = a.kind() == ValueKind::Int;
    let a = a.to_kind(ValueKind::Float)?;
    let out = if b.is_scalar() || b.len() == 1 && b.rank() <= a.rank() {
        let e = b.to_f32s()?[0];
        let scalar = a.is_scalar();
        with_rank!(a.rank(), D => {
            let x = a.f::<D>();
            Value::float(if e == 2.0 { x.clone() * x } else if e == 1.0 { x } else { x.powf_scalar(e) })
        })
        .with_scalar(scalar)
    } else {
        let (a, b, scalar) = same_rank(a, b.to_kind(ValueKind::Float)?)?;
        with_rank!(a.rank(), D => Value::float(a.f::<D>().powf(b.f::<D>()))).with_scalar(scalar)
    };
    if int_base {
        out.to_kind(ValueKind::Int)
    } else {
        Ok(out)
    }
}

/// A one-operand float operator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unary {
    Relu,
    Sigmoid,
    Tanh,
    Erf,
    Sqrt,
    Exp,
    Log,
    Neg,
    Abs,
    Reciprocal,
    Floor,
    Ceil,
    Round,
    Sin,
    Cos,
    /// `x` where `x ≥ 0`, `alpha·x` elsewhere.
    LeakyRelu(f32),
    /// `clamp(alpha·x + beta, 0, 1)`.
    HardSigmoid(f32, f32),
    /// `x · hard_sigmoid(x; 1/6, 1/2)`.
    HardSwish,
    /// Exact (erf) GELU.
    Gelu,
    /// GELU's tanh approximation.
    GeluTanh,
    Softplus,
    /// Clamp to `[min, max]` (either side optional).
    Clip(Option<f32>, Option<f32>),
    /// `x` where `x > 0`, `alpha·(eˣ − 1)` elsewhere.
    Elu(f32),
    /// `gamma·x` where `x > 0`, `gamma·alpha·(eˣ − 1)` elsewhere.
    Selu(f32, f32),
    /// `max(0, x) + min(0, alpha·(e^(x/alpha) − 1))`.
    Celu(f32),
    /// `x · tanh(softplus(x))`.
    Mish,
    /// `x / (1 + |x|)`.
    Softsign,
    /// `x` where `x > alpha`, 0 elsewhere.
    ThresholdedRelu(f32),
    /// `x · sigmoid(alpha·x)`.
    Swish(f32),
    /// −1, 0 or 1.
    Sign,
    Tan,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Asinh,
    Acosh,
    Atanh,
}

/// `op(x)`. Integer inputs of sign-preserving operators stay integers; others compute in
/// float.
pub fn unary(op: Unary, x: Value) -> Result<Value, OnnxError> {
    let scalar = x.is_scalar();
    if x.kind() == ValueKind::Int
        && matches!(
            op,
            Unary::Neg | Unary::Abs | Unary::Relu | Unary::Clip(..) | Unary::Sign
        )
    {
        let out = with_rank!(x.rank(), D => {
            let t = x.i::<D>();
            Value::int(match op {
                Unary::Neg => t.neg(),
                Unary::Abs => t.abs(),
                Unary::Relu => t.clamp_min(0),
                Unary::Sign => t.sign(),
                Unary::Clip(lo, hi) => {
                    let t = match lo { Some(lo) => t.clamp_min(lo as i64), None => t };
                    match hi { Some(hi) => t.clamp_max(hi as i64), None => t }
                }
                _ => unreachable!("matched above"),
            })
        });
        return Ok(out.with_scalar(scalar));
    }
    let x = x.to_kind(ValueKind::Float)?;
    let out = with_rank!(x.rank(), D => Value::float(float_unary::<D>(op, x.f::<D>())));
    Ok(out.with_scalar(scalar))
}

fn float_unary<const D: usize>(op: Unary, x: Tensor<D>) -> Tensor<D> {
    match op {
        Unary::Relu => activation::relu(x),
        Unary::Sigmoid => crate::kernels::activation::sigmoid(x),
        Unary::Tanh => x.tanh(),
        Unary::Erf => crate::kernels::activation::erf(x),
        Unary::Sqrt => x.sqrt(),
        Unary::Exp => x.exp(),
        Unary::Log => x.log(),
        Unary::Neg => x.neg(),
        Unary::Abs => x.abs(),
        Unary::Reciprocal => x.recip(),
        Unary::Floor => x.floor(),
        Unary::Ceil => x.ceil(),
        Unary::Round => x.round(),
        Unary::Sin => x.sin(),
        Unary::Cos => x.cos(),
        Unary::LeakyRelu(alpha) => activation::leaky_relu(x, alpha as f64),
        Unary::HardSigmoid(alpha, beta) => (x * alpha + beta).clamp(0.0, 1.0),
        Unary::HardSwish => x.clone() * (x / 6.0 + 0.5).clamp(0.0, 1.0),
        Unary::Gelu => crate::kernels::activation::gelu(x),
        Unary::GeluTanh => {
            let inner = (x.clone() + x.clone().powf_scalar(3.0) * 0.044715)
                * (2.0f32 / std::f32::consts::PI).sqrt();
            x * 0.5 * (inner.tanh() + 1.0)
        }
        Unary::Softplus => activation::softplus(x, 1.0),
        Unary::Clip(lo, hi) => {
            let x = match lo {
                Some(lo) => x.clamp_min(lo),
                None => x,
            };
            match hi {
                Some(hi) => x.clamp_max(hi),
                None => x,
            }
        }
        Unary::Elu(alpha) => {
            let neg = (x.clone().clamp_max(0.0).exp() - 1.0) * alpha;
            x.clamp_min(0.0) + neg
        }
        Unary::Selu(alpha, gamma) => {
            let neg = (x.clone().clamp_max(0.0).exp() - 1.0) * alpha;
            (x.clamp_min(0.0) + neg) * gamma
        }
        Unary::Celu(alpha) => {
            let neg = ((x.clone().clamp_max(0.0) / alpha).exp() - 1.0) * alpha;
            x.clamp_min(0.0) + neg
        }
        Unary::Mish => x.clone() * activation::softplus(x, 1.0).tanh(),
        Unary::Softsign => x.clone() / (x.abs() + 1.0),
        Unary::ThresholdedRelu(alpha) => {
            let keep = x.clone().greater_elem(alpha);
            x.clone().zeros_like().mask_where(keep, x)
        }
        Unary::Swish(alpha) => x.clone() * crate::kernels::activation::sigmoid(x * alpha),
        Unary::Sign => x.sign(),
        Unary::Tan => x.tan(),
        Unary::Asin => x.asin(),
        Unary::Acos => x.acos(),
        Unary::Atan => x.atan(),
        Unary::Sinh => x.sinh(),
        Unary::Cosh => x.cosh(),
        Unary::Asinh => x.asinh(),
        Unary::Acosh => x.acosh(),
        Unary::Atanh => x.atanh(),
    }
}

/// `PRelu`: `x` where `x ≥ 0`, `slope·x` elsewhere, `slope` broadcast to `x`.
pub fn prelu(x: Value, slope: Value) -> Result<Value, OnnxError> {
    let x = x.to_kind(ValueKind::Float)?;
    let neg = binary(
        Binary::Mul,
        unary(Unary::Clip(None, Some(0.0)), x.clone())?,
        slope,
    )?;
    binary(Binary::Add, unary(Unary::Relu, x)?, neg)
}

/// Logical `Not`.
pub fn not(x: Value) -> Result<Value, OnnxError> {
    let scalar = x.is_scalar();
    let x = x.to_kind(ValueKind::Bool)?;
    Ok(with_rank!(x.rank(), D => Value::bool(x.b::<D>().bool_not())).with_scalar(scalar))
}

/// `Where(cond, x, y)`: `x` where `cond`, `y` elsewhere, all three broadcast together.
pub fn where_(cond: Value, x: Value, y: Value) -> Result<Value, OnnxError> {
    let scalar = cond.is_scalar() && x.is_scalar() && y.is_scalar();
    let rank = cond.rank().max(x.rank()).max(y.rank());
    let (cond, x, y) = (
        cond.lift_to_rank(rank)?.to_kind(ValueKind::Bool)?,
        x.lift_to_rank(rank)?,
        y.lift_to_rank(rank)?,
    );
    let kind = if x.kind() == ValueKind::Float || y.kind() == ValueKind::Float {
        ValueKind::Float
    } else {
        x.kind()
    };
    let (x, y) = (x.to_kind(kind)?, y.to_kind(kind)?);
    let dims = broadcast_dims(&broadcast_dims(&cond.dims(), &x.dims())?, &y.dims())?;
    let (cond, x, y) = (
        super::shape::expand_to(cond, &dims)?,
        super::shape::expand_to(x, &dims)?,
        super::shape::expand_to(y, &dims)?,
    );
    let out = with_rank!(rank, D => match kind {
        ValueKind::Float => Value::float(y.f::<D>().mask_where(cond.b::<D>(), x.f::<D>())),
        ValueKind::Int => Value::int(y.i::<D>().mask_where(cond.b::<D>(), x.i::<D>())),
        ValueKind::Bool => Value::bool(y.b::<D>().mask_where(cond.b::<D>(), x.b::<D>())),
    });
    Ok(out.with_scalar(scalar))
}

/// Softmax (or its log) over `axis`: over the last axis of an f32 value on the host, Kiln's
/// kernel reading the value in place ([`kiln_kernels::softmax`]); Burn's otherwise.
pub fn softmax(x: Value, axis: usize, log: bool) -> Result<Value, OnnxError> {
    let x = x.to_kind(ValueKind::Float)?;
    let dims = x.dims();
    if !log && axis + 1 == dims.len() && crate::kernels::serves(&x.device()) {
        let row = dims[axis];
        let _op = tracing::trace_span!("kiln.softmax", shape = ?dims).entered();
        if row > 0
            && let Some(y) = x.with_f32_view(|v| kiln_kernels::softmax::softmax_rows(v, row))
        {
            let scalar = x.is_scalar();
            let y = Value::from_data(burn::tensor::TensorData::new(y, dims), &x.device())?;
            return Ok(y.with_scalar(scalar));
        }
    }
    Ok(with_rank!(x.rank(), D => {
        let t = x.f::<D>();
        Value::float(if log { activation::log_softmax(t, axis) } else { activation::softmax(t, axis) })
    }))
}
