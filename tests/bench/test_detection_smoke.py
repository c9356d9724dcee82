"""Smoke test of the fault-injection benchmark: 2 faults + 1 healthy configuration, a few steps,
in process; the report has the confusion-matrix structure bench/results/detection.md shows."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tndebug.probes import PROBE_NAMES

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_detection_harness_smoke(tmp_path):
    detection, report = _load("detection"), _load("detection_report")
    out = tmp_path / "d.jsonl"
    threads = torch.get_num_threads()
    try:
        rc = detection.main(["--faults", "no_scale", "pre_ln_no_final_norm", "--healthy-tasks", "copy",
                             "--norms", "pre", "--archs", "seq2seq", "--eval-fault-seeds", "10", "--eval-healthy-seeds", "10",
                             "--eval-benign-seeds", "--benign", "--calib-seeds", "--calib-benign-seeds",
                             "--calib-fault-seeds", "--steps", "4",
                             "--resume-at", "2", "--eval-size", "20", "--workers", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    runs = [r for r in lines if not r.get("meta")]
    assert len(runs) == 4 and all(r["ok"] for r in runs), [r.get("error") for r in runs]
    # a rerun skips what is done
    assert detection.done_keys(out) == {r["key"] for r in runs}

    d = report.analyse(*report.load(out))
    assert set(d["faults"]) == {"no_scale", "pre_ln_no_final_norm"}
    sizes = {"no_scale": 2, "pre_ln_no_final_norm": 1}          # Fault.norms: pre+post, pre only
    for name, o in d["faults"].items():
        assert set(o["confusion"]) == set(PROBE_NAMES)
        for cell in o["confusion"].values():
            assert cell["n"] == sizes[name] and 0 <= cell["k"] <= cell["n"]
            lo, hi = cell["wilson95"]
            assert 0.0 <= lo <= cell["rate"] <= hi <= 1.0
        # both faults have an exact test at step 0
        assert o["recall"]["k"] == sizes[name], o["first_alarm_where"]
        assert o["steps_to_detection"]["median"] == 0
        assert o["localisation_first"]["n"] == o["recall"]["k"]
    assert set(d["false_positives"]["healthy"]) == set(PROBE_NAMES) | {"any"}
    assert d["false_positives"]["healthy"]["any"]["n"] == 1
    md = report.markdown(d)
    assert "## Confusion matrix (probe x fault)" in md
    row = next(x for x in md.splitlines() if x.startswith("| no_scale |") and "**" in x)
    assert row.count("|") == len(PROBE_NAMES) + 2
