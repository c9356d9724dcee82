"""head-collapse: shared Q/K/V and duplicated heads at step 0; entropy collapse only with instability."""
from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from tndebug.config import ModelConfig
from tndebug.harness import train_with_probes
from tndebug.inject import make_model
from tndebug.model.hooks import HookPoint, name_hook_points
from tndebug.probes import probe_class
from tndebug.probes.base import RunContext, StepInfo
from tndebug.probes.head_collapse import EXACT_ASYM, HeadCollapse
from tndebug.subject import Subject, tndebug_subject
from tndebug.capture.taps import TapCapture
from tndebug.capture.trace import AttentionRecord, Trace

SITES = {"encoder.layers.0.self_attn", "encoder.layers.1.self_attn", "decoder.layers.0.self_attn",
         "decoder.layers.0.cross_attn", "decoder.layers.1.self_attn", "decoder.layers.1.cross_attn"}


def alarms(findings):
    return [f for f in findings if f.probe == "head-collapse" and f.severity != "info"]


def test_registered():
    assert probe_class("head-collapse") is HeadCollapse


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_tiny_is_clean(norm):
    probe = HeadCollapse()
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm), [probe], steps=2)
    assert alarms(findings) == [] and probe.checked


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_shared_qkv_is_an_error_in_every_attention(norm):
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm).with_faults("shared_qkv"),
                                       [HeadCollapse()], steps=1)
    found = {f.where: f for f in alarms(findings)}
    assert set(found) == SITES
    assert all(f.severity == "error" and f.step == 0 for f in found.values())
    enc = found["encoder.layers.0.self_attn"]
    assert enc.message.startswith("Q, K and V come from one projection")
    assert enc.evidence["asymmetry"] < enc.evidence["threshold_asymmetry"]
    assert found["decoder.layers.0.cross_attn"].evidence["same_projection"] == \
        ["decoder.layers.0.cross_attn.w_q"]          # cross-attention: caught from the module


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_identical_head_init_is_an_error_in_every_attention(norm):
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm).with_faults("identical_head_init"),
                                       [HeadCollapse()], steps=1)
    found = {f.where: f for f in alarms(findings)}
    assert set(found) == SITES
    for f in found.values():
        assert f.severity == "error" and f.step == 0 and f.evidence["heads"] == [0, 1, 2, 3]
        assert f.evidence["max_head_cosine"]["q"] > f.evidence["threshold_cosine"]
        assert "xavier" in f.fix


def test_a_rank_collapsed_stream_is_not_mistaken_for_shared_qk():
    """no_residual makes every token alike by the third layer: scores are constant, hence
    symmetric, and all maps uniform; that is variance-drift's finding, not this probe's."""
    torch.manual_seed(0)
    probe = HeadCollapse()
    probe.setup(RunContext(subject=tndebug_subject(make_model(ModelConfig.small().with_faults("no_residual")))))
    assert probe.checked and alarms(probe.findings) == []


def test_metrics_use_the_reporters_tags():
    seen = []

    class Sink:
        def on_metric(self, step, tag, value):
            seen.append(tag)

    train_with_probes(ModelConfig.tiny(), [HeadCollapse()], steps=1, sinks=[Sink()])
    for tag in ("attn/enc_self/layer0/head3/entropy", "attn/cross/layer1/head0/max_prob",
                "attn/dec_self/layer1/head2/similarity", "attn/cross/layer0/diversity"):
        assert tag in seen


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_no_dropout_does_not_collapse_heads(dropout):
    """Note 000 says heads collapse without dropout. Measured (tiny/small, 4+3 seeds): sharp
    copy-alignment heads appear with or without dropout, the loss is fine: nothing to report."""
    _, findings, _ = train_with_probes(ModelConfig.tiny(dropout=dropout), [HeadCollapse()], steps=300)
    assert alarms(findings) == []


# -- entropy collapse over training (synthetic traces) -------------------------------------
def sharp_trace(h=4, T=6, sharp=True):
    """Self-attention where every head puts (almost) all mass on one key."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, h, T, T, generator=g) * (40.0 if sharp else 0.5)
    rec = AttentionRecord("enc.0.attn", "enc_self", 0, scores=scores, masked_scores=scores,
                          probs=scores.softmax(-1))
    return Trace(src=torch.full((2, T), 3), attention={rec.site: rec})


@pytest.mark.parametrize("losses, warned", [
    ([2.0, 1.0, 0.8, 2.5, 2.6, 3.0], True),     # collapsed heads and the loss going back up
    ([2.0, 1.0, 0.8, 0.6, 0.5, 0.4], False),    # sharp heads on a healthy run: normal
    ([2.0, 1.0, 0.8, 2.5, 0.7, 3.0], False),    # not 3 probes in a row
])
def test_collapse_needs_instability_three_probes_in_a_row(losses, warned):
    probe = HeadCollapse()
    for step, loss in enumerate(losses):
        info = StepInfo(step * 50, loss=torch.tensor(loss))
        probe.update(probe.observe(sharp_trace(), info), info)
    found = alarms(probe.findings)
    assert bool(found) == warned
    if warned:
        (f,) = found
        assert f.severity == "warning" and f.where == "enc.0.attn" and f.step == 250
        assert f.evidence["collapsed_share"] > 0.5 and f.evidence["threshold_entropy"] == 0.05


def test_diffuse_heads_with_unstable_loss_are_not_collapse():
    probe = HeadCollapse()
    for step, loss in enumerate([2.0, 1.0, 3.0, 3.0, 3.0]):
        info = StepInfo(step, loss=torch.tensor(loss))
        probe.update(probe.observe(sharp_trace(sharp=False), info), info)
    assert alarms(probe.findings) == []


# -- the same bugs written by hand ---------------------------------------------------------
class HandAttention(nn.Module):
    """A user's multi-head attention; `shared=True` reuses one Linear for Q, K and V."""

    def __init__(self, d: int, h: int, shared: bool, self_mask: bool = False) -> None:
        super().__init__()
        self.h, self.dk, self.self_mask = h, d // h, self_mask
        self.proj_q = nn.Linear(d, d)
        self.proj_k = self.proj_q if shared else nn.Linear(d, d)
        self.proj_v = self.proj_q if shared else nn.Linear(d, d)
        self.proj_o = nn.Linear(d, d)
        for name in ("q", "k", "v", "scores", "masked_scores", "probs"):
            setattr(self, f"hook_{name}", HookPoint())

    def heads(self, x):
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.dk).transpose(1, 2)     # [B, h, T, dk]

    def forward(self, xq, xkv, keep):
        q = self.hook_q(self.heads(self.proj_q(xq)))
        k = self.hook_k(self.heads(self.proj_k(xkv)))
        v = self.hook_v(self.heads(self.proj_v(xkv)))
        s = self.hook_scores(q @ k.transpose(-1, -2) / math.sqrt(self.dk))   # [B, h, T, S]
        if self.self_mask:
            keep = keep & ~torch.eye(s.shape[-2], s.shape[-1], dtype=torch.bool)
        s = self.hook_masked_scores(s.masked_fill(~keep, -1e9))
        p = self.hook_probs(s.softmax(-1))
        B, _, T, _ = p.shape
        return self.proj_o((p @ v).transpose(1, 2).reshape(B, T, -1))


class HandLayer(nn.Module):
    def __init__(self, d, h, cross, **kw):
        super().__init__()
        self.self_attn = HandAttention(d, h, **kw)
        self.cross_attn = HandAttention(d, h, **{**kw, "self_mask": False}) if cross else None
        self.norm = nn.LayerNorm(d)

    def forward(self, x, keep, mem=None, mem_keep=None):
        x = self.norm(x + self.self_attn(x, x, keep))
        if self.cross_attn is not None:
            x = self.norm(x + self.cross_attn(x, mem, mem_keep))
        return x


class HandModel(nn.Module):
    """Tap points named like tndebug's, so TapCapture fills the trace."""

    def __init__(self, d=32, h=4, **kw) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([HandLayer(d, h, False, **kw)])
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([HandLayer(d, h, True, **kw)])
        self.out = nn.Linear(d, 11)
        name_hook_points(self)

    def forward(self, src, tgt):
        T = tgt.shape[1]
        src_keep = (src != 0)[:, None, None, :]
        tgt_keep = (tgt != 0)[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril()
        mem = self.encoder.layers[0](self.emb(src), src_keep)
        return self.out(self.decoder.layers[0](self.emb(tgt), tgt_keep, mem, src_keep))


def tap_subject(model):
    return Subject(model, lambda m, s, t, pad: m(s, t), src_vocab=11, tgt_vocab=11,
                   capture=TapCapture(model))


def test_hand_written_shared_projection_is_caught():
    probe = HeadCollapse()
    probe.setup(RunContext(subject=tap_subject(HandModel(shared=True))))
    found = {f.where: f for f in alarms(probe.findings)}
    assert set(found) == {"encoder.layers.0.self_attn", "decoder.layers.0.self_attn",
                          "decoder.layers.0.cross_attn"}
    assert found["encoder.layers.0.self_attn"].evidence["same_projection"] == \
        ["encoder.layers.0.self_attn.proj_q"]


class ScoresOnly:
    """A capture that sees scores and probabilities but not q/k/v (e.g. a patched softmax)."""

    def __init__(self, model):
        self.inner = TapCapture(model)

    @contextmanager
    def recording(self, reads, trace):
        with self.inner.recording(reads, trace):
            yield trace
        for rec in trace.attention.values():
            rec.q = rec.k = rec.v = None


@pytest.mark.parametrize("shared", [True, False])
def test_hand_written_shared_projection_from_scores_alone(shared):
    model = HandModel(shared=shared)
    probe = HeadCollapse()
    probe.setup(RunContext(subject=Subject(model, lambda m, s, t, pad: m(s, t), src_vocab=11,
                                           tgt_vocab=11, capture=ScoresOnly(model))))
    found = {f.where: f for f in alarms(probe.findings)}
    if shared:   # cross-attention scores are not square: only the self-attentions can tell
        assert set(found) == {"encoder.layers.0.self_attn", "decoder.layers.0.self_attn"}
        assert all(f.evidence["asymmetry"] < 0.05 for f in found.values())
    else:
        assert found == {}


def test_hand_written_separate_projections_are_clean():
    probe = HeadCollapse()
    probe.setup(RunContext(subject=tap_subject(HandModel(shared=False))))
    assert probe.checked and alarms(probe.findings) == []


def test_shared_qk_with_self_masking_is_by_design():
    probe = HeadCollapse()
    probe.setup(RunContext(subject=tap_subject(HandModel(shared=True, self_mask=True))))
    assert {f.where for f in alarms(probe.findings)} == {"decoder.layers.0.cross_attn"}
    infos = [f for f in probe.findings if f.severity == "info"]
    assert {f.where for f in infos} == {"encoder.layers.0.self_attn", "decoder.layers.0.self_attn"}


class MhaModel(nn.Module):
    """nn.MultiheadAttention (packed in_proj, no q/k/probs exposed); `copies` clones head 0."""

    def __init__(self, d=32, h=4, copies=False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.out = nn.Linear(d, 11)
        if copies:   # the bug by hand: every head's rows of W_Q, W_K, W_V copied from head 0
            with torch.no_grad():
                w = self.attn.in_proj_weight.view(3, h, d // h, d)
                w[:, 1:] = w[:, :1].clone()

    def forward(self, src, tgt):
        x = self.emb(src)
        return self.out(self.attn(x, x, x, key_padding_mask=src == 0, need_weights=False)[0])


class MhaCapture:
    """Only the module's output: what a forward hook on nn.MultiheadAttention gives."""

    def __init__(self, model):
        self.model = model

    @contextmanager
    def recording(self, reads, trace):
        def hook(m, i, o):
            trace.attention["attn"] = AttentionRecord("attn", "enc_self", 0, out=o[0].detach())
        h = self.model.attn.register_forward_hook(hook)
        try:
            yield trace
        finally:
            h.remove()


@pytest.mark.parametrize("copies", [True, False])
def test_hand_written_duplicate_heads_in_nn_multihead_attention(copies):
    model = MhaModel(copies=copies)
    probe = HeadCollapse()
    probe.setup(RunContext(subject=Subject(model, lambda m, s, t, pad: m(s, t), src_vocab=11,
                                           tgt_vocab=11, capture=MhaCapture(model))))
    found = alarms(probe.findings)
    if copies:
        (f,) = found
        assert f.severity == "error" and f.where == "attn" and f.evidence["heads"] == [0, 1, 2, 3]
    else:
        assert found == [] and probe.checked


# -- the claim follows the evidence (issue 10: "Q and K come from one projection" while q and k
# differed by 42%) -------------------------------------------------------------------------------
class BiasedAttention(HandAttention):
    """Separate Q and K, plus a large symmetric position bias -20|i - j| in the scores (as a
    relative-position scheme may add): the scores are nearly symmetric, q and k are not equal."""

    def forward(self, xq, xkv, keep):
        q = self.hook_q(self.heads(self.proj_q(xq)))
        k = self.hook_k(self.heads(self.proj_k(xkv)))
        v = self.hook_v(self.heads(self.proj_v(xkv)))
        T, S = q.shape[-2], k.shape[-2]
        bias = -20.0 * (torch.arange(T)[:, None] - torch.arange(S)[None, :]).abs().float()   # [T, S]
        s = self.hook_scores(q @ k.transpose(-1, -2) / math.sqrt(self.dk) + bias)            # [B, h, T, S]
        s = self.hook_masked_scores(s.masked_fill(~keep, -1e9))
        p = self.hook_probs(s.softmax(-1))
        B, _, T, _ = p.shape
        return self.proj_o((p @ v).transpose(1, 2).reshape(B, T, -1))


def biased_model():
    model = HandModel(shared=False)
    model.encoder.layers[0].self_attn.__class__ = BiasedAttention
    return model


def test_symmetric_scores_with_measured_different_q_and_k_are_not_called_shared():
    probe = HeadCollapse()
    probe.setup(RunContext(subject=tap_subject(biased_model())))
    assert alarms(probe.findings) == []
    (f,) = [f for f in probe.findings if f.where == "encoder.layers.0.self_attn"]
    assert f.severity == "info" and "one projection" not in f.message.replace("not one projection", "")
    assert f.evidence["asymmetry"] < f.evidence["threshold_asymmetry"]
    assert f.evidence["q_minus_k_rel"] >= f.evidence["threshold_same"]
    assert f"{f.evidence['q_minus_k_rel']:.2g}" in f.message and "Q and K are not one projection" in f.message


def test_nearly_symmetric_scores_without_q_and_k_are_a_warning_not_a_claim():
    model = biased_model()
    probe = HeadCollapse()
    probe.setup(RunContext(subject=Subject(model, lambda m, s, t, pad: m(s, t), src_vocab=11,
                                           tgt_vocab=11, capture=ScoresOnly(model))))
    (f,) = [f for f in probe.findings if f.where == "encoder.layers.0.self_attn"]
    assert EXACT_ASYM <= f.evidence["asymmetry"] < f.evidence["threshold_asymmetry"]
    assert f.severity == "warning" and "q and k were not captured to confirm" in f.message
    assert f.message.startswith("Q and K may come from one projection")


def test_shared_projection_message_says_what_to_do():
    probe = HeadCollapse()
    probe.setup(RunContext(subject=tap_subject(HandModel(shared=True))))
    f = next(f for f in probe.findings if f.where == "encoder.layers.0.self_attn")
    assert "one module computes both" not in f.message
    assert "encoder.layers.0.self_attn.proj_q computes q, k and v: give each its own nn.Linear" in f.message
    assert "q equals k equals v (relative difference 0 < 1e-06)" in f.message


# -- uniform heads are alike because they attend to nothing, not because of a shared draw (issue 19)
def cross_model(kind):
    """HandModel whose cross-attention is near-uniform (W_Q 100x too small: an unused
    cross-attention) or has every head copied from head 0 (W_Q, W_K, W_V rows)."""
    torch.manual_seed(0)
    model = HandModel(shared=False)
    attn = model.decoder.layers[0].cross_attn
    with torch.no_grad():
        if kind == "uniform":
            attn.proj_q.weight.mul_(0.01)
            attn.proj_q.bias.mul_(0.01)
        else:
            for lin in (attn.proj_q, attn.proj_k, attn.proj_v):
                w = lin.weight.view(attn.h, attn.dk, -1)
                w[1:] = w[:1].clone()
                b = lin.bias.view(attn.h, attn.dk)
                b[1:] = b[:1].clone()
    return model


@pytest.mark.parametrize("kind", ["uniform", "copies"])
def test_uniform_heads_get_no_duplicate_verdict(kind):
    model = cross_model(kind)
    probe = HeadCollapse()
    probe.setup(RunContext(subject=Subject(model, lambda m, s, t, pad: m(s, t), src_vocab=11,
                                           tgt_vocab=11, capture=ScoresOnly(model))))
    found = {f.where: f for f in alarms(probe.findings)}
    cov = probe.coverage["decoder.layers.0.cross_attn"]
    if kind == "uniform":
        assert found == {}
        assert cov["status"] == "no verdict" and "uniform" in cov["reason"]
        assert "0,1,2,3" in cov["reason"]
    else:
        f = found["decoder.layers.0.cross_attn"]
        assert f.severity == "error" and f.evidence["heads"] == [0, 1, 2, 3]
        assert min(f.evidence["uniform_js_bits"]) >= f.evidence["threshold_uniform_js_bits"]
        assert cov["status"] == "checked"


# -- one projection for q, k and v: every role named, every attention that uses it (issue 19) --
class CoreAttn(nn.Module):
    """The module that holds the softmax (and the taps); the projections sit in its parent."""

    def __init__(self, dk):
        super().__init__()
        self.dk = dk
        for name in ("q", "k", "v", "scores", "masked_scores", "probs"):
            setattr(self, f"hook_{name}", HookPoint())

    def forward(self, q, k, v, keep):
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        s = self.hook_scores(q @ k.transpose(-1, -2) / math.sqrt(self.dk))   # [B, h, T, S]
        p = self.hook_probs(self.hook_masked_scores(s.masked_fill(~keep, -1e9)).softmax(-1))
        return p @ v                                                         # [B, h, T, dk]


class WrapperAttention(nn.Module):
    """`style="seq_first"`: w_qs/w_ks/w_vs on [T, B, d] beside a `core_attn` (shared: w_ks and
    w_vs are w_qs); `style="fused"`: one qkv Linear (shared: q = k = v = its first third)."""

    def __init__(self, d, h, shared, style):
        super().__init__()
        self.h, self.dk, self.shared, self.style = h, d // h, shared, style
        if style == "fused":
            self.qkv = nn.Linear(d, 3 * d)
        else:
            self.w_qs = nn.Linear(d, d, bias=False)
            self.w_ks = self.w_qs if shared else nn.Linear(d, d, bias=False)
            self.w_vs = self.w_qs if shared else nn.Linear(d, d, bias=False)
        self.core_attn = CoreAttn(d // h)
        self.fc = nn.Linear(d, d)

    def forward(self, xq, xkv, keep):
        B, T, d = xq.shape
        if self.style == "fused":
            if xq is not xkv:
                raise ValueError("the fused style is self-attention only")
            q, k, v = self.qkv(xq).chunk(3, dim=-1)
            if self.shared:
                k = v = q
            q, k, v = (t.view(B, T, self.h, self.dk).transpose(1, 2) for t in (q, k, v))
        else:
            S = xkv.shape[1]
            xq, xkv = xq.transpose(0, 1), xkv.transpose(0, 1)                    # [T, B, d]
            q = self.w_qs(xq).view(T, B, self.h, self.dk).permute(1, 2, 0, 3)   # [B, h, T, dk]
            k = self.w_ks(xkv).view(S, B, self.h, self.dk).permute(1, 2, 0, 3)
            v = self.w_vs(xkv).view(S, B, self.h, self.dk).permute(1, 2, 0, 3)
        z = self.core_attn(q, k, v, keep)
        return self.fc(z.transpose(1, 2).reshape(B, T, d))


def wrapper_model(shared, style):
    torch.manual_seed(0)
    model = HandModel(shared=False)
    for layer in (model.encoder.layers[0], model.decoder.layers[0]):
        layer.self_attn = WrapperAttention(32, 4, shared, style)
        if layer.cross_attn is not None and style == "seq_first":
            layer.cross_attn = WrapperAttention(32, 4, shared, style)
    name_hook_points(model)
    return model


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("style", ["seq_first", "fused"])
def test_one_projection_names_every_role_in_every_attention_that_uses_it(style, shared):
    probe = HeadCollapse()
    probe.setup(RunContext(subject=tap_subject(wrapper_model(shared, style))))
    found = {f.where: f for f in alarms(probe.findings)}
    if not shared:
        assert found == {} and probe.checked
        return
    sites = {"encoder.layers.0.self_attn.core_attn", "decoder.layers.0.self_attn.core_attn"}
    if style == "seq_first":     # the cross-attention's own shared w_qs is found from the module
        sites.add("decoder.layers.0.cross_attn.core_attn")
    assert set(found) == sites
    for where, f in found.items():
        assert f.severity == "error" and f.message.startswith("Q, K and V come from one projection")
        proj = where.removesuffix(".core_attn") + (".w_qs" if style == "seq_first" else ".qkv")
        label = proj if style == "seq_first" else f"{proj} (part 1 of 3 of its output)"
        assert f.evidence["same_projection"] == [label]
        assert f"{label} computes q, k and v" in f.message
