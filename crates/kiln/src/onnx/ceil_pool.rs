//! `AveragePool` with `ceil_mode = 1` in a model below opset 19: valid ONNX since opset 10
//! (timm's ResNet-D, SE-ResNeXt-D and ResNeSt export it for their average-pool shortcuts), but
//! onnx-ir refuses it ("ceil_mode requires opset 19+"). Before onnx-ir parses the model, each
//! such pool that does not count padding is rewritten to the same pool in floor mode with
//! `stride − 1` more padding at each axis's end: `floor((n + s − 1) / s) = ceil(n / s)` gives
//! the same output size, and the added padding is never counted in an average, as ceil mode's
//! overhanging windows are not. Only where every window still starts inside the input or its
//! leading padding (`end padding + stride ≤ kernel`), so no window lies wholly in the padding.

use onnx_ir::{AttributeProto, ModelProto, NodeProto};

/// Rewrites the ceil-mode average pools onnx-ir refuses; returns how many.
pub fn rewrite_ceil_average_pools(model: &mut ModelProto) -> usize {
    let opset = model
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map_or(0, |o| o.version);
    if opset >= 19 {
        return 0;
    }
    let Some(graph) = model.graph.as_mut() else {
        return 0;
    };
    graph
        .node
        .iter_mut()
        .filter(|n| n.op_type == "AveragePool" && n.domain.is_empty())
        .map(rewrite)
        .filter(|&done| done)
        .count()
}

fn ints(n: &NodeProto, name: &str) -> Option<Vec<i64>> {
    n.attribute
        .iter()
        .find(|a| a.name == name)
        .map(|a| a.ints.clone())
}

fn int(n: &NodeProto, name: &str) -> Option<i64> {
    n.attribute.iter().find(|a| a.name == name).map(|a| a.i)
}

fn set(n: &mut NodeProto, attr: AttributeProto) {
    n.attribute.retain(|a| a.name != attr.name);
    n.attribute.push(attr);
}

/// One pool; `true` when rewritten.
fn rewrite(n: &mut NodeProto) -> bool {
    let auto_pad = n
        .attribute
        .iter()
        .find(|a| a.name == "auto_pad")
        .map(|a| String::from_utf8_lossy(&a.s).to_string());
    if int(n, "ceil_mode") != Some(1)
        || int(n, "count_include_pad").unwrap_or(0) != 0
        || auto_pad.is_some_and(|p| p != "NOTSET")
    {
        return false;
    }
    let Some(kernel) = ints(n, "kernel_shape") else {
        return false;
    };
    let rank = kernel.len();
    let strides = ints(n, "strides").unwrap_or_else(|| vec![1; rank]);
    let mut pads = ints(n, "pads").unwrap_or_else(|| vec![0; 2 * rank]);
    if strides.len() != rank || pads.len() != 2 * rank {
        return false;
    }
    if (0..rank).any(|i| pads[rank + i] + strides[i] > kernel[i]) {
        return false;
    }
    for i in 0..rank {
        pads[rank + i] += strides[i] - 1;
    }
    let mut a = AttributeProto::new();
    a.name = "pads".into();
    a.type_ = onnx_ir::AttributeType::INTS.into();
    a.ints = pads;
    set(n, a);
    let mut c = AttributeProto::new();
    c.name = "ceil_mode".into();
    c.type_ = onnx_ir::AttributeType::INT.into();
    c.i = 0;
    set(n, c);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(ceil: i64, include_pad: i64, kernel: i64, stride: i64) -> NodeProto {
        let mut n = NodeProto::new();
        n.op_type = "AveragePool".into();
        for (name, v) in [("ceil_mode", ceil), ("count_include_pad", include_pad)] {
            let mut a = AttributeProto::new();
            a.name = name.into();
            a.i = v;
            n.attribute.push(a);
        }
        for (name, v) in [("kernel_shape", kernel), ("strides", stride)] {
            let mut a = AttributeProto::new();
            a.name = name.into();
            a.ints = vec![v, v];
            n.attribute.push(a);
        }
        n
    }

    #[test]
    fn ceil_mode_becomes_end_padding_only_where_equivalent() {
        let mut model = ModelProto::new();
        model.opset_import.push(Default::default());
        model.opset_import[0].version = 17;
        let graph = model.graph.mut_or_insert_default();
        graph.node.push(pool(1, 0, 2, 2)); // ResNet-D's shortcut: rewritten
        graph.node.push(pool(1, 1, 2, 2)); // counts padding: left
        graph.node.push(pool(1, 0, 2, 3)); // a window could lie in the padding: left
        graph.node.push(pool(0, 0, 2, 2)); // floor mode already
        assert_eq!(rewrite_ceil_average_pools(&mut model), 1);
        let n = &model.graph.as_ref().unwrap().node[0];
        assert_eq!(ints(n, "pads"), Some(vec![0, 0, 1, 1]));
        assert_eq!(int(n, "ceil_mode"), Some(0));
        assert_eq!(
            int(&model.graph.as_ref().unwrap().node[1], "ceil_mode"),
            Some(1)
        );
    }
}
