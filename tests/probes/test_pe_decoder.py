"""Issue 45: positions in a decoder-only model. positional-encoding's swap test
(probes/_pe_causal.py): a declared mechanism (a learned or sinusoidal table, rotary, ALiBi) that
never reaches the attention is an error, at initialisation and after training; a model with
none at all (NoPE) is info; every applied mechanism passes and the report says where it enters.
Before, the test was "not applicable" on a decoder and all of these were CLEAN."""
from __future__ import annotations

import pytest
import torch

import tndebug
from pe_gpts import STYLES, PosGPT, forward, train

CODE = "positional-encoding/positions-not-applied"


def _pe(report):
    return [(f.severity, f.code) for f in report.findings if f.probe == "positional-encoding"]


@pytest.mark.parametrize("style", [s for s in STYLES if s != "none"])
def test_an_applied_mechanism_passes_and_is_named(style):
    torch.manual_seed(0)
    report = tndebug.check(PosGPT(style), forward, probes="positional-encoding", arch="decoder")
    st = report.probes["positional-encoding"]
    assert st["status"] == "pass" and _pe(report) == [], (style, report.findings)
    where = st["coverage"][""]["reason"]
    assert ("embeddings" in where) == (style in ("learned", "sinusoidal")), where


@pytest.mark.parametrize("style", [s for s in STYLES if s != "none"])
def test_a_declared_mechanism_never_applied_is_an_error(style):
    torch.manual_seed(0)
    report = tndebug.check(PosGPT(style, bug="not_applied"), forward, arch="decoder")
    assert ("error", CODE) in _pe(report), (style, report.findings)
    f = next(f for f in report.findings if f.code == CODE)
    assert f.evidence["declared"] and f.evidence["swap_rel_diff"] < 1e-4
    assert report.verdict == "errors"


def test_nope_by_design_is_info_not_an_error():
    torch.manual_seed(0)
    report = tndebug.check(PosGPT("none"), forward, arch="decoder")
    assert _pe(report) == [("info", "positional-encoding/no-positions")], report.findings
    assert report.probes["positional-encoding"]["status"] == "pass"


def test_positions_never_applied_are_named_after_training_too():
    torch.manual_seed(0)
    healthy = train(PosGPT("learned"))
    torch.manual_seed(0)
    buggy = train(PosGPT("learned", bug="not_applied"))
    assert _pe(tndebug.check(healthy, forward, arch="decoder")) == []
    assert ("error", CODE) in _pe(tndebug.check(buggy, forward, arch="decoder"))


def test_hugging_face_rotary_never_applied_is_named(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    assert _pe(tndebug.check(model)) == []
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, *a, **kw: (q, k))
    assert ("error", CODE) in _pe(tndebug.check(model))


def test_hugging_face_gptj_rotary_never_applied_is_named(monkeypatch):
    """GPT-J keeps its sin/cos table in a buffer named `embed_positions` (plural): read as no
    mechanism declared (NoPE, info) until `positions` was a declared name (issue 45's user-style
    corpus, tests/foreign/styles/rope_interleaved.py, missed at 7bc89fd)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gptj import modeling_gptj
    cfg = transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=8, vocab_size=64,
                                  n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPTJForCausalLM(cfg)
    assert _pe(tndebug.check(model)) == []
    monkeypatch.setattr(modeling_gptj, "apply_rotary_pos_emb", lambda t, sin, cos: t)
    assert ("error", CODE) in _pe(tndebug.check(model))
