"""The real-bug corpus (issue 19): bugs reported in public issue threads and fix PRs of Transformer
code, each reconstructed as a switch on a small encoder-decoder of our own (tests/realbugs), run
through `tndebug.check` (model bugs: on a fresh initialisation, and again after a brief training
on a copy task) or `tndebug.watch` (training-loop bugs), against healthy controls over seeds.

    OMP_NUM_THREADS=1 python bench/realbugs.py            # -> bench/results/realbugs.{md,json}
    python bench/realbugs.py --seeds 5 --steps 60 --bugs no_scale,pe_single_row --out /tmp/rb

To judge the committed tndebug while the shared tree holds others' uncommitted edits:
    git archive HEAD tndebug | tar -x -C /tmp/rb_head
    REALBUGS_TNDEBUG_AT=$(git rev-parse HEAD) PYTHONPATH=/tmp/rb_head python bench/realbugs.py

A behaviour-changing bug is *caught* when its expected probe reports it at warning or error (at
any severity for a bug expected as info: an fp16 hazard in an fp32 model); a *collateral* error
is another probe's error on it. A benign reported bug (it does not change what the model computes
on real tokens) and every healthy control must stay clean: no warning, no error.
The corpus was written after tndebug's thresholds (issue 19), except three rules set on it since
(the results file names them; docs/thresholds.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "realbugs"))
sys.path.insert(0, str(ROOT / "bench"))
from _provenance import Provenance, provenance_line  # noqa: E402
import bugs as corpus  # noqa: E402
import mechanisms  # noqa: E402
import _source_lines as source_lines  # noqa: E402
from loops import run_watch, train  # noqa: E402
from model import forward  # noqa: E402

import tndebug  # noqa: E402

OUT = ROOT / "bench" / "results" / "realbugs"
SEV = ("warning", "error")
CORPUS_PATHS = ("tests/realbugs", "bench/realbugs.py")
# Healthy training-loop controls: the loop as the watch bugs run it, without their bug.
WATCH_CONTROLS = {"healthy loop": {}, "healthy resume (scheduler restored)": {"resume": "keep"},
                  "healthy label smoothing": {"criterion_kind": "smooth_ok"}}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _findings(report, expected: str | None) -> list[dict]:
    """The findings that decide (warning, error), and every finding of the expected probe."""
    return [{"probe": f.probe, "severity": f.severity, "where": f.where, "message": f.message, "fix": f.fix,
             **({"source": f.source} if getattr(f, "source", None) else {})}
            for f in report.findings if f.severity in SEV or f.probe == expected]


def bug_lines(model) -> tuple[str | None, list[int]]:
    """Where the bug is written (issue 48): the methods of the mechanism classes (mechanisms.py)
    swapped into `model`, read off the built model, not typed in."""
    return source_lines.method_lines({type(m) for m in model.modules()
                                      if type(m).__module__ == mechanisms.__name__})


def line_score(rec: dict, where: tuple[str | None, list[int]]) -> dict:
    """rec['source_line'] for a caught bug whose mechanism is a class of mechanisms.py."""
    rec["named"] = rec["outcome"].startswith("caught")
    if rec["named"] and where[1]:
        sev = SEV + ("info",) if rec["expected_severity"] == "info" else SEV
        rec["source_line"] = source_lines.score(rec["findings"], rec["expected_probe"], *where, severities=sev)
    return rec


def judge(rec: dict) -> dict:
    exp, sev = rec["expected_probe"], rec["expected_severity"]
    flagged = [f for f in rec["findings"] if f["severity"] in SEV]
    rec["flagged"] = sorted({f"{f['probe']}:{f['severity']}" for f in flagged})
    if "crashed" in rec:
        rec["outcome"] = "crash"
    elif sev is None:
        rec["outcome"] = "false alarm" if flagged else "clean"
    else:
        own = [f for f in rec["findings"] if f["probe"] == exp and (f["severity"] in SEV or sev == "info")]
        others = sorted({f["probe"] for f in flagged if f["probe"] != exp})
        collateral = sorted({f["probe"] for f in flagged if f["probe"] != exp and f["severity"] == "error"})
        rec["own_severity"] = max((f["severity"] for f in own), key=("info", "warning", "error").index,
                                  default=None)
        rec["collateral_errors"] = collateral
        if own:
            rec["outcome"] = "caught" + (" + collateral error" if collateral else "")
        else:
            rec["outcome"] = "misnamed" if others else "missed"
    return rec


def base_record(bug, name: str, phase: str, seed: int) -> dict:
    return {"bug": name, "phase": phase, "seed": seed, "url": getattr(bug, "url", None),
            "changes": getattr(bug, "changes", "no (healthy)"),
            "expected_probe": getattr(bug, "expected_probe", None),
            "expected_severity": getattr(bug, "expected_severity", None)}


def run_check(bug, name: str, seed: int, steps: int) -> dict:
    rec = base_record(bug, name, "trained" if steps else "init", seed)
    t0 = time.perf_counter()
    where: tuple[str | None, list[int]] = (None, [])
    try:
        model = corpus.build(bug, seed)
        where = bug_lines(model)
        if steps:
            g = torch.Generator().manual_seed(seed)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            losses = train(model, opt, steps, g)
            rec["train"] = {"steps_done": len(losses), "first_loss": losses[0] if losses else None,
                            "last_loss": losses[-1] if losses else None}
        report = tndebug.check(model, forward, pad_id=model.pad_id, bos_id=1)
    except Exception as e:  # noqa: BLE001 - a crash is a result too
        rec["crashed"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        rec["findings"] = []
    else:
        rec["findings"] = _findings(report, rec["expected_probe"])
        rec["verdict"] = report.verdict
        exp = rec["expected_probe"]
        if exp and exp in report.probes and report.probes[exp].get("status") not in ("pass", "warn", "fail"):
            rec["expected_status"] = f"{report.probes[exp].get('status')}: {report.probes[exp].get('reason')}"
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return line_score(judge(rec), where)


def run_loop(bug, name: str, seed: int, steps: int, loop: dict) -> dict:
    rec = base_record(bug, name, "watch", seed)
    t0 = time.perf_counter()
    try:
        report = run_watch(corpus.build(bug, seed), steps=steps, seed=seed, **loop)
    except Exception as e:  # noqa: BLE001
        rec["crashed"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        rec["findings"] = []
    else:
        rec["findings"] = _findings(report, rec["expected_probe"])
        rec["verdict"] = report.verdict
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return judge(rec)


def loop_options(bug) -> dict:
    opts = dict(bug.loop)
    if "criterion" in opts:
        opts["criterion_kind"] = opts.pop("criterion")
    return opts


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "crashed" in r:
        return "crash"
    shown = [f"{f['probe']}:{f['severity']}" for f in r["findings"]
             if f["severity"] in SEV or f["probe"] == r["expected_probe"]]
    return ", ".join(sorted(set(shown))) or "clean"


def write_md(path: Path, meta: dict, records: list[dict]) -> None:
    bugs = [r for r in records if r["bug"] in corpus.BUGS]
    healthy = [r for r in records if r["bug"] not in corpus.BUGS]
    changing = [r for r in bugs if r["expected_severity"] is not None]
    benign = [r for r in bugs if r["expected_severity"] is None]
    caught = [r for r in changing if r["outcome"].startswith("caught")]
    coll = [r for r in changing if "collateral" in r["outcome"]]
    L = ["# Real-bug corpus: reported Transformer bugs, reconstructed in a model of our own (issue 19)", "",
         provenance_line(meta["provenance"]),
         f"* Commit `{meta['commit']}` (at the start); the code clean at the start (bench/_provenance.py CODE_PATHS): **{meta['clean_tree']}**"
         f" (the corpus itself, {', '.join(CORPUS_PATHS)}: {'committed' if meta['corpus_clean'] else 'UNCOMMITTED'})",
         f"* Command `{meta['provenance']['command']}`; load average before {meta['provenance']['load_before']}, "
         f"after {meta['provenance']['load_after']}; wall {meta['wall_s']:.0f} s",
         f"* {len(corpus.BUGS)} bugs from {len({b.url for b in corpus.BUGS.values()})} threads: "
         f"{sum(b.expected_severity is not None for b in corpus.BUGS.values())} change behaviour, "
         f"{sum(b.benign for b in corpus.BUGS.values())} benign. Model bugs: `tndebug.check` on a fresh "
         f"initialisation (seed 0) and after {meta['steps']} Adam steps on a copy task; loop bugs: "
         f"`tndebug.watch` over {meta['watch_steps']} steps. Healthy controls over seeds {meta['seeds']}.",
         *([f"* The commit moved during the run: {meta['provenance']['code_changed_during_run']}"]
           if "code_changed_during_run" in meta["provenance"] else []),
         f"* tndebug imported from `{meta['tndebug_from']}`; its uncommitted changes: "
         f"{meta['tndebug_uncommitted'] or 'none'}",
         "* Evaluation, except three rules set on this corpus (docs/thresholds.md): `_residual.DEGENERATE` "
         "(8c02423), the error severity of a residual that carries the normalised input (6d03794), and "
         "the NaN rule of `driver.after_nan_forward` (c487c04: a non-finite gradient after a non-finite "
         "forward is info, made for `pad_mask_on_queries_inf`); every other threshold was set before the "
         "corpus was written.", "",
         "## Summary", "",
         f"* Behaviour-changing runs caught by their probe: **{len(caught)}/{len(changing)}**; "
         f"with a collateral error from another probe: {len(coll)}/{len(changing)}",
         f"* Behaviour-changing bugs caught in every phase they ran: **"
         f"{sum(all(r['outcome'].startswith('caught') for r in changing if r['bug'] == n) for n in {r['bug'] for r in changing})}"
         f"/{len({r['bug'] for r in changing})}**",
         f"* Benign reported bugs clean: **{sum(r['outcome'] == 'clean' for r in benign)}/{len(benign)}**",
         f"* Healthy controls clean: **{sum(r['outcome'] == 'clean' for r in healthy)}/{len(healthy)}**",
         f"* Crashes: {sum(r['outcome'] == 'crash' for r in records)}",
         f"* Source lines (issue 48; bench/_source_lines.py), over the caught model bugs whose mechanism is "
         f"a class of tests/realbugs/mechanisms.py: {source_lines.summary_line(source_lines.summary(records))}", "",
         "## Bugs", "",
         "Cells: the probes at warning or error, and the expected probe at any severity. "
         "Outcome per phase (init / trained, or watch).", "",
         "| bug | thread | changes behaviour | expected | init / watch | trained | outcome |",
         "|---|---|---|---|---|---|---|"]
    for name, b in corpus.BUGS.items():
        rs = {r["phase"]: r for r in bugs if r["bug"] == name}
        first = rs.get("init") or rs.get("watch")
        exp = f"{b.expected_probe} ({b.expected_severity})" if b.expected_probe else "clean"
        outs = " / ".join(r["outcome"] for r in (rs.get("init") or rs.get("watch"), rs.get("trained")) if r)
        L.append(f"| `{name}` | {b.url} | {b.changes} | {exp} | {_cell(first)} | {_cell(rs.get('trained'))} | {outs} |")
    L += ["", "## Healthy controls", "", "| control | phase | seed | findings at warning or error | outcome |",
          "|---|---|---|---|---|"]
    for r in healthy:
        L.append(f"| {r['bug']} | {r['phase']} | {r['seed']} | {', '.join(r['flagged']) or '-'} | {r['outcome']} |")

    def listing(title, pick, lines):
        items = [r for r in records if pick(r)]
        L.extend(["", f"## {title} ({len(items)})", ""])
        for r in items:
            for line in lines(r):
                L.append(f"* `{r['bug']}` ({r['phase']}): {line}")
        if not items:
            L.append("none")

    def fl(r, keep):
        return [f"{f['severity']} {f['probe']} at `{f['where'] or '(run)'}`: {f['message']} — fix: {f['fix']}"
                for f in r["findings"] if keep(f)] or [r.get("crashed", "no finding")]

    L += ["", "## Source lines (issue 48)", "",
          "For each caught model bug whose mechanism is a swapped-in class of tests/realbugs/mechanisms.py "
          "(config and training-loop bugs have no such line): the lines of that class's own methods "
          "(*bug's lines*, read off the built model) against the lines the expected probe's findings "
          "give. *Right*: a given line is one of the bug's lines; *function*: it is in one of the "
          "bug's methods.", "",
          "| bug | phase | bug's lines (mechanisms.py) | the finding's lines | given | right | function |",
          "|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    for r in records:
        sl = r.get("source_line")
        if sl:
            bl = sl["bug_lines"]
            L.append(f"| `{r['bug']}` | {r['phase']} | {source_lines.spans(bl)} | {'; '.join(sl['sources']) or '(none)'} | "
                     f"{yes[sl['given']]} | {yes[sl['right']] if sl['given'] else '-'} | "
                     f"{yes[sl['function_right']] if sl['given'] else '-'} |")
    listing("Missed or misnamed", lambda r: r["outcome"] in ("missed", "misnamed", "crash"),
            lambda r: [f"expected {r['expected_probe']} ({r['expected_severity']})"
                       + (f"; its status {r['expected_status']}" if r.get("expected_status") else "")]
            + fl(r, lambda f: True))
    listing("What the owning probe said (the first phase each bug ran)",
            lambda r: r["expected_probe"] and r["phase"] in ("init", "watch") and r["outcome"].startswith("caught"),
            lambda r: fl(r, lambda f: f["probe"] == r["expected_probe"])[:1])
    listing("Caught below the expected severity",
            lambda r: r["outcome"].startswith("caught") and r.get("own_severity") != r["expected_severity"],
            lambda r: [f"expected {r['expected_severity']}, got {r['own_severity']}"])
    listing("Collateral errors", lambda r: "collateral" in r["outcome"],
            lambda r: fl(r, lambda f: f["severity"] == "error" and f["probe"] != r["expected_probe"]))
    listing("False alarms (benign bugs and healthy controls)", lambda r: r["outcome"] == "false alarm",
            lambda r: fl(r, lambda f: f["severity"] in SEV))
    path.write_text("\n".join(L) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds of each healthy control (default 3)")
    ap.add_argument("--steps", type=int, default=30, help="training steps before the second check (default 30; 0: init only)")
    ap.add_argument("--watch-steps", type=int, default=12, help="steps of each watched loop (default 12)")
    ap.add_argument("--bugs", default=None, help="comma-separated bug names (default: all)")
    ap.add_argument("--out", default=str(OUT), help="output path without suffix (.md and .json)")
    args = ap.parse_args(argv)
    names = args.bugs.split(",") if args.bugs else list(corpus.BUGS)
    unknown = set(names) - set(corpus.BUGS)
    if unknown:
        ap.error(f"unknown bugs {sorted(unknown)}; have {sorted(corpus.BUGS)}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    prov = Provenance.start(__file__, argv)
    clean_tree = prov.tree["clean"]          # the code's paths (results written by a chain excluded)
    corpus_clean = _git("status", "--porcelain", "--", *CORPUS_PATHS) == ""
    t0 = time.perf_counter()
    records = []
    for seed in range(args.seeds):
        records.append(run_check(None, "healthy model", seed, 0))
        if args.steps:
            records.append(run_check(None, "healthy model", seed, args.steps))
        for control, loop in WATCH_CONTROLS.items():
            records.append(run_loop(None, control, seed, args.watch_steps, loop))
    for name in names:
        bug = corpus.BUGS[name]
        if bug.front == "watch":
            records.append(run_loop(bug, name, 0, args.watch_steps, loop_options(bug)))
        else:
            records.append(run_check(bug, name, 0, 0))
            if args.steps:
                records.append(run_check(bug, name, 0, args.steps))
    for r in records:
        print(f"{r['bug']:36s} {r['phase']:8s} seed {r['seed']}: {r['outcome']:28s} {r['flagged']}", flush=True)
    pkg = Path(tndebug.__file__).resolve().parent
    from_repo = ROOT in pkg.parents
    meta = {"bench": "realbugs", "commit": prov.tree["commit"], "clean_tree": clean_tree,
            "tndebug_from": str(pkg), "tndebug_uncommitted": (
                _git("status", "--porcelain", "--", "tndebug").splitlines() if from_repo else
                "not the working tree: " + os.environ.get("REALBUGS_TNDEBUG_AT", "a copy put first on PYTHONPATH")),
            "corpus_clean": corpus_clean, "seeds": list(range(args.seeds)), "steps": args.steps,
            "watch_steps": args.watch_steps, "wall_s": time.perf_counter() - t0,
            "source_lines": source_lines.summary(records),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    meta["provenance"] = prov.finish()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bugs = [{"name": b.name, "url": b.url, "reported": b.reported, "changes": b.changes,
             "expected_probe": b.expected_probe, "expected_severity": b.expected_severity, "front": b.front}
            for b in corpus.BUGS.values() if b.name in names]
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "bugs": bugs, "records": records}, indent=1))
    write_md(out.with_suffix(".md"), meta, records)
    print(f"wrote {out.with_suffix('.md')} and .json ({meta['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
