//! BatchNorm under data parallelism (SyncBatchNorm). Kiln's BatchNorm ([`crate::nn::BatchNorm`])
//! sums its batch statistics over the ranks while the trainer holds a [`sync_scope`]
//! ([`crate::kernels::stats_sync`]), so N ranks normalize every micro-batch with the
//! statistics of the global micro-batch and train the model one process trains with it.
//! Burn's own `BatchNorm` cannot: after the first micro-batch the trainer checks that every
//! BatchNorm layer of the model synchronized ([`check_synchronized`]) and stops with the fix
//! otherwise, before any replica could drift.

use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;

use super::{Collective, ReduceOp};
use crate::error::{KilnError, Result};
use crate::kernels::stats_sync::{self, StatsSync};

/// A BatchNorm layer of a model: where it is and its scale's parameter id.
#[derive(Debug, Clone)]
pub struct BatchNormLayer {
    /// The layer's path in the model (`layer1.0.bn1`).
    pub path: String,
    gamma: ParamId,
}

/// The model's BatchNorm layers (Kiln's and Burn's alike: both name their struct
/// `BatchNorm`), in module order.
pub fn batch_norm_layers<M: Module>(model: &M) -> Vec<BatchNormLayer> {
    #[derive(Default)]
    struct Find {
        path: Vec<String>,
        /// The path of the BatchNorm entered whose γ (its first parameter) comes next.
        pending: Option<String>,
        found: Vec<BatchNormLayer>,
    }
    impl ModuleVisitor for Find {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            // Burn enters each field with the type of the struct it belongs to: a
            // BatchNorm's `gamma` field is its scale, and the layer is the path above it.
            if name == "gamma" && container_type.ends_with("BatchNorm") {
                self.pending = Some(self.path.join("."));
            }
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(path) = self.pending.take() {
                self.found.push(BatchNormLayer {
                    path,
                    gamma: param.id,
                });
            }
        }
    }
    let mut find = Find::default();
    model.visit(&mut find);
    find.found
}

/// Synchronized BatchNorm statistics on this thread over `collective` until dropped.
pub fn sync_scope(collective: Arc<dyn Collective>) -> StatsSync {
    StatsSync::enter(Box::new(move |buf| {
        collective.all_reduce_f64(buf, ReduceOp::Sum)
    }))
}

/// After a training micro-batch inside [`sync_scope`]: an error naming the first of `layers`
/// that normalized with this rank's statistics only, and the fix.
pub fn check_synchronized(layers: &[BatchNormLayer]) -> Result<()> {
    match layers.iter().find(|l| !stats_sync::was_synced(l.gamma)) {
        None => Ok(()),
        Some(layer) => Err(KilnError::Inconsistent(format!(
            "data parallelism with BatchNorm (`{}`): the layer normalized with this rank's own \
             batch statistics, so the replicas would not train the model that one process \
             does. Kiln's BatchNorm synchronizes them over the ranks: use \
             `kiln::nn::BatchNorm` (a drop-in for Burn's: `kiln::nn::BatchNormConfig`, or \
             `.into()` from `burn::nn::BatchNorm`) on the CPU with Kiln's kernels on \
             (`device.kiln_kernels = true`) and f32 input to the layer (bf16/f16 autocast \
             is fine: it hands norms f32), or use a normalization without batch statistics \
             (LayerNorm, GroupNorm)",
            layer.path
        ))),
    }
}
