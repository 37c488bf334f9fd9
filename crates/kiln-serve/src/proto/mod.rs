//! The KServe v2 protocol's message types, apart from the service that uses them: the wire
//! codecs (`codec`) and the Triton configuration (`triton_config`) depend on these types
//! only, never on the gRPC service, the pipeline or the repository, so each decoder can be
//! built and fuzzed alone (`tests/fuzz_codecs.rs`).

/// Messages and service stubs generated from `proto/kserve_v2.proto` by prost-build
/// (`kserve_v2.rs`, ~1.7k lines, kept whole: generated code is regenerated, never edited).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    include!("kserve_v2.rs");
}
