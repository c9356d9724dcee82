"""Where `tndebug.watch`'s overhead goes, step by step, and what the watched healthy run shows.

    python bench/watch_breakdown.py --model bart --steps 800     # -> bench/results/watch_breakdown_bart.json
    python bench/watch_breakdown.py --model sdpa-small --arm every1 --steps 200 --host-reads \
        --out /tmp/every1.json                                   # every probe on every step

The paired loop of `bench/watch_overhead.py` (`paired`: a plain and a watched copy of the
model, one step of each in turn on the same batches, one torch thread, gc frozen), with
each step's extra main-thread CPU filed under the set of probes due on it (lr-schedule, due
every step, left out of the name). Other threads' CPU (TensorBoard's writer) is reported as
one total. Also kept: the watched run's verdict, its warnings and errors, and the series the
probes judged on: the loss at ln-placement's probed steps (its post-LN warmup hazard) and
label-smoothing's pad mass (p(<pad>) at real targets), as ratios and values.

Per probe: the seconds its observe/update took per step from `--skip` on (the engine's own
clock, wall time: on a loaded machine read the shares, not the milliseconds). `--host-reads`
also counts, per watched step, the reads of a tensor's value by tndebug's code (`.item()`,
`.tolist()`, `.cpu()`, `bool()`, `float()`, `int()`), by the line that reads: on a GPU each is
a host sync (on the CPU they cost little); the counting wrapper adds its own time to the ratio.
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
    ap.add_argument("--model", choices=("sdpa", "bart", "sdpa-small", "gpt"), default="bart")
    ap.add_argument("--arm", choices=("default", "every1"), default="default",
                    help="the probes' default schedules within the budget, or every probe every step")
    ap.add_argument("--host-reads", action="store_true", help="count tndebug's tensor reads")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prov = Provenance.start(__file__, argv)
    kind, steps = args.model, args.steps
    by: dict[str, list[float]] = defaultdict(list)
    losses: list[float] = []
    held = {"base": 0.0, "probes": None, "seconds0": {}, "seconds": {}}
    reads = _ReadCounter() if args.host_reads else None

    def on_step(i, dbg, tp, tw, loss):
        held["probes"] = probes = dbg._engine.probes
        held["seconds" if i >= args.skip else "seconds0"] = dict(dbg._engine.seconds_by_probe)
        if reads is not None and i == args.skip - 1:
            reads.start()
        losses.append(loss)
        if i < args.skip:
            return
        due = [p.name for p in probes if p.schedule(i) and p.name != "lr-schedule"]
        due += ["final snapshot"] if i == steps - 1 else []
        held["base"] += tp
        by[",".join(due) or "(no probe but lr-schedule)"].append(tw - tp)

    with tempfile.TemporaryDirectory() as tmp:
        timing = W.paired(kind, args.arm, steps, args.skip, on_step=on_step, out=tmp)
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
    per_probe = {k: (v - held["seconds0"].get(k, 0.0)) / n * 1e3 for k, v in held["seconds"].items()}
    per_probe = dict(sorted(((k, round(v, 3)) for k, v in per_probe.items() if v > 0),
                            key=lambda kv: -kv[1]))
    ln = next(p for p in probes if p.name == "ln-placement")
    ln_steps = [s for s in range(steps) if ln.schedule(s)]
    result = {
        "model": kind, "arm": args.arm, "steps": steps, "skip": args.skip,
        "plain_cpu_step_ms": base / n * 1e3, "per_probe_ms_wall": per_probe,
        **({"host_reads_per_step": reads.per_step(n)} if reads is not None else {}),
        "ratio_cpu": timing["ratio_cpu"],
        "other_threads_share": other / base, "by_due_probes": rows,
        "verdict": report["verdict"],
        "alarms": [f"{f['severity']} {f['probe']}: {f['message']}" for f in report["findings"]
                   if f["severity"] in ("warning", "error")],
        "loss_at_ln_placement_steps": [(s, losses[s], losses[s] / losses[0]) for s in ln_steps],
        "pad_mass": pad_mass, "provenance": prov.finish(),
    }
    if reads is not None:
        reads.stop()
    name = kind if args.arm == "default" else f"{kind}_{args.arm}"
    out = Path(args.out or Path(__file__).parent / "results" / f"watch_breakdown_{name}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{kind}: x{result['ratio_cpu']:.4f}, other threads {other / base:.2%}, verdict "
          f"{result['verdict']}", file=sys.stderr)
    for r in rows:
        print(f"  {r['steps']:4d} steps  {r['median_extra_ms']:7.2f} ms  "
              f"{r['share_of_plain_cpu']:6.2%}  {r['due']}", file=sys.stderr)
    print("  per probe (ms a step, wall): " + ", ".join(f"{k} {v:.2f}" for k, v in per_probe.items()),
          file=sys.stderr)
    if reads is not None:
        print(f"  tndebug's tensor reads a step: {result['host_reads_per_step']['total']:.1f}",
              file=sys.stderr)
        for line, c in list(result["host_reads_per_step"]["by_line"].items())[:8]:
            print(f"    {c:6.2f}  {line}", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 0


class _ReadCounter:
    """Counts the tensor reads made by tndebug's own code (its frames), by file:line."""
    METHODS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")

    def __init__(self) -> None:
        import tndebug
        self.root = str(Path(tndebug.__file__).parent)
        self.counts: dict[str, int] = defaultdict(int)
        self.saved: dict = {}

    def start(self) -> None:
        for name in self.METHODS:
            self.saved[name] = orig = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, orig))

    def _wrap(self, name, orig):
        def read(t, *a, **k):
            f = sys._getframe(1)
            if f.f_code.co_filename.startswith(self.root):
                where = f.f_code.co_filename[len(self.root) + 1:]
                self.counts[f"{where}:{f.f_lineno} {name}"] += 1
            return orig(t, *a, **k)
        return read

    def stop(self) -> None:
        for name, orig in self.saved.items():
            setattr(torch.Tensor, name, orig)
        self.saved = {}

    def per_step(self, n: int) -> dict:
        by = sorted(self.counts.items(), key=lambda kv: -kv[1])
        return {"total": round(sum(self.counts.values()) / n, 2),
                "by_line": {k: round(v / n, 2) for k, v in by}}


if __name__ == "__main__":
    sys.exit(main())
