"""sample_runs/ holds real outputs: they match the current schema, and a quick one reproduces."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tndebug.report import SCHEMA, Report

ROOT = Path(__file__).resolve().parents[1] / "sample_runs"
spec = importlib.util.spec_from_file_location("regenerate", ROOT / "regenerate.py")
regenerate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(regenerate)

RUN_KEYS = {"task", "preset", "norm", "faults", "seed", "steps", "device", "final_loss",
            "exact_match", "token_accuracy", "wall_s", "status"}


def _signature(report: dict) -> set[tuple[str, str, str]]:
    return {(f["probe"], f["severity"], f["where"]) for f in report["findings"]
            if f["severity"] != "info"}


@pytest.mark.parametrize("name", list(regenerate.SAMPLES))
def test_sample_matches_the_schema(name):
    d = ROOT / name
    report = json.loads((d / "report.json").read_text())
    assert report["schema"] == SCHEMA
    assert RUN_KEYS <= set(report["run"])
    Report.from_dict(report)                     # every finding parses into a Finding
    assert set(report["probes"]) >= {"nan-scores", "missing-scale", "mask-broadcast"}
    assert (d / "report.md").exists() and list((d / "tb").glob("events.out.tfevents.*"))
    for png in (d / "report.md").read_text().split("](")[1:]:
        target = png.split(")")[0]
        if target.endswith(".png"):
            assert (d / target).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_healthy_samples_are_clean_and_faulty_ones_name_their_probe():
    for name in ("healthy_pre", "healthy_post"):
        assert _signature(json.loads((ROOT / name / "report.json").read_text())) == set()
    expected = {"no_scale": "missing-scale", "no_causal_mask": "mask-broadcast",
                "pad_mask_query_axis": "mask-broadcast", "neg_inf_fill_all_masked": "nan-scores",
                "shared_qkv": "head-collapse", "no_residual": "variance-drift",
                "pre_ln_no_final_norm": "ln-placement", "kl_raw_logits": "loss-health"}
    for name, probe in expected.items():
        report = json.loads((ROOT / name / "report.json").read_text())
        assert probe in {p for p, sev, _ in _signature(report) if sev == "error"}, name


def _findings(report: dict) -> list[tuple[str, str, str]]:
    """Every finding, info included, as (probe, severity, where), with repeats."""
    return sorted((f["probe"], f["severity"], f["where"]) for f in report["findings"])


# not slow: no_scale is 120 tiny steps, ~9 s of CPU on one thread (the cheapest sample with a
# finding beyond info); the committed sample must be what this commit's code produces
def test_rerunning_a_quick_sample_reproduces_its_verdict_and_findings(tmp_path):
    stored = json.loads((ROOT / "no_scale" / "report.json").read_text())
    out = regenerate.regenerate("no_scale", root=tmp_path)
    fresh = json.loads((out / "report.json").read_text())
    assert fresh["verdict"] == stored["verdict"] == "errors"
    assert _findings(fresh) == _findings(stored), (
        "sample_runs/no_scale differs from a rerun at this commit: regenerate sample_runs/ "
        "(`python -m bench run sample_runs`) and commit it")
    assert fresh["run"]["steps"] == stored["run"]["steps"] and fresh["run"]["faults"] == stored["run"]["faults"]


def test_the_regeneration_record_matches_the_committed_samples():
    """bench/sample_runs.py (`python -m bench run sample_runs`) records the commit that produced
    sample_runs/ beside each sample's verdict and findings; the two must agree."""
    record = ROOT.parent / "bench" / "results" / "sample_runs.json"
    if not record.exists():
        pytest.skip("bench/results/sample_runs.json not written yet: `python -m bench run sample_runs`")
    samples = json.loads(record.read_text())["samples"]
    assert set(samples) == set(regenerate.SAMPLES)
    for name, rec in samples.items():
        report = json.loads((ROOT / name / "report.json").read_text())
        assert rec["verdict"] == report["verdict"], name
        assert [tuple(f) for f in rec["findings"]] == _findings(report), name
