"""label-shift on Hugging Face decoder-only directories (tndebug/hf/shift.py, issue 21):
GPT-2 and Llama trained here on walks through a successor map, through transformers' own loss
(`labels=ids`: shifted once, inside the model), with the labels shifted before it too
(`labels=ids[:, 1:]`: twice), or with a loss of the loop's own on unshifted labels; triaged through
the CLI with --data {'ids': [N, T]}, with the probes' output layer whole and sliced."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from tndebug.cli import main                                            # noqa: E402
from test_hf_head_decoder import BOS, V, _model, fit, triage_report     # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")



def _loss(model, ids, labels: str):
    if labels == "once":                                  # transformers shifts inside
        return model(input_ids=ids, labels=ids).loss
    if labels == "twice":                                 # ... and the loop had shifted already
        pre = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], 1)
        return model(input_ids=ids, labels=pre).loss
    logits = model(input_ids=ids).logits                  # the loop's own loss, not shifted
    return F.cross_entropy(logits.reshape(-1, V), ids.reshape(-1))


def _trained(arch: str, labels: str, tied: bool, steps: int = 300):
    """(model, held-out ids [24, 16]): BOS, then a walk through 24 words (inside the 96 ids) in
    which each word has one successor: every next token is known from the one before, so a
    trained model predicts this data at one offset or another (label-shift judges there)."""
    torch.manual_seed(0)
    model = _model(arch, tied)
    g = torch.Generator().manual_seed(1)
    words = torch.randperm(V - 8, generator=g)[:24] + 8
    succ = torch.randperm(24, generator=g)

    def batch(n):
        walk = [torch.randint(0, 24, (n,), generator=g)]
        for _ in range(14):
            walk.append(succ[walk[-1]])
        return torch.cat([torch.full((n, 1), BOS), words[torch.stack(walk, 1)]], 1)
    return fit(model, batch, lambda m, ids: _loss(m, ids, labels), steps)


def _triage(model, ids, tmp_path, name):
    code, report = triage_report(model, ids, tmp_path, name)
    return code, report, [f for f in report["findings"] if f["probe"] == "label-shift"]


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_labels_shifted_twice_are_named(arch, sliced, tmp_path, monkeypatch):
    if sliced:                                    # the probes see ids 0..39 of 96: label-shift
        import tndebug.triage.hf_dir as hf            # still argmaxes over all 96
        monkeypatch.setattr(hf, "PROBE_VOCAB", 40)
    model, ids = _trained(arch, "once", tied=arch == "gpt2")
    code, report, got = _triage(model, ids, tmp_path, "healthy")
    st = report["probes"]["label-shift"]
    assert got == [] and st["status"] == "pass", (got, st)
    assert report["run"]["probe_seconds"]["label-shift"] >= 0          # its own pass, timed
    assert st["coverage"]["shifted-twice"]["status"] == "checked", st   # judged, on --data
    assert (report["run"]["probes_see_logits_of_ids"] == "0..39 (of 96; exact)") == sliced
    model, ids = _trained(arch, "twice", tied=arch == "gpt2")
    code, report, got = _triage(model, ids, tmp_path, "twice")
    assert code == 1 and [(f["code"], f["severity"]) for f in got] == [
        ("label-shift/shifted-twice", "error")], got
    assert got[0]["evidence"]["after_next_rate"] >= 0.5, got[0]["evidence"]


def test_unshifted_labels_on_an_untied_head_are_named(tmp_path):
    model, ids = _trained("llama", "unshifted", tied=False)
    code, report, got = _triage(model, ids, tmp_path, "unshifted")
    assert code == 1 and [(f["code"], f["severity"]) for f in got] == [
        ("label-shift/unshifted", "error")], got
    assert got[0]["evidence"]["judged_on"] == "checkpoint"        # a fresh init does not repeat
    assert report["probes"]["label-shift"]["fresh_init"]["repeats_input_at_init"] is False


def test_an_encoder_decoder_is_not_asked(tmp_path):
    """label-shift is for one causal stack; asked for on a BART directory it says why not."""
    cfg = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.BartForConditionalGeneration(cfg).save_pretrained(tmp_path / "bart")
    out = tmp_path / "bart_out"
    main(["triage", str(tmp_path / "bart"), "--probe", "label-shift", "--out", str(out)])
    st = json.loads((out / "report.json").read_text())["probes"]["label-shift"]
    assert st["status"] == "skipped" and st["coverage"][""]["status"] == "not applicable", st
    assert "encoder-decoder" in st["reason"], st
