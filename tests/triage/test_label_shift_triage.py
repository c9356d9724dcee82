"""Triage of `tndebug run --arch decoder` checkpoints (tndebug's own decoder-only model, read as
its own code: triage/own_decoder.py), and label-shift judged on the trained weights: labels not
shifted or shifted twice are named from the checkpoint's one pass; a healthy model passes; where
a fresh initialisation of the same code repeats its input too (a tied head), the "not shifted"
test has no verdict and says why, instead of an error an untrained tied model would also get."""
from __future__ import annotations

import json

import pytest
import torch

from tndebug.cli import main
from tndebug.train.config import TrainConfig, model_config
from tndebug.train.loop import run_training


def _trained(tmp_path_factory, name, *faults, tie=False):
    out = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    mc = model_config("copy", "tiny", "pre", faults, arch="decoder", dropout=0.0,
                      tie_embeddings=tie)
    tc = TrainConfig(task="copy", steps=250, warmup=100, lr_factor=1.5)
    run_training(mc, tc, probes="none", out_dir=out, evaluate_at_end=False)
    return out / "checkpoint.pt"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {name: _trained(tmp_path_factory, name, *faults, tie=tie) for name, faults, tie in [
        ("healthy", (), False), ("unshifted", ("lm_labels_unshifted",), False),
        ("twice", ("lm_labels_shifted_twice",), False),
        ("unshifted_tied", ("lm_labels_unshifted",), True)]}


def _triage(ckpt, tmp_path):
    out = tmp_path / "t"
    rc = main(["triage", str(ckpt), "--no-figures", "--out", str(out), "--format", "json"])
    return rc, json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("name,code", [("unshifted", "label-shift/unshifted"),
                                       ("twice", "label-shift/shifted-twice")])
def test_a_misshifted_checkpoint_is_named(ckpts, tmp_path, name, code):
    rc, rep = _triage(ckpts[name], tmp_path)
    errors = [f for f in rep["findings"] if f["severity"] == "error"]
    assert rc == 1 and [f["code"] for f in errors] == [code]
    ev = errors[0]["evidence"]
    rate = ev["self_rate"] if name == "unshifted" else ev["after_next_rate"]
    assert rate >= 2 * ev["next_rate"] and ev["judged_on"] == "checkpoint"
    assert rep["run"]["layout"] == "tndebug (decoder-only)"
    if name == "unshifted":     # an untied head does not repeat its input at init: the error stands
        assert rep["probes"]["label-shift"]["fresh_init"]["repeats_input_at_init"] is False


def test_a_healthy_decoder_checkpoint_is_clean_with_both_tests_checked(ckpts, tmp_path):
    rc, rep = _triage(ckpts["healthy"], tmp_path)
    assert rc == 0 and rep["verdict"] == "clean"
    cov = rep["probes"]["label-shift"]["coverage"]
    assert {k: v["status"] for k, v in cov.items()} == {"unshifted": "checked",
                                                        "shifted-twice": "checked"}
    assert rep["probes"]["lm-decoding"]["status"] == "pass"        # its KV cache was tested


def test_a_tied_head_that_repeats_its_input_at_init_gets_no_verdict_not_an_error(ckpts, tmp_path):
    rc, rep = _triage(ckpts["unshifted_tied"], tmp_path)
    assert not [f for f in rep["findings"] if f["code"].startswith("label-shift/")]
    st = rep["probes"]["label-shift"]
    assert st["status"] == "no verdict" and st["fresh_init"]["repeats_input_at_init"] is True
    assert "tied" in st["coverage"]["unshifted"]["reason"]
    assert rc == 4 and rep["verdict"] == "incomplete"


def test_a_decoder_checkpoint_whose_model_config_does_not_fit_is_one_line(ckpts, tmp_path, capsys):
    state = torch.load(ckpts["healthy"], weights_only=True)
    state["model_config"]["bogus"] = 1
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    assert main(["triage", str(bad), "--no-figures", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert "model_config does not fit" in err and "bogus" in err and "\n" not in err
    assert not (tmp_path / "t" / "report.json").exists()
