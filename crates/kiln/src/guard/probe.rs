//! Fused non-finite checks over a module's parameters or gradients.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

fn zero_sum<const D: usize>(t: Tensor<D>) -> Tensor<1> {
    // 0·x is 0 for finite x and NaN for ±Inf/NaN; the sum of zeros cannot overflow.
    t.mul_scalar(0.0).sum()
}

fn add(total: &mut Option<Tensor<1>>, s: Tensor<1>) {
    *total = Some(match total.take() {
        Some(t) => t + s,
        None => s,
    });
}

/// A 1-element tensor that is 0 when every gradient is finite and NaN otherwise.
pub fn probe_grads<M: Module>(model: &M, grads: &GradientsParams) -> Option<Tensor<1>> {
    struct V<'a>(&'a GradientsParams, Option<Tensor<1>>);
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(p.id) {
                add(&mut self.1, zero_sum(g));
            }
        }
    }
    let mut v = V(grads, None);
    model.visit(&mut v);
    v.1
}

/// One entry per float parameter of `model`, in visit order (the order of [`param_paths`]):
/// 0 where the parameter's gradient is finite (or absent), NaN where it is not. Kept on the
/// device by the trainer and read at its next sync point, so a skipped step still names the
/// tensors that overflowed without a read per step.
pub fn probe_grads_each<M: Module>(model: &M, grads: &GradientsParams) -> Option<Tensor<1>> {
    struct V<'a>(&'a GradientsParams, Vec<Tensor<1>>);
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let probe = match self.0.get::<D>(p.id) {
                Some(g) => zero_sum(g),
                None => Tensor::zeros([1], &p.val().device()),
            };
            self.1.push(probe);
        }
    }
    let mut v = V(grads, Vec::new());
    model.visit(&mut v);
    (!v.1.is_empty()).then(|| Tensor::cat(v.1, 0))
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
            self.found.push(module_path(&self.stack));
        }
    }
    let mut paths = Paths {
        stack: Vec::new(),
        found: Vec::new(),
    };
    model.visit(&mut paths);
    paths.found
}

/// The dotted path of the modules entered so far (the unnamed root left out).
fn module_path(stack: &[String]) -> String {
    let parts: Vec<&str> = stack
        .iter()
        .map(String::as_str)
        .filter(|s| !s.is_empty())
        .collect();
    parts.join(".")
}

/// A 1-element tensor that is 0 when every parameter is finite and NaN otherwise.
pub fn probe_params<M: Module>(model: &M) -> Option<Tensor<1>> {
    struct V(Option<Tensor<1>>);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            add(&mut self.0, zero_sum(p.val()));
        }
    }
    let mut v = V(None);
    model.visit(&mut v);
    v.0
}

fn is_bad<const D: usize>(t: Tensor<D>) -> bool {
    let v: f32 = zero_sum(t).into_scalar();
    !v.is_finite()
}

/// Module paths (`Mlp.fc1.weight`) of the gradients that are not finite (slow path: one
/// read per tensor, run only after the fused check failed).
pub fn nonfinite_grad_names<M: Module>(model: &M, grads: &GradientsParams) -> Vec<String> {
    nonfinite_paths(model, Some(grads))
}

/// Module paths of the parameters that are not finite (slow path).
pub fn nonfinite_param_names<M: Module>(model: &M) -> Vec<String> {
    nonfinite_paths(model, None)
}

/// Walks the module tracking the path, and checks each parameter's gradient (when `grads` is
/// given) or its value.
fn nonfinite_paths<M: Module>(model: &M, grads: Option<&GradientsParams>) -> Vec<String> {
    struct Scan<'a> {
        grads: Option<&'a GradientsParams>,
        stack: Vec<String>,
        found: Vec<String>,
    }
    impl ModuleVisitor for Scan<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let tensor = match self.grads {
                Some(grads) => grads.get::<D>(p.id),
                None => Some(p.val()),
            };
            if tensor.is_some_and(is_bad) {
                self.found.push(module_path(&self.stack));
            }
        }
    }
    let mut scan = Scan {
        grads,
        stack: Vec::new(),
        found: Vec::new(),
    };
    model.visit(&mut scan);
    scan.found
}
