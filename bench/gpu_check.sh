#!/usr/bin/env bash
# One prepared GPU check, under 5 minutes on one GPU (sized for an H200): the `base` preset
# trained with probes off / default schedules / every probe every step (tokens/s, overhead
# ratios, peak memory), then the detection suite's GPU-relevant faults under autocast.
# Results: bench/results/gpu_check.json (written part by part, so a timeout keeps what ran);
# then an FSDP2 step (tndebug.watch on a sharded loop, below), bench/results/gpu_check_fsdp2/.
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
    code=0
fi

# FSDP2 step (issue 51): tndebug.watch on a nanoGPT-style loop sharded with fully_shard, one
# process per GPU (NCCL; 1 GPU: a one-rank mesh, the DTensor paths all the same), healthy and
# with the attention scale missing, 60 steps each, under 2 minutes. Without CUDA: 2 gloo
# processes on the CPU, labelled so. Reports: bench/results/gpu_check_fsdp2/<bug>/report.json;
# one summary line each.
gpus=0
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    gpus=$(python -c "import torch; print(min(2, torch.cuda.device_count()))")
fi
nproc=$gpus; label="cuda, $gpus GPU(s)"
if [ "$gpus" -eq 0 ]; then nproc=2; label="CPU FALLBACK, 2 gloo processes"; fi
fsdp_out=bench/results/gpu_check_fsdp2
rm -rf "$fsdp_out"
for bug in healthy no_scale; do
    TNDEBUG_TEST_DEVICE=$([ "$gpus" -gt 0 ] && echo cuda || echo cpu) OMP_NUM_THREADS=1 \
        timeout --kill-after=10 100 python -m torch.distributed.run --standalone \
        --nproc-per-node="$nproc" tests/api/fsdp_watch_worker.py "$fsdp_out/$bug" fsdp "$bug" 60 \
        > "$fsdp_out.$bug.log" 2>&1
    rc=$?
    python - "$fsdp_out/$bug/report.json" "$bug" "$rc" "$label" <<'PY'
import json, sys
path, bug, rc, label = sys.argv[1:]
try:
    r = json.load(open(path))
except OSError:
    print(f"gpu_check fsdp2 [{label}] {bug}: no report (torchrun exit {rc}; see {path.rsplit('/', 2)[0]}.{bug}.log)")
    sys.exit(0)
errors = sorted({f["code"] for f in r["findings"] if f["severity"] == "error"})
failed = sorted(f["probe"] for f in r["findings"] if f["code"].endswith("/probe-failed"))
print(f"gpu_check fsdp2 [{label}] {bug}: verdict {r['verdict']}, errors {errors}, probes switched "
      f"off {failed}, sharding {r['run'].get('sharding')}, world {r['run'].get('world_size')}, "
      f"probe_s {r['run'].get('probe_s')} (expected: healthy clean; no_scale missing-scale/absent)")
PY
done
exit "$code"
