# Sourced by bench/serve_perf.sh, bench/soak.sh and bench/serve_video.sh: finds NVIDIA perf_analyzer and sets $pa
# (and LD_LIBRARY_PATH for its CUDA runtime stub). With $setup = 1 it first installs it into
# ${TMPDIR:-/tmp}/kiln-perf-venv: tritonclient 2.50.0 is the last PyPI wheel that ships the
# binary; it needs Debian's libb64-0d and PyPI's nvidia-cuda-runtime-cu12, nothing else of CUDA.
venv="${TMPDIR:-/tmp}/kiln-perf-venv"
if [ "$setup" = 1 ]; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "tritonclient[http,grpc]==2.50.0" nvidia-cuda-runtime-cu12
  if ! ldconfig -p | grep -q libb64.so.0d; then
    apt-get install -y -q libb64-0d >/dev/null || { echo "install Debian's libb64-0d" >&2; exit 1; }
  fi
fi
pa="${PERF_ANALYZER:-}"
if [ -z "$pa" ]; then
  if command -v perf_analyzer >/dev/null; then pa=$(command -v perf_analyzer)
  elif [ -x "$venv/bin/perf_analyzer" ]; then pa="$venv/bin/perf_analyzer"
  else echo "perf_analyzer not found: run this script with --setup (or set PERF_ANALYZER)" >&2; exit 1
  fi
fi
cudart=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cuda_runtime/lib 2>/dev/null | head -1 || true)
if [ -n "$cudart" ]; then
  export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# wait_for_serve WORK TRIES: waits up to TRIES × 0.1 s for the `kiln serve` writing to
# WORK/serve.out to print its listening line, then sets $http_addr and $grpc_addr from it;
# stops the script, naming WORK/serve.log, when the server did not start.
wait_for_serve() {
  for _ in $(seq "$2"); do grep -q listening "$1/serve.out" 2>/dev/null && break; sleep 0.1; done
  read -r http_addr grpc_addr < <(awk '/listening/ {print $4, $6}' "$1/serve.out")
  [ -n "${grpc_addr:-}" ] || { echo "kiln serve did not start (see $1/serve.log)" >&2; exit 1; }
}
