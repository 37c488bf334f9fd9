//! Kiln's CPU kernels: functions over slices of `f32` (and `i8`/`u8`) with their shapes,
//! for the operations where Burn's `flex` backend was measured slow (BENCHMARKS.md).
//!
//! **Key decision: this crate knows nothing of tensors, graphs or Burn.** A kernel takes
//! slices and a shape and writes a slice; deciding *when* a kernel serves (the device, the
//! dtype, autodiff, the user's switch) is the caller's business (`kiln::kernels`, a Burn
//! backend extension, and the ONNX and inference executors). So a kernel can be tested,
//! benchmarked and read alone (`cargo test -p kiln-kernels`), as tract keeps its kernels in
//! `tract-linalg`.
//!
//! **Layers, imports pointing down only.** [`base`] (instruction-set dispatch, thread-pool
//! rules, buffers, shapes, the GEMM, layout transposes) imports nothing else here. Above it
//! the element-wise families ([`activation`], [`channelwise`], [`norm`], [`layer_norm`],
//! [`softmax`], [`strided`], [`adam`], [`pool`], [`int8`], [`linear`]), then the
//! convolutions, each using only what is below it: [`depthwise`], [`patches`],
//! [`winograd`] → [`implicit`] → [`expand_depthwise`]; [`direct`] and [`winograd`] →
//! [`conv`] (the training convolution). `tests/import_direction.rs` in `kiln` holds these
//! rules.
//!
//! **One dispatch point.** Every SIMD family picks its instruction set through
//! [`base::isa`] (the CPU's features, probed once; `KILN_F32_KERNEL`, `KILN_INT8_KERNEL`,
//! `KILN_WINOGRAD` to measure a lesser path), and element-wise loops are compiled once per
//! instruction set by `multiversion!`.
#![deny(missing_docs)]

#[macro_use]
pub mod base;

pub mod activation;
pub mod adam;
pub mod attention;
pub mod channelwise;
pub mod conv;
pub mod depthwise;
pub mod direct;
pub mod expand_depthwise;
pub mod implicit;
pub mod int8;
pub mod layer_norm;
pub mod linear;
pub mod norm;
pub mod patches;
pub mod pool;
pub mod softmax;
pub mod strided;
pub mod winograd;
