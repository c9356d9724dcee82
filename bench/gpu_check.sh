#!/usr/bin/env bash
# One prepared GPU check, under 5 minutes on one GPU (sized for an H200): the `base` preset
# trained with probes off / default schedules / every probe every step (tokens/s, overhead
# ratios, peak memory), then the detection suite's GPU-relevant faults under autocast.
# Results: bench/results/gpu_check.json (written part by part, so a timeout keeps what ran).
# Without CUDA it runs a tiny CPU version, labelled "CPU FALLBACK" in the JSON, and exits 0.
#
#   bash bench/gpu_check.sh                 # defaults
#   bash bench/gpu_check.sh --steps 80      # extra arguments go to bench/gpu_check.py
set -uo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
timeout --kill-after=10 295 python bench/gpu_check.py "$@"
code=$?
if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
    echo "gpu_check: stopped at the 5-minute limit; bench/results/gpu_check.json has the parts that finished" >&2
    exit 0
fi
exit "$code"
