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

The FSDP2 arm (`--arm fsdp2`, results in bench/results/ddp_overhead_fsdp2.json) is the user's
own loop under `tndebug.watch`, not `tndebug run`: a nanoGPT-style decoder
(tests/foreign/nanogpt.py, SDPA, tied head) with `fully_shard` on each block and on the root,
AdamW, each rank its half of one global batch; each rep one torchrun job that trains it twice
from the same seed, without watch and with watch at the default probes (out= a temporary
folder), in alternating order. Step time: the mean wall time of the steps after the first 5,
on rank 0 (probed steps included: the mean is what a run costs). Figures: `ratio_fsdp2`
(watch / no watch, target <= 1.05, met only when every rep is), and the cost of reading
sharded tensors: `gather_ms` (whole weights gathered with `full_tensor()`, at setup),
`norm_reduce_ms_per_probed_step` (the all-reduce of the shards' squared norms, on the steps
that read gradients or updates) and its share of a step.

    python bench/ddp_overhead.py --arm fsdp2 --steps 200 --reps 2
"""
from __future__ import annotations

import argparse
import contextlib
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "foreign"))   # nanogpt (fsdp2)
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


# -- the FSDP2 arm: tndebug.watch on the user's own loop -------------------------------------------
FSDP2_RESULT = Path(__file__).parent / "results" / "ddp_overhead_fsdp2.json"
GPT = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)


def fsdp2_run(args, watched: bool, rank: int, world: int, out_dir: str) -> dict:
    """One training run of the sharded nanoGPT; rank 0's mean step time and gather costs."""
    import tempfile
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    import nanogpt
    import tndebug
    from tndebug import sharded
    torch.manual_seed(0)
    model = nanogpt.build("sdpa", **GPT)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rows = args.batch_size // world
    spent = {"gather_s": 0.0, "gather_calls": 0, "reduce_s": 0.0, "reduce_calls": 0}
    full_tensor, reduce = DTensor.full_tensor, sharded._sum_over_shards

    def timed_full(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return full_tensor(self, *a, **k)
        finally:
            spent["gather_s"] += time.perf_counter() - t0
            spent["gather_calls"] += 1

    def timed_reduce(*a, **k):
        t0 = time.perf_counter()
        try:
            return reduce(*a, **k)
        finally:
            spent["reduce_s"] += time.perf_counter() - t0
            spent["reduce_calls"] += 1

    def forward(m, ids, pad_id):
        return m(ids, ids.contiguous())[0]                                  # [B, T, V]

    DTensor.full_tensor, sharded._sum_over_shards = timed_full, timed_reduce
    stamps = []
    try:
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp, (
                tndebug.watch(model, opt, forward=forward, pad_id=None, out=Path(tmp) / "run",
                              total_steps=args.steps, quiet=True)
                if watched else contextlib.nullcontext()) as dbg:
            for step in range(args.steps):
                ids = torch.randint(0, GPT["vocab_size"], (args.batch_size, GPT["block_size"] + 1),
                                    generator=g)[rank * rows:(rank + 1) * rows]
                logits = forward(model, ids[:, :-1].contiguous(), None)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if step == 4 or step == args.steps - 1:
                    stamps.append((step, time.perf_counter()))
            report = None
        if watched:
            report = dbg.report
    finally:
        DTensor.full_tensor, sharded._sum_over_shards = full_tensor, reduce
    (s0, t0), (s1, t1) = stamps
    out = {"step_ms": (t1 - t0) / (s1 - s0) * 1e3, **spent}
    if report is not None:
        out["verdict"] = report.verdict
        out["probed_steps"] = _probed_steps(report)
        out["probe_budget"] = report.run.get("probe_budget")
    return out


def _probed_steps(report) -> int:
    """Steps on which some probe read gradients or updates (gradient-flow, ln-placement,
    lr-schedule's sampled steps): the steps that pay the norms' all-reduce."""
    gf = report.probes.get("gradient-flow", {}).get("steps_observed") or 0
    return int(gf)


def fsdp2_worker(args) -> None:
    import torch.distributed as tdist
    torch.set_num_threads(1)
    tdist.init_process_group("gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    order = [False, True] if args.rep % 2 == 0 else [True, False]
    out = {("watch" if w else "none"): fsdp2_run(args, w, rank, world,
                                                 str(Path(args.worker_out).parent)) for w in order}
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(out))
    tdist.barrier()
    tdist.destroy_process_group()


def fsdp2_main(args, prov) -> int:
    arms: dict[str, list] = {"none": [], "watch": []}
    gather_ms, reduce_ms, calls, probed, verdicts, budgets = [], [], [], [], [], []
    tmp = args.out.parent / ".ddp_overhead_fsdp2_worker.json"
    for rep in range(args.reps):
        got = launch(args, rep, tmp)
        for arm in arms:
            arms[arm].append(round(got[arm]["step_ms"], 3))
        w = got["watch"]
        gather_ms.append(w["gather_s"] * 1e3)
        reduce_ms.append(w["reduce_s"] * 1e3)
        calls.append(w["reduce_calls"])
        probed.append(w["probed_steps"])
        verdicts.append(w["verdict"])
        budgets.append(w.get("probe_budget"))
        print(f"rep {rep}: {arms}", file=sys.stderr)
    tmp.unlink(missing_ok=True)
    med = statistics.median
    reps = [round(wt / n, 4) for wt, n in zip(arms["watch"], arms["none"])]
    per_probed = med([r / max(p, 1) for r, p in zip(reduce_ms, probed)])
    result = {
        "arm": "fsdp2", "model": {"file": "tests/foreign/nanogpt.py", "variant": "sdpa", **GPT},
        "steps": args.steps, "global_batch": args.batch_size, "processes": 2, "backend": "gloo",
        "device": "cpu", "torch_threads_per_process": 1, "reps": args.reps,
        "sharding": "fully_shard on each block and the root (FSDP2)",
        "step_ms": arms, "median_step_ms": {a: med(v) for a, v in arms.items()},
        "ratio_fsdp2": round(med(arms["watch"]) / med(arms["none"]), 4), "ratio_fsdp2_reps": reps,
        "gather_ms": round(med(gather_ms), 3),
        "norm_reduce_ms_total": round(med(reduce_ms), 3), "norm_reduce_calls": med(calls),
        "probed_steps": med(probed),
        "norm_reduce_ms_per_probed_step": round(per_probed, 4),
        "norm_reduce_share_of_step": round(per_probed / med(arms["none"]), 5),
        "verdicts": verdicts, "target": TARGET, "meets_target": max(reps) <= TARGET,
        # rank 0's run.probe_budget each rep: the ranks agree every 10 steps (probes/budget.py)
        "probe_budget": [{k: b.get(k) for k in ("fraction", "spent_fraction", "thinned",
                                                "ranks_agreed")} if b else None for b in budgets],
        "note": "gather_ms: full_tensor() calls (head-collapse's Q/K/V weights and "
                "positional-encoding's token table, at setup only); the norms' all-reduce runs "
                "on the steps gradient-flow, ln-placement and lr-schedule read gradients or "
                "updates (norm_reduce_calls in all, probed_steps = gradient-flow's looks)",
        "provenance": prov.finish(),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_step_ms", "ratio_fsdp2", "ratio_fsdp2_reps",
                                             "gather_ms", "norm_reduce_ms_per_probed_step",
                                             "meets_target")}), file=sys.stderr)
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, rep: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__, "--worker-out",
           str(out), "--rep", str(rep), "--preset", args.preset, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--arm", args.arm]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32, help="the global batch (16 rows per rank)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--arm", choices=("run", "fsdp2"), default="run",
                    help="run: `tndebug run` under DDP (default); fsdp2: watch on a loop sharded with FSDP2")
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/ddp_overhead"
                    "[_fsdp2].json")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = FSDP2_RESULT if args.arm == "fsdp2" else RESULT
    if args.worker_out:
        (fsdp2_worker if args.arm == "fsdp2" else worker)(args)
        return 0

    torch.set_num_threads(1)
    prov = Provenance.start(__file__, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.arm == "fsdp2":
        return fsdp2_main(args, prov)
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
