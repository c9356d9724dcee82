"""Where `tndebug.watch`'s overhead goes, step by step, and what the watched healthy run shows.

    python bench/watch_breakdown.py --model bart --steps 800     # -> bench/results/watch_breakdown_bart.json

The paired loop of `bench/watch_overhead.py` (a plain and a watched copy of the model, one
step of each in turn on the same batches, one torch thread, gc frozen after setup), with
each step's extra main-thread CPU filed under the set of probes due on it (lr-schedule, due
every step, left out of the name). Other threads' CPU (TensorBoard's writer) is reported as
one total. Also kept: the watched run's verdict, its warnings and errors, and the series the
probes judged on: the loss at ln-placement's probed steps (its post-LN warmup hazard) and
label-smoothing's pad mass (p(<pad>) at real targets), as ratios and values.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import watch_overhead as W  # noqa: E402  (build, the user's loop, sizes)

M = W.M


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("sdpa", "bart"), default="bart")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import tndebug
    kind, steps = args.model, args.steps
    plain, forward = W.build(kind)
    watched, _ = W.build(kind)
    opt_p = torch.optim.Adam(plain.parameters(), lr=3e-4)
    opt_w = torch.optim.Adam(watched.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(0)
    batches = [M.copy_batch(g, W.BATCH, W.LENGTH) for _ in range(steps)]
    losses = []

    def step(model, opt, src, tgt):
        c0 = time.thread_time()
        loss = M.train_step(kind, model, src, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.thread_time() - c0, float(loss.detach())

    by: dict[str, list[float]] = defaultdict(list)
    base = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        dbg = tndebug.watch(watched, opt_w, forward=forward, out=tmp, quiet=True, total_steps=steps)
        dbg.__enter__()
        probes = dbg._engine.probes
        plain.train()
        watched.train()
        gc.collect()
        gc.freeze()
        for i, (src, tgt) in enumerate(batches):
            if i == args.skip:
                proc0, thread0 = time.process_time(), time.thread_time()
            due = [p.name for p in probes if p.schedule(i) and p.name != "lr-schedule"]
            due += ["final snapshot"] if i == steps - 1 else []
            if i % 2 == 0:
                tp, _ = step(plain, opt_p, src, tgt)
                tw, lw = step(watched, opt_w, src, tgt)
            else:
                tw, lw = step(watched, opt_w, src, tgt)
                tp, _ = step(plain, opt_p, src, tgt)
            losses.append(lw)
            if i >= args.skip:
                base += tp
                by[",".join(due) or "(no probe but lr-schedule)"].append(tw - tp)
        other = (time.process_time() - proc0) - (time.thread_time() - thread0)
        gc.unfreeze()
        dbg.__exit__(None, None, None)
        report = json.loads((Path(tmp) / "report.json").read_text())
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(str(Path(tmp) / "tb"))
        acc.Reload()
        pad_mass = [(e.step, e.value) for e in acc.Scalars("smoothing/pad_mass")] \
            if "smoothing/pad_mass" in acc.Tags()["scalars"] else []
    n = steps - args.skip
    rows = sorted(({"due": k, "steps": len(v), "median_extra_ms": statistics.median(v) * 1e3,
                    "share_of_plain_cpu": sum(v) / base} for k, v in by.items()),
                  key=lambda r: -r["share_of_plain_cpu"])
    ln_steps = [s for s in range(steps) if next(p for p in probes if p.name == "ln-placement").schedule(s)]
    result = {
        "command": "python bench/watch_breakdown.py " + " ".join(argv or sys.argv[1:]),
        "model": kind, "steps": steps, "skip": args.skip, "plain_cpu_step_ms": base / n * 1e3,
        "ratio_cpu": 1 + (sum(sum(v) for v in by.values()) + other) / base,
        "other_threads_share": other / base, "by_due_probes": rows,
        "verdict": report["verdict"],
        "alarms": [f"{f['severity']} {f['probe']}: {f['message']}" for f in report["findings"]
                   if f["severity"] in ("warning", "error")],
        "loss_at_ln_placement_steps": [(s, losses[s], losses[s] / losses[0]) for s in ln_steps],
        "pad_mass": pad_mass,
    }
    out = Path(args.out or Path(__file__).parent / "results" / f"watch_breakdown_{kind}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{kind}: x{result['ratio_cpu']:.4f}, other threads {other / base:.2%}, verdict "
          f"{result['verdict']}", file=sys.stderr)
    for r in rows:
        print(f"  {r['steps']:4d} steps  {r['median_extra_ms']:7.2f} ms  "
              f"{r['share_of_plain_cpu']:6.2%}  {r['due']}", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
