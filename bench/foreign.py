"""Triage verdicts on code no one here wrote (issue 10): the whole foreign-code corpus of
tests/foreign (Hugging Face BART/Marian/T5 in eager and SDPA, five plain-PyTorch styles), healthy
over several init seeds and with each injected bug, each model trained briefly, saved as users
save, and triaged as `tndebug triage CKPT --model FILE.py:build --adapter FILE.py:forward`.

    OMP_NUM_THREADS=1 python bench/foreign.py                  # -> bench/results/foreign.{md,json}
    python bench/foreign.py --seeds 10 --bug-seeds 5 --styles hf-bart,relbias --out /tmp/f
    python bench/foreign.py --at 5e4f9d9        # tndebug as it was at a commit (git archive), the
                                                # corpus and this script as they are now

Writes the confusion table style x fault x probe (the worst severity each probe gave, over the
seeds), the false-alarm rate per style (healthy runs with any warning or error), the recall per
style (bugs whose own probe said warning or error), every false alarm, missed bug and collateral
error with its message, the command, the commit and the machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "foreign"))
import foreign_corpus as corpus  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from _provenance import Provenance, provenance_line  # noqa: E402
import _source_lines as source_lines  # noqa: E402

import tndebug  # noqa: E402
# tndebug.triage exports TRIAGE_PROBES at every commit --at goes back to (b735d21 kept it there,
# not in tndebug.probes)
from tndebug.triage import TRIAGE_PROBES  # noqa: E402

OUT = ROOT / "bench" / "results" / "foreign"
# --corpus styles: 600 steps (issue 45), healthy over 2 seeds, each bug over 1
STYLE_DEFAULTS = {"--seeds": 2, "--bug-seeds": 1, "--steps": 600,
                  "--out": str(ROOT / "bench" / "results" / "foreign_styles")}
# styles whose bugs are put into an installed package's modules from outside (the user's file
# holds only the switch): no line of the user's is the bug's, so no source-line score
IN_PACKAGE = frozenset({"hf-bart", "hf-marian", "hf-t5", "xtransformers", "xgpt"})
PROBES = list(TRIAGE_PROBES) + ["checkpoint"]
SEV = {"error": "E", "warning": "W"}
_NUMBER = re.compile(r"\d+(\.\d+)?(e[+-]?\d+)?")


def git(*args: str, cwd: Path = ROOT) -> str:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _finding(f) -> dict:
    d = {"probe": f.probe, "severity": f.severity, "where": f.where, "message": f.message}
    if getattr(f, "source", None):                   # issue 48: the line in the user's code
        d["source"] = f.source
    return d


def _line_score(rec: dict, file, lines: list[int]) -> None:
    """rec['source_line'] (issue 48) for a bug run its probe named, where the corpus knows the
    bug's line."""
    if rec.get("named") and lines:
        rec["source_line"] = source_lines.score(rec["findings"], rec["expected_probe"], file, lines)


def one_run(style: str, variant: str, bug: str | None, seed: int, folder: Path, steps: int) -> dict:
    t0 = time.perf_counter()
    path = corpus.make_checkpoint(style, variant, bug, seed, folder, steps=steps)
    t1 = time.perf_counter()
    rec = {"style": style, "variant": variant, "fault": bug or "healthy", "seed": seed,
           "expected_probe": corpus.EXPECTED_PROBE.get(bug)}
    try:
        report = corpus.run_triage(style, path)
    except Exception as e:  # noqa: BLE001 - a crash is a result too
        rec.update(crashed=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
                   findings=[], no_verdict={})
    else:
        rec["findings"] = [_finding(f) for f in report.findings]
        rec["no_verdict"] = {p: s.get("reason") for p, s in report.probes.items()
                             if s.get("status") == "no verdict"}   # skipped: nothing applied
        rec["probe_reasons"] = {p: s["reason"] for p, s in report.probes.items() if s.get("reason")}
        rec["probe_failures"] = corpus.probe_failures(report)
    rec["train_s"], rec["triage_s"] = round(t1 - t0, 3), round(time.perf_counter() - t1, 3)
    # keep the findings that decide (warnings, errors) and the info findings of the bug's own probe
    rec["findings"] = [f for f in rec["findings"]
                       if f["severity"] in SEV or f["probe"] == rec["expected_probe"]]
    flagged = [f for f in rec["findings"] if f["severity"] in SEV]
    rec["flagged"] = sorted({(f["probe"], f["severity"]) for f in flagged})
    if bug is None:
        rec["outcome"] = ("crash" if "crashed" in rec else "false alarm" if flagged else
                          "unjudged (probes broke)" if rec["probe_failures"] else "clean")
    else:
        own = corpus.names_bug(rec["findings"], bug)      # a deviation: at any severity
        collateral = [f for f in flagged if f["severity"] == "error" and f["probe"] != rec["expected_probe"]]
        rec["collateral_errors"] = sorted({f["probe"] for f in collateral})
        rec["named"] = bool(own) and "crashed" not in rec
        if style not in IN_PACKAGE:
            path_ = corpus.BY_NAME[style].path
            _line_score(rec, path_, source_lines.switch_lines(path_, bug))
        rec["outcome"] = ("crash" if "crashed" in rec else
                          ("caught" if own else "missed") + (" + collateral error" if collateral else ""))
    return rec


# -- one stack: nanoGPT-style (decoder-only) and BERT-style (encoder-only) user code ---------------
# style -> its corpus module (make_checkpoint, run_triage, EXPECTED_PROBE, BUG_CASES), variants;
# each trains with its own steps: one stack needs more than --steps to learn copy. Under --at an
# older tndebug may lack what these corpora train with (tndebug.data.as_lm): they are then left
# out, and the results file says so (UNAVAILABLE), rather than the whole run failing.
ONE_STACK: dict = {}
UNAVAILABLE: dict[str, str] = {}     # style -> why it cannot run with this tndebug
for _style, _module in (("nanogpt", "nanogpt_corpus"), ("minibert", "minibert_corpus"),
                        ("xgpt", "xgpt_corpus")):
    try:
        _mod = __import__(_module)
        ONE_STACK[_style] = (_mod, getattr(_mod, "VARIANTS", ("manual", "sdpa")))
    except ImportError as _e:
        if os.environ.get("FOREIGN_BENCH_AT") is None:
            raise                       # at the current commit every corpus must import
        UNAVAILABLE[_style] = f"{type(_e).__name__}: {_e}"


def lm_cases(style: str, seeds, bug_seeds) -> list[tuple]:
    module, variants = ONE_STACK[style]
    return ([(style, v, None, s) for v in variants for s in seeds] +
            [(style, v, b, s) for v, b in module.BUG_CASES for s in bug_seeds])


def _own_steps() -> dict[str, int]:
    """The steps each one-stack corpus trains by default (its make_checkpoint's)."""
    import inspect
    return {style: inspect.signature(module.make_checkpoint).parameters["steps"].default
            for style, (module, _) in ONE_STACK.items()}


def one_lm_run(style: str, variant: str, bug: str | None, seed: int, folder: Path,
               steps: int | None = None) -> dict:
    """One one-stack model of `style`: trained its corpus's way (its own number of steps unless
    `steps`), triaged with the adapter guessed from the model (`gpt`, or `bert` from
    MiniBert's class name), judged as one_run judges (a benign bug, EXPECTED_PROBE None, must
    be clean)."""
    module = ONE_STACK[style][0]
    t0 = time.perf_counter()
    path = module.make_checkpoint(variant, bug, seed, folder, **({"steps": steps} if steps else {}))
    t1 = time.perf_counter()
    probe = module.EXPECTED_PROBE.get(bug)
    benign = bug is not None and probe is None      # the same model: a healthy variant
    rec = {"style": style, "variant": f"{variant}+{bug}" if benign else variant,
           "fault": "healthy" if benign else bug or "healthy", "seed": seed, "expected_probe": probe}
    try:
        report = module.run_triage(path)
    except Exception as e:  # noqa: BLE001 - a crash is a result too
        rec.update(crashed=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
                   findings=[], no_verdict={}, probe_failures={})
    else:
        rec["findings"] = [_finding(f) for f in report.findings if f.severity in SEV or f.probe == probe]
        rec["no_verdict"] = {p: s.get("reason") for p, s in report.probes.items()
                             if s.get("status") == "no verdict"}   # skipped: nothing applied
        rec["probe_failures"] = corpus.probe_failures(report)
    rec["train_s"], rec["triage_s"] = round(t1 - t0, 3), round(time.perf_counter() - t1, 3)
    flagged = [f for f in rec["findings"] if f["severity"] in SEV]
    rec["flagged"] = sorted({(f["probe"], f["severity"]) for f in flagged})
    if probe is None:
        rec["outcome"] = ("crash" if "crashed" in rec else "false alarm" if flagged else
                          "unjudged (probes broke)" if rec["probe_failures"] else "clean")
    else:
        # non-finite weights are the bug's own doing when it made training NaN (minibert's
        # triu under masked_fill(-inf)): the file's state, not another probe's misreading
        collateral = [f for f in flagged if f["severity"] == "error" and f["probe"] != probe
                      and not (f["probe"] in ("checkpoint", "nan-scores", "gradient-flow")
                               and any("non-finite" in g["message"] or "NaN" in g["message"]
                                       for g in flagged if g["probe"] == "checkpoint"))]
        rec["collateral_errors"] = sorted({f["probe"] for f in collateral})
        own = any(f["probe"] == probe for f in flagged)
        rec["named"] = own and "crashed" not in rec
        if style not in IN_PACKAGE:
            _line_score(rec, module.FILE, source_lines.switch_lines(module.FILE, bug))
        rec["outcome"] = ("crash" if "crashed" in rec else
                          ("caught" if own else "missed") + (" + collateral error" if collateral else ""))
    return rec


# -- the user-style corpus (issue 45): one-line bugs written into the user's own file -----------
try:
    import styles_corpus  # noqa: E402 - tests/foreign
except ImportError as _e:                 # under --at: a tndebug too old for the corpus's imports
    if os.environ.get("FOREIGN_BENCH_AT") is None:
        raise
    styles_corpus = None


def style_cases(seeds, bug_seeds) -> list[tuple]:
    """(style, variant, bug, seed): healthy fp32 over `seeds`, 16-bit copies of a few healthy
    models (seed 0), each bug over `bug_seeds`."""
    sc = styles_corpus
    half = [str(d).removeprefix("torch.") for d in sc.HALF_DTYPES]
    return ([(s, "fp32", None, seed) for s in sc.STYLES for seed in seeds] +
            [(s, h, None, seeds[0]) for s in sc.HALF_STYLES for h in half if seeds] +
            [(s, "fp32", b, seed) for s in sc.STYLES for b in sc.BUGS[s] for seed in bug_seeds])


def one_style_run(style: str, variant: str, bug: str | None, seed: int, folder: Path,
                  steps: int, data: torch.Tensor) -> dict:
    """One model of the user-style corpus: its file with the bug written in, trained `steps`
    steps on character text, triaged with --data ids.pt --pad-id none; judged as one_run judges
    (a benign bug, probe None, must be clean), and the bug's line scored (issue 48)."""
    sc = styles_corpus
    t0 = time.perf_counter()
    dtype = None if variant == "fp32" else getattr(torch, variant)
    case = sc.make_checkpoint(style, bug, seed, folder, steps=steps, data=data, dtype=dtype)
    t1 = time.perf_counter()
    probe = sc.expected_probe(style, bug)
    benign = bug is not None and probe is None
    rec = {"style": style, "variant": f"{variant}+{bug}" if benign else variant,
           "fault": "healthy" if benign else bug or "healthy", "seed": seed, "expected_probe": probe,
           "train_loss": round(case.loss, 3)}
    try:
        report = sc.run_triage(case)
    except Exception as e:  # noqa: BLE001 - a crash is a result too
        rec.update(crashed=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
                   findings=[], no_verdict={}, probe_failures={})
    else:
        rec["findings"] = [_finding(f) for f in report.findings if f.severity in SEV or f.probe == probe]
        rec["no_verdict"] = {p: s.get("reason") for p, s in report.probes.items()
                             if s.get("status") == "no verdict"}
        rec["probe_reasons"] = {p: s["reason"] for p, s in report.probes.items() if s.get("reason")}
        rec["probe_failures"] = corpus.probe_failures(report)
    rec["train_s"], rec["triage_s"] = round(t1 - t0, 3), round(time.perf_counter() - t1, 3)
    flagged = [f for f in rec["findings"] if f["severity"] in SEV]
    rec["flagged"] = sorted({(f["probe"], f["severity"]) for f in flagged})
    if probe is None:
        rec["outcome"] = ("crash" if "crashed" in rec else "false alarm" if flagged else
                          "unjudged (probes broke)" if rec["probe_failures"] else "clean")
    else:
        collateral = [f for f in flagged if f["severity"] == "error" and f["probe"] != probe]
        rec["collateral_errors"] = sorted({f["probe"] for f in collateral})
        own = any(f["probe"] == probe for f in flagged)
        rec["named"] = own and "crashed" not in rec
        rec["what"] = sc.BUGS[style][bug].what
        _line_score(rec, case.file, case.bug_lines)
        rec["outcome"] = ("crash" if "crashed" in rec else
                          ("caught" if own else "missed") + (" + collateral error" if collateral else ""))
    return rec


def cell(records: list[dict], probe: str) -> str:
    """'E3/3' = error in 3 of 3 runs; 'W1/3'; '' = nothing at warning or error."""
    worst = [max((SEV[s] == "E") + 1 for p, s in r["flagged"] if p == probe) if
             any(p == probe for p, _ in r["flagged"]) else 0 for r in records]
    n = len(records)
    e, w = sum(x == 2 for x in worst), sum(x == 1 for x in worst)
    parts = ([f"E{e}"] if e else []) + ([f"W{w}"] if w else [])
    return f"{' '.join(parts)}/{n}" if parts else ""


def _one_stack_note(meta: dict) -> str:
    steps = meta.get("one_stack_steps")
    return f" ({', '.join(f'{k} {v}' for k, v in steps.items())})" if steps else ""


def _plain_collateral(r: dict) -> bool:
    """An error from a probe other than the bug's own, no exemption (the printed definition)."""
    return bool(r.get("expected_probe")) and any(
        f["severity"] == "error" and f["probe"] != r["expected_probe"] for f in r["findings"])


def _plain(records: list[dict]) -> int:
    return sum(_plain_collateral(r) for r in records)


def _plain_runs(records: list[dict]) -> str:
    runs = [f"{r['style']}/{r['variant']} {r['fault']} seed {r['seed']}" for r in records
            if _plain_collateral(r) and "collateral" not in r["outcome"]]
    return f", the exempted ones: {', '.join(runs)}" if runs else ""


def _source_section(records: list[dict]) -> list[str]:
    """Issue 48: whether the named bugs' findings point at the line the bug is on."""
    scored = [r for r in records if r.get("source_line")]
    named = [r for r in records if r.get("named")]
    L = ["## Source lines (issue 48)", "",
         "For each bug its own probe named (warning or error) where the corpus knows the bug's "
         "line (bench/_source_lines.py: the edited line of the user-style corpus, the lines "
         "that test a switch corpus's bug name with the statement they guard; none for bugs put "
         "into an installed package or into the training loop): *line given* when one of the "
         "probe's findings carries a line of the user's file, *line right* when it is one of the "
         f"bug's lines, *in the bug's function* when it is in the same function. "
         f"{len(scored)} of {len(named)} named bugs have a known line.", "",
         f"Overall: {source_lines.summary_line(source_lines.summary(records))}.", ""]
    if not scored:
        return L
    L += ["| style | variant | fault | seeds | bug's lines | the finding's lines | given | right | function |",
          "|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in scored:
        sl = r["source_line"]
        key = (r["style"], r["variant"], r["fault"], tuple(sl["bug_lines"]), tuple(sl["sources"]),
               sl["given"], sl["right"], sl["function_right"])
        groups.setdefault(key, []).append(r["seed"])
    yes = {True: "yes", False: "no"}
    for (st, v, fault, bl, srcs, g, ok, fn), seeds in groups.items():
        span = source_lines.spans(list(bl))
        L.append(f"| {st} | {v} | {fault} | {', '.join(map(str, sorted(seeds)))} | {span} | "
                 f"{'; '.join(srcs) or '(none)'} | {yes[g]} | {yes[ok] if g else '-'} | {yes[fn] if g else '-'} |")
    return L + [""]


def write_md(path: Path, meta: dict, records: list[dict]) -> None:
    tot_b = [r for r in records if r["fault"] != "healthy"]
    rows = defaultdict(list)
    for r in records:
        rows[(r["style"], r["variant"], r["fault"])].append(r)
    title = ("# User-style corpus: triage of decoder-only and encoder-only code written the ways "
             "people write it (issue 45)" if meta.get("corpus") == "styles" else
             "# Foreign-code corpus: triage verdicts on code no one here wrote (issue 10)")
    L = [title, "",
         provenance_line(meta["provenance"]) if "provenance" in meta else
         "* Provenance: not recorded (written before bench/_provenance.py); rerun `python -m bench run foreign`",
         f"* tndebug at commit `{meta['commit']}`{meta['dirty_note']} (imported from `{meta['tndebug_from']}`); "
         f"the corpus (tests/foreign) and this script as in the provenance; transformers {meta['transformers']}",
         f"* {meta['runs']} runs ({meta['healthy_runs']} healthy over seeds {meta['seeds']}, "
         f"{meta['bug_runs']} with a bug over seeds {meta['bug_seeds']}), {meta['steps']} training "
         f"steps each{_one_stack_note(meta)}, wall {meta['wall_s']:.0f} s; {meta['date']}"]
    L += [f"* left out at this commit: {name} ({why})" for name, why in meta.get("styles_left_out", {}).items()]
    L += ["",
         "Healthy: a *false alarm* is any warning or error. Bug: *caught* when the probe that owns "
         "it gives a warning or an error (for a deviation from the paper that models train with, "
         "`no_emb_scale`, a finding at any severity: its info names the deviation, "
         "tests/foreign/foreign_corpus.py DEVIATIONS); *collateral* when another probe gives an "
         "error, with one exemption, in the one-stack corpora only (nanogpt, minibert, xgpt: "
         "`one_lm_run`): a checkpoint, nan-scores or gradient-flow error is not collateral when "
         "the checkpoint finding reports non-finite (NaN) weights, the bug having made training "
         "itself NaN (the file's state, not another probe's misreading). Without the exemption "
         f"(every error from another probe): collateral errors in {_plain(tot_b)}/{len(tot_b)} "
         f"bug runs{_plain_runs(tot_b)}.", "",
         "## Per style", "",
         "| style | healthy runs | false alarms | rate | clean only because probes broke | bug runs | caught | recall | collateral errors | crashes |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    # every style run, the decoder-only and encoder-only corpora (not in corpus.STYLES) too
    names = [s.name for s in corpus.STYLES]
    names += [n for n in dict.fromkeys(r["style"] for r in records) if n not in names]
    for name in names:
        h = [r for r in records if r["style"] == name and r["fault"] == "healthy"]
        b = [r for r in records if r["style"] == name and r["fault"] != "healthy"]
        if not h and not b:
            continue
        fa = sum(r["outcome"] == "false alarm" for r in h)
        unjudged = sum(r["outcome"].startswith("unjudged") for r in h)
        caught = sum(r["outcome"].startswith("caught") for r in b)
        coll = sum("collateral" in r["outcome"] for r in b)
        crashes = sum(r["outcome"] == "crash" for r in h + b)
        L.append(f"| {name} | {len(h)} | {fa} | {fa / max(len(h), 1):.0%} | {unjudged} | {len(b)} | {caught} | "
                 f"{caught / max(len(b), 1):.0%} | {coll} | {crashes} |")
    tot_h = [r for r in records if r["fault"] == "healthy"]
    tot_b = [r for r in records if r["fault"] != "healthy"]
    L += ["", f"Overall: false-alarm rate {sum(r['outcome'] == 'false alarm' for r in tot_h)}/{len(tot_h)} "
          f"(and {sum(r['outcome'].startswith('unjudged') for r in tot_h)} clean only because probes broke), "
          f"recall {sum(r['outcome'].startswith('caught') for r in tot_b)}/{len(tot_b)}, "
          f"collateral errors in {sum('collateral' in r['outcome'] for r in tot_b)}/{len(tot_b)} bug runs "
          f"({_plain(tot_b)}/{len(tot_b)} without the one-stack exemption), "
          f"crashes in {sum(r['outcome'] == 'crash' for r in records)}/{len(records)} runs.", ""]
    half = [r for r in tot_h if r["variant"] in ("bfloat16", "float16")]
    if half:                          # issue 44: a half-precision model gets no false error
        L += [f"16-bit healthy copies (the fp32 checkpoint's weights saved in bfloat16 or float16, "
              f"triaged as saved): {sum(r['outcome'] == 'false alarm' for r in half)}/{len(half)} flagged "
              f"({', '.join(sorted({r['style'] + ' ' + r['variant'] for r in half}))}).", ""]
    L += _source_section(records)
    L += ["## Confusion table: style x fault x probe", "",
          "Each cell: E = error, W = warning, in how many of the runs (seeds); **bold** = the probe "
          "that owns the fault.", "",
          "| style | variant | fault | " + " | ".join(PROBES) + " | outcome |",
          "|---|---|---|" + "---|" * len(PROBES) + "---|"]
    for (style, variant, fault), rs in rows.items():
        exp = rs[0]["expected_probe"]
        cells = []
        for p in PROBES:
            c = cell(rs, p)
            cells.append(f"**{c or '-'}**" if p == exp else c)
        outcomes = sorted({r["outcome"] for r in rs})
        L.append(f"| {style} | {variant} | {fault} | " + " | ".join(cells) + f" | {', '.join(outcomes)} |")

    def listing(title: str, pick, show) -> None:
        items = [r for r in records if pick(r)]
        L.extend(["", f"## {title} ({len(items)})", ""])
        groups: dict = {}            # one line per case and message, numbers aside; its seeds
        for r in items:
            for line in show(r):
                key = (r["style"], r["variant"], r["fault"], _NUMBER.sub("#", line))
                groups.setdefault(key, [line, []])[1].append(r["seed"])
        for (style, variant, fault, _), (line, seeds) in groups.items():
            L.append(f"* {style}/{variant} {fault} (seeds {sorted(set(seeds))}): {line}")
        if not items:
            L.append("none")

    def flagged_lines(r, only=None):
        return [f"{f['severity']} {f['probe']} at `{f['where'] or '(run)'}`: {f['message']}"
                for f in r["findings"] if f["severity"] in SEV and (only is None or only(f))]

    listing("False alarms on healthy models", lambda r: r["fault"] == "healthy" and r["outcome"] in ("false alarm", "crash"),
            lambda r: [r["crashed"]] if "crashed" in r else flagged_lines(r))
    listing("Missed bugs", lambda r: r["outcome"].startswith("missed") or r["outcome"] == "crash",
            lambda r: ([r["crashed"]] if "crashed" in r else
                       [f"{r['expected_probe']}: status "
                        f"{'no verdict: ' + str(r['no_verdict'][r['expected_probe']]) if r['expected_probe'] in r['no_verdict'] else 'pass'}"
                        + (f" (reason: {r['probe_reasons'][r['expected_probe']]})"
                           if r['expected_probe'] in r.get('probe_reasons', {}) and r['expected_probe'] not in r['no_verdict'] else "")]
                       + [f"info {f['probe']}: {f['message']}" for f in r["findings"]
                          if f["severity"] == "info" and f["probe"] == r["expected_probe"]]))
    listing("Collateral errors (another probe's error on a bug)",
            lambda r: "collateral" in r["outcome"],
            lambda r: flagged_lines(r, lambda f: f["severity"] == "error" and f["probe"] != r["expected_probe"]))
    listing("Probes without a verdict, or that broke on the model",
            lambda r: bool(r.get("no_verdict") or r.get("probe_failures")),
            lambda r: [f"{p} ({'no verdict' if p in r['no_verdict'] else 'pass'}): {why}"
                       for p, why in sorted({**r.get("probe_failures", {}), **r["no_verdict"]}.items())])
    path.write_text("\n".join(L) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", choices=("default", "styles"), default="default",
                    help="styles: the user-style decoder- and encoder-only corpus (tests/foreign/styles_corpus.py; "
                         "--steps then defaults to 600, --seeds to 2, --bug-seeds to 1, --out to "
                         "bench/results/foreign_styles)")
    ap.add_argument("--seeds", type=int, default=5, help="init seeds per healthy model (default 5)")
    ap.add_argument("--bug-seeds", type=int, default=3, help="init seeds per bug (default 3)")
    ap.add_argument("--steps", type=int, default=10,
                    help="training steps of the encoder-decoder styles before saving (default 10)")
    ap.add_argument("--one-stack-steps", type=int, default=None, metavar="N",
                    help="training steps of the nanoGPT and MiniBERT corpora (default: their own, "
                         f"{', '.join(f'{k} {v}' for k, v in _own_steps().items())})")
    ap.add_argument("--styles", default=None, help="comma-separated styles (default: all)")
    ap.add_argument("--out", default=str(OUT), help="output path without suffix (.md and .json)")
    ap.add_argument("--at", default=None, metavar="COMMIT",
                    help="triage with tndebug/ as it was at COMMIT (extracted with git archive into a "
                         "temporary folder put first on PYTHONPATH); the corpus is the current one")
    args = ap.parse_args(argv)
    if args.at and os.environ.get("FOREIGN_BENCH_AT") is None:
        return _rerun_at(args.at, sys.argv[1:] if argv is None else list(argv))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if args.corpus == "styles":          # its own defaults where the flag was not given
        given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)}
        for flag, value in STYLE_DEFAULTS.items():
            if flag not in given:
                setattr(args, flag.lstrip("-").replace("-", "_"), value)
        if styles_corpus is None:
            ap.error("--corpus styles: this tndebug cannot import tests/foreign/styles_corpus.py")
        chosen = set(args.styles.split(",")) if args.styles else set(styles_corpus.STYLES)
        if chosen - set(styles_corpus.STYLES):
            ap.error(f"unknown styles {sorted(chosen - set(styles_corpus.STYLES))}; have {list(styles_corpus.STYLES)}")
        return _run_styles(args, argv, chosen)
    styles = set(args.styles.split(",")) if args.styles else set(corpus.BY_NAME) | set(ONE_STACK)
    styles -= set(UNAVAILABLE)
    unknown = styles - set(corpus.BY_NAME) - set(ONE_STACK)
    if unknown:
        ap.error(f"unknown styles {sorted(unknown)}; have {sorted(set(corpus.BY_NAME) | set(ONE_STACK))}")
    seeds, bug_seeds = list(range(args.seeds)), list(range(args.bug_seeds))
    cases = ([(s, v, None, seed) for s, v, seed in corpus.healthy_cases(seeds) if s in styles] +
             [(s, v, b, seed) for s, v, b in corpus.bug_cases() if s in styles for seed in bug_seeds])
    for style in sorted(styles & set(ONE_STACK)):
        cases += lm_cases(style, seeds, bug_seeds)
    prov = Provenance.start(__file__, argv)
    t0 = time.perf_counter()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (s, v, b, seed) in enumerate(cases):
            if s in UNAVAILABLE:
                continue
            try:
                rec = (one_lm_run(s, v, b, seed, Path(tmp), args.one_stack_steps) if s in ONE_STACK
                       else one_run(s, v, b, seed, Path(tmp), args.steps))
            except Exception as e:  # noqa: BLE001 - only under --at: the corpus needs newer tndebug
                if os.environ.get("FOREIGN_BENCH_AT") is None:
                    raise
                UNAVAILABLE[s] = f"building a checkpoint failed: {type(e).__name__}: {str(e)[:200]}"
                records = [r for r in records if r["style"] != s]
                print(f"[{i + 1}/{len(cases)}] {s}: left out at this commit ({UNAVAILABLE[s]})", flush=True)
                continue
            records.append(rec)
            print(f"[{i + 1}/{len(cases)}] {s}/{v} {rec['fault']} seed {seed}: {rec['outcome']} "
                  f"{rec['flagged'] or ''}", flush=True)
    meta = _meta(args, argv, records, t0, prov, "default")
    meta["one_stack_steps"] = {k: args.one_stack_steps or v for k, v in _own_steps().items()}
    return _write(args.out, meta, records)


def _meta(args, argv, records: list[dict], t0: float, prov, corpus_name: str) -> dict:
    pkg = Path(tndebug.__file__).resolve().parent
    inside = ROOT in pkg.parents
    commit = git("rev-parse", "HEAD") if inside else os.environ.get("FOREIGN_BENCH_AT", "unknown (not in the repo)")
    dirty = git("status", "--porcelain", "--", "tndebug") if inside else ""
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = "not installed"
    return {"bench": "foreign", "corpus": corpus_name, "commit": commit,
            "dirty_note": " (tndebug/ has uncommitted changes)" if dirty else "",
            "tndebug_from": str(pkg), "transformers": tf_version,
            "seeds": list(range(args.seeds)), "bug_seeds": list(range(args.bug_seeds)), "steps": args.steps,
            "runs": len(records),
            "healthy_runs": sum(r["fault"] == "healthy" for r in records),
            "bug_runs": sum(r["fault"] != "healthy" for r in records),
            "styles_left_out": dict(sorted(UNAVAILABLE.items())),
            "source_lines": source_lines.summary(records),
            "wall_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "provenance": prov.finish()}


def _run_styles(args, argv, chosen: set[str]) -> int:
    """--corpus styles: every case of the user-style corpus, one at a time, into args.out."""
    cases = [c for c in style_cases(list(range(args.seeds)), list(range(args.bug_seeds))) if c[0] in chosen]
    prov = Provenance.start(__file__, argv)
    t0 = time.perf_counter()
    data = styles_corpus.text_ids()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (s, v, b, seed) in enumerate(cases):
            rec = one_style_run(s, v, b, seed, Path(tmp), args.steps, data)
            records.append(rec)
            print(f"[{i + 1}/{len(cases)}] {s}/{rec['variant']} {rec['fault']} seed {seed}: {rec['outcome']} "
                  f"{rec['flagged'] or ''} {rec.get('source_line', {}).get('sources', '')}", flush=True)
    meta = _meta(args, argv, records, t0, prov, "styles")
    meta["text"] = ("Python's pydoc topics (pydoc_data.topics), 96 characters, no pad token; decoders "
                    "predict the next character, encoders (enc_*, triaged with --arch encoder) restore "
                    f"the {styles_corpus.CORRUPT:.0%} of characters replaced by random ones")
    return _write(args.out, meta, records)


def _write(out: str, meta: dict, records: list[dict]) -> int:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "records": records}, indent=1, default=str) + "\n")
    write_md(out.with_suffix(".md"), meta, records)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')} ({meta['wall_s']:.0f} s)")
    return 0


def _rerun_at(commit: str, argv: list[str]) -> int:
    """Run this script again with tndebug/ from `commit` first on PYTHONPATH."""
    full = git("rev-parse", "--verify", f"{commit}^{{commit}}")
    if not full:
        raise SystemExit(f"bench/foreign.py: --at {commit}: no such commit")
    with tempfile.TemporaryDirectory(prefix="foreign-at-") as tmp:
        archive = subprocess.run(["git", "archive", full, "tndebug"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")])),
               "FOREIGN_BENCH_AT": full}
        return subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
