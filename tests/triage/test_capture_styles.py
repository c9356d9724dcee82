"""The generic capture on the ways people write attention: scale folded into q, additive masks
with and without a position bias, SDPA with a float bias, `x @ W` projections, wrappers around
the attention, one module per head, gated FFNs. Each asserts the fitted scale (missing-scale's
fit) or the structure found, against the value the code applies."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tndebug.probes.missing_scale import folded_into_weights
from tndebug.probes.missing_scale_fit import fit_from_sums, fit_sums
from tndebug.capture.trace import Trace
from tndebug.capture import GenericCapture, masked_by_addition

D, H, V, PAD = 32, 4, 13, 0
DK = D // H


class Attn(nn.Module):
    """One attention written several ways. `style` picks how scale, mask and bias are applied;
    `scale` is the factor the code applies to q k^T (1/sqrt(d_k) when healthy)."""

    def __init__(self, style: str, scale: float, bias: bool = False) -> None:
        super().__init__()
        self.style, self.scale = style, scale
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        self.w_q = nn.Parameter(torch.randn(D, D) / math.sqrt(D))
        self.bias = nn.Parameter(torch.randn(1, H, 1, 1) * 2) if bias else None

    def split(self, x):                                        # [B, T, D] -> [B, h, T, d_k]
        return x.view(x.shape[0], x.shape[1], H, DK).transpose(1, 2)

    def forward(self, x, memory=None, keep=None):              # keep [B, 1, Tq|1, S] bool
        kv = x if memory is None else memory
        q_in = x @ self.w_q if self.style == "x_at_w" else self.q_proj(x)
        q, k, v = self.split(q_in), self.split(self.k_proj(kv)), self.split(self.v_proj(kv))
        if self.style == "sdpa_float":
            add = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
            if self.bias is not None:
                add = add + self.bias
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=self.scale)
        else:
            if self.style == "fold_q":
                s = (q * self.scale) @ k.transpose(-2, -1)
            elif self.style == "fold_div":
                s = (q / (1 / self.scale)) @ k.transpose(-2, -1)
            else:
                s = torch.matmul(q, k.transpose(-2, -1)) * self.scale
            if self.bias is not None:
                s = s + self.bias
            if self.style == "additive":
                s = s + torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(s.dtype).min)
            else:
                s = s.masked_fill(~keep, -1e9)
            z = F.softmax(s, dim=-1) @ v
        return self.o_proj(z.transpose(1, 2).reshape(x.shape))


class Wrapper(nn.Module):
    """A wrapper whose class name says Attention but that only calls one (T5's layers do)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.SelfAttention, self.norm = inner, nn.LayerNorm(D)

    def forward(self, x, memory=None, keep=None):
        return x + self.SelfAttention(self.norm(x), memory, keep), torch.randn(1, H, 3, 3)


Wrapper.__name__ = "LayerSelfAttention"


class Model(nn.Module):
    def __init__(self, style="plain", scale=1 / math.sqrt(DK), bias=False, wrap=False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        make = (lambda: Wrapper(Attn(style, scale, bias))) if wrap else (lambda: Attn(style, scale, bias))
        self.enc_attn, self.dec_attn, self.mixer = make(), make(), make()
        self.out = nn.Linear(D, V)

    def forward(self, src, tgt):
        ks = (src != PAD)[:, None, None, :]                          # [B, 1, 1, S]
        T = tgt.shape[1]
        kt = (tgt != PAD)[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril()
        first = lambda o: o[0] if isinstance(o, tuple) else o       # noqa: E731
        m = first(self.enc_attn(self.emb(src), None, ks))
        y = first(self.dec_attn(self.emb(tgt), None, kt))
        y = first(self.mixer(y, m, ks))                              # cross, by what k is fed
        return self.out(y)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (6, 9), generator=g)
    tgt = torch.randint(3, V, (6, 7), generator=g)
    src[0, 6:], tgt[0, 5:] = PAD, PAD
    return src, tgt


def traced(model):
    src, tgt = batch()
    trace = Trace(src=src, tgt=tgt)
    with torch.no_grad(), GenericCapture(model).recording(("all",), trace):
        model(src, tgt)
    return trace


def scale_x_sqrt_dk(rec) -> tuple[float, float]:
    sums, _ = fit_sums(rec)
    c, resid = fit_from_sums(*sums[:3].tolist())
    return c * math.sqrt(DK), resid


@pytest.mark.parametrize("style", ["plain", "fold_q", "fold_div", "additive", "sdpa_float", "x_at_w"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scaled", [True, False])
def test_the_fitted_scale_is_the_one_the_code_applies(style, bias, scaled):
    torch.manual_seed(0)
    scale = 1 / math.sqrt(DK) if scaled else 1.0
    trace = traced(Model(style, scale, bias).eval())
    assert set(trace.attention) == {"enc_attn", "dec_attn", "mixer"}
    for site, rec in trace.attention.items():
        assert rec.qk_source == "projection", site
        assert fit_sums(rec)[1] == "scores", site                # the softmax input, not ln P
        ratio, resid = scale_x_sqrt_dk(rec)
        assert resid < 1e-3, (site, resid)
        assert ratio == pytest.approx(scale * math.sqrt(DK), rel=1e-3), site


def test_kinds_come_from_what_the_key_projection_was_fed():
    trace = traced(Model().eval())
    kinds = {s: r.kind for s, r in trace.attention.items()}
    # "mixer" says nothing by its name; its keys are projected from the encoder output
    assert kinds == {"enc_attn": "enc_self", "dec_attn": "dec_self", "mixer": "cross"}


def test_an_additive_mask_is_told_from_a_bias():
    torch.manual_seed(0)
    trace = traced(Model("additive", bias=True).eval())
    rec = trace.attention["enc_attn"]
    assert rec.scores.shape == rec.masked_scores.shape == (6, H, 9, 9)
    assert fit_sums(rec)[1] == "scores"
    removed = rec.masked_scores != rec.scores                      # [B, h, T, S]
    src, _ = batch()
    assert torch.equal(removed[:, 0, 0], src == PAD)               # the pads, and only they
    assert masked_by_addition(torch.tensor([[0.0, -3.0, 2.5]]), (1, 3)) is None   # a bias
    assert masked_by_addition(torch.tensor([[0.0, -1e4, 1.0]]), (1, 3)).tolist() == [[False, True, False]]


def test_a_wrapper_around_an_attention_is_not_a_site():
    trace = traced(Model(wrap=True).eval())
    assert set(trace.attention) == {"enc_attn.SelfAttention", "dec_attn.SelfAttention", "mixer.SelfAttention"}


class Head(nn.Module):
    """One head per module, named neither Attention nor Attn (Karpathy's `Head`)."""

    def __init__(self) -> None:
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(D, DK, bias=False) for _ in range(3))

    def forward(self, x):
        w = self.query(x) @ self.key(x).transpose(-2, -1) * DK ** -0.5
        return F.softmax(w, dim=-1) @ self.value(x)


class HeadModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.heads, self.lm = nn.Embedding(V, D), nn.ModuleList(Head() for _ in range(H)), nn.Linear(D, V)

    def forward(self, src, tgt):
        x = self.emb(src)
        x = x + torch.cat([h(x) for h in self.heads], -1)
        return F.softmax(self.lm(x), dim=-1)                      # a softmax over the vocabulary


def test_discovery_finds_attention_by_what_it_does():
    model = HeadModel().eval()
    cap = GenericCapture(model)
    src, tgt = batch()
    assert cap.discover(lambda: model(src, tgt)) == {f"heads.{i}" for i in range(H)}   # not `lm`
    trace = Trace(src=src, tgt=tgt)
    with torch.no_grad(), cap.recording(("all",), trace):
        model(src, tgt)
    rec = trace.attention["heads.0"]
    assert rec.q.shape == (6, 1, 9, DK) and rec.probs.shape == (6, 1, 9, 9)
    assert scale_x_sqrt_dk(rec)[0] == pytest.approx(1.0, rel=1e-3)


class GatedFFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi_0, self.wi_1, self.wo = nn.Linear(D, 64), nn.Linear(D, 64), nn.Linear(64, D)

    def forward(self, x):
        return self.wo(F.gelu(self.wi_0(x)) * self.wi_1(x))


def test_the_ffn_is_found_from_its_shapes():
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.block = nn.ModuleList([nn.Module()])
    model.encoder.block[0].DenseReluDense = GatedFFN()
    model.lm_head = nn.Linear(D, V)
    assert GenericCapture(model).ffn_out == {"encoder.block.0.DenseReluDense.wo": "encoder.block.0.DenseReluDense"}


def test_weights_that_carry_the_scale_are_told_from_a_missing_scale():
    assert folded_into_weights(rms_q=0.25, rms_k=1.0, d_k=16)        # T5: W_Q sqrt(d_k) smaller
    assert not folded_into_weights(rms_q=0.9, rms_k=1.0, d_k=16)     # same size: the scale is missing
    assert not folded_into_weights(rms_q=0.5, rms_k=1.0, d_k=2)      # d_k too small to tell


def test_one_weight_for_q_and_k_is_told_from_fused_qkv():
    shared = Model().eval()
    for a in (shared.enc_attn, shared.dec_attn, shared.mixer):
        a.k_proj = a.q_proj                                     # the shared-projection bug
    assert all(r.shared_projection for r in traced(shared).attention.values())
    assert not any(r.shared_projection for r in traced(Model().eval()).attention.values())
