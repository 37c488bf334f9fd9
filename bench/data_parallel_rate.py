"""One line of bench/data_parallel.sh's table from a run's JSON on stdin.

usage: ... | python3 data_parallel_rate.py kiln|torch LABEL
kiln: `kiln train --json` step events; 5 warm-up steps, then 3 equal groups, the median
group's samples/s, and the mean reduce_ms where the run was data parallel.
torch: torch_ddp.py's JSON line.
"""
import json
import statistics
import sys

kind, label = sys.argv[1], sys.argv[2]
lines = [json.loads(l) for l in sys.stdin if l.startswith("{")]
extra = ""
if kind == "kiln":
    steps = [v for v in lines if v.get("event") == "step"][5:]
    n = len(steps) // 3
    groups = [steps[i * n:(i + 1) * n] for i in range(3)]
    rate = statistics.median(
        sum(s["samples"] for s in g) / sum(s["step_ms"] for s in g) * 1e3 for g in groups
    )
    reduce_ms = [s["reduce_ms"] for s in steps if s.get("reduce_ms") is not None]
    if reduce_ms:
        extra = f"  (reduce {statistics.mean(reduce_ms):.2f} ms/step)"
else:
    rate = lines[-1]["samples_per_s"]
print(f"{label:40s} {rate:9.0f} samples/s{extra}")
