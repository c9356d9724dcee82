"""Our Transformer computes what torch.nn.Transformer computes, and our two attention paths agree.

* stacks: with weights copied over, our encoder/decoder equal nn.Transformer's (post- and pre-LN,
  padding and causal masks, dropout 0, eval), on the fused and on the explicit attention path;
* attention: the explicit path equals F.scaled_dot_product_attention;
* the fused path (fused projection + SDPA, taken when no tap inside attention is observed)
  gives the explicit path's numbers, forward and gradients (spec: habit 2 of STYLE.md).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.model.attention import MultiHeadAttention

TOL = dict(atol=1e-5, rtol=1e-5)


# -- helpers ---------------------------------------------------------------------------------
def tokens(B=4, S=9, T=7, vocab=11, pad=0):
    """Right-padded src/tgt, BOS-led targets; row 0 unpadded, other rows padded differently."""
    src = torch.randint(2, vocab, (B, S))
    tgt = torch.randint(2, vocab, (B, T))
    tgt[:, 0] = 1
    for b in range(1, B):
        src[b, S - 2 * b:] = pad
        tgt[b, T - b:] = pad
    return src, tgt


def force_explicit(model: nn.Module) -> list:
    """Observe every hook_scores (a no-op hook) so attention takes the explicit path."""
    return [p.register_forward_hook(lambda *a: None)
            for n, p in model.hook_points.items() if n.endswith("hook_scores")]


def copy_attention(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    # nn.MultiheadAttention packs W_Q, W_K, W_V row-wise into in_proj_weight [3d, d].
    theirs.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight, ours.w_v.weight]))
    theirs.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias, ours.w_v.bias]))
    theirs.out_proj.load_state_dict(ours.w_o.state_dict())


def torch_twin(model) -> nn.Transformer:
    """nn.Transformer with our weights, its final norms removed where ours has none (post-LN)."""
    cfg = model.cfg
    with warnings.catch_warnings():   # "enable_nested_tensor is True, but ...": not used here
        warnings.simplefilter("ignore", UserWarning)
        twin = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.n_layers, cfg.d_ff, dropout=0.0,
                              batch_first=True, norm_first=cfg.norm == "pre", layer_norm_eps=cfg.ln_eps)
    with torch.no_grad():
        for ours, theirs in zip(model.encoder.layers, twin.encoder.layers):
            copy_attention(ours.self_attn, theirs.self_attn)
            theirs.linear1.load_state_dict(ours.ffn.w_1.state_dict())
            theirs.linear2.load_state_dict(ours.ffn.w_2.state_dict())
            for i, norm in enumerate((theirs.norm1, theirs.norm2)):
                norm.load_state_dict(ours.sublayer[i].norm.state_dict())
        for ours, theirs in zip(model.decoder.layers, twin.decoder.layers):
            copy_attention(ours.self_attn, theirs.self_attn)
            copy_attention(ours.cross_attn, theirs.multihead_attn)
            theirs.linear1.load_state_dict(ours.ffn.w_1.state_dict())
            theirs.linear2.load_state_dict(ours.ffn.w_2.state_dict())
            for i, norm in enumerate((theirs.norm1, theirs.norm2, theirs.norm3)):
                norm.load_state_dict(ours.sublayer[i].norm.state_dict())
        if cfg.norm == "pre":
            twin.encoder.norm.load_state_dict(model.encoder.norm.state_dict())
            twin.decoder.norm.load_state_dict(model.decoder.norm.state_dict())
    if cfg.norm == "post":
        # nn.Transformer always builds a final LayerNorm after each stack, even with
        # norm_first=False; the paper's post-LN stack (ours) ends with the last layer's own
        # norm, so compare against its stacks without that extra norm.
        twin.encoder.norm = None
        twin.decoder.norm = None
    return twin.eval()


# -- stacks against nn.Transformer -----------------------------------------------------------
@pytest.mark.parametrize("path", ["fused", "explicit"])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_stacks_equal_nn_transformer(norm, path):
    model = make_model(ModelConfig.tiny(norm=norm, dropout=0.0)).eval()
    twin = torch_twin(model)
    if path == "explicit":
        force_explicit(model)
    src, tgt = tokens()
    T = tgt.shape[1]
    x_src, x_tgt = model.src_embed(src), model.tgt_embed(tgt)               # [B, S|T, d]
    enc_keep, dec_keep, mem_keep = model.masks(src, tgt)

    ours_mem = model.encoder(x_src, enc_keep)                                # [B, S, d]
    ours_out = model.decoder(x_tgt, ours_mem, dec_keep, mem_keep)            # [B, T, d]
    # torch's masks say True = ignore; grad stays on so torch takes its plain (non-nested) path,
    # which keeps outputs at pad positions instead of zeroing them.
    src_pad, tgt_pad = src == 0, tgt == 0
    future = torch.ones(T, T, dtype=torch.bool).triu(1)                      # [T, T]
    their_mem = twin.encoder(x_src, src_key_padding_mask=src_pad)
    their_out = twin.decoder(x_tgt, their_mem, tgt_mask=future, tgt_key_padding_mask=tgt_pad,
                             memory_key_padding_mask=src_pad)

    assert src_pad.any() and tgt_pad.any()     # the masks are exercised
    torch.testing.assert_close(ours_mem, their_mem, **TOL)
    torch.testing.assert_close(ours_out, their_out, **TOL)


def test_post_ln_twin_needs_its_final_norm_removed():
    """The comparison above is not vacuous: nn.Transformer's extra final norm changes outputs."""
    model = make_model(ModelConfig.tiny(norm="post", dropout=0.0)).eval()
    twin = torch_twin(model)
    twin.encoder.norm = nn.LayerNorm(model.cfg.d_model)
    with torch.no_grad():
        twin.encoder.norm.weight.uniform_(0.5, 1.5)
    src, _ = tokens()
    x = model.src_embed(src)
    ours = model.encoder(x, model.masks(src, src[:, :1])[0])
    theirs = twin.encoder(x, src_key_padding_mask=src == 0)
    assert (ours - theirs).abs().max() > 1e-2


# -- attention paths -------------------------------------------------------------------------
def random_keep(B, T, S, *, full_rows=True):
    keep = torch.rand(B, 1, T, S) > 0.4                                      # [B, 1, T, S]
    if full_rows:
        keep[..., 0] = True          # at least one key per query
    return keep


@pytest.mark.parametrize("mask", ["none", "padding", "causal", "random"])
def test_explicit_path_equals_sdpa(mask):
    attn = MultiHeadAttention(ModelConfig.tiny(dropout=0.0)).eval()
    B, h, T, d_k = 3, attn.h, 6, attn.d_k
    q, k, v = (torch.randn(B, h, T, d_k) for _ in range(3))
    keep = {"none": None,
            "padding": torch.arange(T)[None, None, None, :] < torch.tensor([6, 4, 2])[:, None, None, None],
            "causal": torch.ones(T, T, dtype=torch.bool).tril()[None, None],
            "random": random_keep(B, T, T)}[mask]
    ours = attn.explicit(q, k, v, keep)                                      # [B, h, T, d_k]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(ours, ref, **TOL)


def fused_and_explicit(attn, x_q, x_kv, keep):
    """(out, grads) once on the fused path and once on the explicit path."""
    results = []
    for explicit in (False, True):
        attn.zero_grad(set_to_none=True)
        xq = x_q.detach().clone().requires_grad_()
        xkv = xq if x_kv is x_q else x_kv.detach().clone().requires_grad_()
        handle = attn.hook_scores.register_forward_hook(lambda *a: None) if explicit else None
        out = attn(xq, xkv, keep)                                            # [B, T, d]
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = {n: p.grad.clone() for n, p in attn.named_parameters()}
        grads["x_q"] = xq.grad.clone()
        if xkv is not xq:
            grads["x_kv"] = xkv.grad.clone()
        if handle:
            handle.remove()
        results.append((out.detach(), grads))
    return results


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_fused_path_equals_explicit_forward_and_gradients(kind, monkeypatch):
    attn = MultiHeadAttention(ModelConfig.tiny(dropout=0.0)).train()   # train: grads; p=0
    calls = {"fused": 0, "explicit": 0}
    fused, explicit = MultiHeadAttention.project_fused, MultiHeadAttention.explicit
    monkeypatch.setattr(MultiHeadAttention, "project_fused",
                        lambda self, *a: (calls.__setitem__("fused", calls["fused"] + 1), fused(self, *a))[1])
    monkeypatch.setattr(MultiHeadAttention, "explicit",
                        lambda self, *a: (calls.__setitem__("explicit", calls["explicit"] + 1), explicit(self, *a))[1])
    B, T, S, d = 3, 5, 7, attn.h * attn.d_k
    x_q = torch.randn(B, T, d)
    x_kv = x_q if kind == "self" else torch.randn(B, S, d)
    keep = random_keep(B, T, x_kv.shape[1])
    keep[1, :, 2] = False            # one query with no key at all: both paths average v
    (out_f, g_f), (out_e, g_e) = fused_and_explicit(attn, x_q, x_kv, keep)
    assert calls == {"fused": 1, "explicit": 1}
    torch.testing.assert_close(out_f, out_e, **TOL)
    assert g_f.keys() == g_e.keys()
    for name in g_f:
        torch.testing.assert_close(g_f[name], g_e[name], **TOL, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("empty_row", [False, True])
def test_fused_path_equals_explicit_for_whole_model(empty_row):
    model = make_model(ModelConfig.tiny(dropout=0.0)).train()
    src, tgt = tokens()
    if empty_row:                    # a sequence that is all pads: its queries keep no key
        src[-1], tgt[-1] = 0, 0
    runs = []
    for explicit in (False, True):
        model.zero_grad(set_to_none=True)
        handles = force_explicit(model) if explicit else []
        logits = model(src, tgt)                                             # [B, T, V]
        F.cross_entropy(logits.flatten(0, 1), tgt.roll(-1, 1).flatten(), ignore_index=0).backward()
        runs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        for h in handles:
            h.remove()
    (lf, gf), (le, ge) = runs
    torch.testing.assert_close(lf, le, **TOL)
    for name in gf:
        torch.testing.assert_close(gf[name], ge[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"grad {n}: {m}")


def test_fused_path_equals_explicit_in_eval_without_grad():
    """Inference may take a different SDPA kernel; the numbers still match."""
    model = make_model(ModelConfig.tiny()).eval()
    src, tgt = tokens()
    src[-1], tgt[-1] = 0, 0
    with torch.no_grad():
        fused = model(src, tgt)
        handles = force_explicit(model)
        explicit = model(src, tgt)
    for h in handles:
        h.remove()
    torch.testing.assert_close(fused, explicit, **TOL)
