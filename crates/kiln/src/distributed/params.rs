//! Reading a model's parameters back to the host, for equivalence checks.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;

/// All float parameters of `model`, concatenated in visit order.
pub fn flatten_params<M: Module>(model: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let data = param.val().into_data();
            // Parameters are f32 in every precision policy (master weights).
            if let Ok(values) = data.try_to_vec::<f32>() {
                self.0.extend(values);
            }
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}
