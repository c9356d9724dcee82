"""How long `tndebug triage` takes on a `base`-size checkpoint (ModelConfig.base(): 512/8/6,
d_ff 2048, vocabulary 11). Target: <= 20 s on 2 CPU cores.

Three ways in, each timed end to end as the CLI runs it (load, build, probes, hygiene and the
temperature sweep; not the Python/torch start-up, which `--cli` adds):

* tndebug   our own checkpoint format ({"model", "optimizer", "model_config", ...});
* annotated the same weights under The Annotated Transformer's names (a bare state_dict),
            converted into tndebug's model, heads given (`--heads 8`);
* user      the annotated weights loaded into the user's own code (tests/zoo/annotated.py)
            with the generic capture (`--model ... --adapter annotated`).

    python bench/triage_speed.py                       # -> bench/results/triage_speed.json
    python bench/triage_speed.py --reps 1 --cases tndebug --out /tmp/t.json
    python bench/triage_speed.py --reps 0 --figures-direct 5 --out bench/results/triage_figures.json

`--figures-direct N` times the figure stage itself (issue 23: <= 2 s), as report.run.timings_s
records it (ReportSession._draw: `figures`, `figures_cpu`): once inside a real triage of the base
checkpoint through the CLI's deferred session, then in N fresh processes that draw that
triage's recorded data cold (and again warm); and checks that a session without figures (what
--no-figures makes) writes no PNG and times no figure stage.

Random weights: the temperature sweep is inconclusive and reported as info; it still runs.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import Provenance  # noqa: E402
from tndebug.config import ModelConfig  # noqa: E402
from tndebug.inject import make_model  # noqa: E402
from tndebug.triage import TriageOptions, triage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "triage_speed.json"
ZOO = ROOT / "tests" / "zoo" / "annotated.py"
TARGET_S = 20.0
FIGURES_TARGET_S = 2.0   # issue 23: what figures/ may add to the base triage; met when every
#                          sample is within (--figures-direct: every cold draw's CPU time, one thread)


def to_annotated(sd: dict) -> dict:
    """tndebug names -> The Annotated Transformer's names (the inverse of layouts._ANNOTATED)."""
    import re
    out = {}
    for k, v in sd.items():
        k2 = re.sub(r"\.self_attn\.w_([qkvo])\.", lambda m: f".self_attn.linears.{'qkvo'.index(m.group(1))}.", k)
        k2 = re.sub(r"\.cross_attn\.w_([qkvo])\.", lambda m: f".src_attn.linears.{'qkvo'.index(m.group(1))}.", k2)
        k2 = k2.replace(".ffn.", ".feed_forward.").replace(".norm.weight", ".norm.a_2").replace(".norm.bias", ".norm.b_2")
        k2 = re.sub(r"^(src|tgt)_embed\.lut\.", r"\1_embed.0.lut.", k2)
        out[k2] = v
    return out


def make_checkpoints(folder: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    cfg = ModelConfig.base(dropout=0.0)
    model = make_model(cfg)
    opt = torch.optim.Adam(model.parameters())
    paths = {"tndebug": folder / "base_tndebug.pt", "annotated": folder / "base_annotated.pt"}
    torch.save({"format": "tndebug.checkpoint/1", "model": model.state_dict(),
                "optimizer": opt.state_dict(), "global_step": 0, "schedule_step": 0,
                "model_config": cfg.to_dict()}, paths["tndebug"])
    ann = to_annotated(model.state_dict())
    from tndebug.model.embedding import sinusoid_table
    pe = sinusoid_table(64, cfg.d_model)[None]                                     # the zoo's max_len
    ann["src_embed.1.pe"], ann["tgt_embed.1.pe"] = pe, pe.clone()
    torch.save(ann, paths["annotated"])
    return paths


def options(case: str, paths: dict) -> TriageOptions:
    if case == "tndebug":
        return TriageOptions(str(paths["tndebug"]))
    if case == "annotated":
        return TriageOptions(str(paths["annotated"]), heads=8)
    cfg = json.dumps({"src_vocab": 11, "tgt_vocab": 11, "N": 6, "d_model": 512, "d_ff": 2048,
                      "h": 8, "dropout": 0.0, "fill": None})
    return TriageOptions(str(paths["annotated"]), model=f"{ZOO}:make_model", adapter="annotated",
                         config=cfg)


def cli_args(case: str, paths: dict, out: Path) -> list[str]:
    o = options(case, paths)
    args = [sys.executable, "-m", "tndebug", "triage", o.checkpoint, "--out", str(out), "--fail-on", "never",
            "--overwrite"]          # one --out per case, rerun for each thread count
    if o.heads:
        args += ["--heads", str(o.heads)]
    if o.model:
        args += ["--model", o.model, "--adapter", o.adapter, "--config", o.config]
    return args


def probe_breakdown(paths: dict) -> dict:
    """CPU seconds of each triage probe's setup alone on the base model, one thread."""
    from tndebug.probes import make_probes
    from tndebug.probes.base import RunContext
    from tndebug.subject import tndebug_subject
    from tndebug.probes import TRIAGE_PROBES
    from tndebug.triage.loading import load_checkpoint

    torch.set_num_threads(1)
    ck = load_checkpoint(paths["tndebug"])
    model = make_model(ModelConfig.from_dict(ck.config)).eval()
    model.load_state_dict(ck.state_dict)
    run = RunContext(tndebug_subject(model), mode="triage")
    out = {}
    for name in TRIAGE_PROBES:
        (probe,) = make_probes([name])
        c0 = time.process_time()
        probe.setup(run)
        out[name] = round(time.process_time() - c0, 2)
        print(f"  setup {name:20s} {out[name]:6.2f} s cpu")
    return out


def _spread(xs: list[float]) -> dict:
    """Median, min..max and the quartiles of some timings (seconds)."""
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"each": [round(x, 3) for x in xs], "median": round(statistics.median(xs), 3),
            "min": round(min(xs), 3), "max": round(max(xs), 3),
            "iqr": [round(q[0], 3), round(q[2], 3)]}


def _stage(report) -> tuple[float, float] | None:
    t = report.run.get("timings_s", {})
    return (t["figures_cpu"], t["figures"]) if "figures_cpu" in t else None


def figures_direct(paths: dict, folder: Path, procs: int, warm: int) -> dict:
    """The figure stage alone, one thread: see the module docstring."""
    from tndebug.reporters.session import ReportSession
    torch.set_num_threads(1)
    out = folder / "direct"
    session = ReportSession(out, fmt="json", tensorboard=True, figures=True, defer=True, echo=False)
    c0 = time.process_time()
    report = triage(options("tndebug", paths), sinks=session.sinks)       # the probed pass
    triage_cpu = time.process_time() - c0
    data = folder / "recorded.pkl"
    data.write_bytes(pickle.dumps((session.recorder, report)))         # before finish() draws
    bare = copy.deepcopy(report)
    c0 = time.process_time()
    session.finish(report, fail_on="never")                            # figures, tb/, json, md
    finish_cpu = time.process_time() - c0
    cpu, wall = _stage(report)
    pngs = sorted(p.name for p in (out / "figures").glob("*.png"))
    # --no-figures' session, shown the same pass: no PNG, no figure stage in timings_s
    off = ReportSession(folder / "off", fmt="json", tensorboard=False, figures=False, defer=True,
                        echo=False)
    off.recorder = session.recorder
    off.finish(bare, fail_on="never")
    off_pngs = sorted(p.name for p in (folder / "off").rglob("*.png"))
    cold, warm_runs = [(cpu, wall)], []
    for i in range(procs):
        got = subprocess.run([sys.executable, __file__, "--draw-recorded", str(data), "--warm", str(warm),
                              "--out", str(folder / f"draw-{i}")], check=True, capture_output=True,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        times = json.loads(got.stdout.strip().splitlines()[-1])
        cold.append(tuple(times[0]))
        warm_runs += [tuple(t) for t in times[1:]]
        print(f"  draw process {i}: cold {times[0][0]:.2f} s cpu, warm "
              f"{', '.join(f'{c:.2f}' for c, _ in times[1:])} s cpu")
    cold_cpu = [c for c, _ in cold]
    row = {"what": "the figure stage (ReportSession._draw: make_figures, its matplotlib import "
                   "included) timed by the session itself (run.timings_s.figures_cpu / figures), "
                   "torch and numpy on one thread",
           "in_process": {"figures_cpu_s": cpu, "figures_wall_s": wall, "triage_cpu_s": round(triage_cpu, 2),
                          "finish_cpu_s": round(finish_cpu, 3), "pngs": pngs,
                          "note": "one triage of the base checkpoint with the CLI's deferred session, then "
                                  "finish(): the first figures of the process, on the triage's own heap"},
           "cold_cpu_s": _spread(cold_cpu), "cold_wall_s": _spread([w for _, w in cold]),
           "cold_note": f"the in-process draw and {procs} fresh processes, each drawing the same "
                        f"triage's recorded data (Recorder and Report, pickled) once, cold",
           "warm_cpu_s": _spread([c for c, _ in warm_runs]) if warm_runs else None,
           "warm_wall_s": _spread([w for _, w in warm_runs]) if warm_runs else None,
           "warm_note": f"{warm} more draws in each of those processes (imports and caches in place)",
           "no_figures": {"pngs": off_pngs, "figures_timed": _stage(bare) is not None,
                          "timings_s": bare.run.get("timings_s")},
           "target_s": FIGURES_TARGET_S,
           "figures_within_2_s": max(cold_cpu) <= FIGURES_TARGET_S,
           "figures_wall_within_2_s": max(w for _, w in cold) <= FIGURES_TARGET_S}
    print(f"figure stage, cold: cpu median {row['cold_cpu_s']['median']:.2f} s "
          f"({row['cold_cpu_s']['min']:.2f}..{row['cold_cpu_s']['max']:.2f}); within "
          f"{FIGURES_TARGET_S} s: {row['figures_within_2_s']}")
    return row


def draw_recorded(data: Path, warm: int, out: Path) -> None:
    """One fresh process of figures_direct: the modules `tndebug triage` has loaded before it
    draws, then the stage once cold and `warm` times more; prints [[cpu, wall], ...]."""
    import tndebug.commands.triage  # noqa: F401  (what the CLI imported before finish())
    from tndebug.reporters.session import ReportSession
    torch.set_num_threads(1)
    recorder, report = pickle.loads(data.read_bytes())
    times = []
    for i in range(1 + warm):
        session = ReportSession(out / str(i), fmt="json", tensorboard=False, figures=True,
                                defer=True, echo=False)
        session.recorder = recorder
        session._draw(report)
        times.append(list(_stage(report)))
    print(json.dumps(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", default="tndebug,annotated,user")
    ap.add_argument("--cli", action="store_true", help="also time the command as a subprocess")
    ap.add_argument("--no-figures", action="store_true",
                    help="with --cli: also time the command with --no-figures (what figures/ costs)")
    ap.add_argument("--cli-reps", type=int, default=1,
                    help="with --cli: runs of each arm, alternating (default 1)")
    ap.add_argument("--threads", default="1,2",
                    help="torch thread counts to time (1: the CPU time is the single-core cost, "
                         "free of spin-waits)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each probe's setup alone (1 thread, tndebug case)")
    ap.add_argument("--figures-direct", type=int, default=0, metavar="N",
                    help="time the figure stage itself: in a triage, then in N fresh processes "
                         "(see above); --reps 0 skips the whole-triage timings")
    ap.add_argument("--warm", type=int, default=2, help="with --figures-direct: warm draws per process")
    ap.add_argument("--draw-recorded", type=Path, help=argparse.SUPPRESS)   # figures_direct's child
    ap.add_argument("--merge", action="store_true", help="update --out instead of replacing it")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.draw_recorded:
        return draw_recorded(args.draw_recorded, args.warm, args.out)
    results = {}
    prov = Provenance.start(__file__, None)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_checkpoints(Path(tmp))
        breakdown = probe_breakdown(paths) if args.breakdown else None
        direct = figures_direct(paths, Path(tmp), args.figures_direct, args.warm) \
            if args.figures_direct else None
        for threads, case in [(int(n), c) for n in args.threads.split(",") for c in args.cases.split(",")
                              if c and args.reps]:
            torch.set_num_threads(threads)
            walls, cpus, stages = [], [], []
            for _ in range(args.reps):
                t0, c0 = time.perf_counter(), time.process_time()
                report = triage(options(case, paths))
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                stages.append(report.run["timings_s"])
            row = {"wall_s": [round(w, 2) for w in walls], "median_s": round(statistics.median(walls), 2),
                   "cpu_s": [round(c, 2) for c in cpus], "cpu_median_s": round(statistics.median(cpus), 2),
                   "stages_s_of_median": stages[walls.index(statistics.median(walls))] if args.reps % 2 else stages[-1],
                   "verdict": report.verdict, "probes_run": report.run["probes_run"],
                   "wall_within_target": statistics.median(walls) <= TARGET_S,
                   "cpu_within_target": statistics.median(cpus) <= TARGET_S}
            arms = [("", [])] + ([("_no_figures", ["--no-figures"])] if args.no_figures else [])
            runs: dict[str, list[tuple[float, float]]] = {suffix: [] for suffix, _ in arms}
            # the arms alternate, rep by rep (paired: a slow spell of the machine hits both)
            for rep in range(args.cli_reps if args.cli else 0):
                for suffix, extra in (arms if rep % 2 == 0 else arms[::-1]):
                    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
                    subprocess.run(cli_args(case, paths, Path(tmp) / f"out-{case}") + extra,
                                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    runs[suffix].append((time.perf_counter() - t0,
                                         c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime))
                    print(f"{case:10s} cli{suffix}: wall {runs[suffix][-1][0]:.2f} s, "
                          f"cpu {runs[suffix][-1][1]:.2f} s")
            for suffix, got in runs.items():
                if got:                                        # cli_s, cli_no_figures_s: medians
                    row[f"cli{suffix}_wall_s"] = round(statistics.median(w for w, _ in got), 2)
                    row[f"cli{suffix}_cpu_s"] = round(statistics.median(c for _, c in got), 2)
                    row[f"cli{suffix}_cpu_s_each"] = [round(c, 2) for _, c in got]
            if args.cli and args.no_figures and runs["_no_figures"]:
                diffs = [a[1] - b[1] for a, b in zip(runs[""], runs["_no_figures"])]
                row["figures_cpu_s_each_pair"] = [round(d, 2) for d in diffs]
                row["figures_cpu_s_median"] = round(statistics.median(diffs), 2)
                row["figures_within_2_s"] = max(diffs) <= FIGURES_TARGET_S
            results[f"{case}/threads={threads}"] = row
            print(f"{case:10s} threads={threads} wall {row['median_s']:7.2f} s  cpu {row['cpu_median_s']:7.2f} s  "
                  f"{row['stages_s_of_median']}")
    doc = {"bench": "triage_speed", "preset": "base", "config": ModelConfig.base().to_dict(),
           "target_s": TARGET_S, "provenance": prov.finish(),
           "note": "wall: triage() in-process, end to end. The machine is shared: the provenance's load says "
                   "how many processes competed for its 2 cores, and wall time grows with it. "
                   "cpu_s = process CPU time; with threads=1 it is the cost on one idle core "
                   "(other processes do not add to it, except through shared caches), so "
                   "cpu_s <= 20 with one thread means <= 20 s wall on 2 idle cores",
           "results": results}
    if breakdown is not None:
        doc["probe_setup_cpu_s_1_thread"] = breakdown
    if direct is not None:
        doc["figures_direct"] = direct
    if args.merge and args.out.exists():
        old = json.loads(args.out.read_text())
        doc = {**old, **{k: v for k, v in doc.items() if k != "results"},
               "results": {**old.get("results", {}), **results},
               # merged rows keep the provenance of the invocation that measured them
               "merged_from": [*old.get("merged_from", []), old.get("provenance")]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
