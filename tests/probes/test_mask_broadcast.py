import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.harness import train_with_probes
from tndebug.probes.mask_broadcast import MaskBroadcast

try:
    from attn_handmade import PAD, HandAttention, HandModel, hand_subject, run_probe
except ImportError:  # tests/probes imported as a package
    from tests.probes.attn_handmade import PAD, HandAttention, HandModel, hand_subject, run_probe

ENC, DEC, CROSS = "encoder.layers.0.self_attn", "decoder.layers.0.self_attn", "decoder.layers.0.cross_attn"


def found(cfg):
    _, findings, _ = train_with_probes(cfg, [MaskBroadcast()], steps=1, batch=8)
    return findings


@pytest.mark.parametrize("preset,norm", [("tiny", "pre"), ("tiny", "post"), ("small", "pre")])
def test_healthy_model_gives_no_finding(preset, norm):
    cfg = ModelConfig.preset(preset, norm=norm, dropout=0.1)
    assert found(cfg) == []


@pytest.mark.parametrize("fault,expected", [
    ("mask_inverted", {ENC: "mask inverted", DEC: "mask inverted", CROSS: "mask inverted"}),
    ("pad_mask_query_axis", {ENC: "on pad keys"}),
    ("no_causal_mask", {DEC: "on future keys (no causal mask)"}),
    ("causal_transposed", {DEC: "causal mask transposed"}),
    ("mask_after_softmax", {ENC: "masked after softmax", DEC: "masked after softmax", CROSS: "masked after softmax"}),
    ("no_memory_mask", {CROSS: "on source pad keys (no memory mask)"}),
    ("softmax_wrong_dim", {ENC: "softmax over the query axis", DEC: "softmax over the query axis",
                           CROSS: "softmax over the query axis"}),
    ("view_without_transpose", {ENC: "no transpose", DEC: "no transpose", CROSS: "no transpose"}),
])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_fault_is_caught_at_step_0_in_the_right_attention(fault, expected, norm):
    findings = found(ModelConfig.tiny(norm=norm).with_faults(fault))
    assert {f.where for f in findings} == set(expected)
    for f in findings:
        assert f.severity == "error" and f.step == 0
        assert expected[f.where] in f.message, f.message


# -- the same bugs written by hand -------------------------------------------------------------
class NoCausal(HandModel):
    def tgt_mask(self, tgt):
        return (tgt != PAD)[:, None, None, :]                   # the bug: padding mask only


class NoMemoryMask(HandModel):
    def forward(self, src, tgt):
        memory = self.encode(src)
        x, keep = self.tgt_tap(self.embed(self.tgt_emb, tgt)), self.tgt_mask(tgt)
        for blk in self.dec:
            x = blk(x, keep, memory, torch.ones_like(self.src_mask(src)))   # the bug: no src mask
        return self.gen(x)


class ViewNoTranspose(HandAttention):
    def split(self, x):
        B, T, _ = x.shape
        return x.view(B, self.h, T, self.d_k)                   # the bug: no transpose

    def merge(self, z):
        B, _, T, _ = z.shape
        return z.reshape(B, T, self.h * self.d_k)


def test_handmade_healthy_models_give_no_finding():
    for kw in ({}, {"fields": ("out",)}, {"fields": ("q", "k", "probs"), "head_average": True}):
        assert run_probe(hand_subject(HandModel(layers=2), **kw), MaskBroadcast(), steps=1) == [], kw


def test_handmade_missing_causal_mask_is_named_by_module():
    findings = run_probe(hand_subject(NoCausal()), MaskBroadcast(), steps=1)
    assert [(f.severity, f.where) for f in findings] == [("error", "dec.0.self_attn")]
    assert "future keys" in findings[0].message


def test_handmade_missing_causal_mask_without_probs_names_the_attention_type():
    probe = MaskBroadcast()
    findings = run_probe(hand_subject(NoCausal(), fields=("out",)), probe, steps=1)   # fused: no probs
    assert [f.where for f in findings] == ["decoder (self-attention)"]
    assert findings[0].evidence["behaviour"]["causality"]["delta"] > findings[0].evidence["behaviour"]["causality"]["tol"]


def test_handmade_missing_memory_mask_without_probs_is_told_from_the_encoder():
    findings = run_probe(hand_subject(NoMemoryMask(), fields=("out",)), MaskBroadcast(), steps=1)
    assert [f.where for f in findings] == ["decoder (cross-attention)"]
    findings = run_probe(hand_subject(NoMemoryMask()), MaskBroadcast(), steps=1)
    assert [f.where for f in findings] == ["dec.0.src_attn"]


def test_handmade_view_without_transpose_names_every_attention():
    findings = run_probe(hand_subject(HandModel(attn_cls=ViewNoTranspose)), MaskBroadcast(), steps=1)
    assert {f.where for f in findings} == {"enc.0.self_attn", "dec.0.self_attn", "dec.0.src_attn"}
    assert all("no transpose" in f.message for f in findings)


# -- stories that fit the evidence (issue 19) ---------------------------------------------------------
def test_dropout_left_on_in_eval_is_named_not_read_as_a_leak():
    """Outputs that change between two identical eval calls make every comparison meaningless:
    one error that says so, and no mask story."""
    import torch.nn.functional as F
    from tndebug.inject import make_model
    from tndebug.config import ModelConfig
    from tndebug.probes.mask_broadcast import MaskBroadcast
    from tndebug.probes.base import RunContext
    from tndebug.subject import tndebug_subject
    torch.manual_seed(0)
    model = make_model(ModelConfig.tiny())
    orig = model.generator.forward
    model.generator.forward = lambda x: orig(F.dropout(x, 0.3))          # training=True always
    probe = MaskBroadcast()
    probe.setup(RunContext(subject=tndebug_subject(model)))
    assert [f.message for f in probe.findings if "two identical calls" in f.message], probe.findings
    assert len(probe.findings) == 1 and "F.dropout(x, p, training=self.training)" in probe.findings[0].fix


def test_softmax_over_the_batch_axis_is_named():
    from tndebug.probes._mask_tests import _normalised_axis
    p = torch.randn(4, 2, 5, 5).softmax(0)
    assert _normalised_axis(p) == "batch"
    assert _normalised_axis(torch.randn(4, 2, 5, 5).softmax(1)) == "heads"
    assert _normalised_axis(torch.randn(4, 2, 5, 5).softmax(-1)) is None
