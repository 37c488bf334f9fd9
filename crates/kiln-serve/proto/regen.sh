#!/usr/bin/env bash
# Regenerates src/proto/kserve_v2.rs from kserve_v2.proto. The generated file is committed so
# that building Kiln needs no protoc; run this only after editing the proto.
# Needs: protoc (Debian: apt-get install protobuf-compiler) and network access to crates.io.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/out"
cat > "$work/Cargo.toml" <<'TOML'
[package]
name = "kiln-serve-protogen"
version = "0.0.0"
edition = "2024"
publish = false
[dependencies]
tonic-prost-build = "0.14.9"
TOML
cat > "$work/src/main.rs" <<'RS'
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (proto, dir, out) = (&args[1], &args[2], &args[3]);
    tonic_prost_build::configure()
        .out_dir(out)
        .compile_protos(&[proto.as_str()], &[dir.as_str()])
        .expect("protoc failed");
}
RS
cargo run --quiet --release --manifest-path "$work/Cargo.toml" -- \
  "$here/kserve_v2.proto" "$here" "$work/out"
cp "$work/out/inference.rs" "$here/../src/proto/kserve_v2.rs"
echo "wrote $here/../src/proto/kserve_v2.rs"
