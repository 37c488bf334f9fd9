//! The inference graph: a flat list of operations over numbered values, with the weights on
//! the host. Zoo models are lowered into it once; the passes rewrite it; the executor runs it
//! on a device; the ONNX exporter serializes it. One representation keeps all four in
//! agreement — what is exported is exactly what was measured.

use serde::{Deserialize, Serialize};

use crate::precision::Precision;

// The int8 kernels' weight and geometry types are part of the graph (and its file format).
pub use kiln_kernels::int8::{ConvGeometry, QuantWeight};

/// A constant tensor on the host (weights, statistics).
///
/// `values` are f32 in memory whatever the weight's [`Precision`]; a half-precision weight
/// (the `f16` / `bf16` passes) holds values exactly representable in that type and is stored
/// in graph files at 2 bytes per element.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "WeightRepr", try_from = "WeightRepr")]
pub struct Weight {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub values: Vec<f32>,
    /// The precision the weight is stored and computed in.
    pub precision: Precision,
}

impl Weight {
    /// An f32 weight, checking that the values fill the shape.
    pub fn new(shape: Vec<usize>, values: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), values.len());
        Weight {
            shape,
            values,
            precision: Precision::F32,
        }
    }

    /// The weight rounded to `precision` (to nearest, ties to even), marked as such.
    pub fn rounded_to(&self, precision: Precision) -> Self {
        let values = self
            .values
            .iter()
            .map(|&v| round_to(v, precision))
            .collect();
        Weight {
            shape: self.shape.clone(),
            values,
            precision,
        }
    }

    /// Bytes per element as stored.
    pub fn element_bytes(&self) -> usize {
        match self.precision {
            Precision::F32 => 4,
            Precision::F16 | Precision::Bf16 => 2,
        }
    }

    /// Bytes as stored.
    pub fn bytes(&self) -> usize {
        self.len() * self.element_bytes()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

/// `v` rounded to the nearest value of `precision` (ties to even), as f32.
pub fn round_to(v: f32, precision: Precision) -> f32 {
    match precision {
        Precision::F32 => v,
        Precision::F16 => half::f16::from_f32(v).to_f32(),
        Precision::Bf16 => half::bf16::from_f32(v).to_f32(),
    }
}

/// A weight as stored in graph files: its values as a byte string of little-endian elements
/// of its precision (4 bytes per f32, 2 per f16/bf16) rather than a CBOR array of numbers, so
/// the file size is the weights' size. Files written before weights had a precision have no
/// `precision` field and read as f32.
#[derive(Serialize, Deserialize)]
struct WeightRepr {
    shape: Vec<usize>,
    #[serde(with = "serde_bytes")]
    values: Vec<u8>,
    #[serde(default, skip_serializing_if = "is_f32")]
    precision: Precision,
}

fn is_f32(p: &Precision) -> bool {
    *p == Precision::F32
}

impl From<Weight> for WeightRepr {
    fn from(w: Weight) -> Self {
        let values = match w.precision {
            Precision::F32 => w.values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Precision::F16 => w
                .values
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            Precision::Bf16 => w
                .values
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        };
        WeightRepr {
            shape: w.shape,
            values,
            precision: w.precision,
        }
    }
}

impl TryFrom<WeightRepr> for Weight {
    type Error = String;

    fn try_from(r: WeightRepr) -> Result<Self, String> {
        let width = match r.precision {
            Precision::F32 => 4,
            Precision::F16 | Precision::Bf16 => 2,
        };
        let count: usize = r.shape.iter().product();
        if r.values.len() != count * width {
            return Err(format!(
                "a {} weight of shape {:?} needs {} bytes, the file holds {}",
                r.precision.name(),
                r.shape,
                count * width,
                r.values.len()
            ));
        }
        let values = match r.precision {
            Precision::F32 => r
                .values
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Precision::F16 => r
                .values
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Precision::Bf16 => r
                .values
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        };
        Ok(Weight {
            shape: r.shape,
            values,
            precision: r.precision,
        })
    }
}

/// One operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// `[B, Ci, H, W] → [B, Co, H', W']`; weight `[Co, Ci/groups, kh, kw]`, bias `[Co]`.
    Conv2d {
        /// Kernel.
        weight: Weight,
        /// Bias.
        bias: Option<Weight>,
        /// Geometry.
        geometry: ConvGeometry,
    },
    /// `[B, in] → [B, out]`, or `[B, T, in] → [B, T, out]` on a sequence (per token); an
    /// image input is flattened first. Weight `[in, out]` (Burn's layout), bias `[out]`.
    Linear {
        /// Weight.
        weight: Weight,
        /// Bias.
        bias: Option<Weight>,
    },
    /// Inference BatchNorm over channel axis 1: `(x − mean) / sqrt(var + eps) · gamma + beta`.
    BatchNorm {
        /// Scale.
        gamma: Vec<f32>,
        /// Shift.
        beta: Vec<f32>,
        /// Running mean.
        mean: Vec<f32>,
        /// Running variance.
        var: Vec<f32>,
        /// Epsilon.
        eps: f64,
    },
    /// Elementwise max(x, 0).
    Relu,
    /// Max pooling without padding.
    MaxPool2d {
        /// Window.
        kernel: [usize; 2],
        /// Stride.
        stride: [usize; 2],
    },
    /// Mean over H and W: `[B, C, H, W] → [B, C, 1, 1]`.
    GlobalAvgPool,
    /// `[B, ...] → [B, product]`.
    Flatten,
    /// Elementwise sum of two values of the same shape.
    Add,
    /// Identity at inference; removed by the `strip` pass. Kept by lowering so that the graph
    /// says what the trained model held.
    Dropout {
        /// Training-time drop probability.
        prob: f64,
    },
    /// `[B, ...] → [B, shape...]`: the per-sample dims change, the values' order does not
    /// (W4 reads its `[1, 28, 28]` images as 28 tokens of 28 features).
    Reshape {
        /// Per-sample target shape (the batch dimension is kept).
        shape: Vec<usize>,
    },
    /// `x + constant`, the constant broadcast from the right (a learned position embedding
    /// `[1, T, D]`, or a bias `[D]` an importer could not fold into its matmul).
    AddConstant {
        /// The constant.
        value: Weight,
    },
    /// Layer normalization over the last axis: `(x − mean) / sqrt(var + eps) · gamma + beta`
    /// with the biased variance (Burn's and ONNX's `LayerNormalization`).
    LayerNorm {
        /// Scale `[D]`.
        gamma: Vec<f32>,
        /// Shift `[D]`.
        beta: Option<Vec<f32>>,
        /// Epsilon.
        eps: f64,
    },
    /// Scaled dot-product attention over already-projected queries, keys and values (three
    /// inputs, each `[B, T, D]`): split into `heads` heads of `D / heads` features,
    /// `softmax(q·kᵀ / sqrt(D / heads)) · v` per head, heads concatenated back to `[B, T, D]`.
    /// The projections around it are ordinary [`Op::Linear`] nodes, so the passes (int8)
    /// reach them.
    Attention {
        /// Number of heads.
        heads: usize,
        /// Features per head (`D / heads`).
        head_dim: usize,
    },
    /// Mean over the tokens: `[B, T, D] → [B, D]`.
    TokenMean,
    /// Int8 dynamic-quantized linear: activations quantized per batch, integer matmul with
    /// i32 accumulation, dequantized with the activation scale × each channel's weight scale.
    QLinear {
        /// Quantized weights, `out × in`.
        weight: QuantWeight,
        /// f32 bias `[out]`.
        bias: Option<Vec<f32>>,
        /// A following ReLU fused into the dequantization.
        relu: bool,
    },
    /// Int8 dynamic-quantized convolution (im2col + the int8 matmul).
    QConv2d {
        /// Quantized weights, `Co × (Ci/groups · kh · kw)`.
        weight: QuantWeight,
        /// f32 bias `[Co]`.
        bias: Option<Vec<f32>>,
        /// Geometry.
        geometry: ConvGeometry,
        /// A following ReLU fused into the dequantization.
        relu: bool,
    },
}

pub use kiln_kernels::norm::batch_norm_affine;

impl Op {
    /// The op's name in reports and errors (ONNX's where one exists).
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Conv2d { .. } => "Conv",
            Op::Linear { .. } => "Gemm",
            Op::BatchNorm { .. } => "BatchNormalization",
            Op::Relu => "Relu",
            Op::MaxPool2d { .. } => "MaxPool",
            Op::GlobalAvgPool => "GlobalAveragePool",
            Op::Flatten => "Flatten",
            Op::Add => "Add",
            Op::Dropout { .. } => "Dropout",
            Op::Reshape { .. } => "Reshape",
            Op::AddConstant { .. } => "Add",
            Op::LayerNorm { .. } => "LayerNormalization",
            Op::Attention { .. } => "MultiHeadAttention",
            Op::TokenMean => "ReduceMean",
            Op::QLinear { .. } => "QLinear(int8)",
            Op::QConv2d { .. } => "QConv(int8)",
        }
    }

    /// Bytes of constants this op holds (weights, statistics).
    pub fn weight_bytes(&self) -> usize {
        let f = |w: &Weight| w.bytes();
        let of = |w: &Option<Weight>| w.as_ref().map_or(0, f);
        let ov = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| v.len() * 4);
        match self {
            Op::Conv2d { weight, bias, .. } | Op::Linear { weight, bias } => f(weight) + of(bias),
            Op::BatchNorm { gamma, .. } => gamma.len() * 16,
            Op::AddConstant { value } => f(value),
            Op::LayerNorm { gamma, beta, .. } => {
                (gamma.len() + beta.as_ref().map_or(0, Vec::len)) * 4
            }
            Op::QLinear { weight, bias, .. } | Op::QConv2d { weight, bias, .. } => {
                weight.values.len() + weight.scales.len() * 4 + ov(bias)
            }
            _ => 0,
        }
    }
}

/// Identifies a value: 0 is the graph input, each node defines one more.
pub type ValueId = usize;

/// One node: an op applied to values, defining a new value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// The module path it came from (`blocks.3.conv1`), for reports and errors.
    pub name: String,
    /// The operation.
    pub op: Op,
    /// Input values.
    pub inputs: Vec<ValueId>,
    /// The value it defines.
    pub output: ValueId,
}

/// A model as a graph: one input `[B, C, H, W]`, one output `[B, classes]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    /// Zoo model name.
    pub model: String,
    /// Per-sample input shape `[C, H, W]`.
    pub input_shape: [usize; 3],
    /// Nodes in execution order.
    pub nodes: Vec<Node>,
    /// The value holding the logits.
    pub output: ValueId,
    /// The precision convolutions, linear layers and attention products compute in (set by
    /// the `f16` / `bf16` passes, which also round those layers' weights to it). Everything
    /// else — normalization, softmax, pooling, residual adds — stays f32, as in mixed-precision
    /// training. Absent in older files: f32.
    #[serde(default)]
    pub precision: Precision,
    /// Convolutions kept on the implicit GEMM although the kernels' rule would run them as
    /// Winograd F(2×2, 3×3): `kiln optimize` measured Winograd slower for them on the
    /// machine it ran on ([`crate::infer::choose_winograd`]). Absent in older files: none.
    #[serde(default)]
    pub direct_convs: std::collections::BTreeSet<String>,
}

impl Graph {
    /// An empty graph over an input of `[C, H, W]` samples.
    pub fn new(model: &str, input_shape: [usize; 3]) -> Self {
        Graph {
            model: model.to_string(),
            input_shape,
            nodes: Vec::new(),
            output: 0,
            precision: Precision::F32,
            direct_convs: Default::default(),
        }
    }

    /// The graph's input value.
    pub const INPUT: ValueId = 0;

    /// Appends a node and returns the value it defines (which becomes the output).
    pub fn push(&mut self, name: impl Into<String>, op: Op, inputs: Vec<ValueId>) -> ValueId {
        let output = self.next_value();
        self.nodes.push(Node {
            name: name.into(),
            op,
            inputs,
            output,
        });
        self.output = output;
        output
    }

    /// A value id not used yet.
    pub fn next_value(&self) -> ValueId {
        self.nodes.iter().map(|n| n.output).max().unwrap_or(0) + 1
    }

    /// Total bytes of constants.
    pub fn weight_bytes(&self) -> usize {
        self.nodes.iter().map(|n| n.op.weight_bytes()).sum()
    }

    /// How many nodes use `value` as an input.
    pub fn uses(&self, value: ValueId) -> usize {
        self.nodes
            .iter()
            .map(|n| n.inputs.iter().filter(|&&v| v == value).count())
            .sum::<usize>()
            + usize::from(self.output == value)
    }

    /// Replaces every use of `old` with `new` (inputs and the graph output).
    pub fn rename_uses(&mut self, old: ValueId, new: ValueId) {
        for n in &mut self.nodes {
            for v in &mut n.inputs {
                if *v == old {
                    *v = new;
                }
            }
        }
        if self.output == old {
            self.output = new;
        }
    }

    /// The rank of every value (indexed by [`ValueId`]; the input is 4: `[B, C, H, W]`), so
    /// the ONNX writer can pick `Gemm` for a batch of vectors and `MatMul` for a sequence.
    pub fn ranks(&self) -> Vec<usize> {
        let mut ranks = vec![0; self.next_value()];
        ranks[Self::INPUT] = 4;
        for n in &self.nodes {
            // An input that is never defined (a malformed file) has rank 0; the executor
            // reports it by name.
            let input = n
                .inputs
                .first()
                .and_then(|&v| ranks.get(v).copied())
                .unwrap_or(0);
            ranks[n.output] = match &n.op {
                Op::Flatten | Op::TokenMean => 2,
                Op::Reshape { shape } => shape.len() + 1,
                Op::Attention { .. } => 3,
                // A linear layer flattens an image; a sequence stays one.
                Op::Linear { .. } | Op::QLinear { .. } => {
                    if input == 3 {
                        3
                    } else {
                        2
                    }
                }
                Op::Conv2d { .. } | Op::QConv2d { .. } | Op::MaxPool2d { .. } => 4,
                Op::GlobalAvgPool => 4,
                Op::BatchNorm { .. }
                | Op::Relu
                | Op::Add
                | Op::Dropout { .. }
                | Op::AddConstant { .. }
                | Op::LayerNorm { .. } => input,
            };
        }
        ranks
    }

    /// Counts of each op kind, for reports (`Conv ×20, BatchNormalization ×20, ...`).
    pub fn op_counts(&self) -> Vec<(&'static str, usize)> {
        let mut counts: Vec<(&'static str, usize)> = Vec::new();
        for n in &self.nodes {
            match counts.iter_mut().find(|(k, _)| *k == n.op.kind()) {
                Some((_, c)) => *c += 1,
                None => counts.push((n.op.kind(), 1)),
            }
        }
        counts
    }
}
