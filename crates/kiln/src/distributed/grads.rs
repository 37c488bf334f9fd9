//! The model-side half of data parallelism: gradients flattened into buckets in parameter
//! order and all-reduced, the step's statistics reduced with them, rank 0's parameters
//! broadcast, and a replica check.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

use super::params::flatten_params;
use super::{Collective, ReduceOp};
use crate::error::{KilnError, Result};

/// Reduces a step's gradients across ranks in buckets of at most `bucket_floats` values (in
/// parameter order, as DDP does with its ~25 MB buckets: large messages amortize each call's
/// latency, bounded ones keep the host copy small).
#[derive(Debug, Clone, Copy)]
pub struct GradReducer {
    /// Values per all-reduce call.
    pub bucket_floats: usize,
}

impl Default for GradReducer {
    fn default() -> Self {
        // 25 MiB of f32, PyTorch DDP's default bucket size.
        GradReducer {
            bucket_floats: 25 * 1024 * 1024 / 4,
        }
    }
}

/// One parameter's place in the flattened buffer.
struct Slot {
    id: ParamId,
    dims: Vec<usize>,
    offset: usize,
    len: usize,
}

impl GradReducer {
    /// Replaces each rank's `grads` by their sum over all ranks. Each rank's gradients must
    /// already carry its share of the step's samples (the trainer weights each micro-batch's
    /// loss by its samples over the step's samples on *all* ranks), so the sum is the
    /// gradient of the whole step's mean loss. A parameter gets a gradient when any rank has
    /// one (a rank without samples in a step contributes zeros); frozen parameters stay
    /// without.
    pub fn reduce<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
        collective: &dyn Collective,
    ) -> Result<GradientsParams> {
        if let Some(peers) = collective.device_group() {
            // Even a group of one goes through the device collective: it is the code path a
            // one-GPU machine can test.
            return self.reduce_on_device(model, grads, collective, peers);
        }
        if collective.size() <= 1 {
            return Ok(grads);
        }
        let mut flat = flatten(model, &grads)?;
        // The "has a gradient" flags ride at the end of the last bucket, summed with the
        // values (a count above 0 = some rank has one): one collective call per step fewer
        // than reducing them apart, which is one network latency per step.
        let n = flat.values.len();
        flat.values.append(&mut flat.present);
        for bucket in flat.values.chunks_mut(self.bucket_floats.max(1)) {
            collective.all_reduce_f32(bucket, ReduceOp::Sum)?;
        }
        flat.present = flat.values.split_off(n);
        Ok(unflatten(model, grads, &flat))
    }

    /// [`GradReducer::reduce`] on the devices `peers` (in rank order): each bucket is the concatenation of its
    /// parameters' flattened gradients (zeros where this rank has none), all-reduced by
    /// Burn's collective across the group's devices and cut back into gradients; only the
    /// one-per-parameter "has a gradient" flags go through the host.
    fn reduce_on_device<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
        collective: &dyn Collective,
        peers: &[Device],
    ) -> Result<GradientsParams> {
        let device = peers.get(collective.rank()).ok_or_else(|| {
            KilnError::Collective(format!(
                "rank {} of a device group with {} devices",
                collective.rank(),
                peers.len()
            ))
        })?;
        let mut parts = flatten_on_device(model, &grads, device);
        let mut present: Vec<f32> = parts.iter().map(|p| p.present).collect();
        collective.all_reduce_f32(&mut present, ReduceOp::Sum)?;
        let mut reduced = Vec::with_capacity(parts.len());
        let mut start = 0;
        while start < parts.len() {
            // A bucket: consecutive parameters up to `bucket_floats` values (at least one).
            let mut end = start + 1;
            let mut floats = parts[start].len;
            while end < parts.len() && floats + parts[end].len <= self.bucket_floats {
                floats += parts[end].len;
                end += 1;
            }
            let pieces: Vec<Tensor<1>> = parts[start..end]
                .iter_mut()
                .map(|p| p.values.take().expect("each part is taken once"))
                .collect();
            let bucket = Tensor::cat(pieces, 0);
            let bucket = burn::tensor::distributed::all_reduce(
                bucket,
                burn::tensor::distributed::ReduceOperation::Sum,
                peers.to_vec(),
            )
            .resolve();
            let mut offset = 0;
            for p in &parts[start..end] {
                reduced.push(bucket.clone().slice(offset..offset + p.len));
                offset += p.len;
            }
            start = end;
        }
        Ok(unflatten_on_device(model, grads, &parts, &present, reduced))
    }
}

/// One parameter's gradient on the device, flattened, before the reduction.
struct DevicePart {
    dims: Vec<usize>,
    len: usize,
    /// 1 when this rank has a gradient for it.
    present: f32,
    /// The flattened gradient (zeros where this rank has none), until it joins a bucket.
    values: Option<Tensor<1>>,
}

/// Every parameter's gradient flattened on `device`, in visit order.
fn flatten_on_device<M: Module>(
    model: &M,
    grads: &GradientsParams,
    device: &Device,
) -> Vec<DevicePart> {
    struct Collect<'a> {
        grads: &'a GradientsParams,
        device: &'a Device,
        parts: Vec<DevicePart>,
    }
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let (dims, values, present) = match self.grads.get::<D>(param.id) {
                Some(g) => {
                    let dims = g.dims().to_vec();
                    let n = dims.iter().product::<usize>();
                    (dims, g.reshape([n]), 1.0)
                }
                None => {
                    let dims = param.val().dims().to_vec();
                    let n = dims.iter().product::<usize>();
                    (dims, Tensor::<1>::zeros([n], self.device), 0.0)
                }
            };
            self.parts.push(DevicePart {
                len: values.dims()[0],
                dims,
                present,
                values: Some(values),
            });
        }
    }
    let mut c = Collect {
        grads,
        device,
        parts: Vec::new(),
    };
    model.visit(&mut c);
    c.parts
}

/// Registers the reduced gradients of the parameters some rank had one for.
fn unflatten_on_device<M: Module>(
    model: &M,
    mut grads: GradientsParams,
    parts: &[DevicePart],
    present: &[f32],
    reduced: Vec<Tensor<1>>,
) -> GradientsParams {
    struct Write<'a> {
        grads: &'a mut GradientsParams,
        parts: &'a [DevicePart],
        present: &'a [f32],
        reduced: std::vec::IntoIter<Tensor<1>>,
        next: usize,
    }
    impl ModuleVisitor for Write<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let i = self.next;
            self.next += 1;
            let (Some(values), Some(part)) = (self.reduced.next(), self.parts.get(i)) else {
                return;
            };
            let _ = self.grads.remove::<D>(param.id);
            // A parameter no rank had a gradient for (frozen) stays without one.
            if self.present.get(i).is_none_or(|&p| p == 0.0) {
                return;
            }
            if let Ok(dims) = <[usize; D]>::try_from(part.dims.as_slice()) {
                self.grads.register::<D>(param.id, values.reshape(dims));
            }
        }
    }
    model.visit(&mut Write {
        grads: &mut grads,
        parts,
        present,
        reduced: reduced.into_iter(),
        next: 0,
    });
    grads
}

/// A step's gradients on the host, in parameter visit order.
struct Flat {
    /// Each parameter's place in `values`.
    slots: Vec<Slot>,
    /// The values (zeros where a parameter has no gradient here).
    values: Vec<f32>,
    /// Per parameter: 1 or 0, whether it has a gradient here; after the reduction, how many
    /// ranks had one.
    present: Vec<f32>,
    /// The device the gradients live on (none when this rank has none).
    device: Option<Device>,
}

/// Reads every parameter's gradient to the host, in visit order.
fn flatten<M: Module>(model: &M, grads: &GradientsParams) -> Result<Flat> {
    struct Collect<'a> {
        grads: &'a GradientsParams,
        flat: Flat,
        error: Option<KilnError>,
    }
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let flat = &mut self.flat;
            let offset = flat.values.len();
            let (dims, has) = match self.grads.get::<D>(param.id) {
                Some(g) => {
                    flat.device.get_or_insert_with(|| g.device());
                    let dims = g.dims().to_vec();
                    match g.into_data().convert::<f32>().try_into_vec::<f32>() {
                        Ok(v) => flat.values.extend(v),
                        Err(e) => {
                            self.error.get_or_insert(KilnError::Collective(format!(
                                "cannot read a gradient back to the host: {e:?}"
                            )));
                        }
                    }
                    (dims, true)
                }
                None => {
                    let dims = param.val().dims().to_vec();
                    flat.values
                        .resize(offset + dims.iter().product::<usize>(), 0.0);
                    (dims, false)
                }
            };
            flat.present.push(if has { 1.0 } else { 0.0 });
            flat.slots.push(Slot {
                id: param.id,
                len: flat.values.len() - offset,
                dims,
                offset,
            });
        }
    }
    let mut c = Collect {
        grads,
        flat: Flat {
            slots: Vec::new(),
            values: Vec::new(),
            present: Vec::new(),
            device: None,
        },
        error: None,
    };
    model.visit(&mut c);
    match c.error {
        Some(e) => Err(e),
        None => Ok(c.flat),
    }
}

/// Writes the reduced values back as the gradients of the parameters some rank had one for.
fn unflatten<M: Module>(model: &M, mut grads: GradientsParams, flat: &Flat) -> GradientsParams {
    struct Write<'a> {
        grads: &'a mut GradientsParams,
        flat: &'a Flat,
        next: usize,
    }
    impl ModuleVisitor for Write<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let i = self.next;
            self.next += 1;
            let flat = self.flat;
            let (Some(slot), Some(&present)) = (flat.slots.get(i), flat.present.get(i)) else {
                return;
            };
            debug_assert_eq!(slot.id, param.id);
            let _ = self.grads.remove::<D>(param.id);
            if present == 0.0 {
                return;
            }
            // Gradients live on the inner (non-autodiff) device; a rank that had none this
            // step takes it from the parameter.
            let device = flat
                .device
                .clone()
                .unwrap_or_else(|| param.val().device().without_autodiff());
            let values = flat.values[slot.offset..slot.offset + slot.len].to_vec();
            let data = TensorData::new(values, slot.dims.clone());
            self.grads
                .register::<D>(param.id, Tensor::<D>::from_data(data, &device));
        }
    }
    model.visit(&mut Write {
        grads: &mut grads,
        flat,
        next: 0,
    });
    grads
}

/// A step's statistics summed over ranks, and each rank's compute time.
#[derive(Debug, Clone, PartialEq)]
pub struct ReduceStats {
    /// Sum over all ranks of mean loss × samples (NaN if any rank's was not finite).
    pub loss_sum: f64,
    /// Samples of the step on all ranks.
    pub samples: usize,
    /// Forward + backward milliseconds of each rank, by rank (stragglers show here).
    pub rank_compute_ms: Vec<f64>,
}

impl ReduceStats {
    /// Reduces one rank's numbers over all ranks (one small all-reduce).
    pub fn reduce(
        collective: &dyn Collective,
        loss_sum: f64,
        samples: usize,
        compute_ms: f64,
    ) -> Result<ReduceStats> {
        let size = collective.size();
        let mut buf = vec![0.0; 2 + size];
        buf[0] = loss_sum;
        buf[1] = samples as f64;
        buf[2 + collective.rank()] = compute_ms;
        collective.all_reduce_f64(&mut buf, ReduceOp::Sum)?;
        Ok(ReduceStats {
            loss_sum: buf[0],
            samples: buf[1].round() as usize,
            rank_compute_ms: buf[2..].to_vec(),
        })
    }
}

/// Gives every rank rank 0's parameters (a user's `init` need not be seeded for the replicas
/// to start equal).
pub fn broadcast_params<M: Module>(model: M, collective: &dyn Collective) -> Result<M> {
    if collective.size() <= 1 {
        return Ok(model);
    }
    let mut flat = flatten_params(&model);
    collective.broadcast_f32(&mut flat, 0)?;
    struct Load<'a> {
        flat: &'a [f32],
        offset: usize,
    }
    impl ModuleMapper for Load<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let flat = self.flat;
            let offset = &mut self.offset;
            param.map(|t| {
                let dims = t.dims();
                let n: usize = dims.iter().product();
                let Some(values) = flat.get(*offset..*offset + n) else {
                    return t;
                };
                *offset += n;
                let require_grad = t.is_require_grad();
                let device = t.device();
                let loaded = Tensor::<D>::from_data(
                    TensorData::new(values.to_vec(), dims.to_vec()),
                    &device,
                );
                if require_grad {
                    loaded.require_grad()
                } else {
                    loaded
                }
            })
        }
    }
    Ok(model.map(&mut Load {
        flat: &flat,
        offset: 0,
    }))
}

/// Checks that every rank holds the same parameters (sum and sum of squares compared as
/// maxima and minima over ranks); a difference means the replicas diverged (a collective
/// called out of order, or a nondeterministic step on one rank).
pub fn check_replicas<M: Module>(model: &M, collective: &dyn Collective) -> Result<()> {
    if collective.size() <= 1 {
        return Ok(());
    }
    let flat = flatten_params(model);
    let sum: f64 = flat.iter().map(|&v| v as f64).sum();
    let sq: f64 = flat.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let spread = spread_over_ranks(&[sum, sq], collective)?;
    let same = |(lo, hi): (f64, f64)| lo == hi || (lo.is_nan() && hi.is_nan());
    if !spread.iter().all(|&s| same(s)) {
        return Err(KilnError::Collective(format!(
            "the model replicas differ between ranks (parameter sums from {} to {}): every rank \
             must run the same model, options and data order",
            spread[0].0, spread[0].1
        )));
    }
    Ok(())
}

/// Each value's smallest and largest over the ranks, in one all-reduce (the maxima of the
/// values and of their negations).
fn spread_over_ranks(values: &[f64], collective: &dyn Collective) -> Result<Vec<(f64, f64)>> {
    let n = values.len();
    let mut buf: Vec<f64> = values.iter().chain(values).copied().collect();
    for v in &mut buf[n..] {
        *v = -*v;
    }
    collective.all_reduce_f64(&mut buf, ReduceOp::Max)?;
    Ok((0..n).map(|i| (-buf[n + i], buf[i])).collect())
}

/// Checks that every rank describes its run the same way (`settings`: the trajectory settings,
/// the dataset size, whatever must agree), comparing a digest of it across ranks; ranks
/// started with different settings would otherwise wait forever on collectives the others
/// never call, or train different models.
pub fn check_same_settings(settings: &str, collective: &dyn Collective) -> Result<()> {
    use sha2::{Digest, Sha256};
    if collective.size() <= 1 {
        return Ok(());
    }
    let digest = Sha256::digest(settings.as_bytes());
    // Three 20-bit pieces, each exact in f64, compared as maxima and minima over ranks.
    let piece =
        |i: usize| (u32::from_le_bytes([digest[i], digest[i + 1], digest[i + 2], 0]) >> 4) as f64;
    let spread = spread_over_ranks(&[piece(0), piece(3), piece(6)], collective)?;
    if spread.iter().any(|(lo, hi)| lo != hi) {
        return Err(KilnError::Collective(format!(
            "rank {} was started with other settings or data than another rank (every rank \
             must run the same command: same options, same data, same number of samples); \
             this rank has: {settings}",
            collective.rank()
        )));
    }
    Ok(())
}
