//! Multi-scale inference: classify at a lower resolution first, and at full resolution only
//! the samples the coarse model is not confident about.
//!
//! A coarse-to-fine cascade of two classifiers: `coarse` takes the images downscaled by an
//! integer factor (area averaging, the anti-aliased reduction), `fine` the images as they are.
//! A coarse model at half resolution does about a quarter of the work of the same network at
//! full resolution, and far less when it is also smaller; [`Downscaled`] trains it on the same
//! data seen at its resolution.

use burn::tensor::Tensor;

use super::{FrameClassifier, Prediction, Route, check_batch_shape, select_rows};
use crate::data::Dataset;
use crate::error::{KilnError, Result};

/// `images` `[B, C, H, W]` reduced to `[B, C, H / factor, W / factor]` by averaging each
/// `factor × factor` block; an error unless `factor` divides both sides.
pub fn downscale(images: Tensor<4>, factor: usize) -> Result<Tensor<4>> {
    let [b, c, h, w] = images.dims();
    check_factor(h, w, factor, "images")?;
    if factor == 1 {
        return Ok(images);
    }
    let (oh, ow) = (h / factor, w / factor);
    let blocks: Tensor<6> = images.reshape([b, c, oh, factor, ow, factor]);
    Ok(blocks.mean_dim(5).mean_dim(3).reshape([b, c, oh, ow]))
}

/// An error unless `factor` divides both sides of `h × w` `what`.
fn check_factor(h: usize, w: usize, factor: usize, what: &str) -> Result<()> {
    if factor == 0 || !h.is_multiple_of(factor) || !w.is_multiple_of(factor) {
        return Err(KilnError::Stream(format!(
            "cannot downscale {h}×{w} {what} by {factor}: the factor must divide both sides"
        )));
    }
    Ok(())
}

/// The resolution factor from a `fine` input shape to a `coarse` one: an error unless the
/// channels agree and both sides shrink by the same integer factor.
pub(super) fn scale_factor(fine: [usize; 3], coarse: [usize; 3]) -> Result<usize> {
    let ok = fine[0] == coarse[0]
        && coarse[1] > 0
        && coarse[2] > 0
        && fine[1].is_multiple_of(coarse[1])
        && fine[2].is_multiple_of(coarse[2])
        && fine[1] / coarse[1] == fine[2] / coarse[2];
    if !ok {
        return Err(KilnError::Stream(format!(
            "a coarse model on {coarse:?} cannot serve a fine model on {fine:?}: the channels \
             must agree and both sides shrink by one integer factor"
        )));
    }
    Ok(fine[1] / coarse[1])
}

/// The coarse-to-fine runner.
#[derive(Debug)]
pub struct MultiScale<C, F> {
    coarse: C,
    fine: F,
    factor: usize,
    threshold: f32,
}

impl<C: FrameClassifier, F: FrameClassifier> MultiScale<C, F> {
    /// A cascade in which `coarse` answers when its softmax confidence reaches `threshold`
    /// (in [0, 1]) and `fine` answers the rest.
    pub fn new(coarse: C, fine: F, threshold: f32) -> Result<Self> {
        let factor = scale_factor(fine.input_shape(), coarse.input_shape())?;
        if !(0.0..=1.0).contains(&threshold) {
            return Err(KilnError::Stream(format!(
                "multi-scale threshold {threshold} is outside [0, 1]; it is a softmax confidence"
            )));
        }
        Ok(MultiScale {
            coarse,
            fine,
            factor,
            threshold,
        })
    }

    /// How many times smaller each side of the coarse input is.
    pub fn factor(&self) -> usize {
        self.factor
    }
}

impl<C: FrameClassifier, F: FrameClassifier> FrameClassifier for MultiScale<C, F> {
    fn input_shape(&self) -> [usize; 3] {
        self.fine.input_shape()
    }

    fn classify(&self, images: Tensor<4>) -> Result<Vec<Prediction>> {
        check_batch_shape(&images, self.fine.input_shape())?;
        let small = downscale(images.clone(), self.factor)?;
        let mut out = self.coarse.classify(small)?;
        for p in &mut out {
            p.route = Route::Coarse;
        }
        let unsure: Vec<usize> = (0..out.len())
            .filter(|&i| out[i].confidence < self.threshold)
            .collect();
        if unsure.is_empty() {
            return Ok(out);
        }
        let hard = select_rows(images, &unsure);
        for (i, mut p) in unsure.into_iter().zip(self.fine.classify(hard)?) {
            p.route = Route::Fine;
            out[i] = p;
        }
        Ok(out)
    }
}

/// A dataset seen at `1 / factor` of its resolution (area averaging, as [`downscale`]): the
/// training data of a coarse model.
pub struct Downscaled<D> {
    inner: D,
    factor: usize,
}

impl<D: Dataset> Downscaled<D> {
    /// `inner` with both sides divided by `factor`; an error unless it divides them.
    pub fn new(inner: D, factor: usize) -> Result<Self> {
        let [_, h, w] = inner.item_shape();
        check_factor(h, w, factor, "samples")?;
        Ok(Downscaled { inner, factor })
    }
}

impl<D: Dataset> Dataset for Downscaled<D> {
    fn len(&self) -> usize {
        self.inner.len()
    }

    fn item_shape(&self) -> [usize; 3] {
        let [c, h, w] = self.inner.item_shape();
        [c, h / self.factor, w / self.factor]
    }

    fn fill(&self, index: usize, out: &mut [f32]) -> Result<usize> {
        let [c, h, w] = self.inner.item_shape();
        let mut full = vec![0.0f32; c * h * w];
        let label = self.inner.fill(index, &mut full)?;
        let f = self.factor;
        let (oh, ow) = (h / f, w / f);
        let norm = 1.0 / (f * f) as f32;
        for ch in 0..c {
            for y in 0..oh {
                for x in 0..ow {
                    let mut sum = 0.0;
                    for dy in 0..f {
                        let row = (ch * h + y * f + dy) * w + x * f;
                        sum += full[row..row + f].iter().sum::<f32>();
                    }
                    out[(ch * oh + y) * ow + x] = sum * norm;
                }
            }
        }
        Ok(label)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    #[test]
    fn downscale_averages_blocks_and_refuses_factors_that_do_not_divide() {
        let device = Device::flex();
        let x = Tensor::<4>::from_data(
            TensorData::new((0..16).map(|v| v as f32).collect::<Vec<_>>(), [1, 1, 4, 4]),
            &device,
        );
        let y = downscale(x.clone(), 2).unwrap();
        let v = y.into_data().try_into_vec_as::<f32>().unwrap();
        assert_eq!(v, vec![2.5, 4.5, 10.5, 12.5]);
        assert!(downscale(x, 3).unwrap_err().to_string().contains("divide"));
    }

    #[test]
    fn the_scale_factor_needs_one_integer_ratio_and_equal_channels() {
        assert_eq!(scale_factor([1, 28, 28], [1, 14, 14]).unwrap(), 2);
        assert!(scale_factor([1, 28, 28], [1, 14, 7]).is_err());
        assert!(scale_factor([3, 28, 28], [1, 14, 14]).is_err());
        assert!(scale_factor([1, 28, 28], [1, 0, 0]).is_err());
    }
}
