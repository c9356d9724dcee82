"""Triage of a `tndebug run --fault no_scale` checkpoint (issue 44): the report says that triage
rebuilt tndebug's code without the faults the weights were trained with, and missing-scale is
shown with one status (NOT CHECKED: its temperature sweep did not run), not also as passed and
partly checked."""
from __future__ import annotations

import json

import torch

from tndebug.cli import main
from tndebug.config import ModelConfig
from tndebug.inject import make_model


def _ckpt(tmp_path, *faults):
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(dropout=0.0).with_faults(*faults)
    path = tmp_path / "checkpoint.pt"
    torch.save({"format": "tndebug.checkpoint/1", "model": make_model(cfg).state_dict(),
                "global_step": 40, "model_config": cfg.to_dict()}, path)
    return path


def test_a_fault_checkpoint_says_the_code_was_rebuilt_and_shows_one_status(tmp_path, capsys):
    out = tmp_path / "t"
    rc = main(["triage", str(_ckpt(tmp_path, "no_scale")), "--no-figures", "--out", str(out),
               "--probe", "missing-scale"])
    text = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    (f,) = [f for f in report["findings"] if f["code"] == "checkpoint/rebuilt-code"]
    assert f["severity"] == "info" and f["evidence"]["trained_with_faults"] == ["no_scale"]
    st = report["probes"]["missing-scale"]
    assert st["status"] == "pass" and "temperature sweep" in st["not_run"]     # the schema keeps both
    assert rc == 4 and "NOT CHECKED" in text
    passed = next(line for line in text.splitlines() if line.startswith("probes passed"))
    assert "missing-scale" not in passed
    assert "partly checked" not in text
    md = (out / "report.md").read_text()
    assert "| `missing-scale` | *not checked* |" in md


def test_a_healthy_checkpoint_gets_no_rebuilt_code_note(tmp_path):
    out = tmp_path / "t"
    main(["triage", str(_ckpt(tmp_path)), "--no-figures", "--out", str(out), "--probe",
          "missing-scale", "--format", "json"])
    report = json.loads((out / "report.json").read_text())
    assert not [f for f in report["findings"] if f["code"] == "checkpoint/rebuilt-code"]
