"""Regression tests for what bench/hf_unseen.py (Hugging Face architectures no other test uses)
found on its DEV half: each a tiny config, healthy -> no finding from the probe that was wrong,
and the faulty counterpart of the same probe still found."""
from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from tndebug.probes._float64 import in_float64                        # noqa: E402
from tndebug.probes.gradient_flow import _fires                       # noqa: E402
from tndebug.triage.hf_dir import triage_hf                               # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
V, D = 128, 32


def _roformer(**kw):
    torch.manual_seed(0)
    cfg = transformers.RoFormerConfig(vocab_size=V, hidden_size=D, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=2 * D,
                                      max_position_embeddings=64, embedding_size=D, pad_token_id=0,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw)
    return transformers.AutoModelForMaskedLM.from_config(cfg)


def _codes(report, probe):
    return [(f.severity, f.code) for f in report.findings if f.probe == probe and f.severity != "info"]


def test_fresh_rotary_encoder_uses_order_though_weakly(tmp_path):
    """A fresh RoFormer (rotary only, near-uniform attention at a 0.02-std init) changes under a
    permutation by 3e-5 in fp32, under PERM_TOL, and by the same in float64: it uses order."""
    _roformer().save_pretrained(tmp_path / "rof")
    report = triage_hf(TriageOptions(str(tmp_path / "rof")))
    assert not _codes(report, "positional-encoding"), _codes(report, "positional-encoding")
    assert report.probes["positional-encoding"]["coverage"][""]["status"] == "checked"


def test_order_blind_encoder_is_still_named(tmp_path):
    """The same model with its rotary made the identity (sin 0, cos 1 at every position): the
    float64 recheck agrees with fp32, and the declared rotary (`embed_positions`) never applied is an
    error (positions-not-applied, issue 45: order-ignored, naming no mechanism, before)."""
    model = _roformer()

    def blind(model, adapter):
        pos = model.roformer.encoder.embed_positions
        pos.weight.data.zero_()             # sin half 0, cos half... RoFormer: [sin | cos] rows

        def no_rotary(self, *a, **k):       # position table with sin 0 and cos 1: no rotation
            out = type(pos).forward(self, *a, **k)
            half = out.shape[-1] // 2
            return torch.cat([torch.zeros_like(out[..., :half]), torch.ones_like(out[..., half:])], -1)
        pos.forward = no_rotary.__get__(pos)
    model.save_pretrained(tmp_path / "rof")
    report = triage_hf(TriageOptions(str(tmp_path / "rof")), patch=blind)
    assert ("error", "positional-encoding/positions-not-applied") in _codes(report, "positional-encoding"), \
        [(f.code, f.message) for f in report.findings]


def test_in_float64_restores_dtypes_and_ties():
    m = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5))
    m[1].weight = m[0].weight                                      # tied, [5, 4] both
    m.register_buffer("table", torch.ones(2, dtype=torch.float16))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with in_float64(m):
        assert m[1].weight.dtype == torch.float64 and m.table.dtype == torch.float64
        assert m[0].weight is m[1].weight
    assert m.table.dtype == torch.float16 and m[1].weight.dtype == torch.float32
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_gelu_units_in_the_negative_region_fire_and_relu_zeros_do_not():
    x = torch.linspace(-3.0, -0.1, 50)[:, None]                # inputs a trained GELU unit sees
    assert _fires(nn.functional.gelu(x)).all()                  # alive: signal and gradient
    assert not _fires(torch.relu(x)).any()                      # a ReLU there is dead
    assert not _fires(nn.functional.gelu(torch.full((4, 1), -12.0))).any()   # GELU far below: dead


def test_trained_gelu_encoder_has_no_dead_unit_warning(tmp_path):
    """RoFormer (GELU) after 150 masked-LM steps: 53% of its FFN units never positive, all in GELU's
    negative region: no dead-units warning. The same model with FFN bias -12 still warns."""
    model = _roformer()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        x = torch.randint(4, V - 4, (16, 12), generator=g)
        pick = torch.rand(x.shape, generator=g) < 0.15
        pick[:, 0] = True
        loss = model(input_ids=x.masked_fill(pick, V - 1),
                     labels=torch.where(pick, x, torch.full_like(x, -100))).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(tmp_path / "ok")
    report = triage_hf(TriageOptions(str(tmp_path / "ok")))
    assert not _codes(report, "gradient-flow"), _codes(report, "gradient-flow")
    for layer in model.roformer.encoder.layer:
        layer.intermediate.dense.bias.data.fill_(-12.0)
    model.save_pretrained(tmp_path / "dead")
    report = triage_hf(TriageOptions(str(tmp_path / "dead")))
    assert ("warning", "gradient-flow/dead-units") in _codes(report, "gradient-flow")


def _mvp(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.MvpConfig(vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2,
                                 encoder_attention_heads=4, decoder_attention_heads=4,
                                 encoder_ffn_dim=2 * D, decoder_ffn_dim=2 * D, max_position_embeddings=64,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                 decoder_start_token_id=2, dropout=0.0)
    transformers.AutoModelForSeq2SeqLM.from_config(cfg).save_pretrained(tmp_path / "mvp")
    return tmp_path / "mvp"


def test_scores_that_already_hold_the_mask_fill_are_fitted(tmp_path):
    """MVP adds the padding mask (finfo.min) to the product before the capture point: the fit
    leaves out the keys the softmax zeroed, so every attention is checked and the 1/sqrt(d_k)
    it applies passes; with its scaling set to 1 missing-scale names it."""
    folder = _mvp(tmp_path)
    report = triage_hf(TriageOptions(str(folder)))
    cov = report.probes["missing-scale"]["coverage"]
    assert cov and all(c["status"] == "checked" for w, c in cov.items() if w), cov
    assert not _codes(report, "missing-scale")

    def unscaled(model, adapter):
        for m in model.modules():
            if hasattr(m, "scaling") and hasattr(m, "q_proj"):
                m.scaling = 1.0
    report = triage_hf(TriageOptions(str(folder)), patch=unscaled)
    assert ("error", "missing-scale/absent") in _codes(report, "missing-scale"), \
        [(f.code, f.message) for f in report.findings]
