"""`tndebug check FILE.py:FACTORY` (issue 48): the exact tests on model code, no checkpoint, no
training; ruff-like lines under --format concise at the line the evidence was made; triage's
exit codes. Run in-process through tndebug.cli.main."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tndebug.cli import main

sys.path.insert(0, str(Path(__file__).parent / "capture"))
from nanogpt_text import model_file  # noqa: E402

FAST = ["--probe", "missing-scale,mask-broadcast"]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_concise_names_the_line_of_the_bug(in_tmp, capsys):
    _, lines = model_file(in_tmp, "no_scale")
    code = main(["check", "model.py:build", "--format", "concise", *FAST])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[0].startswith(f"model.py:{lines['scores']}: missing-scale/absent error: "
                             f"transformer.h.0.attn: scale 1.000")
    assert out[-1] == "tndebug check: ERRORS (1 error, 0 warnings, 0 info)"


def test_clean_model_exits_0_and_ignore_drops_the_error(in_tmp, capsys):
    model_file(in_tmp, "healthy", name="good.py")
    assert main(["check", "good.py:build", "--format", "concise", *FAST]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("tndebug check: CLEAN")
    model_file(in_tmp, "no_scale")
    assert main(["check", "model.py:build", "--format", "concise", *FAST,
                 "--ignore", "missing-scale"]) == 0
    assert "missing-scale" not in capsys.readouterr().out


def test_select_keeps_only_those_codes(in_tmp, capsys):
    model_file(in_tmp, "no_mask")
    assert main(["check", "model.py:build", "--format", "concise", *FAST,
                 "--select", "mask-broadcast/causal-leak"]) == 1
    lines = capsys.readouterr().out.splitlines()[:-1]
    assert [ln.split(": ")[1].split()[0] for ln in lines] == ["mask-broadcast/causal-leak"]


def test_json_carries_the_source(in_tmp, capsys):
    path, lines = model_file(in_tmp, "no_scale")
    assert main(["check", "model.py:build", "--format", "json", "--probe", "missing-scale"]) == 1
    report = json.loads(capsys.readouterr().out)
    (f,) = [f for f in report["findings"] if f["code"] == "missing-scale/absent"]
    assert (Path(f["source"]["file"]).resolve(), f["source"]["line"]) == (path.resolve(), lines["scores"])


@pytest.mark.parametrize("argv", [
    ["check", "nothere.py:build"],
    ["check", "model.py:nosuch"],
    ["check", "model.py:build", "--select", "no-such-probe"],
    ["check", "model.py:build", "--adapter", "nosuch"],
])
def test_bad_input_exits_2(in_tmp, capsys, argv):
    model_file(in_tmp, "healthy")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tndebug: error: ") and len(err.strip().splitlines()) == 1


def test_a_finding_with_no_source_line_points_at_its_modules_forward(in_tmp, capsys):
    path, _ = model_file(in_tmp, "healthy")
    main(["check", "model.py:build", "--format", "concise", "--probe", "lm-decoding"])
    out = capsys.readouterr().out.splitlines()[:-1]
    def_line = path.read_text().splitlines().index("    def forward(self, x):") + 1
    hits = [ln for ln in out if "lm-decoding/" in ln]             # where = transformer.h.0.attn
    assert hits and all(ln.startswith(f"model.py:{def_line}: lm-decoding/") for ln in hits), out
