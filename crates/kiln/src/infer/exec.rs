//! Runs an inference [`Graph`] on a device: f32 ops through Burn, int8 ops through Kiln's
//! integer kernel on the host.

use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::tensor::module::{adaptive_avg_pool2d, conv2d, linear};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Device, Tensor, TensorData};

use super::graph::{ConvGeometry, Graph, Op, ValueId, Weight};
use super::int8::{self, I16Matrix};
use crate::error::{KilnError, Result};

/// A value flowing through the graph.
#[derive(Debug, Clone)]
enum Value {
    /// `[B, features]`.
    Flat(Tensor<2>),
    /// `[B, C, H, W]`.
    Image(Tensor<4>),
}

/// An op with its constants already on the device (or widened for the int8 kernel).
#[derive(Debug)]
enum Prepared {
    Conv {
        weight: Tensor<4>,
        bias: Option<Tensor<1>>,
        options: ConvOptions<2>,
    },
    Linear {
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
    },
    /// Inference BatchNorm as a per-channel affine map.
    Affine {
        scale: Vec<f32>,
        shift: Vec<f32>,
    },
    Relu,
    MaxPool(MaxPool2d),
    GlobalAvgPool,
    Flatten,
    Add,
    Identity,
    QLinear {
        weight: I16Matrix,
        scales: Vec<f32>,
        bias: Option<Vec<f32>>,
    },
    QConv {
        weight: I16Matrix,
        scales: Vec<f32>,
        bias: Option<Vec<f32>>,
        geometry: ConvGeometry,
    },
}

/// A graph ready to run on a device.
#[derive(Debug)]
pub struct Executor {
    graph: Graph,
    ops: Vec<Prepared>,
    device: Device,
}

fn tensor<const D: usize>(w: &Weight, device: &Device) -> Result<Tensor<D>> {
    let dims: [usize; D] =
        w.shape.clone().try_into().map_err(|_| {
            KilnError::Inference(format!("weight of shape {:?} is not {D}-D", w.shape))
        })?;
    Ok(Tensor::from_data(
        TensorData::new(w.values.clone(), dims),
        device,
    ))
}

fn host_tensor<const D: usize>(values: Vec<f32>, dims: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, dims), device)
}

fn host_values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap_or_default()
}

impl Executor {
    /// Uploads the graph's constants to `device`.
    pub fn new(graph: Graph, device: &Device) -> Result<Self> {
        let mut ops = Vec::with_capacity(graph.nodes.len());
        for node in &graph.nodes {
            ops.push(match &node.op {
                Op::Conv2d {
                    weight,
                    bias,
                    geometry: g,
                } => Prepared::Conv {
                    weight: tensor(weight, device)?,
                    bias: bias.as_ref().map(|b| tensor(b, device)).transpose()?,
                    options: conv_options(g),
                },
                Op::Linear { weight, bias } => Prepared::Linear {
                    weight: tensor(weight, device)?,
                    bias: bias.as_ref().map(|b| tensor(b, device)).transpose()?,
                },
                Op::BatchNorm {
                    gamma,
                    beta,
                    mean,
                    var,
                    eps,
                } => {
                    let scale: Vec<f32> = gamma
                        .iter()
                        .zip(var)
                        .map(|(g, v)| g / (v + *eps as f32).sqrt())
                        .collect();
                    let shift = beta
                        .iter()
                        .zip(mean)
                        .zip(&scale)
                        .map(|((b, m), s)| b - m * s)
                        .collect();
                    Prepared::Affine { scale, shift }
                }
                Op::Relu => Prepared::Relu,
                Op::MaxPool2d { kernel, stride } => {
                    Prepared::MaxPool(MaxPool2dConfig::new(*kernel).with_strides(*stride).init())
                }
                Op::GlobalAvgPool => Prepared::GlobalAvgPool,
                Op::Flatten => Prepared::Flatten,
                Op::Add => Prepared::Add,
                Op::Dropout { .. } => Prepared::Identity,
                Op::QLinear { weight, bias } => Prepared::QLinear {
                    weight: I16Matrix::from_weights(weight),
                    scales: weight.scales.clone(),
                    bias: bias.clone(),
                },
                Op::QConv2d {
                    weight,
                    bias,
                    geometry,
                } => Prepared::QConv {
                    weight: I16Matrix::from_weights(weight),
                    scales: weight.scales.clone(),
                    bias: bias.clone(),
                    geometry: *geometry,
                },
            });
        }
        Ok(Executor {
            graph,
            ops,
            device: device.clone(),
        })
    }

    /// The graph being run.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The device it runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Logits `[B, classes]` for images `[B, C, H, W]`.
    pub fn forward(&self, images: Tensor<4>) -> Result<Tensor<2>> {
        let [_, c, h, w] = images.dims();
        if [c, h, w] != self.graph.input_shape {
            return Err(KilnError::Shape(format!(
                "images have shape [B, {c}, {h}, {w}] but the model expects [B, {}, {}, {}]",
                self.graph.input_shape[0], self.graph.input_shape[1], self.graph.input_shape[2]
            )));
        }
        let mut values: Vec<Option<Value>> = vec![None; self.graph.next_value()];
        values[Graph::INPUT] = Some(Value::Image(images));
        // Free each value after its last use: peak memory is the live set, not the graph.
        let mut remaining: Vec<usize> = (0..values.len()).map(|v| self.graph.uses(v)).collect();
        for (node, op) in self.graph.nodes.iter().zip(&self.ops) {
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for &v in &node.inputs {
                let value = take_or_clone(&mut values, &mut remaining, v, &node.name)?;
                inputs.push(value);
            }
            let out = run(op, inputs, &self.device)
                .map_err(|e| KilnError::Inference(format!("node `{}`: {e}", node.name)))?;
            values[node.output] = Some(out);
        }
        match take_or_clone(&mut values, &mut remaining, self.graph.output, "output")? {
            Value::Flat(t) => Ok(t),
            Value::Image(t) => {
                let [b, ..] = t.dims();
                Ok(t.reshape([b as i32, -1]))
            }
        }
    }
}

fn take_or_clone(
    values: &mut [Option<Value>],
    remaining: &mut [usize],
    v: ValueId,
    node: &str,
) -> Result<Value> {
    remaining[v] = remaining[v].saturating_sub(1);
    let slot = &mut values[v];
    let value = if remaining[v] == 0 {
        slot.take()
    } else {
        slot.clone()
    };
    value.ok_or_else(|| KilnError::Inference(format!("node `{node}` reads undefined value {v}")))
}

fn conv_options(g: &ConvGeometry) -> ConvOptions<2> {
    let [top, left, bottom, right] = g.pads;
    ConvOptions::new_with_padding(
        g.stride,
        [(top, bottom), (left, right)],
        g.dilation,
        g.groups,
    )
}

fn image(v: Value) -> std::result::Result<Tensor<4>, String> {
    match v {
        Value::Image(t) => Ok(t),
        Value::Flat(t) => Err(format!("expects an image, got {:?}", t.dims())),
    }
}

fn flat(v: Value) -> std::result::Result<Tensor<2>, String> {
    match v {
        Value::Flat(t) => Ok(t),
        Value::Image(t) => Err(format!("expects a flat batch, got {:?}", t.dims())),
    }
}

fn run(
    op: &Prepared,
    mut inputs: Vec<Value>,
    device: &Device,
) -> std::result::Result<Value, String> {
    let x = inputs.remove(0);
    Ok(match op {
        Prepared::Conv {
            weight,
            bias,
            options,
        } => Value::Image(conv2d(
            image(x)?,
            weight.clone(),
            bias.clone(),
            options.clone(),
        )),
        Prepared::Linear { weight, bias } => {
            Value::Flat(linear(flat(x)?, weight.clone(), bias.clone()))
        }
        Prepared::Affine { scale, shift } => {
            let c = scale.len();
            match x {
                Value::Image(t) => {
                    let s = host_tensor(scale.clone(), [1, c, 1, 1], device);
                    let b = host_tensor(shift.clone(), [1, c, 1, 1], device);
                    Value::Image(t * s + b)
                }
                Value::Flat(t) => {
                    let s = host_tensor(scale.clone(), [1, c], device);
                    let b = host_tensor(shift.clone(), [1, c], device);
                    Value::Flat(t * s + b)
                }
            }
        }
        Prepared::Relu => match x {
            Value::Image(t) => Value::Image(burn::tensor::activation::relu(t)),
            Value::Flat(t) => Value::Flat(burn::tensor::activation::relu(t)),
        },
        Prepared::MaxPool(pool) => Value::Image(pool.forward(image(x)?)),
        Prepared::GlobalAvgPool => Value::Image(adaptive_avg_pool2d(image(x)?, [1, 1])),
        Prepared::Flatten => match x {
            Value::Image(t) => Value::Flat(t.flatten(1, 3)),
            flat @ Value::Flat(_) => flat,
        },
        Prepared::Add => {
            let y = inputs.pop().ok_or("Add needs two inputs")?;
            match (x, y) {
                (Value::Image(a), Value::Image(b)) => Value::Image(a + b),
                (Value::Flat(a), Value::Flat(b)) => Value::Flat(a + b),
                _ => return Err("Add of an image and a flat batch".into()),
            }
        }
        Prepared::Identity => x,
        Prepared::QLinear {
            weight,
            scales,
            bias,
        } => {
            let x = flat(x)?;
            let [b, k] = x.dims();
            let values = host_values(x);
            let y = quantized_matmul(&values, k, weight, scales, bias.as_deref());
            Value::Flat(host_tensor(y, [b, weight.rows], device))
        }
        Prepared::QConv {
            weight,
            scales,
            bias,
            geometry,
        } => {
            let x = image(x)?;
            let dims = x.dims();
            let values = host_values(x);
            let (y, out_dims) =
                quantized_conv(&values, dims, weight, scales, bias.as_deref(), geometry)?;
            Value::Image(host_tensor(y, out_dims, device))
        }
    })
}

/// `x [m × k] → [m × n]`: quantize x per batch, integer matmul, dequantize, add the bias.
fn quantized_matmul(
    x: &[f32],
    k: usize,
    weight: &I16Matrix,
    scales: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let sx = int8::activation_scale(x);
    let a = int8::quantize_activations(x, k, sx);
    let acc = int8::gemm_abt(&a, weight);
    let n = weight.rows;
    let combined: Vec<f32> = scales.iter().map(|s| s * sx).collect();
    acc.chunks_exact(n)
        .flat_map(|row| {
            row.iter()
                .enumerate()
                .map(|(j, v)| *v as f32 * combined[j] + bias.map_or(0.0, |b| b[j]))
        })
        .collect()
}

/// Int8 convolution: quantize the input once, unfold patches (im2col) in the layout of the
/// weight rows `[ci, kh, kw]`, integer matmul, dequantize into NCHW.
fn quantized_conv(
    x: &[f32],
    [b, ci, h, w]: [usize; 4],
    weight: &I16Matrix,
    scales: &[f32],
    bias: Option<&[f32]>,
    g: &ConvGeometry,
) -> std::result::Result<(Vec<f32>, [usize; 4]), String> {
    if g.groups != 1 {
        return Err("grouped int8 convolution is not supported".into());
    }
    let [kh, kw] = g.kernel;
    let [top, left, bottom, right] = g.pads;
    let span = |k: usize, axis: usize| g.dilation[axis] * (k - 1) + 1;
    let (hp, wp) = (h + top + bottom, w + left + right);
    if hp < span(kh, 0) || wp < span(kw, 1) {
        return Err(format!("input {h}×{w} is smaller than the kernel"));
    }
    let ho = (hp - span(kh, 0)) / g.stride[0] + 1;
    let wo = (wp - span(kw, 1)) / g.stride[1] + 1;
    let k = ci * kh * kw;
    let kp = int8::padded(k);
    let sx = int8::activation_scale(x);
    let inv = 1.0 / sx;
    let q: Vec<i16> = x
        .iter()
        .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i16)
        .collect();
    let mut patches = vec![0i16; b * ho * wo * kp];
    use rayon::prelude::*;
    patches
        .par_chunks_mut(ho * wo * kp)
        .enumerate()
        .for_each(|(n, sample)| {
            let src = &q[n * ci * h * w..(n + 1) * ci * h * w];
            for oy in 0..ho {
                for ox in 0..wo {
                    let row = &mut sample[(oy * wo + ox) * kp..][..kp];
                    let mut idx = 0;
                    for c in 0..ci {
                        for ky in 0..kh {
                            let iy =
                                (oy * g.stride[0] + ky * g.dilation[0]) as isize - top as isize;
                            for kx in 0..kw {
                                let ix = (ox * g.stride[1] + kx * g.dilation[1]) as isize
                                    - left as isize;
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                    row[idx] = src[c * h * w + iy as usize * w + ix as usize];
                                }
                                idx += 1;
                            }
                        }
                    }
                }
            }
        });
    let a = I16Matrix {
        rows: b * ho * wo,
        cols: k,
        data: patches,
    };
    let acc = int8::gemm_abt(&a, weight);
    let co = weight.rows;
    let mut y = vec![0f32; b * co * ho * wo];
    let combined: Vec<f32> = scales.iter().map(|s| s * sx).collect();
    y.par_chunks_mut(co * ho * wo)
        .enumerate()
        .for_each(|(n, out)| {
            for p in 0..ho * wo {
                let row = &acc[(n * ho * wo + p) * co..][..co];
                for (c, v) in row.iter().enumerate() {
                    out[c * ho * wo + p] = *v as f32 * combined[c] + bias.map_or(0.0, |bb| bb[c]);
                }
            }
        });
    Ok((y, [b, co, ho, wo]))
}
