//! The contract of an image classifier: images `[B, C, H, W]` in, logits `[B, classes]` out.
//! Its users sit on several floors: the trainer (every classifier trains through
//! [`crate::train::TrainStep`]), inference's reference forward, real-time streams and the
//! zoo's models that implement it; so it lives below all of them, importing only Burn.

use burn::module::Module;
use burn::tensor::Tensor;

/// A model that maps a batch of images `[B, C, H, W]` to logits `[B, classes]`.
pub trait Classifier: Module {
    /// Forward pass.
    fn forward(&self, images: Tensor<4>) -> Tensor<2>;

    /// Checks that samples of shape `[C, H, W]` fit this model; the error says what does.
    fn check_input(&self, shape: [usize; 3]) -> std::result::Result<(), String> {
        let _ = shape;
        Ok(())
    }
}
