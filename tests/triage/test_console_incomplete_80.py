"""The console at 80 columns for an INCOMPLETE triage, as a new user sees `tndebug triage DIR`
of a Hugging Face model at initialisation without data (issue 48; the CLEAN and ERRORS ones are
tests/reporters/test_console_80.py): the headline, then NOT CHECKED saying which test did not
run and what to pass, the rows the headline counts, the probes, the paths; every line fits; no
name internal to tndebug (tok, out, capture) reaches the user; exit code 4."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from tndebug.cli import main  # noqa: E402

ROW = re.compile(r"^ (ERROR|WARN|INFO) ")
WORDS = {"ERROR": "error", "WARN": "warning", "INFO": "info"}


@pytest.fixture(scope="module")
def gpt2_at_init(tmp_path_factory):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "gpt"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64,
                               bos_token_id=1, eos_token_id=2)).save_pretrained(path)
    return path


def test_incomplete_triage_at_80_columns(gpt2_at_init, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("NO_COLOR", "1")
    code = main(["triage", str(gpt2_at_init), "--out", "tri"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 4
    assert not [ln for ln in lines if len(ln.rstrip()) > 80]
    m = re.fullmatch(r"verdict: INCOMPLETE  \((\d+) errors?, (\d+) warnings?, (\d+) info\)", lines[0])
    assert m, lines[0]
    rows = [WORDS[ROW.match(ln).group(1)] for ln in lines if ROW.match(ln)]
    assert dict(zip(("error", "warning", "info"), map(int, m.groups()))) == \
        {s: rows.count(s) for s in ("error", "warning", "info")}
    assert lines[1].startswith("NOT CHECKED: ")                       # right under the verdict
    said = " ".join(" ".join(lines[1:lines.index(next(ln for ln in lines[1:] if not ln.strip()))]).split())
    assert "missing-scale (temperature sweep not run" in said and "--text FILE" in said \
        and "--data FILE.pt" in said, said
    text = "\n".join(lines)
    order = [text.index(s) for s in ("NOT CHECKED:", " severity ", "probes passed", "report: tri/report.json")]
    assert order == sorted(order), order
    assert not re.search(r"\((tok|out)\)|\bcapture\b", text), \
        [ln for ln in lines if re.search(r"\((tok|out)\)|\bcapture\b", ln)]


def test_verbose_triage_shows_the_evidence_in_full(gpt2_at_init, tmp_path, monkeypatch, capsys):
    """-v on triage as on check (tests/reporters/test_console_80.py): nothing left to report.md."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("NO_COLOR", "1")
    main(["triage", str(gpt2_at_init), "--out", "short"])
    short = " ".join(capsys.readouterr().out.split())
    assert main(["triage", str(gpt2_at_init), "--out", "full", "-v"]) == 4
    lines = capsys.readouterr().out.splitlines()
    assert not [ln for ln in lines if len(ln.rstrip()) > 80]
    full = " ".join(" ".join(lines).split())
    assert re.search(r"\(\+\d+ more\)|\(in report\.md\)", short)          # without -v: cut
    assert not re.search(r"\(\+\d+ more\)|\(in report\.md\)", full)       # with -v: all of it
    assert len(re.findall(r"\w=", full)) > len(re.findall(r"\w=", short))
