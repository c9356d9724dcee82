"""Issue 45: a probe whose own code raised is never "pass". Its status is "internal error", the
verdict cannot be clean (INCOMPLETE, exit 4), and the console names it as a tndebug bug with the
frame that raised. A probe that raised inside the model's code keeps its no verdict."""
from __future__ import annotations

import io

import torch

import tndebug
from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.probes import engine
from tndebug.probes.head_collapse import HeadCollapse
from tndebug.reporters import console, markdown


def _raise_after_checking(self, site, rec, roles, module, trace):
    self.cover(site, "checked")               # it had checked something ...
    [][0]                                     # ... then its own code raised (IndexError)


def test_a_probe_that_raised_in_its_own_code_is_an_internal_error(monkeypatch):
    monkeypatch.setattr(HeadCollapse, "_duplicates", _raise_after_checking)
    monkeypatch.setattr(engine, "by_tndebug", lambda e: True)    # as if raised in tndebug/
    torch.manual_seed(0)
    report = tndebug.check(make_model(ModelConfig.tiny()), probes=["head-collapse", "missing-scale"])
    st = report.probes["head-collapse"]
    assert st["status"] == "internal error", st
    assert "IndexError" in st["reason"] and "tndebug bug" in st["reason"], st["reason"]
    assert "test_internal_error.py" in st["reason"]            # the frame that raised
    assert report.verdict == "incomplete" and report.exit_code() == 4
    assert report.probes["missing-scale"]["status"] == "pass"
    buf = io.StringIO()
    console.print_summary(report, console.Console(file=buf, width=80, highlight=False))
    assert "INTERNAL ERROR" in buf.getvalue() and "tndebug bug" in buf.getvalue(), buf.getvalue()
    assert "INTERNAL ERROR" in markdown.render(report)


def test_a_probe_that_checked_and_did_not_raise_still_passes():
    torch.manual_seed(0)
    report = tndebug.check(make_model(ModelConfig.tiny()), probes=["head-collapse"])
    assert report.probes["head-collapse"]["status"] == "pass", report.probes


def test_a_probe_interrupted_by_the_model_raising_is_no_verdict_not_pass(monkeypatch):
    """The raise came from outside tndebug (here: this file, standing for the model's code)
    and no probe caught it: what the probe checked before is unfinished, so no verdict."""
    monkeypatch.setattr(HeadCollapse, "_duplicates", _raise_after_checking)
    torch.manual_seed(0)
    report = tndebug.check(make_model(ModelConfig.tiny()), probes=["head-collapse"])
    st = report.probes["head-collapse"]
    assert st["status"] == "no verdict" and "IndexError" in st["reason"], st
    assert report.verdict == "incomplete"
