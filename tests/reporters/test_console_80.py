"""The console at 80 columns, as a new user sees `tndebug check` (issue 48): every line fits,
a CLEAN check collapses its info findings to one line unless -v, the headline counts the rows
shown, evidence is a few named numbers at 3 significant digits, no module path said twice."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tndebug.cli import main

sys.path.insert(0, str(Path(__file__).parents[1] / "capture"))
from nanogpt_text import model_file  # noqa: E402

ROW = re.compile(r"^ (ERROR|WARN|INFO) ")
WORDS = {"ERROR": "error", "WARN": "warning", "INFO": "info"}


@pytest.fixture
def console80(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("NO_COLOR", "1")

    def run(attention, *flags):
        model_file(tmp_path, attention)
        code = main(["check", "model.py:build", *flags])
        return code, capsys.readouterr().out.splitlines()
    return run


def _fits(lines):
    wide = [ln for ln in lines if len(ln.rstrip()) > 80]
    assert not wide, wide


def _headline(lines) -> dict:
    m = re.search(r"\((\d+) errors?, (\d+) warnings?, (\d+) info\)", lines[0])
    return dict(zip(("error", "warning", "info"), map(int, m.groups())))


def test_clean_check_is_short(console80):
    code, lines = console80("healthy")
    assert code == 0 and lines[0].startswith("verdict: CLEAN")
    _fits(lines)
    infos = _headline(lines)["info"]
    assert not [ln for ln in lines if ROW.match(ln)]                 # no table rows
    if infos:
        assert f"{infos} note{'s' * (infos != 1)}: -v shows them" in lines
    code, verbose = console80("healthy", "-v")
    _fits(verbose)
    assert len([ln for ln in verbose if ROW.match(ln)]) == infos      # -v: one row per note


def test_errors_check_fits_and_says_each_thing_once(console80):
    code, lines = console80("no_scale")
    assert code == 1 and lines[0].startswith("verdict: ERRORS")
    _fits(lines)
    rows = [WORDS[ROW.match(ln).group(1)] for ln in lines if ROW.match(ln)]
    assert _headline(lines) == {s: rows.count(s) for s in ("error", "warning", "info")}
    text = "\n".join(lines)
    assert "source: model.py:" in text and "(CausalSelfAttention.forward)" in text
    for a, b in zip(lines, lines[1:]):                                # the message names it
        if "where: " in a:
            assert not b.split()[0].startswith(a.split("where: ")[1].split()[0]), (a, b)
    assert "at step 0 in transformer.h.0.attn: transformer.h.0.attn" not in " ".join(text.split())
    evidence = " ".join(" ".join(text.split("evidence:")[1:]).split())
    assert "{" not in evidence.split("fix:")[0]                       # no raw dicts
    for chunk in text.split("evidence:")[1:]:
        numbers = re.findall(r"=(-?\d[\d.e+-]*)", chunk.split("fix:")[0])
        assert numbers and len(numbers) <= 4, numbers
        assert all(len(re.sub(r"[^0-9]", "", n.split("e")[0]).lstrip("0")) <= 3 for n in numbers), numbers


def test_verbose_shows_every_evidence_item_and_the_source_lines(console80):
    """-v: the evidence in full (each item named, nested values opened, numbers at 3
    significant digits) and the lines of the user's file around the finding's source line."""
    code, lines = console80("no_scale", "-v")
    assert code == 1 and lines[0].startswith("verdict: ERRORS")
    _fits(lines)
    text = "\n".join(lines)
    chunk = " ".join(text.split("evidence:")[1].split("fix:")[0].split())
    assert len(re.findall(r"\w=", chunk)) > 4 and "(+" not in chunk, chunk      # nothing left out
    marked = [ln for ln in lines if re.search(r">\s*\d+ \| ", ln)]
    assert marked and "q @ k.transpose(-2," in marked[0], marked          # the line itself
    assert len([ln for ln in lines if re.search(r"\s\d+ \| ", ln)]) >= 3         # and around it
    code, short = console80("no_scale")
    assert not [ln for ln in short if re.search(r"\d+ \| ", ln)]                # not without -v


@pytest.mark.parametrize("command", ["run", "triage", "check"])
def test_the_three_commands_take_the_same_verbose_flag(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "-v, --verbose" in out
    assert "each finding's evidence in full, and the lines of your code around its source line" in out
