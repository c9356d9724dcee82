"""What the probes cost under DDP: 2 CPU processes (gloo), default schedules vs no probes.

    python bench/ddp_overhead.py                          # tiny preset, 200 steps, 2 reps
    python bench/ddp_overhead.py --preset small --steps 300 --reps 3

Each rep launches one torchrun job (2 processes) that trains the same run twice, probes off
and probes at their default schedules, in alternating order (none, default; then default,
none); between the jobs this process trains the same two arms in one process, so the
one-process overhead is measured under the same machine load. Step time is the steady state
(`bench/_timing.py`: probe setup and the first 5 steps excluded), on rank 0.

Figures, written to bench/results/ddp_overhead.json:

* `ratio_ddp`: median step time, default / none, under DDP (target <= 1.05);
* `ratio_single`: the same in one process (what the probes cost without DDP);
* `reduce_ms_per_step`: time rank 0 spent in the cross-rank reduction of the probe
  statistics (`Dist.reducer`), per step, and `reduce_share`: that over the none arm's step.

One torch thread per process: two processes on two shared cores.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import Provenance  # noqa: E402
from _timing import StepTimer  # noqa: E402

from tndebug.train import TrainConfig, distributed, model_config, run_training  # noqa: E402

RESULT = Path(__file__).parent / "results" / "ddp_overhead.json"
TARGET = 1.05
NOTE = ("reduce_ms_per_step is the wall time rank 0 spends in the reducer, mostly waiting for the "
        "other rank to finish its probe work (without the reducer that wait moves into the next "
        "step's DDP gradient all-reduce); ratio_ddp - ratio_single is the reduction's own cost. "
        "ratio_single is the probes' cost in one process: at the default schedules about one "
        "step in eight is probed (log-spaced nan-scores and variance-drift, gradient-flow and "
        "loss-health every 10 steps), the others only run lr-schedule's host-side check.")
ARMS = {"none": "none", "default": "all"}


def one_run(args, arm: str, dist=distributed.LOCAL) -> dict:
    timer = StepTimer(skip=5) if dist.is_main else None
    spent = [0.0]
    if dist.active:
        reduce = dist._reduce

        def timed(packed):
            t0 = time.perf_counter()
            out = reduce(packed)
            spent[0] += time.perf_counter() - t0
            return out
        dist._reduce = timed
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, device="cpu", log_every=10)
    run_training(model_config("copy", args.preset), cfg, probes=ARMS[arm], session=timer,
                 evaluate_at_end=False, dist=dist)
    if dist.active:
        del dist._reduce
    return {"step_ms": timer.step_seconds() * 1e3 if timer else None,
            "reduce_ms_per_step": spent[0] * 1e3 / args.steps}


def worker(args) -> None:
    torch.set_num_threads(1)
    dist = distributed.init_from_env("cpu")
    order = list(ARMS) if args.rep % 2 == 0 else list(ARMS)[::-1]
    out = {arm: one_run(args, arm, dist) for arm in order}
    if dist.is_main:
        Path(args.worker_out).write_text(json.dumps(out))
    dist.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, rep: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__, "--worker-out",
           str(out), "--rep", str(rep), "--preset", args.preset, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32, help="the global batch (16 rows per rank)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_out:
        worker(args)
        return 0

    torch.set_num_threads(1)
    prov = Provenance.start(__file__, argv)
    ddp: dict[str, list] = {a: [] for a in ARMS}
    single: dict[str, list] = {a: [] for a in ARMS}
    reduce_ms: list[float] = []
    tmp = args.out.parent / ".ddp_overhead_worker.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for rep in range(args.reps):
        got = launch(args, rep, tmp)
        for arm in ARMS:
            ddp[arm].append(round(got[arm]["step_ms"], 3))
        reduce_ms.append(got["default"]["reduce_ms_per_step"])
        order = list(ARMS)[::-1] if rep % 2 == 0 else list(ARMS)
        for arm in order:
            single[arm].append(round(one_run(args, arm)["step_ms"], 3))
        print(f"rep {rep}: ddp {ddp}  single {single}", file=sys.stderr)
    tmp.unlink(missing_ok=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    ratio_ddp = med(ddp["default"]) / med(ddp["none"])
    # each rep's ratio (its arms ran back to back): the spread beside the median
    reps_ddp = [round(d / n, 4) for d, n in zip(ddp["default"], ddp["none"])]
    reps_single = [round(d / n, 4) for d, n in zip(single["default"], single["none"])]
    result = {
        "preset": args.preset, "steps": args.steps, "global_batch": args.batch_size, "processes": 2,
        "backend": "gloo", "device": "cpu", "torch_threads_per_process": 1, "reps": args.reps,
        "step_ms": {"ddp": ddp, "single": single},
        "median_step_ms": {"ddp": {a: med(v) for a, v in ddp.items()},
                           "single": {a: med(v) for a, v in single.items()}},
        "ratio_ddp": round(ratio_ddp, 4),
        "ratio_single": round(med(single["default"]) / med(single["none"]), 4),
        "reduce_ms_per_step": round(med(reduce_ms), 4),
        "reduce_share": round(med(reduce_ms) / med(ddp["none"]), 5),
        "ratio_ddp_reps": reps_ddp, "ratio_single_reps": reps_single,
        # met only when every rep is: a spread that crosses the target is not met
        "target": TARGET, "meets_target": max(reps_ddp) <= TARGET, "note": NOTE,
        "provenance": prov.finish(),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_step_ms", "ratio_ddp", "ratio_single",
                                             "reduce_ms_per_step", "meets_target")}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
