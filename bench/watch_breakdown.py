"""Where `tndebug.watch`'s overhead goes, step by step, and what the watched healthy run shows.

    python bench/watch_breakdown.py --model bart --steps 800     # -> bench/results/watch_breakdown_bart.json

The paired loop of `bench/watch_overhead.py` (`paired`: a plain and a watched copy of the
model, one step of each in turn on the same batches, one torch thread, gc frozen), with
each step's extra main-thread CPU filed under the set of probes due on it (lr-schedule, due
every step, left out of the name). Other threads' CPU (TensorBoard's writer) is reported as
one total. Also kept: the watched run's verdict, its warnings and errors, and the series the
probes judged on: the loss at ln-placement's probed steps (its post-LN warmup hazard) and
label-smoothing's pad mass (p(<pad>) at real targets), as ratios and values.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import watch_overhead as W  # noqa: E402  (build, the user's loop, sizes)
from _provenance import Provenance  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("sdpa", "bart"), default="bart")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prov = Provenance.start(__file__, argv)
    kind, steps = args.model, args.steps
    by: dict[str, list[float]] = defaultdict(list)
    losses: list[float] = []
    held = {"base": 0.0, "probes": None}

    def on_step(i, dbg, tp, tw, loss):
        held["probes"] = probes = dbg._engine.probes
        losses.append(loss)
        if i < args.skip:
            return
        due = [p.name for p in probes if p.schedule(i) and p.name != "lr-schedule"]
        due += ["final snapshot"] if i == steps - 1 else []
        held["base"] += tp
        by[",".join(due) or "(no probe but lr-schedule)"].append(tw - tp)

    with tempfile.TemporaryDirectory() as tmp:
        timing = W.paired(kind, "default", steps, args.skip, on_step=on_step, out=tmp)
        report = json.loads((Path(tmp) / "report.json").read_text())
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(str(Path(tmp) / "tb"))
        acc.Reload()
        pad_mass = [(e.step, e.value) for e in acc.Scalars("smoothing/pad_mass")] \
            if "smoothing/pad_mass" in acc.Tags()["scalars"] else []
    base, probes = held["base"], held["probes"]
    other = timing["other_threads_cpu_step_s"] * (steps - args.skip)
    n = steps - args.skip
    rows = sorted(({"due": k, "steps": len(v), "median_extra_ms": statistics.median(v) * 1e3,
                    "share_of_plain_cpu": sum(v) / base} for k, v in by.items()),
                  key=lambda r: -r["share_of_plain_cpu"])
    ln = next(p for p in probes if p.name == "ln-placement")
    ln_steps = [s for s in range(steps) if ln.schedule(s)]
    result = {
        "model": kind, "steps": steps, "skip": args.skip, "plain_cpu_step_ms": base / n * 1e3,
        "ratio_cpu": timing["ratio_cpu"],
        "other_threads_share": other / base, "by_due_probes": rows,
        "verdict": report["verdict"],
        "alarms": [f"{f['severity']} {f['probe']}: {f['message']}" for f in report["findings"]
                   if f["severity"] in ("warning", "error")],
        "loss_at_ln_placement_steps": [(s, losses[s], losses[s] / losses[0]) for s in ln_steps],
        "pad_mass": pad_mass, "provenance": prov.finish(),
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
