//! Gradient clipping by the global L2 norm over all parameters, as torch's
//! `clip_grad_norm_` does. Burn's own `GradientClippingConfig::Norm` clips each tensor
//! separately, which changes the update direction; this keeps it.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

/// The global L2 norm of all gradients of `model`'s parameters, as a 1-element tensor
/// (no host round-trip).
pub fn global_norm<M: Module>(model: &M, grads: &GradientsParams) -> Option<Tensor<1>> {
    struct SumSquares<'a> {
        grads: &'a GradientsParams,
        total: Option<Tensor<1>>,
    }
    impl ModuleVisitor for SumSquares<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let s = g.square().sum();
                self.total = Some(match self.total.take() {
                    Some(t) => t + s,
                    None => s,
                });
            }
        }
    }
    let mut visitor = SumSquares { grads, total: None };
    model.visit(&mut visitor);
    visitor.total.map(|t| t.sqrt())
}

/// Scales all gradients so their global norm is at most `max_norm`; returns the norm before
/// clipping. Uses torch's coefficient `max_norm / (norm + 1e-6)`, capped at 1.
pub fn clip_global_norm<M: Module>(
    model: &M,
    mut grads: GradientsParams,
    max_norm: f64,
) -> (GradientsParams, f32) {
    let Some(norm) = global_norm(model, &grads) else {
        return (grads, 0.0);
    };
    // One scalar read per optimizer step: the norm is also reported in step events.
    let norm: f32 = norm.into_scalar();
    let coef = max_norm / (norm as f64 + 1e-6);
    if coef < 1.0 {
        grads = scale_grads(model, grads, coef);
    }
    (grads, norm)
}

/// Multiplies every gradient of `model` by `factor` (clipping, loss-scale removal).
pub fn scale_grads<M: Module>(model: &M, grads: GradientsParams, factor: f64) -> GradientsParams {
    scale_each(model, grads, Factor::Host(factor))
}

/// Multiplies every gradient of `model` by the 1-element device tensor `factor` (loss-scale
/// removal without reading the scale back).
pub fn scale_grads_by<M: Module>(
    model: &M,
    grads: GradientsParams,
    factor: &Tensor<1>,
) -> GradientsParams {
    scale_each(model, grads, Factor::Device(factor))
}

/// A gradient multiplier: a host scalar, or a 1-element tensor on the gradients' device.
#[derive(Clone, Copy)]
enum Factor<'a> {
    Host(f64),
    Device(&'a Tensor<1>),
}

fn scale_each<M: Module>(
    model: &M,
    mut grads: GradientsParams,
    factor: Factor<'_>,
) -> GradientsParams {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: Factor<'a>,
    }
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                let scaled = match self.factor {
                    Factor::Host(f) => g.mul_scalar(f),
                    Factor::Device(f) => g.mul(f.clone().reshape([1; D])),
                };
                self.grads.register::<D>(param.id, scaled);
            }
        }
    }
    model.visit(&mut Scale {
        grads: &mut grads,
        factor,
    });
    grads
}
