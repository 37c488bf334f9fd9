//! A model's wire signature (inputs, outputs, postprocessing): what the protocol's metadata
//! and config endpoints report and the codecs check requests against. The bottom of the
//! server's model types: it imports only the tensor types.

use crate::tensor::{NamedTensor, TensorSpec, Values};

/// A model's signature as the protocol's metadata and config endpoints report it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// Triton "platform" string.
    pub platform: String,
    /// Inputs, in the order backends take them.
    pub inputs: Vec<TensorSpec>,
    /// Outputs, in the order they are returned.
    pub outputs: Vec<TensorSpec>,
    /// What the postprocess stage derives from the backend's raw output.
    pub postprocess: Postprocess,
}

/// Work the postprocess stage does per request after the batch is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Postprocess {
    /// Outputs are the backend's outputs unchanged.
    None,
    /// A classifier: the backend returns logits; `label` (INT64 `[1]`) is their arg-max.
    ArgmaxLabel,
}

/// Applies the model's postprocessing to one request's slice of the raw outputs.
pub fn postprocess(spec: &ModelSpec, batch: usize, raw: Vec<Values>) -> Vec<NamedTensor> {
    let mut out: Vec<NamedTensor> = spec
        .outputs
        .iter()
        .zip(raw)
        .map(|(s, values)| NamedTensor {
            name: s.name.clone(),
            shape: std::iter::once(batch)
                .chain(s.dims.iter().copied())
                .collect(),
            values,
        })
        .collect();
    if spec.postprocess == Postprocess::ArgmaxLabel
        && let Some(Values::F32(logits)) = out.first().map(|t| &t.values)
    {
        let classes = spec.outputs[0].sample_len().max(1);
        let labels = logits
            .chunks(classes)
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| {
                        if v > best.1 { (i, v) } else { best }
                    })
                    .0 as i64
            })
            .collect();
        out.push(NamedTensor {
            name: spec.outputs[1].name.clone(),
            shape: vec![batch, 1],
            values: Values::I64(labels),
        });
    }
    out
}
