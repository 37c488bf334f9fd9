//! Runs one onnx-ir node on [`Value`]s, and says at load time which nodes cannot run.
//!
//! onnx-ir hands each operator over with its attributes already parsed, defaults applied and
//! negative axes resolved; inputs it could read at load time arrive as `Static` config values,
//! the others as `Runtime` references to the node's inputs, read here when the node runs.

pub mod conv_nd;
pub mod einsum;
pub mod index;
pub mod math;
pub mod nn;
pub mod norm;
pub mod quant;
pub mod recurrent;
mod recurrent_host;
pub mod shape;

use burn::tensor::Device;
use burn::tensor::ops::PadMode as BurnPadMode;
use onnx_ir::node::attention::AttentionQkMatmulOutputMode;
use onnx_ir::node::pad::{ConstantValueInput, PadInput, PadMode};
use onnx_ir::node::resize::{CoordinateTransformMode, NearestMode, ResizeMode};
use onnx_ir::{ArgType, DType, Node, RuntimeInputRef};

use super::OnnxError;
use super::value::{Value, ValueKind};
use math::{Binary, Unary};
use nn::{Reduce, ResizeKind, Window};

/// A node's inputs at run time (`None`: an optional input left out).
pub type Inputs<'a> = &'a [Option<Value>];

fn input(ins: Inputs, i: usize, node: &Node) -> Result<Value, OnnxError> {
    ins.get(i).cloned().flatten().ok_or_else(|| {
        OnnxError::Graph(format!(
            "node `{}` ({}) has no input {i}",
            node.name(),
            node.node_type()
        ))
    })
}

fn optional(ins: Inputs, i: usize) -> Option<Value> {
    ins.get(i).cloned().flatten()
}

fn runtime_ints(ins: Inputs, r: &RuntimeInputRef, node: &Node) -> Result<Vec<i64>, OnnxError> {
    input(ins, r.input_index, node)?.to_i64s()
}

/// The integers of an onnx-ir `Static(Vec<i64>)` / `Runtime(input)` config enum.
macro_rules! ints_of {
    ($config:expr, $Enum:ident, $ins:expr, $node:expr) => {
        match $config {
            $Enum::Static(v) => v.clone(),
            $Enum::Runtime(r) => runtime_ints($ins, r, $node)?,
        }
    };
}

fn runtime_f64(ins: Inputs, r: &RuntimeInputRef, node: &Node) -> Result<f64, OnnxError> {
    let v = input(ins, r.input_index, node)?.to_f32s()?;
    v.first()
        .map(|&x| x as f64)
        .ok_or_else(|| OnnxError::Shape(format!("node `{}`: empty scalar input", node.name())))
}

/// Why `node` cannot run here, or `None` when it can. Checked for every node at load, so a
/// model is refused before it runs with every reason at once.
pub fn unsupported(node: &Node) -> Option<String> {
    let op = node.node_type().to_string();
    let reason = match node {
        Node::Custom(c) => return Some(format!("{}::{}", c.domain, c.op_type)),
        Node::Resize(n) => resize_kind(&n.config).err(),
        Node::Pad(n)
            if n.config.mode != PadMode::Constant
                && matches!(n.config.pads, PadInput::Runtime { axes: Some(_), .. }) =>
        {
            Some("mode other than constant with runtime axes".into())
        }
        Node::Attention(n) => {
            let c = &n.config;
            if c.softcap != 0.0
                || c.q_num_heads.is_some()
                || c.kv_num_heads.is_some()
                || c.qk_matmul_output_mode != AttentionQkMatmulOutputMode::Matmul
                || n.outputs.len() > 1
                || n.inputs.len() > 4
            {
                Some(
                    "only 4-D attention without softcap, head counts, KV cache or extra outputs"
                        .into(),
                )
            } else {
                None
            }
        }
        Node::Lstm(n) => {
            use onnx_ir::node::lstm::LstmActivationFunction as A;
            let c = &n.config;
            (c.gate_activation != A::Sigmoid
                || c.cell_activation != A::Tanh
                || c.hidden_activation != A::Tanh)
                .then(|| "activations other than Sigmoid, Tanh, Tanh".into())
        }
        Node::Gru(n) => {
            use onnx_ir::node::gru::GruActivationFunction as A;
            let c = &n.config;
            (c.gate_activation != A::Sigmoid || c.hidden_activation != A::Tanh)
                .then(|| "activations other than Sigmoid, Tanh".into())
        }
        Node::Rnn(n) => rnn_activation(n.config.hidden_activation)
            .is_none()
            .then(|| format!("activation {:?}", n.config.hidden_activation)),
        Node::AveragePool1d(n) if n.config.dilation != 1 => Some("dilation".into()),
        Node::Conv1d(_)
        | Node::Conv3d(_)
        | Node::ConvTranspose1d(_)
        | Node::ConvTranspose3d(_)
        | Node::MaxPool1d(_)
        | Node::MaxPool3d(_)
        | Node::AveragePool1d(_)
        | Node::AveragePool3d(_)
        | Node::InstanceNormalization(_)
        | Node::GroupNormalization(_)
        | Node::Trilu(_)
        | Node::DepthToSpace(_)
        | Node::SpaceToDepth(_)
        | Node::Einsum(_)
        | Node::ScatterND(_)
        | Node::ScatterElements(_)
        | Node::GatherElements(_)
        | Node::GatherND(_)
        | Node::TopK(_)
        | Node::CumSum(_)
        | Node::OneHot(_)
        | Node::NonZero(_)
        | Node::Tile(_)
        | Node::PRelu(_)
        | Node::Elu(_)
        | Node::Selu(_)
        | Node::Celu(_)
        | Node::Mish(_)
        | Node::Softsign(_)
        | Node::ThresholdedRelu(_)
        | Node::Swish(_)
        | Node::Sign(_)
        | Node::Tan(_)
        | Node::Asin(_)
        | Node::Acos(_)
        | Node::Atan(_)
        | Node::Sinh(_)
        | Node::Cosh(_)
        | Node::Asinh(_)
        | Node::Acosh(_)
        | Node::Atanh(_)
        | Node::Conv2d(_)
        | Node::ConvTranspose2d(_)
        | Node::MaxPool2d(_)
        | Node::AveragePool2d(_)
        | Node::GlobalAveragePool(_)
        | Node::GlobalMaxPool(_)
        | Node::BatchNormalization(_)
        | Node::LayerNormalization(_)
        | Node::Linear(_)
        | Node::MatMul(_)
        | Node::Gemm(_)
        | Node::Add(_)
        | Node::Sub(_)
        | Node::Mul(_)
        | Node::Div(_)
        | Node::Pow(_)
        | Node::Mod(_)
        | Node::Max(_)
        | Node::Min(_)
        | Node::Sum(_)
        | Node::Mean(_)
        | Node::Equal(_)
        | Node::Less(_)
        | Node::LessOrEqual(_)
        | Node::Greater(_)
        | Node::GreaterOrEqual(_)
        | Node::And(_)
        | Node::Or(_)
        | Node::Xor(_)
        | Node::Not(_)
        | Node::Where(_)
        | Node::Relu(_)
        | Node::Sigmoid(_)
        | Node::Tanh(_)
        | Node::Erf(_)
        | Node::Sqrt(_)
        | Node::Exp(_)
        | Node::Log(_)
        | Node::Neg(_)
        | Node::Abs(_)
        | Node::Reciprocal(_)
        | Node::Floor(_)
        | Node::Ceil(_)
        | Node::Round(_)
        | Node::Sin(_)
        | Node::Cos(_)
        | Node::LeakyRelu(_)
        | Node::HardSigmoid(_)
        | Node::HardSwish(_)
        | Node::Gelu(_)
        | Node::Softplus(_)
        | Node::Clip(_)
        | Node::Softmax(_)
        | Node::LogSoftmax(_)
        | Node::Identity(_)
        | Node::Dropout(_)
        | Node::Constant(_)
        | Node::ConstantOfShape(_)
        | Node::Shape(_)
        | Node::Size(_)
        | Node::Reshape(_)
        | Node::Flatten(_)
        | Node::Transpose(_)
        | Node::Squeeze(_)
        | Node::Unsqueeze(_)
        | Node::Concat(_)
        | Node::Split(_)
        | Node::Slice(_)
        | Node::Gather(_)
        | Node::Expand(_)
        | Node::Cast(_)
        | Node::Pad(_)
        | Node::Range(_)
        | Node::ArgMax(_)
        | Node::ArgMin(_)
        | Node::QuantizeLinear(_)
        | Node::DequantizeLinear(_) => None,
        // A new operator whose output dimensions depend on its operands' values must also
        // be named in `shape_cache::shape_role`.
        _ if is_reduction(node) => None,
        _ => return Some(op),
    };
    reason.map(|r| format!("{op} ({r})"))
}

fn rnn_activation(
    a: onnx_ir::node::rnn::RnnActivationFunction,
) -> Option<recurrent::RnnActivation> {
    use onnx_ir::node::rnn::RnnActivationFunction as A;
    match a {
        A::Tanh => Some(recurrent::RnnActivation::Tanh),
        A::Relu => Some(recurrent::RnnActivation::Relu),
        A::Sigmoid => Some(recurrent::RnnActivation::Sigmoid),
        _ => None,
    }
}

/// The `Reduce*` operators Kiln runs (axes from an attribute or a second operand).
pub(super) fn is_reduction(node: &Node) -> bool {
    matches!(
        node,
        Node::ReduceMean(_)
            | Node::ReduceSum(_)
            | Node::ReduceMax(_)
            | Node::ReduceMin(_)
            | Node::ReduceProd(_)
            | Node::ReduceSumSquare(_)
            | Node::ReduceL2(_)
    )
}

fn resize_kind(c: &onnx_ir::node::resize::ResizeConfig) -> Result<ResizeKind, String> {
    use CoordinateTransformMode as C;
    let half = matches!(
        c.coordinate_transformation_mode,
        C::HalfPixel | C::PytorchHalfPixel
    );
    let align = c.coordinate_transformation_mode == C::AlignCorners;
    match c.mode {
        ResizeMode::Nearest
            if c.coordinate_transformation_mode == C::Asymmetric
                && c.nearest_mode == NearestMode::Floor =>
        {
            Ok(ResizeKind::Nearest)
        }
        ResizeMode::Nearest
            if (half || c.coordinate_transformation_mode == C::TfHalfPixelForNn)
                && matches!(
                    c.nearest_mode,
                    NearestMode::RoundPreferCeil | NearestMode::Floor
                ) =>
        {
            Ok(ResizeKind::NearestExact)
        }
        ResizeMode::Linear if half || align => Ok(ResizeKind::Bilinear(align)),
        ResizeMode::Cubic if (half || align) && (c.cubic_coeff_a + 0.75).abs() < 1e-6 => {
            Ok(ResizeKind::Bicubic(align))
        }
        _ => Err(format!(
            "mode {:?} with coordinate_transformation_mode {:?}, nearest_mode {:?}, cubic_coeff_a {}",
            c.mode, c.coordinate_transformation_mode, c.nearest_mode, c.cubic_coeff_a
        )),
    }
}

/// A Clip's bounds when both are constants (`[-∞, ∞]` for a missing one).
pub fn constant_clip(n: &onnx_ir::node::clip::ClipNode) -> Option<[f32; 2]> {
    use onnx_ir::node::clip::ClipInput;
    let bound = |b: &Option<ClipInput>, none: f32| match b {
        None => Some(none),
        Some(ClipInput::Static(v)) => Some(*v as f32),
        Some(ClipInput::Runtime(_)) => None,
    };
    Some([
        bound(&n.config.min, f32::NEG_INFINITY)?,
        bound(&n.config.max, f32::INFINITY)?,
    ])
}

/// The Kiln activation an ONNX node computes: ReLU, Sigmoid, HardSwish, HardSigmoid, exact
/// GELU, or a Clip with constant bounds (the host runs these on images and rows; a
/// convolution or a linear layer takes them into its store).
pub fn activation_of(node: &onnx_ir::Node) -> Option<kiln_kernels::activation::Activation> {
    use kiln_kernels::activation::Activation;
    use onnx_ir::Node;
    match node {
        Node::Relu(_) => Some(Activation::Relu),
        Node::Clip(n) => constant_clip(n).map(|[lo, hi]| Activation::Clip(lo, hi)),
        Node::Sigmoid(_) => Some(Activation::Sigmoid),
        Node::HardSwish(_) => Some(Activation::HardSwish),
        Node::HardSigmoid(n) => Some(Activation::HardSigmoid(
            n.config.alpha as f32,
            n.config.beta as f32,
        )),
        Node::Gelu(n) if n.config.approximate == onnx_ir::node::gelu::GeluApproximate::Exact => {
            Some(Activation::Gelu)
        }
        _ => None,
    }
}

/// A BatchNormalization node's epsilon (onnx-ir keeps it in either config form).
pub fn batch_norm_epsilon(n: &onnx_ir::node::batch_norm::BatchNormalizationNode) -> f64 {
    match &n.config {
        onnx_ir::node::batch_norm::BatchNormConfig::Static(c) => c.epsilon,
        onnx_ir::node::batch_norm::BatchNormConfig::Runtime(c) => c.epsilon,
    }
}

/// The spatial window of a Conv, MaxPool or AveragePool node.
pub fn node_window(node: &Node) -> Result<Window, OnnxError> {
    // The three configs name the same fields (pooling spells the stride `strides`).
    macro_rules! fields {
        ($c:expr, $stride:ident) => {{
            let c = &$c;
            (
                c.kernel_size,
                c.$stride,
                c.dilation,
                &c.padding,
                &c.auto_pad,
            )
        }};
    }
    let (kernel, stride, dilation, padding, auto_pad) = match node {
        Node::Conv2d(n) => fields!(n.config, stride),
        Node::MaxPool2d(n) => fields!(n.config, strides),
        Node::AveragePool2d(n) => fields!(n.config, strides),
        other => {
            return Err(OnnxError::Graph(format!(
                "{} has no convolution or pooling window",
                other.node_type()
            )));
        }
    };
    Ok(Window {
        kernel,
        stride,
        dilation,
        padding: padding.clone(),
        auto_pad: auto_pad.clone(),
    })
}

fn binary(op: Binary, ins: Inputs, node: &Node) -> Result<Vec<Value>, OnnxError> {
    Ok(vec![math::binary(
        op,
        input(ins, 0, node)?,
        input(ins, 1, node)?,
    )?])
}

/// A variadic `Max`/`Min`/`Sum`/`Mean`: folds the operands pairwise.
fn variadic(op: Binary, ins: Inputs, node: &Node, mean: bool) -> Result<Vec<Value>, OnnxError> {
    let values: Vec<Value> = ins.iter().flatten().cloned().collect();
    let n = values.len();
    let mut it = values.into_iter();
    let first = it
        .next()
        .ok_or_else(|| OnnxError::Graph(format!("node `{}` has no inputs", node.name())))?;
    let mut acc = it.try_fold(first, |acc, v| math::binary(op, acc, v))?;
    if mean {
        let device = acc.device();
        acc = math::binary(
            Binary::Div,
            acc,
            Value::from_i64(vec![n as i64], true, &device),
        )?;
    }
    Ok(vec![acc])
}

fn unary(op: Unary, ins: Inputs, node: &Node) -> Result<Vec<Value>, OnnxError> {
    Ok(vec![math::unary(op, input(ins, 0, node)?)?])
}

/// The part sizes of a Split along an axis of `dim` values, when the node fixes them (sizes
/// given, a part size, or an even split); `None` when an input gives them at run time.
pub fn static_split_sizes(n: &onnx_ir::node::split::SplitNode, dim: usize) -> Option<Vec<usize>> {
    use onnx_ir::node::split::SplitSizesInput;
    Some(match (&n.config.split_sizes, n.config.split_size) {
        (Some(SplitSizesInput::Static(s)), _) => s.clone(),
        (Some(SplitSizesInput::Runtime(_)), _) => return None,
        (None, Some(size)) if size > 0 => {
            let mut s = vec![size; dim / size];
            if !dim.is_multiple_of(size) {
                s.push(dim % size);
            }
            s
        }
        _ => shape::even_split(dim, n.config.num_outputs.unwrap_or(n.outputs.len())),
    })
}

/// Runs `node` on `ins`; one value per node output.
pub fn run(node: &Node, ins: Inputs, device: &Device) -> Result<Vec<Value>, OnnxError> {
    let x = || input(ins, 0, node);
    let one = |v: Value| Ok(vec![v]);
    match node {
        Node::Conv2d(n) => {
            let c = &n.config;
            let w = node_window(node)?;
            one(nn::conv2d(
                x()?,
                input(ins, 1, node)?,
                optional(ins, 2),
                &w,
                c.groups,
            )?)
        }
        Node::ConvTranspose2d(n) => {
            let c = &n.config;
            one(nn::conv_transpose2d_op(
                x()?,
                input(ins, 1, node)?,
                optional(ins, 2),
                c.stride,
                c.padding,
                c.padding_out,
                c.dilation,
                c.groups,
            )?)
        }
        Node::MaxPool2d(n) => {
            let c = &n.config;
            let w = node_window(node)?;
            one(nn::max_pool(x()?, &w, c.ceil_mode)?)
        }
        Node::AveragePool2d(n) => {
            let c = &n.config;
            let w = node_window(node)?;
            one(nn::avg_pool(x()?, &w, c.ceil_mode, c.count_include_pad)?)
        }
        Node::GlobalAveragePool(_) => one(nn::global_pool(x()?, false)?),
        Node::GlobalMaxPool(_) => one(nn::global_pool(x()?, true)?),
        Node::BatchNormalization(n) => {
            let eps = batch_norm_epsilon(n);
            one(nn::batch_norm(
                x()?,
                input(ins, 1, node)?,
                input(ins, 2, node)?,
                input(ins, 3, node)?,
                input(ins, 4, node)?,
                eps,
            )?)
        }
        Node::LayerNormalization(n) => one(nn::layer_norm(
            x()?,
            input(ins, 1, node)?,
            optional(ins, 2),
            n.config.axis,
            n.config.epsilon,
        )?),
        Node::Linear(n) => {
            let mut w = input(ins, 1, node)?;
            if n.config.transpose_weight {
                w = shape::transpose(w, &[1, 0])?;
            }
            one(nn::linear(x()?, w, optional(ins, 2))?)
        }
        Node::MatMul(_) => one(nn::matmul(x()?, input(ins, 1, node)?)?),
        Node::Gemm(n) => {
            let c = &n.config;
            one(nn::gemm(
                x()?,
                input(ins, 1, node)?,
                optional(ins, 2),
                c.alpha,
                c.beta,
                c.trans_a != 0,
                c.trans_b != 0,
            )?)
        }
        Node::Attention(n) => one(nn::attention(
            x()?,
            input(ins, 1, node)?,
            input(ins, 2, node)?,
            optional(ins, 3),
            n.config.scale,
            n.config.is_causal,
        )?),
        Node::Resize(n) => {
            let kind = resize_kind(&n.config).map_err(OnnxError::Unsupported)?;
            let v = x()?;
            let dims = v.dims();
            if dims.len() != 4 {
                return Err(OnnxError::Unsupported(format!(
                    "Resize of a rank-{} tensor (only [N, C, H, W])",
                    dims.len()
                )));
            }
            let size = resize_size(n, ins, node, &dims)?;
            one(nn::resize(v, size, kind)?)
        }
        Node::Add(_) => binary(Binary::Add, ins, node),
        Node::Sub(_) => binary(Binary::Sub, ins, node),
        Node::Mul(_) => binary(Binary::Mul, ins, node),
        Node::Div(_) => binary(Binary::Div, ins, node),
        Node::Pow(_) => binary(Binary::Pow, ins, node),
        Node::Mod(n) => binary(
            if n.config.fmod {
                Binary::Fmod
            } else {
                Binary::Mod
            },
            ins,
            node,
        ),
        Node::Max(_) => variadic(Binary::Max, ins, node, false),
        Node::Min(_) => variadic(Binary::Min, ins, node, false),
        Node::Sum(_) => variadic(Binary::Add, ins, node, false),
        Node::Mean(_) => variadic(Binary::Add, ins, node, true),
        Node::Equal(_) => binary(Binary::Equal, ins, node),
        Node::Less(_) => binary(Binary::Less, ins, node),
        Node::LessOrEqual(_) => binary(Binary::LessOrEqual, ins, node),
        Node::Greater(_) => binary(Binary::Greater, ins, node),
        Node::GreaterOrEqual(_) => binary(Binary::GreaterOrEqual, ins, node),
        Node::And(_) => binary(Binary::And, ins, node),
        Node::Or(_) => binary(Binary::Or, ins, node),
        Node::Xor(_) => binary(Binary::Xor, ins, node),
        Node::Not(_) => one(math::not(x()?)?),
        Node::Where(_) => one(math::where_(
            x()?,
            input(ins, 1, node)?,
            input(ins, 2, node)?,
        )?),
        Node::Relu(_) => unary(Unary::Relu, ins, node),
        Node::Sigmoid(_) => unary(Unary::Sigmoid, ins, node),
        Node::Tanh(_) => unary(Unary::Tanh, ins, node),
        Node::Erf(_) => unary(Unary::Erf, ins, node),
        Node::Sqrt(_) => unary(Unary::Sqrt, ins, node),
        Node::Exp(_) => unary(Unary::Exp, ins, node),
        Node::Log(_) => unary(Unary::Log, ins, node),
        Node::Neg(_) => unary(Unary::Neg, ins, node),
        Node::Abs(_) => unary(Unary::Abs, ins, node),
        Node::Reciprocal(_) => unary(Unary::Reciprocal, ins, node),
        Node::Floor(_) => unary(Unary::Floor, ins, node),
        Node::Ceil(_) => unary(Unary::Ceil, ins, node),
        Node::Round(_) => unary(Unary::Round, ins, node),
        Node::Sin(_) => unary(Unary::Sin, ins, node),
        Node::Cos(_) => unary(Unary::Cos, ins, node),
        Node::LeakyRelu(n) => unary(Unary::LeakyRelu(n.config.alpha as f32), ins, node),
        Node::HardSigmoid(n) => unary(
            Unary::HardSigmoid(n.config.alpha as f32, n.config.beta as f32),
            ins,
            node,
        ),
        Node::HardSwish(_) => unary(Unary::HardSwish, ins, node),
        Node::Gelu(n) => unary(
            match n.config.approximate {
                onnx_ir::node::gelu::GeluApproximate::Exact => Unary::Gelu,
                onnx_ir::node::gelu::GeluApproximate::Tanh => Unary::GeluTanh,
            },
            ins,
            node,
        ),
        Node::Softplus(_) => unary(Unary::Softplus, ins, node),
        Node::Clip(n) => {
            use onnx_ir::node::clip::ClipInput;
            let bound = |b: &Option<ClipInput>| -> Result<Option<f32>, OnnxError> {
                Ok(match b {
                    None => None,
                    Some(ClipInput::Static(v)) => Some(*v as f32),
                    Some(ClipInput::Runtime(r)) => Some(runtime_f64(ins, r, node)? as f32),
                })
            };
            unary(
                Unary::Clip(bound(&n.config.min)?, bound(&n.config.max)?),
                ins,
                node,
            )
        }
        Node::Softmax(n) => one(math::softmax(x()?, n.config.axis, false)?),
        Node::LogSoftmax(n) => one(math::softmax(x()?, n.config.axis, true)?),
        Node::Identity(_) | Node::Dropout(_) => one(x()?),
        Node::Constant(_) => one(x()?),
        Node::ConstantOfShape(n) => {
            use onnx_ir::node::constant_of_shape::ConstantOfShapeShape;
            let dims = ints_of!(&n.config.shape, ConstantOfShapeShape, ins, node);
            one(shape::constant_of_shape(
                &dims,
                n.config.value.as_ref(),
                device,
            )?)
        }
        Node::Shape(n) => one(shape::shape(&x()?, n.config.start, n.config.end, device)),
        Node::Size(_) => one(shape::size(&x()?, device)),
        Node::Reshape(n) => {
            use onnx_ir::node::reshape::ReshapeInput;
            let spec = ints_of!(&n.config.shape, ReshapeInput, ins, node);
            one(shape::reshape(x()?, &spec)?)
        }
        Node::Flatten(n) => one(shape::flatten(x()?, n.config.axis)?),
        Node::Transpose(n) => one(shape::transpose(x()?, &n.config.perm)?),
        Node::Squeeze(n) => {
            use onnx_ir::node::squeeze::SqueezeInput;
            let axes = match &n.config.axes {
                None => None,
                Some(axes) => Some(ints_of!(axes, SqueezeInput, ins, node)),
            };
            one(shape::squeeze(x()?, axes.as_deref())?)
        }
        Node::Unsqueeze(n) => {
            use onnx_ir::node::unsqueeze::UnsqueezeConfig;
            let axes = ints_of!(&n.config, UnsqueezeConfig, ins, node);
            one(shape::unsqueeze(x()?, &axes)?)
        }
        Node::Concat(n) => {
            let parts: Vec<Value> = ins.iter().flatten().cloned().collect();
            let rank = parts.iter().map(Value::rank).max().unwrap_or(1);
            one(shape::concat(parts, n.config.axis.min(rank - 1))?)
        }
        Node::Split(n) => {
            use onnx_ir::node::split::SplitSizesInput;
            let v = x()?;
            let axis = n.config.axis;
            let dim = *v
                .dims()
                .get(axis)
                .ok_or_else(|| OnnxError::Shape(format!("split axis {axis} of {:?}", v.dims())))?;
            let sizes: Vec<usize> = match &n.config.split_sizes {
                Some(SplitSizesInput::Runtime(r)) => runtime_ints(ins, r, node)?
                    .into_iter()
                    .map(|s| s.max(0) as usize)
                    .collect(),
                _ => static_split_sizes(n, dim)
                    .ok_or_else(|| OnnxError::Graph("split sizes read at run time".into()))?,
            };
            shape::split(v, axis, &sizes)
        }
        Node::Slice(n) => {
            use onnx_ir::node::slice::SliceInput;
            let read = |s: &SliceInput| -> Result<Vec<i64>, OnnxError> {
                Ok(ints_of!(s, SliceInput, ins, node))
            };
            let c = &n.config;
            let starts = read(&c.starts)?;
            let ends = read(&c.ends)?;
            let axes = c.axes.as_ref().map(&read).transpose()?;
            let steps = c.steps.as_ref().map(&read).transpose()?;
            one(shape::slice(
                x()?,
                &starts,
                &ends,
                axes.as_deref(),
                steps.as_deref(),
            )?)
        }
        Node::Gather(n) => one(shape::gather(x()?, input(ins, 1, node)?, n.config.axis)?),
        Node::Expand(n) => {
            use onnx_ir::node::expand::ExpandConfig;
            let dims = ints_of!(&n.config, ExpandConfig, ins, node);
            one(shape::expand(x()?, &dims)?)
        }
        Node::Cast(n) => {
            let kind = super::value::kind_of(n.config.to)?;
            let v = x()?;
            // Float-to-int casts truncate toward zero (ONNX and C), which Burn's `int` does.
            one(v.to_kind(kind)?)
        }
        Node::Pad(n) => {
            let v = x()?;
            let rank = v.rank();
            let pads: Vec<(usize, usize)> = match &n.config.pads {
                PadInput::Static(p) => p.clone(),
                PadInput::Runtime { input: r, axes } => {
                    let raw = runtime_ints(ins, r, node)?;
                    let axes: Vec<usize> = match axes {
                        None => (0..rank).collect(),
                        Some(onnx_ir::node::pad::AxesInput::Static(a)) => a.clone(),
                        Some(onnx_ir::node::pad::AxesInput::Runtime(r)) => {
                            runtime_ints(ins, r, node)?
                                .into_iter()
                                .map(|a| shape::axis_index(a, rank))
                                .collect::<Result<_, _>>()?
                        }
                    };
                    let half = raw.len() / 2;
                    let mut full = vec![(0, 0); rank];
                    for (i, &a) in axes.iter().enumerate().take(half) {
                        if raw[i] < 0 || raw[i + half] < 0 {
                            return Err(OnnxError::Unsupported(
                                "Pad with negative pads (cropping)".into(),
                            ));
                        }
                        full[a] = (raw[i] as usize, raw[i + half] as usize);
                    }
                    full
                }
            };
            let value = match &n.config.constant_value {
                ConstantValueInput::Static(v) => *v,
                ConstantValueInput::Runtime(r) => runtime_f64(ins, r, node)? as f32,
            };
            let mode = match n.config.mode {
                PadMode::Constant => BurnPadMode::Constant(value),
                PadMode::Reflect => BurnPadMode::Reflect,
                PadMode::Edge => BurnPadMode::Edge,
            };
            one(shape::pad(v, &pads, mode)?)
        }
        Node::Range(n) => {
            use onnx_ir::node::range::RangeInput;
            let read = |r: &RangeInput| -> Result<f64, OnnxError> {
                match r {
                    RangeInput::Static(v) => Ok(*v as f64),
                    RangeInput::StaticFloat(v) => Ok(*v),
                    RangeInput::Runtime(r) => runtime_f64(ins, r, node),
                }
            };
            let int =
                !matches!(n.outputs.first().map(|o| o.ty.elem_type()), Some(d) if d.is_float());
            let c = &n.config;
            one(shape::range(
                read(&c.start)?,
                read(&c.limit)?,
                read(&c.delta)?,
                int,
                device,
            )?)
        }
        Node::ReduceMean(n) => reduce(Reduce::Mean, &n.config, ins, node),
        Node::ReduceSum(n) => reduce(Reduce::Sum, &n.config, ins, node),
        Node::ReduceMax(n) => reduce(Reduce::Max, &n.config, ins, node),
        Node::ReduceMin(n) => reduce(Reduce::Min, &n.config, ins, node),
        Node::ReduceProd(n) => reduce(Reduce::Prod, &n.config, ins, node),
        Node::ReduceSumSquare(n) => reduce(Reduce::SumSquare, &n.config, ins, node),
        Node::ReduceL2(n) => reduce(Reduce::L2, &n.config, ins, node),
        Node::ArgMax(n) => one(nn::arg_extreme(
            x()?,
            n.config.axis,
            n.config.keepdims,
            true,
        )?),
        Node::ArgMin(n) => one(nn::arg_extreme(
            x()?,
            n.config.axis,
            n.config.keepdims,
            false,
        )?),
        _ => run_more(node, ins),
    }
}

macro_rules! scatter_reduction {
    ($r:expr, $E:ident) => {
        match $r {
            $E::None => index::Reduction::None,
            $E::Add => index::Reduction::Add,
            $E::Mul => index::Reduction::Mul,
            $E::Max => index::Reduction::Max,
            $E::Min => index::Reduction::Min,
        }
    };
}

/// The operators beyond the image families': other ranks of convolution and pooling,
/// per-sample normalizations, recurrent layers, Einsum, indexing, more activations.
fn run_more(node: &Node, ins: Inputs) -> Result<Vec<Value>, OnnxError> {
    use conv_nd::{PoolKind, Window3d};
    let x = || input(ins, 0, node);
    let one = |v: Value| Ok(vec![v]);
    let window3 = |kernel,
                   stride,
                   dilation,
                   padding: &onnx_ir::node::padding::PaddingConfig3d,
                   auto_pad: &onnx_ir::node::padding::AutoPad| Window3d {
        kernel,
        stride,
        dilation,
        padding: padding.clone(),
        auto_pad: auto_pad.clone(),
    };
    match node {
        Node::QuantizeLinear(n) => {
            let x = x()?;
            one(quant::quantize_linear(
                &x,
                &input(ins, 1, node)?,
                optional(ins, 2).as_ref(),
                n.config.axis.unwrap_or(1),
                n.outputs[0].ty.elem_type(),
                &x.device(),
            )?)
        }
        Node::DequantizeLinear(n) => {
            let x = x()?;
            one(quant::dequantize_linear(
                &x,
                &input(ins, 1, node)?,
                optional(ins, 2).as_ref(),
                n.config.axis.unwrap_or(1),
                &x.device(),
            )?)
        }
        Node::Conv1d(n) => {
            let c = &n.config;
            let w =
                conv_nd::window_1d(c.kernel_size, c.stride, c.dilation, &c.padding, &c.auto_pad);
            one(conv_nd::conv1d(
                x()?,
                input(ins, 1, node)?,
                optional(ins, 2),
                &w,
                c.groups,
            )?)
        }
        Node::Conv3d(n) => {
            let c = &n.config;
            let w = window3(c.kernel_size, c.stride, c.dilation, &c.padding, &c.auto_pad);
            one(conv_nd::conv3d_op(
                x()?,
                input(ins, 1, node)?,
                optional(ins, 2),
                &w,
                c.groups,
            )?)
        }
        Node::ConvTranspose1d(n) => {
            let c = &n.config;
            one(conv_nd::conv_transpose1d(
                x()?,
                input(ins, 1, node)?,
                optional(ins, 2),
                c.stride,
                c.padding,
                c.padding_out,
                c.dilation,
                c.groups,
            )?)
        }
        Node::ConvTranspose3d(n) => {
            let c = &n.config;
            one(conv_nd::conv_transpose3d_op(
                x()?,
                input(ins, 1, node)?,
                optional(ins, 2),
                c.stride,
                c.padding,
                c.padding_out,
                c.dilation,
                c.groups,
            )?)
        }
        Node::MaxPool1d(n) => {
            let c = &n.config;
            let w =
                conv_nd::window_1d(c.kernel_size, c.stride, c.dilation, &c.padding, &c.auto_pad);
            one(conv_nd::max_pool1d(x()?, &w, c.ceil_mode)?)
        }
        Node::AveragePool1d(n) => {
            let c = &n.config;
            let w =
                conv_nd::window_1d(c.kernel_size, c.stride, c.dilation, &c.padding, &c.auto_pad);
            one(conv_nd::avg_pool1d(
                x()?,
                &w,
                c.ceil_mode,
                c.count_include_pad,
            )?)
        }
        Node::MaxPool3d(n) => {
            let c = &n.config;
            let w = window3(
                c.kernel_size,
                c.strides,
                c.dilation,
                &c.padding,
                &c.auto_pad,
            );
            one(conv_nd::pool3d(x()?, &w, c.ceil_mode, PoolKind::Max)?)
        }
        Node::AveragePool3d(n) => {
            let c = &n.config;
            let w = window3(
                c.kernel_size,
                c.strides,
                c.dilation,
                &c.padding,
                &c.auto_pad,
            );
            let kind = PoolKind::Average {
                count_include_pad: c.count_include_pad,
            };
            one(conv_nd::pool3d(x()?, &w, c.ceil_mode, kind)?)
        }
        Node::InstanceNormalization(n) => one(norm::instance_norm(
            x()?,
            input(ins, 1, node)?,
            input(ins, 2, node)?,
            n.config.epsilon,
        )?),
        Node::GroupNormalization(n) => one(norm::group_norm(
            x()?,
            input(ins, 1, node)?,
            input(ins, 2, node)?,
            n.config.num_groups,
            n.config.epsilon,
        )?),
        Node::Trilu(n) => {
            use onnx_ir::node::trilu::TriluDiagonal;
            let k = match &n.config.diagonal {
                TriluDiagonal::Static(k) => *k,
                TriluDiagonal::Runtime(r) => {
                    runtime_ints(ins, r, node)?.first().copied().unwrap_or(0)
                }
            };
            one(index::trilu(x()?, n.config.upper, k)?)
        }
        Node::DepthToSpace(n) => one(index::depth_to_space(
            x()?,
            n.config.block_size,
            n.config.mode.clone(),
        )?),
        Node::SpaceToDepth(n) => one(index::space_to_depth(x()?, n.config.block_size)?),
        Node::Einsum(n) => {
            let operands: Vec<Value> = ins.iter().flatten().cloned().collect();
            one(einsum::einsum(&n.config.equation, operands)?)
        }
        Node::Lstm(n) => {
            use onnx_ir::node::lstm::LstmDirection as D;
            let c = &n.config;
            let spec = recurrent::Recurrent {
                cell: recurrent::Cell::Lstm {
                    coupled: c.input_forget,
                },
                direction: match c.direction {
                    D::Forward => recurrent::Direction::Forward,
                    D::Reverse => recurrent::Direction::Reverse,
                    D::Bidirectional => recurrent::Direction::Bidirectional,
                },
                hidden: c.hidden_size,
                batch_first: c.batch_first,
                clip: c.clip,
            };
            recurrent_outputs(node, &spec, ins, optional(ins, 6))
        }
        Node::Gru(n) => {
            use onnx_ir::node::gru::GruDirection as D;
            let c = &n.config;
            let spec = recurrent::Recurrent {
                cell: recurrent::Cell::Gru {
                    linear_before_reset: c.linear_before_reset,
                },
                direction: match c.direction {
                    D::Forward => recurrent::Direction::Forward,
                    D::Reverse => recurrent::Direction::Reverse,
                    D::Bidirectional => recurrent::Direction::Bidirectional,
                },
                hidden: c.hidden_size,
                batch_first: c.batch_first,
                clip: c.clip,
            };
            recurrent_outputs(node, &spec, ins, None)
        }
        Node::Rnn(n) => {
            use onnx_ir::node::rnn::RnnDirection as D;
            let c = &n.config;
            let act = rnn_activation(c.hidden_activation).ok_or_else(|| {
                OnnxError::Unsupported(format!("RNN activation {:?}", c.hidden_activation))
            })?;
            let spec = recurrent::Recurrent {
                cell: recurrent::Cell::Rnn(act),
                direction: match c.direction {
                    D::Forward => recurrent::Direction::Forward,
                    D::Reverse => recurrent::Direction::Reverse,
                    D::Bidirectional => recurrent::Direction::Bidirectional,
                },
                hidden: c.hidden_size,
                batch_first: c.batch_first,
                clip: c.clip,
            };
            recurrent_outputs(node, &spec, ins, None)
        }
        Node::ScatterND(n) => {
            use onnx_ir::node::scatter_nd::ScatterNDReduction as R;
            let r = scatter_reduction!(n.config.reduction, R);
            one(index::scatter_nd(
                x()?,
                input(ins, 1, node)?,
                input(ins, 2, node)?,
                r,
            )?)
        }
        Node::ScatterElements(n) => {
            use onnx_ir::node::scatter_elements::ScatterElementsReduction as R;
            let r = scatter_reduction!(n.config.reduction, R);
            one(index::scatter_elements(
                x()?,
                input(ins, 1, node)?,
                input(ins, 2, node)?,
                n.config.axis,
                r,
            )?)
        }
        Node::GatherElements(n) => one(index::gather_elements(
            x()?,
            input(ins, 1, node)?,
            n.config.axis,
        )?),
        Node::GatherND(n) => one(index::gather_nd(
            x()?,
            input(ins, 1, node)?,
            n.config.batch_dims,
        )?),
        Node::TopK(n) => {
            use onnx_ir::node::topk::TopKInput;
            let k = match &n.config.k {
                TopKInput::Static(k) => *k,
                TopKInput::Runtime(r) => runtime_ints(ins, r, node)?
                    .first()
                    .copied()
                    .unwrap_or(0)
                    .max(0) as usize,
            };
            index::top_k(x()?, k, n.config.axis, n.config.largest)
        }
        Node::CumSum(n) => {
            use onnx_ir::node::cumsum::CumSumAxis;
            let v = x()?;
            let axis = match &n.config.axis {
                CumSumAxis::Static(a) => *a,
                CumSumAxis::Runtime(r) => {
                    let a = runtime_ints(ins, r, node)?.first().copied().unwrap_or(0);
                    shape::axis_index(a, v.onnx_dims().len())?
                }
            };
            one(index::cum_sum(
                v,
                axis,
                n.config.exclusive,
                n.config.reverse,
            )?)
        }
        Node::OneHot(n) => {
            use onnx_ir::node::one_hot::{OneHotDepthInput, OneHotValuesInput};
            let depth = match &n.config.depth {
                OneHotDepthInput::Static(d) => *d,
                OneHotDepthInput::Runtime(r) => {
                    let v = input(ins, r.input_index, node)?
                        .to_kind(ValueKind::Float)?
                        .to_f32s()?;
                    v.first().copied().unwrap_or(0.0).max(0.0) as usize
                }
            };
            let values = match &n.config.values {
                OneHotValuesInput::Static(v) => *v,
                OneHotValuesInput::Runtime(r) => {
                    let v = input(ins, r.input_index, node)?
                        .to_kind(ValueKind::Float)?
                        .to_f32s()?;
                    match v.as_slice() {
                        [off, on] => [*off, *on],
                        _ => {
                            return Err(OnnxError::Shape(format!(
                                "OneHot values of {} elements",
                                v.len()
                            )));
                        }
                    }
                }
            };
            let kind = n
                .outputs
                .first()
                .and_then(|o| declared_kind(&o.ty))
                .unwrap_or(ValueKind::Float);
            one(index::one_hot(x()?, depth, values, n.config.axis, kind)?)
        }
        Node::NonZero(_) => one(index::non_zero(x()?)?),
        Node::Tile(n) => {
            use onnx_ir::node::tile::TileInput;
            let repeats: Vec<usize> = match &n.config.repeats {
                TileInput::Static(r) => r.clone(),
                TileInput::Runtime(r) => runtime_ints(ins, r, node)?
                    .into_iter()
                    .map(|v| v.max(0) as usize)
                    .collect(),
            };
            one(index::tile(x()?, &repeats)?)
        }
        Node::PRelu(_) => one(math::prelu(x()?, input(ins, 1, node)?)?),
        Node::Elu(n) => unary(Unary::Elu(n.config.alpha as f32), ins, node),
        Node::Selu(n) => unary(
            Unary::Selu(n.config.alpha as f32, n.config.gamma as f32),
            ins,
            node,
        ),
        Node::Celu(n) => unary(Unary::Celu(n.config.alpha as f32), ins, node),
        Node::Mish(_) => unary(Unary::Mish, ins, node),
        Node::Softsign(_) => unary(Unary::Softsign, ins, node),
        Node::ThresholdedRelu(n) => unary(Unary::ThresholdedRelu(n.config.alpha as f32), ins, node),
        Node::Swish(n) => unary(Unary::Swish(n.config.alpha as f32), ins, node),
        Node::Sign(_) => unary(Unary::Sign, ins, node),
        Node::Tan(_) => unary(Unary::Tan, ins, node),
        Node::Asin(_) => unary(Unary::Asin, ins, node),
        Node::Acos(_) => unary(Unary::Acos, ins, node),
        Node::Atan(_) => unary(Unary::Atan, ins, node),
        Node::Sinh(_) => unary(Unary::Sinh, ins, node),
        Node::Cosh(_) => unary(Unary::Cosh, ins, node),
        Node::Asinh(_) => unary(Unary::Asinh, ins, node),
        Node::Acosh(_) => unary(Unary::Acosh, ins, node),
        Node::Atanh(_) => unary(Unary::Atanh, ins, node),
        other => Err(OnnxError::Unsupported(
            unsupported(other).unwrap_or_else(|| other.node_type().to_string()),
        )),
    }
}

/// Runs a recurrent node (inputs X, W, R, B, sequence_lens, initial_h, initial_c), keeping
/// as many outputs as the node declares.
fn recurrent_outputs(
    node: &Node,
    spec: &recurrent::Recurrent,
    ins: Inputs,
    initial_c: Option<Value>,
) -> Result<Vec<Value>, OnnxError> {
    if optional(ins, 4).is_some() {
        return Err(OnnxError::Unsupported(format!(
            "{} with sequence_lens",
            node.node_type()
        )));
    }
    let mut out = recurrent::run(
        spec,
        input(ins, 0, node)?,
        input(ins, 1, node)?,
        input(ins, 2, node)?,
        optional(ins, 3),
        optional(ins, 5),
        initial_c,
    )?;
    out.truncate(node.outputs().len().max(1));
    Ok(out)
}

fn reduce(
    op: Reduce,
    c: &onnx_ir::node::reduce::ReduceConfig,
    ins: Inputs,
    node: &Node,
) -> Result<Vec<Value>, OnnxError> {
    use onnx_ir::node::reduce::ReduceAxes;
    let v = input(ins, 0, node)?;
    let rank = v.onnx_dims().len();
    let axes: Vec<usize> = match &c.axes {
        ReduceAxes::Static(a) => a.clone(),
        ReduceAxes::Runtime(r) => runtime_ints(ins, r, node)?
            .into_iter()
            .map(|a| shape::axis_index(a, rank))
            .collect::<Result<_, _>>()?,
    };
    Ok(vec![nn::reduce(
        op,
        v,
        &axes,
        c.keepdims,
        c.noop_with_empty_axes,
    )?])
}

/// The output `[H, W]` of a `Resize` from its `sizes` or `scales`.
fn resize_size(
    n: &onnx_ir::node::resize::ResizeNode,
    ins: Inputs,
    node: &Node,
    dims: &[usize],
) -> Result<[usize; 2], OnnxError> {
    use onnx_ir::node::resize::{ResizeScales, ResizeSizes};
    let c = &n.config;
    let sizes: Option<Vec<usize>> = match &c.sizes {
        Some(ResizeSizes::Static(s)) => Some(s.clone()),
        Some(ResizeSizes::Runtime(r)) => {
            let v = runtime_ints(ins, r, node)?;
            (!v.is_empty()).then(|| v.into_iter().map(|s| s.max(0) as usize).collect())
        }
        None => None,
    };
    let pick = |v: &[usize]| -> Result<[usize; 2], OnnxError> {
        match v.len() {
            2 => Ok([v[0], v[1]]),
            4 if v[0] == dims[0] && v[1] == dims[1] => Ok([v[2], v[3]]),
            _ => Err(OnnxError::Unsupported(format!(
                "Resize to {v:?} from {dims:?} (only the spatial axes may change)"
            ))),
        }
    };
    if let Some(s) = sizes {
        return pick(&s);
    }
    let scales: Vec<f32> = match &c.scales {
        Some(ResizeScales::Static(s)) => s.clone(),
        Some(ResizeScales::Runtime(r)) => input(ins, r.input_index, node)?.to_f32s()?,
        None => {
            return Err(OnnxError::Graph(format!(
                "Resize `{}` has neither sizes nor scales",
                node.name()
            )));
        }
    };
    let scaled: Vec<usize> = match scales.len() {
        2 => vec![
            (dims[2] as f32 * scales[0]).floor() as usize,
            (dims[3] as f32 * scales[1]).floor() as usize,
        ],
        4 => dims
            .iter()
            .zip(&scales)
            .map(|(&d, &s)| (d as f32 * s).floor() as usize)
            .collect(),
        _ => {
            return Err(OnnxError::Shape(format!(
                "Resize scales {scales:?} for a rank-4 input"
            )));
        }
    };
    pick(&scaled)
}

/// Whether an output declared as `ty` is an ONNX scalar.
pub fn declares_scalar(ty: &ArgType) -> bool {
    matches!(ty, ArgType::ScalarNative(_) | ArgType::ScalarTensor(_))
        || matches!(ty, ArgType::Tensor(t) if t.rank == 0)
}

/// The element kind an output declared as `ty` holds, when it says.
pub fn declared_kind(ty: &ArgType) -> Option<ValueKind> {
    let dtype: DType = match ty {
        ArgType::ScalarNative(d) | ArgType::ScalarTensor(d) => *d,
        ArgType::Tensor(t) => t.dtype,
        ArgType::Shape(_) => return Some(ValueKind::Int),
    };
    super::value::kind_of(dtype).ok()
}
