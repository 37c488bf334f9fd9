//! Int8 dynamic quantization of linear and convolution layers.

use std::collections::BTreeSet;

use crate::error::Result;
use crate::infer::graph::{Graph, Node, Op};
use kiln_kernels::int8::quantize_rows;

/// Replaces each Linear with a QLinear and each ungrouped Conv2d with a QConv2d (per-channel
/// symmetric int8 weights; activations are quantized per batch when the graph runs).
/// Grouped and depthwise convolutions stay f32 (the integer kernel multiplies whole
/// channels; a change line says which).
pub fn quantize_int8(graph: &mut Graph) -> Result<Vec<String>> {
    quantize_int8_layers(graph, None)
}

/// Whether the int8 pass can quantize `node` (a linear layer or an ungrouped convolution).
pub fn int8_candidate(node: &Node) -> bool {
    match &node.op {
        Op::Linear { .. } => true,
        Op::Conv2d { geometry, .. } => geometry.groups == 1,
        _ => false,
    }
}

/// [`quantize_int8`] on the layers named in `only` (every candidate when `None`): what
/// [`crate::infer::choose_int8`] applies after measuring which layers int8 speeds up.
pub fn quantize_int8_layers(
    graph: &mut Graph,
    only: Option<&BTreeSet<String>>,
) -> Result<Vec<String>> {
    let mut changes = Vec::new();
    for node in &mut graph.nodes {
        if only.is_some_and(|names| !names.contains(&node.name)) {
            continue;
        }
        let replacement = match &node.op {
            Op::Linear { weight, bias } => {
                let (k, n) = (weight.shape[0], weight.shape[1]);
                // Burn stores [in, out]; the kernel wants one row per output channel.
                let mut rows = vec![0f32; n * k];
                for (i, row) in weight.values.chunks_exact(n).enumerate() {
                    for (j, v) in row.iter().enumerate() {
                        rows[j * k + i] = *v;
                    }
                }
                Op::QLinear {
                    weight: quantize_rows(&rows, n, k),
                    bias: bias.as_ref().map(|b| b.values.clone()),
                    relu: false,
                }
            }
            Op::Conv2d {
                weight,
                bias,
                geometry,
            } => {
                if geometry.groups != 1 {
                    changes.push(format!(
                        "{}: Conv2d with groups = {} stays f32",
                        node.name, geometry.groups
                    ));
                    continue;
                }
                let co = weight.shape[0];
                let cols = weight.len() / co;
                Op::QConv2d {
                    weight: quantize_rows(&weight.values, co, cols),
                    bias: bias.as_ref().map(|b| b.values.clone()),
                    geometry: *geometry,
                    relu: false,
                }
            }
            _ => continue,
        };
        changes.push(format!(
            "{}: {} → {} ({} → {} bytes)",
            node.name,
            node.op.kind(),
            replacement.kind(),
            node.op.weight_bytes(),
            replacement.weight_bytes()
        ));
        node.op = replacement;
    }
    changes.extend(fuse_relu(graph));
    Ok(changes)
}

/// Folds each ReLU that is the only consumer of a quantized op into that op's dequantization
/// (one pass over the activations fewer).
fn fuse_relu(graph: &mut Graph) -> Vec<String> {
    let mut changes = Vec::new();
    let mut i = 0;
    while i < graph.nodes.len() {
        let input = graph.nodes[i].inputs.first().copied();
        let is_relu = matches!(graph.nodes[i].op, Op::Relu);
        let producer = input.and_then(|v| graph.nodes.iter().position(|n| n.output == v));
        let fusable = is_relu
            && producer.is_some_and(|p| {
                graph.uses(graph.nodes[p].output) == 1
                    && matches!(graph.nodes[p].op, Op::QLinear { .. } | Op::QConv2d { .. })
            });
        let Some(p) = producer.filter(|_| fusable) else {
            i += 1;
            continue;
        };
        if let Op::QLinear { relu, .. } | Op::QConv2d { relu, .. } = &mut graph.nodes[p].op {
            *relu = true;
        }
        let node = graph.nodes.remove(i);
        graph.rename_uses(node.output, graph.nodes[p].output);
        changes.push(format!("fused {} into {}", node.name, graph.nodes[p].name));
    }
    changes
}
