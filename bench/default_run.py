"""Measure the default `tndebug run` (copy task, small preset, Pre-LN, CPU) against its target:
>= 99% exact-sequence match on held-out sequences within <= 60 s of training on 2 CPU cores.

    python bench/default_run.py                     # probes off, seed 0; writes bench/results/default_run.json
    python bench/default_run.py --seeds 0 1 2 --with-probes

The machine this runs on may be shared, so besides wall time it records the training loop's
process CPU time (all threads): on an idle machine the wall time of the loop cannot exceed it,
so `train_cpu_s <= 60` shows the target holds on 2 idle cores even when the wall clock here
is stretched by other work. The load average is recorded before and after each run.
OMP_WAIT_POLICY=PASSIVE is set (before torch loads) so that OpenMP threads do not spin
against other processes on a loaded machine; it does not change the numbers.

How the defaults were chosen (batch 64, Noam warmup 20, factor 0.2, 400 steps; eval on 500 or
1000 held-out sequences, one torch thread, machine load 10-16 on 2 cores):

* factor 1 / warmup 100 (peak 8.8e-3): 95.7% at 300 steps, 97% at 500; factor 2 / warmup 50
  stalls at 4%; factor 0.5 / warmup 50: 98.4% at 500; factor 0.2 / warmup 20: 99.4% at 200.
* Without an EOS at the end of the source, copies ending in a repeated token ("5 5") stopped
  one token early (all of the remaining errors); data.py appends one.
* Exact match on copy is noisy from checkpoint to checkpoint: evaluated every 10 steps (seed 0),
  about a third of the checkpoints between steps 250 and 430 dip to 94-98.9% and recover
  (wrong tokens in runs of repeated symbols); from step 440 to 500 every one was >= 99.2%.
  One thread, step 400, seeds 1-3: 98.3 / 98.6 / 98.9%; step 350: 99.9 / 99.6 / 99.7%. With the
  default two threads (different rounding, different trajectory) see results/default_run.json.
  A batch of 96 or a lower factor (0.15) dipped as often.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from tndebug.train import TrainConfig, model_config, run_training  # noqa: E402

TARGET_EXACT, TARGET_SECONDS = 0.99, 60.0
RESULT = Path(__file__).parent / "results" / "default_run.json"


def one_run(seed: int, probes: str) -> dict:
    tcfg = TrainConfig(seed=seed, device="cpu")
    load_before = os.getloadavg()
    report = run_training(model_config(tcfg.task, "small", "pre"), tcfg, probes=probes).report
    r = report.run
    out = {k: r[k] for k in ("task", "preset", "norm", "seed", "steps", "batch_size", "warmup",
                             "lr_factor", "exact_match", "token_accuracy", "eval_size", "final_loss",
                             "status", "train_s", "train_cpu_s", "eval_s", "probe_s", "wall_s",
                             "tokens_per_s")}
    out.update(probes=probes, load_before=[round(x, 2) for x in load_before],
               load_after=[round(x, 2) for x in os.getloadavg()],
               meets_exact=r["exact_match"] >= TARGET_EXACT,
               meets_time_cpu_bound=r["train_cpu_s"] <= TARGET_SECONDS,
               findings=len(report.findings), verdict=report.verdict,
               probe_status={n: s["status"] for n, s in report.probes.items()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--with-probes", action="store_true", help="also one run (first seed) with --probe all")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the target says 2 cores)")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = []
    for seed in args.seeds:
        runs.append(one_run(seed, "none"))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    if args.with_probes:
        runs.append(one_run(args.seeds[0], "all"))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    healthy = [r for r in runs if r["probes"] == "none"]
    result = {
        "command": "tndebug run --device cpu --probe none   (the defaults: copy, small, pre, "
                   f"{healthy[0]['steps']} steps, batch {healthy[0]['batch_size']})",
        "target": {"exact_match": TARGET_EXACT, "train_seconds": TARGET_SECONDS, "cores": 2},
        "met": all(r["meets_exact"] and r["meets_time_cpu_bound"] for r in healthy),
        "machine": {"cpus": os.cpu_count(), "torch_threads": args.threads, "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform(),
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"exact match {[r['exact_match'] for r in healthy]}, train CPU s "
          f"{[r['train_cpu_s'] for r in healthy]}, wall s {[r['train_s'] for r in healthy]} "
          f"-> {'MET' if result['met'] else 'NOT MET'}; {args.out}")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
