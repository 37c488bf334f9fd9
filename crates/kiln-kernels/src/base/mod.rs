//! The base layer every kernel stands on, importing nothing above it: which instruction set
//! runs ([`isa`], the one dispatch point), the thread-pool rules ([`threads`]), buffers
//! written once and aligned ones ([`buffers`], [`aligned`]), shapes ([`shape`],
//! [`window`]), the f32 GEMM ([`gemm`]) and layout transposes ([`layout`]).

#[macro_use]
pub mod isa;
pub mod aligned;
pub mod buffers;
pub mod gemm;
pub mod layout;
pub mod scratch;
pub mod shape;
pub mod spin;
#[cfg(test)]
pub(crate) mod testing;
pub mod threads;
pub mod window;
