//! Graph passes: each rewrites an inference [`Graph`] and says what it changed.

mod fold;
mod half;
mod quantize;
mod strip;

use serde::Serialize;

use super::graph::Graph;
use crate::error::{KilnError, Result};
use crate::precision::Precision;

pub use fold::{fold_batch_norm, fold_into_outer_channels};
pub use half::to_half_precision;
pub use quantize::{int8_candidate, quantize_int8, quantize_int8_layers};
pub use strip::strip_train_only;

/// A graph pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Pass {
    /// Remove train-only layers (dropout).
    Strip,
    /// Fold inference BatchNorm into the preceding convolution or linear layer.
    Fold,
    /// Winograd F(2×2, 3×3) for the 3×3 stride-1 convolutions the kernels' rule takes (a
    /// static threshold; without this pass the rule applies as is). `kiln optimize` measures
    /// it layer by layer and keeps a layer on the implicit GEMM where Winograd timed slower
    /// ([`crate::infer::choose_winograd`]); applied unmeasured, it clears those marks.
    Winograd,
    /// Int8 dynamic quantization of linear and convolution layers.
    Int8,
    /// Convolution and linear weights in IEEE half precision, those layers computed in it
    /// (for GPU inference; on a CPU without native f16 it is emulated and slow).
    F16,
    /// As [`Pass::F16`] in bfloat16.
    Bf16,
    /// Image layers channels-last on Kiln's CPU kernels (with its linear and attention
    /// kernels): the default on a CPU, no rewrite of the graph. `kiln optimize` times the
    /// model on them against Burn's ops on NCHW tensors and, where Burn's are faster at every
    /// batch, writes `kiln_kernels = false` into the serving config
    /// ([`crate::infer::kernels_pay`]).
    ChannelsLast,
}

impl Pass {
    /// The CPU optimization passes, in the order they are best applied (what `kiln optimize`
    /// and the `kiln-int8` benchmark case apply by default).
    pub const ALL: [Pass; 5] = [
        Pass::Strip,
        Pass::Fold,
        Pass::Winograd,
        Pass::Int8,
        Pass::ChannelsLast,
    ];

    /// Every pass there is, for parsing and help.
    pub const KNOWN: [Pass; 7] = [
        Pass::Strip,
        Pass::Fold,
        Pass::Winograd,
        Pass::Int8,
        Pass::F16,
        Pass::Bf16,
        Pass::ChannelsLast,
    ];

    /// Config / CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Strip => "strip",
            Pass::Fold => "fold",
            Pass::Winograd => "winograd",
            Pass::Int8 => "int8",
            Pass::F16 => "f16",
            Pass::Bf16 => "bf16",
            Pass::ChannelsLast => "channels-last",
        }
    }

    /// Parses a comma-separated list (`fold,int8`); an empty string is no passes.
    pub fn parse_list(list: &str) -> Result<Vec<Pass>> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                Pass::KNOWN
                    .into_iter()
                    .find(|p| p.name() == s)
                    .ok_or_else(|| KilnError::InvalidValue {
                        key: "passes".into(),
                        value: s.to_string(),
                        expected: "a comma-separated list of strip, fold, winograd, int8, f16, \
                                   bf16, channels-last"
                            .into(),
                    })
            })
            .collect()
    }

    /// Whether the pass can make a model slower on some machine: `kiln optimize` keeps it
    /// only where it measures faster.
    pub fn can_lose(self) -> bool {
        matches!(
            self,
            Pass::Winograd | Pass::Int8 | Pass::F16 | Pass::Bf16 | Pass::ChannelsLast
        )
    }

    /// Applies the pass to `graph`, returning one line per change.
    pub fn apply(self, graph: &mut Graph) -> Result<Vec<String>> {
        match self {
            Pass::Strip => Ok(strip_train_only(graph)),
            Pass::Fold => Ok(fold_batch_norm(graph)),
            Pass::Winograd => {
                graph.direct_convs.clear();
                Ok(Vec::new())
            }
            Pass::Int8 => quantize_int8(graph),
            Pass::F16 => to_half_precision(graph, Precision::F16),
            Pass::Bf16 => to_half_precision(graph, Precision::Bf16),
            // A choice of kernels, not of the graph: `kiln optimize` measures it.
            Pass::ChannelsLast => Ok(Vec::new()),
        }
    }
}

/// What one pass did.
#[derive(Debug, Clone, Serialize)]
pub struct PassReport {
    /// The pass.
    pub pass: Pass,
    /// Nodes before and after.
    pub nodes: (usize, usize),
    /// Bytes of constants before and after.
    pub weight_bytes: (usize, usize),
    /// One line per rewritten node.
    pub changes: Vec<String>,
}

/// Applies `passes` in order, reporting each.
pub fn run_passes(graph: &mut Graph, passes: &[Pass]) -> Result<Vec<PassReport>> {
    let mut reports = Vec::new();
    for &pass in passes {
        let before = (graph.nodes.len(), graph.weight_bytes());
        let changes = pass.apply(graph)?;
        reports.push(PassReport {
            pass,
            nodes: (before.0, graph.nodes.len()),
            weight_bytes: (before.1, graph.weight_bytes()),
            changes,
        });
    }
    Ok(reports)
}
