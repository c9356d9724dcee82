"""Triage of users' own encoder-only code: a BERT-style masked LM (tests/foreign/minibert.py)
trained briefly on copy's source rows. A one-input model is called as a GPT is, so which shape's
tests run comes from --arch, else from the class name (a hint), and the report says which:
MiniBert reads as encoder-only; the same code named Net reads as decoder-only, and then its
bidirectional attention is a causal leak whose fix says how to rerun it as an encoder. Each
injected bug is named by the probe and the code that own it."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tndebug.capture.adapters import import_file, resolve_adapter
from tndebug.errors import UsageError
from tndebug.triage import TriageOptions, triage

from foreign_corpus import ROOT, probe_failures
from minibert_corpus import (BUG_CASES, EXPECTED_CODE, EXPECTED_PROBE, FILE, make_checkpoint,
                             run_triage)
from nanogpt_corpus import describe, flagged

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
_cache: dict = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("minibert")


def checkpoint(folder, variant, bug, seed):
    key = (variant, bug, seed)
    if key not in _cache:
        _cache[key] = make_checkpoint(variant, bug, seed, folder)
    return _cache[key]


@pytest.mark.parametrize("variant, seed", [("manual", 0), ("manual", 1), ("sdpa", 2)])
def test_healthy_minibert_triages_clean_as_an_encoder(folder, variant, seed):
    report = run_triage(checkpoint(folder, variant, None, seed))
    assert report.run["arch"] == "encoder" and report.run["adapter"] == "bert"
    assert "class name MiniBert" in report.run["arch_from"]
    assert report.probes["mask-broadcast"]["status"] == "pass"
    assert report.probes["missing-scale"]["status"] == "pass"
    assert report.probes["lm-decoding"]["status"] == "skipped"
    broke = probe_failures(report)
    assert not broke, f"{variant} seed {seed}: clean only because probes broke: {broke}"
    bad = flagged(report)
    assert not bad, f"{variant} seed {seed}: false alarms\n{describe(bad)}"


@pytest.mark.parametrize("variant, bug", [pytest.param(v, b, id=f"{v}-{b}") for v, b in BUG_CASES])
def test_bug_is_named_by_its_probe(folder, variant, bug):
    report = run_triage(checkpoint(folder, variant, bug, 0))
    codes = {f.code for f in flagged(report, ("error",))}
    assert EXPECTED_CODE[bug] in codes, f"{variant} {bug}:\n{describe(report.findings)}"
    assert report.probes[EXPECTED_PROBE[bug]]["status"] == "fail"
    assert not probe_failures(report)


def test_arch_encoder_reads_a_model_whose_name_says_nothing(folder):
    path = checkpoint(folder, "manual", None, 0)
    guessed = run_triage(path, factory="build_net")
    assert guessed.run["arch"] == "decoder" and "--arch encoder" in guessed.run["arch_from"]
    leak = [f for f in guessed.findings if f.code == "mask-broadcast/causal-leak"]
    assert leak and "rerun with --arch encoder" in leak[0].fix      # bidirectional on purpose?
    told = run_triage(path, factory="build_net", arch="encoder")
    assert told.run["arch"] == "encoder" and told.run["arch_from"] == "--arch encoder"
    assert not [f for f in told.findings if f.code == "mask-broadcast/causal-leak"]
    assert told.probes["mask-broadcast"]["status"] == "pass"


def test_arch_decoder_overrides_the_name_hint(folder):
    report = run_triage(checkpoint(folder, "manual", None, 0), arch="decoder")
    assert report.run["arch"] == "decoder" and report.run["arch_from"] == "--arch decoder"
    # said by the user, so the leak's fix does not second-guess it
    assert all("--arch encoder" not in f.fix for f in report.findings)


def test_arch_that_contradicts_the_adapter_is_one_line():
    model = import_file(FILE).build().eval()
    with pytest.raises(UsageError, match=r"--arch seq2seq, but MiniBert takes one input"):
        resolve_adapter(None, model, "seq2seq")
    with pytest.raises(UsageError, match=r"--arch decoder does not fit --adapter bert"):
        resolve_adapter("bert", model, "decoder")
    adapter = resolve_adapter("bert", model)
    ids = torch.randint(3, 11, (2, 5))
    assert adapter.kind == "encoder" and adapter.forward(model, ids, 0).shape == (2, 5, 12)


def test_arch_applies_only_with_model(tmp_path):
    from tndebug.config import ModelConfig
    from tndebug.inject import make_model
    torch.save(make_model(ModelConfig.tiny()).state_dict(), tmp_path / "m.pt")
    with pytest.raises(UsageError, match="--arch encoder applies with --model"):
        triage(TriageOptions(str(tmp_path / "m.pt"), arch="encoder"))


def test_cli_shows_how_the_shape_was_read(folder, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tndebug", "triage",
                          str(checkpoint(folder, "manual", None, 0)), "--model", f"{FILE}:build_net",
                          "--arch", "encoder", "--no-figures", "--out", str(tmp_path / "o"),
                          "--probe", "mask-broadcast"],
                         capture_output=True, text=True, cwd=ROOT, timeout=180,
                         env={"NO_COLOR": "1", "COLUMNS": "80", "OMP_NUM_THREADS": "1",
                              **{k: v for k, v in __import__("os").environ.items()
                                 if k not in ("COLUMNS", "NO_COLOR")}})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "read as encoder-only (BERT-style, bidirectional): --arch encoder" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "tndebug", "triage", "x.pt", "--arch", "bidi"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'bidi'" in bad.stderr
