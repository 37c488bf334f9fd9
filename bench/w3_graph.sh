# Sourced by bench/serve_perf.sh and bench/soak.sh: builds the release kiln (sets $kiln) and
# defines w3_graph WORK DEST, which trains W3 for one epoch under WORK and writes its f32
# inference graph as DEST/model.kgraph (with $threads CPU threads; logs in WORK).
cargo build --release -q -p kiln-cli
kiln=./target/release/kiln

w3_graph() {
  echo "== train W3 (1 epoch) and write its f32 inference graph" >&2
  $kiln train --model cnn --epochs 1 --checkpoint-dir "$1/ckpt" --threads "$threads" >"$1/train.log" 2>&1
  $kiln optimize --model cnn --checkpoint "$1/ckpt" --passes strip --out "$2" \
    --steps 3 --threads "$threads" >"$1/optimize.log" 2>&1
}
