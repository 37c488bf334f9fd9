//! What an optimizer step needs to know about its step that only the device knows: whether
//! the step is applied (the guard's verdict) and the factor its gradients are multiplied by
//! (global-norm clipping's coefficient). Both are 1-element device tensors, so the optimizer
//! skips a non-finite step by a device-side select, never by a host branch.
//!
//! Why a thread-local: Burn's `Optimizer::step` takes only the learning rate, the parameter,
//! its gradient and its state; the trainer enters the context around `ModuleOptimizer::step`,
//! which runs every parameter's update on the calling thread.

use std::cell::RefCell;

use burn::tensor::Tensor;

/// The device-side facts of the step being applied.
#[derive(Clone)]
pub struct StepContext {
    /// 1.0 when the step is applied, 0.0 when it is skipped (a non-finite loss or gradient).
    pub apply: Tensor<1>,
    /// Multiplies every gradient before the update (clipping), `None` for 1.
    pub grad_factor: Option<Tensor<1>>,
}

thread_local! {
    static CURRENT: RefCell<Option<StepContext>> = const { RefCell::new(None) };
}

/// Sets the step context for this thread until the returned guard drops.
pub fn enter(context: StepContext) -> ContextGuard {
    let previous = CURRENT.with(|c| c.replace(Some(context)));
    ContextGuard { previous }
}

/// The step context in force on this thread: `None` outside the trainer (a user driving
/// Kiln's optimizers by hand), where every step is applied with its gradients as given.
pub fn current() -> Option<StepContext> {
    CURRENT.with(|c| c.borrow().clone())
}

/// Restores the previous context when dropped (contexts nest).
pub struct ContextGuard {
    previous: Option<StepContext>,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}
