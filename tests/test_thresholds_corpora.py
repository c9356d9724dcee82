"""docs/thresholds.md's corpora and held-out statements against the bench scripts (issue 50): the
seeds, step counts and seed-based held-out claims the doc prints are the ones `bench/detection.py`
and `bench/foreign.py` run by default and the ones their results files recorded.

Read with ast (the argparse defaults) and json, importing no bench script."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "thresholds.md"


def argparse_defaults(script: str) -> dict[str, object]:
    """--flag -> its literal default, for every `add_argument` of a bench script."""
    out = {}
    for node in ast.walk(ast.parse((ROOT / script).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" \
                and node.args and isinstance(node.args[0], ast.Constant):
            for kw in node.keywords:
                if kw.arg == "default":
                    try:
                        out[node.args[0].value] = ast.literal_eval(kw.value)
                    except ValueError:
                        pass
    return out


def corpus_row(name: str) -> str:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith(f"| **{name}** |")]
    assert len(rows) == 1, f"docs/thresholds.md: one corpus row **{name}**"
    return rows[0]


def span(seeds) -> str:
    seeds = sorted(seeds)
    assert seeds == list(range(seeds[0], seeds[-1] + 1)), seeds
    return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])


def threshold_rows() -> list[list[str]]:
    """The cells of every 7-column threshold table row (name, value, decides, reason, set on,
    checked on, held out?)."""
    out = []
    for line in DOC.read_text().splitlines():
        if line.startswith("| `") or line.startswith("| inline"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if len(cells) == 7:
                out.append(cells)
    return out


def test_detection_seeds_are_the_scripts():
    d = argparse_defaults("bench/detection.py")
    evaluation, calibration = corpus_row("det-eval"), corpus_row("det-calib")
    assert f"healthy seeds {span(d['--eval-healthy-seeds'])}" in evaluation
    assert f"at seeds {span(d['--eval-fault-seeds'])}" in evaluation
    assert f"healthy seeds {span(d['--calib-seeds'])}" in calibration
    assert f"benign and fault seed {span(d['--calib-fault-seeds'])}" in calibration
    assert d["--calib-benign-seeds"] == d["--calib-fault-seeds"]


def test_foreign_seeds_and_steps_are_the_scripts_and_the_results():
    d = argparse_defaults("bench/foreign.py")
    row = corpus_row("foreign")
    assert f"healthy over {d['--seeds']} seeds" in row
    assert f"bugs per style over {d['--bug-seeds']} seeds" in row
    assert f"{d['--steps']} training steps" in row
    got = json.loads((ROOT / "bench" / "results" / "foreign.json").read_text())
    assert got["seeds"] == list(range(d["--seeds"])) and got["bug_seeds"] == list(range(d["--bug-seeds"]))
    assert got["steps"] == d["--steps"]


def test_seed_based_held_out_claims_name_the_evaluation_seeds():
    """A row "held out" by seeds only is checked on a seed-split corpus (det-eval, or lnwarm's
    evaluation seeds); a seed a row says it was set on that is one of det-eval's is said to be
    one, and the row calls itself held out only partly."""
    d = argparse_defaults("bench/detection.py")
    evaluation = set(d["--eval-fault-seeds"]) | set(d["--eval-healthy-seeds"])
    rows = threshold_rows()
    assert len(rows) >= 90
    for name, _, _, _, set_on, checked, held in rows:
        if held.startswith("seeds only"):
            assert "det-eval" in checked or "lnwarm" in checked, \
                f"{name}: held out by seeds only, yet checked on no seed-split corpus"
        for seed in map(int, re.findall(r"\bseed (\d+)\b", set_on)):
            if seed in evaluation:
                assert "evaluation seed" in set_on and "partly" in held, \
                    f"{name}: set on seed {seed}, one of det-eval's evaluation seeds; say so"


def test_no_threshold_set_on_x_transformers_is_called_held_out_on_it():
    """FP64_KEEPS and tokens_unmixed were set on x-transformers after it joined the corpus."""
    for name, _, _, _, set_on, _, held in threshold_rows():
        if "x-transformers" in set_on:
            assert not held.startswith("yes"), f"{name}: set on x-transformers, called held out"
    assert "not held out for the order test" in corpus_row("foreign")
