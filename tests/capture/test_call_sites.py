"""Findings on modules no recorded op located (embeddings, norms, blocks, feed-forwards) point at
the line of the model's code that calls the module (issue 48: "the embedding addition, the
residual add, the norm"): capture/source.call_site, attached by the probe engine."""
from __future__ import annotations

import os

import pytest

import tndebug
from tndebug.capture.source import call_site

from nanogpt_text import load, model_file


def variant(tmp_path, old: str, new: str):
    path, _ = model_file(tmp_path, "healthy")
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    lines = {n: ln.strip() for n, ln in enumerate(path.read_text().splitlines(), 1)}
    return load(path).build(), lines


def test_call_site_reads_the_callers_forward(tmp_path):
    model, lines = variant(tmp_path, "nn.LayerNorm(n_embd)", "nn.LayerNorm(n_embd)")
    site = {p: call_site(model, p) for p in ("transformer.wte", "transformer.wpe", "transformer.h.0.ln_1",
                                            "transformer.h.1.mlp", "transformer.h.0", "transformer.ln_f")}
    assert site["transformer.wte"]["code"] == "x = self.transformer.wte(idx) + self.transformer.wpe(pos)"
    assert site["transformer.wte"]["function"] == "GPT.forward" and site["transformer.wpe"] == site["transformer.wte"]
    assert site["transformer.h.0.ln_1"]["code"] == "x = x + self.attn(self.ln_1(x))"
    assert site["transformer.h.0.ln_1"]["function"] == "Block.forward"
    assert site["transformer.h.1.mlp"]["code"] == "return x + self.mlp(self.ln_2(x))"
    assert site["transformer.h.0"]["code"] == "for block in self.transformer.h:"       # a list's layer
    assert "self.transformer.ln_f(" in site["transformer.ln_f"]["code"]
    for loc in site.values():
        assert lines[loc["line"]] == loc["code"] and "package" not in loc
    assert call_site(model, "") is None and call_site(model, "no.such.module") is None


def test_transformers_modules_are_located_in_the_package():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64, bos_token_id=1, eos_token_id=2))
    loc = call_site(model, "transformer.wte")            # its forward is decorated: unwrapped
    assert os.path.basename(loc["file"]) == "modeling_gpt2.py" and "self.wte(" in loc["code"]
    assert loc["package"] == "transformers"
    assert "self.ln_1(" in call_site(model, "transformer.h.0.ln_1")["code"]


def test_an_embedding_finding_points_at_the_embedding_sum(tmp_path):
    old = "x = self.transformer.wte(idx) + self.transformer.wpe(pos)"
    model, lines = variant(tmp_path, old, old.replace("+ self", "+ 0 * self"))
    report = tndebug.check(model)
    [f] = [f for f in report.findings if f.code == "positional-encoding/positions-not-applied"]
    assert f.severity == "error" and f.where == "transformer.wpe"
    assert f.source["code"] == "x = self.transformer.wte(idx) + 0 * self.transformer.wpe(pos)"
    assert lines[f.source["line"]] == f.source["code"] and f.source["function"] == "GPT.forward"


def test_an_eps_finding_points_at_the_line_that_sets_eps(tmp_path):
    """The norm's eps is set where the norm is constructed, not where it is called (issue 48)."""
    model, lines = variant(tmp_path, "nn.LayerNorm(n_embd)", "nn.LayerNorm(n_embd, eps=1e-12)")
    report = tndebug.check(model)
    found = {f.where: f for f in report.findings if f.code == "nan-scores/norm-fp16"}
    f = found["transformer.h.0.ln_1"]
    assert f.source["code"] == "self.ln_1 = nn.LayerNorm(n_embd, eps=1e-12)"
    assert f.source["function"] == "Block.__init__" and lines[f.source["line"]] == f.source["code"]
