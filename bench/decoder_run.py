"""`tndebug run --arch decoder --probe all` (issue 21's target), seeds 0-2, Pre-LN and Post-LN.

    python bench/decoder_run.py                   # seeds 0 1 2, pre and post -> results/decoder_run.*
    python bench/decoder_run.py --seeds 0 --norms pre --out /tmp/decoder_run.json

Target (issue 21, stated in docs/decoder.md): the copy task learnt to a held-out token accuracy
of at least TARGET_TOKEN_ACC in at most TARGET_SECONDS of training on 2 CPU cores, the verdict
CLEAN (no warning or error, every applicable probe checked), every seed and norm.

Each run is the real command in a child process (`python -m tndebug run --arch decoder --probe
all ... --format json`, its own defaults otherwise: one torch thread): train_s and train_cpu_s
are the training loop's wall and CPU time from the report; wall_s is the whole command. The
load average before each run is recorded: a wall time is evidence only on a quiet machine
(load < QUIET_LOAD on 2 cores). Written by this script only."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import Provenance, provenance_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET_TOKEN_ACC, TARGET_SECONDS, QUIET_LOAD = 0.97, 30.0, 2.5
RUN_KEYS = ("preset", "norm", "seed", "steps", "exact_match", "token_accuracy", "train_s",
            "train_cpu_s")


def one(seed: int, norm: str) -> dict:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tndebug-decoder-") as d:
        out = Path(d) / "run"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tndebug", "run", "--arch", "decoder",
                               "--probe", "all", "--device", "cpu", "--seed", str(seed),
                               "--norm", norm, "--format", "json", "--fail-on", "never",
                               "--out", str(out)], capture_output=True, text=True, cwd=d)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"seed {seed} {norm}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        report = json.loads((out / "report.json").read_text())
    run = report["run"]
    bad = [(f["severity"], f["probe"], f.get("code")) for f in report["findings"]
           if f["severity"] in ("warning", "error")]
    row = {k: run.get(k) for k in RUN_KEYS}
    row.update(verdict=report["verdict"], warnings_errors=bad, wall_s=round(wall, 2),
               load_before=round(load, 2), quiet=load < QUIET_LOAD)
    row["meets"] = (row["verdict"] == "clean" and (row["token_accuracy"] or 0) >= TARGET_TOKEN_ACC
                    and row["train_s"] <= TARGET_SECONDS)
    return row


def write_md(result: dict, path: Path) -> None:
    lines = ["# `tndebug run --arch decoder --probe all` (`bench/decoder_run.py`, issue 21)", "",
             "Written by `bench/decoder_run.py` from its JSON; nothing here is typed by hand.", "",
             provenance_line(result["provenance"]), "",
             f"Target: held-out token accuracy >= {TARGET_TOKEN_ACC}, training <= "
             f"{TARGET_SECONDS:.0f} s on 2 cores, verdict clean. Wall times are evidence only where "
             f"`quiet` (load < {QUIET_LOAD}).", "",
             "| seed | norm | steps | token accuracy | exact match | train s | train CPU s | wall s | "
             "load | verdict | meets |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['seed']} | {r['norm']} | {r['steps']} | {r['token_accuracy']:.4f} | "
                     f"{r['exact_match']:.3f} | {r['train_s']:.1f} | {r['train_cpu_s']:.1f} | "
                     f"{r['wall_s']:.1f} | {r['load_before']:.2f} | {r['verdict']} | "
                     f"{'yes' if r['meets'] else 'no'} |")
    s = result["summary"]
    lines += ["", f"Summary: {s['meets']}/{s['runs']} runs meet the target; token accuracy "
              f"{s['token_accuracy'][0]:.3f}-{s['token_accuracy'][1]:.3f}, exact match "
              f"{s['exact_match'][0]:.3f}-{s['exact_match'][1]:.3f}, training "
              f"{s['train_s'][0]:.1f}-{s['train_s'][1]:.1f} s; verdicts {', '.join(s['verdicts'])}."]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--norms", nargs="+", default=["pre", "post"], choices=("pre", "post"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decoder_run.json"))
    args = ap.parse_args(argv)
    prov = Provenance.start(__file__, argv)
    runs = []
    for seed in args.seeds:
        for norm in args.norms:
            r = one(seed, norm)
            runs.append(r)
            print(f"seed {seed} {norm:4}: token acc {r['token_accuracy']:.4f} exact "
                  f"{r['exact_match']:.3f} train {r['train_s']:.1f} s (CPU {r['train_cpu_s']:.1f}) "
                  f"load {r['load_before']:.1f} {r['verdict']}", file=sys.stderr, flush=True)
    span = lambda k: [min(r[k] for r in runs), max(r[k] for r in runs)]   # noqa: E731
    result = {"target": {"token_accuracy": TARGET_TOKEN_ACC, "train_s": TARGET_SECONDS},
              "runs": runs,
              "summary": {"runs": len(runs), "meets": sum(r["meets"] for r in runs),
                          "token_accuracy": span("token_accuracy"), "exact_match": span("exact_match"),
                          "train_s": span("train_s"),
                          "verdicts": sorted({r["verdict"] for r in runs})},
              "provenance": prov.finish()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    write_md(result, out.with_suffix(".md"))
    print(f"-> {out}, {out.with_suffix('.md')}")
    return 0 if result["summary"]["meets"] == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
