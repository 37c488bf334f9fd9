//! Removes layers that only matter in training.

use crate::infer::graph::{Graph, Op};

/// Drops every `Dropout` node (identity at inference), rewiring its users to its input.
pub fn strip_train_only(graph: &mut Graph) -> Vec<String> {
    let mut changes = Vec::new();
    let mut i = 0;
    while i < graph.nodes.len() {
        if let Op::Dropout { prob } = graph.nodes[i].op {
            let node = graph.nodes.remove(i);
            graph.rename_uses(node.output, node.inputs[0]);
            changes.push(format!("removed {} (Dropout p={prob})", node.name));
        } else {
            i += 1;
        }
    }
    changes
}
