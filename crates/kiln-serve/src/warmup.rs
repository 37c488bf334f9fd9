//! A model's warm-up (`[warmup]` in its config.toml): executions on every instance before the
//! model is marked ready, as Triton's `model_warmup` does.
//!
//! Why: the first execution of a freshly built model pays for work later ones skip — kernel
//! and algorithm selection, weight transforms done on first use, the allocator growing to the
//! batch's working set. Without a warm-up that cost lands on the first clients after a start
//! or a reload, which is exactly when a zero-downtime reload must not show a latency spike.

use crate::backend::Backend;
use crate::config::Warmup;
use crate::error::{Result, ServeError};
use crate::signature::ModelSpec;
use crate::tensor::{DataType, Values};

/// Runs `warmup` on every backend of model `name`; the first failure is a load error naming
/// the instance, so a model that cannot run its own warm-up is never marked ready.
pub fn run(
    name: &str,
    warmup: &Warmup,
    spec: &ModelSpec,
    backends: &mut [Box<dyn Backend>],
) -> Result<()> {
    let started = std::time::Instant::now();
    for (instance, backend) in backends.iter_mut().enumerate() {
        for round in 0..warmup.count {
            let inputs = inputs(spec, warmup, round as u64);
            backend
                .execute(inputs, warmup.batch_size)
                .map_err(|e| ServeError::Load {
                    model: name.to_string(),
                    message: format!(
                        "warm-up failed on instance {instance} (batch {}): {e}",
                        warmup.batch_size
                    ),
                })?;
        }
    }
    tracing::info!(
        model = name,
        instances = backends.len(),
        executions = warmup.count,
        batch_size = warmup.batch_size,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "warm-up done"
    );
    Ok(())
}

/// One warm-up execution's inputs: `batch_size` rows of every input in the spec.
fn inputs(spec: &ModelSpec, warmup: &Warmup, round: u64) -> Vec<Values> {
    spec.inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            let len = warmup.batch_size * input.sample_len();
            if !warmup.random {
                return Values::with_len(input.datatype, len);
            }
            // A small LCG: reproducible, distinct per input and round, no dependency.
            let mut state = (round << 32 | i as u64).wrapping_mul(6364136223846793005) | 1;
            let mut next = move || {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                state >> 40
            };
            match input.datatype {
                DataType::Fp32 => Values::F32(
                    (0..len)
                        .map(|_| next() as f32 / (1u64 << 24) as f32)
                        .collect(),
                ),
                // Token ids and indices: small non-negative values every embedding accepts.
                DataType::Int64 => Values::I64((0..len).map(|_| (next() % 10) as i64).collect()),
            }
        })
        .collect()
}
