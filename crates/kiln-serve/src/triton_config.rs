//! A running model described in Triton's model-configuration and statistics schemas (JSON
//! for HTTP, protobuf for gRPC): `perf_analyzer` reads these to plan its load.

use std::sync::atomic::Ordering;

use serde_json::{Value, json};

use crate::config::InstanceKind;
use crate::pipeline::ModelRuntime;
use crate::proto::pb;
use crate::tensor::TensorSpec;

fn dims(s: &TensorSpec) -> Vec<i64> {
    s.dims.iter().map(|&d| d as i64).collect()
}

fn type_name(s: &TensorSpec) -> String {
    format!("TYPE_{}", s.datatype.wire_name())
}

/// The model's configuration as Triton's JSON (`GET /v2/models/{m}/config`).
pub fn to_json(rt: &ModelRuntime) -> Value {
    let c = &rt.config;
    let mut config = json!({
        "name": rt.name,
        "platform": rt.spec.platform,
        "backend": rt.spec.platform,
        "max_batch_size": c.max_batch_size,
        "input": rt.spec.inputs.iter().map(|i| json!({
            "name": i.name,
            "data_type": type_name(i),
            "dims": dims(i),
        })).collect::<Vec<_>>(),
        "output": rt.spec.outputs.iter().map(|o| json!({
            "name": o.name,
            "data_type": type_name(o),
            "dims": dims(o),
        })).collect::<Vec<_>>(),
        "instance_group": [{"name": rt.name, "kind": c.kind.name(), "count": c.instances}],
    });
    if let Some(b) = &c.dynamic_batching {
        config["dynamic_batching"] = json!({
            "preferred_batch_size": b.preferred_batch_sizes,
            "max_queue_delay_microseconds": b.max_queue_delay.as_micros() as u64,
            "default_queue_policy": {
                "default_timeout_microseconds": c.timeout.map_or(0, |t| t.as_micros() as u64),
                "max_queue_size": c.max_queue_size,
            },
        });
    }
    // Triton's JSON forms of the version policy and the warm-up, so a client reading the
    // configuration sees which versions the server keeps and what runs before ready.
    config["version_policy"] = match &c.version_policy {
        crate::config::VersionPolicy::Latest(n) => json!({ "latest": { "num_versions": n } }),
        crate::config::VersionPolicy::All => json!({ "all": {} }),
        crate::config::VersionPolicy::Specific(v) => json!({ "specific": { "versions": v } }),
    };
    if let Some(w) = &c.warmup {
        let data = if w.random { "random_data" } else { "zero_data" };
        let inputs: serde_json::Map<String, Value> = rt
            .spec
            .inputs
            .iter()
            .map(|i| {
                let spec = json!({ "data_type": type_name(i), "dims": dims(i), data: true });
                (i.name.clone(), spec)
            })
            .collect();
        config["model_warmup"] = json!([{
            "name": "warmup",
            "batch_size": w.batch_size,
            "count": w.count,
            "inputs": inputs,
        }]);
    }
    if let Some(seq) = &c.sequence {
        // Triton's block (perf_analyzer reads it and sends sequence ids), with Kiln's stream
        // settings beside it.
        config["sequence_batching"] = json!({
            "max_sequence_idle_microseconds": seq.max_idle.as_micros() as u64,
            "kiln_stream": seq.stream,
        });
    }
    config
}

/// The model's configuration as Triton's protobuf (`ModelConfig` RPC).
pub fn to_proto(rt: &ModelRuntime) -> pb::ModelConfig {
    let c = &rt.config;
    pb::ModelConfig {
        name: rt.name.clone(),
        platform: rt.spec.platform.clone(),
        backend: rt.spec.platform.clone(),
        max_batch_size: c.max_batch_size as i32,
        input: rt
            .spec
            .inputs
            .iter()
            .map(|i| pb::ModelInput {
                name: i.name.clone(),
                data_type: i.datatype.config_enum(),
                dims: dims(i),
            })
            .collect(),
        output: rt
            .spec
            .outputs
            .iter()
            .map(|o| pb::ModelOutput {
                name: o.name.clone(),
                data_type: o.datatype.config_enum(),
                dims: dims(o),
            })
            .collect(),
        instance_group: vec![pb::ModelInstanceGroup {
            name: rt.name.clone(),
            count: c.instances as i32,
            kind: match c.kind {
                InstanceKind::Gpu => pb::model_instance_group::Kind::Gpu as i32,
                InstanceKind::Cpu => pb::model_instance_group::Kind::Cpu as i32,
                InstanceKind::Auto => pb::model_instance_group::Kind::Auto as i32,
            },
        }],
        // Triton's scheduling is one of the two: a stream model reports its sequence batching
        // (the frames of different sequences still share executions by the dynamic rules).
        scheduling_choice: match &c.sequence {
            Some(seq) => Some(pb::model_config::SchedulingChoice::SequenceBatching(
                pb::ModelSequenceBatching {
                    max_sequence_idle_microseconds: seq.max_idle.as_micros() as u64,
                },
            )),
            None => dynamic_proto(c),
        },
    }
}

/// The dynamic batching block of a model's protobuf configuration, if it has one.
fn dynamic_proto(c: &crate::config::ModelConfig) -> Option<pb::model_config::SchedulingChoice> {
    c.dynamic_batching.as_ref().map(|b| {
        pb::model_config::SchedulingChoice::DynamicBatching(pb::ModelDynamicBatching {
            preferred_batch_size: b.preferred_batch_sizes.iter().map(|&p| p as i32).collect(),
            max_queue_delay_microseconds: b.max_queue_delay.as_micros() as u64,
            default_queue_policy: Some(pb::ModelQueuePolicy {
                default_timeout_microseconds: c.timeout.map_or(0, |t| t.as_micros() as u64),
                max_queue_size: c.max_queue_size as u32,
            }),
        })
    })
}

/// Cumulative statistics in Triton's schema: (count, ns) for success, fail, queue,
/// compute_input (decode), compute_infer (batches), compute_output (encode).
struct Stats {
    success: u64,
    success_ns: u64,
    fail: u64,
    executions: u64,
    inferences: u64,
    last_ms: u64,
    queue_ns: u64,
    pre_ns: u64,
    infer_ns: u64,
    post_ns: u64,
}

fn stats(rt: &ModelRuntime) -> Stats {
    let m = &rt.metrics;
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    Stats {
        success: get(&m.success),
        success_ns: (m.request_seconds.sum() * 1e9) as u64,
        fail: m.failure.iter().map(get).sum(),
        executions: get(&m.execution_count),
        inferences: get(&m.inference_count),
        last_ms: get(&m.last_inference_ms),
        queue_ns: get(&m.queue_ns),
        pre_ns: get(&m.pre_ns),
        infer_ns: get(&m.compute_ns),
        post_ns: get(&m.post_ns),
    }
}

/// Statistics as Triton's JSON (`GET /v2/models/{m}/stats`).
pub fn statistics_json(rt: &ModelRuntime) -> Value {
    let s = stats(rt);
    let d = |count: u64, ns: u64| json!({"count": count, "ns": ns});
    json!({
        "name": rt.name,
        "version": rt.version.to_string(),
        "last_inference": s.last_ms,
        "inference_count": s.inferences,
        "execution_count": s.executions,
        "inference_stats": {
            "success": d(s.success, s.success_ns),
            "fail": d(s.fail, 0),
            "queue": d(s.success, s.queue_ns),
            "compute_input": d(s.success, s.pre_ns),
            "compute_infer": d(s.success, s.infer_ns),
            "compute_output": d(s.success, s.post_ns),
        },
        "batch_stats": [],
    })
}

/// Statistics as Triton's protobuf (`ModelStatistics` RPC).
pub fn statistics_proto(rt: &ModelRuntime) -> pb::ModelStatistics {
    let s = stats(rt);
    let d = |count: u64, ns: u64| Some(pb::StatisticDuration { count, ns });
    pb::ModelStatistics {
        name: rt.name.clone(),
        version: rt.version.to_string(),
        last_inference: s.last_ms,
        inference_count: s.inferences,
        execution_count: s.executions,
        inference_stats: Some(pb::InferStatistics {
            success: d(s.success, s.success_ns),
            fail: d(s.fail, 0),
            queue: d(s.success, s.queue_ns),
            compute_input: d(s.success, s.pre_ns),
            compute_infer: d(s.success, s.infer_ns),
            compute_output: d(s.success, s.post_ns),
        }),
        batch_stats: Vec::new(),
    }
}
