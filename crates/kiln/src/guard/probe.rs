//! Fused non-finite checks over a module's parameters or gradients.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

fn zero_sum<const D: usize>(t: Tensor<D>) -> Tensor<1> {
    // 0·x is 0 for finite x and NaN for ±Inf/NaN; the sum of zeros cannot overflow.
    t.mul_scalar(0.0).sum()
}

/// One entry per float parameter of `model`, in visit order (the order of [`param_paths`]):
/// 0 where the parameter's gradient (with `grads`) or value (without) is finite, NaN where
/// it is not; an absent gradient counts as finite.
fn probe_each<M: Module>(model: &M, grads: Option<&GradientsParams>) -> Option<Tensor<1>> {
    struct V<'a>(Option<&'a GradientsParams>, Vec<Tensor<1>>);
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let probe = match self.0 {
                Some(grads) => match grads.get::<D>(p.id) {
                    Some(g) => zero_sum(g),
                    None => Tensor::zeros([1], &p.val().device()),
                },
                None => zero_sum(p.val()),
            };
            self.1.push(probe);
        }
    }
    let mut v = V(grads, Vec::new());
    model.visit(&mut v);
    (!v.1.is_empty()).then(|| Tensor::cat(v.1, 0))
}

/// One entry per float parameter of `model`, in visit order (the order of [`param_paths`]):
/// 0 where the parameter's gradient is finite (or absent), NaN where it is not. Kept on the
/// device by the trainer and read at its next sync point, so a skipped step still names the
/// tensors that overflowed without a read per step.
pub fn probe_grads_each<M: Module>(model: &M, grads: &GradientsParams) -> Option<Tensor<1>> {
    probe_each(model, Some(grads))
}

/// A 1-element tensor that is 0 when every parameter is finite and NaN otherwise.
pub fn probe_params<M: Module>(model: &M) -> Option<Tensor<1>> {
    probe_each(model, None).map(Tensor::sum)
}

/// Module paths (`Mlp.fc1.weight`) of every float parameter of `model`, in visit order.
pub fn param_paths<M: Module>(model: &M) -> Vec<String> {
    struct Paths {
        stack: Vec<String>,
        found: Vec<String>,
    }
    impl ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, _p: &Param<Tensor<D>>) {
            let parts: Vec<&str> = self
                .stack
                .iter()
                .map(String::as_str)
                .filter(|s| !s.is_empty())
                .collect();
            self.found.push(parts.join("."));
        }
    }
    let mut paths = Paths {
        stack: Vec::new(),
        found: Vec::new(),
    };
    model.visit(&mut paths);
    paths.found
}

/// Module paths of the parameters that are not finite (run only after the fused check
/// failed: one read of every parameter's probe).
pub fn nonfinite_param_names<M: Module>(model: &M) -> Vec<String> {
    let Some(probes) = probe_each(model, None) else {
        return Vec::new();
    };
    let values = probes
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default();
    param_paths(model)
        .into_iter()
        .zip(values)
        .filter(|(_, v)| !v.is_finite())
        .map(|(path, _)| path)
        .collect()
}
