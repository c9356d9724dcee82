"""Rotary positions (tndebug/model/rotary.py, `ModelConfig(pos="rotary")`): a rotation by
position whose q.k depends on the distance only; q and k rotated in attention (the taps show
them rotated), nothing added at the embedding; the fused path, the explicit path and the KV
cache agree; and the config keeps rotary to the decoder-only model."""
from __future__ import annotations

import math

import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.model.rotary import Rotary

TOL = dict(atol=1e-5, rtol=1e-5)


def build(*faults, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(arch="decoder", dropout=0.0, pos="rotary", **kw).with_faults(*faults)
    return make_model(cfg).eval()


def ids(B=4, T=9, seed=1, left_pads=(0, 1, 2, 0)):
    """BOS-led content rows, row b with left_pads[b] pads before it (same width).  # [B, T]"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, 11, (B, T), generator=g)
    x[:, 0] = 1
    for b, k in enumerate(left_pads[:B]):
        x[b] = torch.cat([torch.zeros(k, dtype=x.dtype), x[b, :T - k]])
    return x


def observe(model, suffixes) -> tuple[dict, list]:
    """Record the named taps (suffix match) on the next forwards; returns (store, handles)."""
    got, handles = {}, []
    for n, p in model.hook_points.items():
        if n.endswith(tuple(suffixes)):
            handles.append(p.register_forward_hook(lambda m, i, o, n=n: got.__setitem__(n, o)))
    return got, handles


# -- the rotation itself ------------------------------------------------------------------------
def test_shifting_every_position_leaves_q_dot_k_unchanged():
    rope = Rotary(16)
    q, k = torch.randn(2, 3, 10, 16), torch.randn(2, 3, 10, 16)        # [B, h, T, d_k]
    pos = torch.arange(10).expand(2, 10)
    scores = rope(q, pos) @ rope(k, pos).transpose(-2, -1)              # [B, h, T, T]
    for c in (1, 7, 250):
        moved = rope(q, pos + c) @ rope(k, pos + c).transpose(-2, -1)
        assert torch.allclose(scores, moved, atol=1e-4, rtol=1e-4), c
    # ... and the positions do reach the scores: unrotated they differ
    assert (scores - q @ k.transpose(-2, -1)).abs().max() > 1e-2


def test_the_rotation_is_roformers_on_the_half_pairing():
    """Feature pair (i, i + d/2) is rotated by pos * base^(-2i/d): RoFormer eq. 34 on that pairing."""
    d, rope = 8, Rotary(8)
    x, pos = torch.randn(1, 1, 5, d), torch.arange(5)[None]
    got = rope(x, pos)
    for t in range(5):
        for i in range(d // 2):
            a = t * 10000.0 ** (-2 * i / d)
            x1, x2 = float(x[0, 0, t, i]), float(x[0, 0, t, i + d // 2])
            assert math.isclose(float(got[0, 0, t, i]), x1 * math.cos(a) - x2 * math.sin(a), abs_tol=1e-5)
            assert math.isclose(float(got[0, 0, t, i + d // 2]), x2 * math.cos(a) + x1 * math.sin(a),
                                abs_tol=1e-5)
    assert torch.allclose(got.norm(dim=-1), x.norm(dim=-1), **TOL)      # a rotation


# -- in the model ---------------------------------------------------------------------------------
@torch.no_grad()
def test_the_embedding_adds_nothing_and_the_taps_show_rotated_q_and_k():
    m = build()
    x = ids(left_pads=(0, 0, 0, 0))
    got, handles = observe(m, ["tgt_embed.hook_out", "tgt_embed.hook_tok", "hook_pe",
                               "layers.0.self_attn.hook_q", "layers.0.self_attn.hook_k",
                               "layers.0.self_attn.hook_scores"])
    try:
        m(x)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(got["tgt_embed.hook_out"], got["tgt_embed.hook_tok"])
    assert "tgt_embed.hook_pe" not in got
    a = "decoder.layers.0.self_attn."
    attn = m.decoder.layers[0].self_attn
    h0 = m.decoder.layers[0].sublayer[0].norm(got["tgt_embed.hook_out"])    # pre-LN input
    q = attn.split_heads(attn.w_q(h0))
    pos = torch.arange(x.shape[1])[None]
    assert torch.allclose(got[a + "hook_q"], attn.rope(q, pos), **TOL)     # rotated, not raw
    assert (got[a + "hook_q"] - q).abs().max() > 1e-3
    assert torch.allclose(got[a + "hook_scores"],
                          got[a + "hook_q"] @ got[a + "hook_k"].transpose(-2, -1) * attn.scale, **TOL)


@pytest.mark.parametrize("norm", ("pre", "post"))
@pytest.mark.parametrize("norm_kind", ("layernorm", "rmsnorm"))
def test_fused_path_equals_explicit_forward_and_gradients(norm, norm_kind):
    m = build(norm=norm, norm_kind=norm_kind).train()      # dropout 0: train mode is deterministic
    x = ids()
    fused = m(x)
    fused.square().sum().backward()
    g_fused = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    _, handles = observe(m, ["hook_scores"])                 # observed: the explicit path
    try:
        explicit = m(x)
        explicit.square().sum().backward()
    finally:
        for h in handles:
            h.remove()
    assert torch.allclose(fused, explicit, **TOL)
    for a, p in zip(g_fused, m.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_left_pads_and_the_kv_cache_leave_the_logits_exact():
    m = build()
    x = ids(left_pads=(0, 0, 0, 0))
    lp = torch.cat([torch.zeros(4, 3, dtype=x.dtype), x], 1)                # 3 pads before each row
    assert torch.allclose(m(x), m(lp)[:, 3:], **TOL)
    ragged = ids()
    for split in (1, 4):
        real = (ragged != 0)[:, split:]                  # a pad query's row is no one's logits
        got, want = m.incremental(ragged, split), m(ragged)[:, split:]
        assert torch.allclose(got[real], want[real], **TOL)


@torch.no_grad()
def test_positions_reach_the_logits():
    """Rotary is a positional encoding: without it (rope removed) the same model differs."""
    m, x = build(), ids()
    ref = m(x)
    for layer in m.decoder.layers:
        layer.self_attn.rope = None
    assert (ref - m(x)).abs().max() > 1e-3


# -- the config ------------------------------------------------------------------------------------
def test_the_config_keeps_rotary_to_the_decoder_and_its_faults_to_rotary():
    with pytest.raises(ValueError, match="pos='rotary' is built for arch='decoder' only"):
        ModelConfig.tiny(pos="rotary")
    with pytest.raises(ValueError, match="needs pos='rotary'"):
        ModelConfig.tiny(arch="decoder").with_faults("rotary_q_only")
    with pytest.raises(ValueError, match="sinusoidal table"):
        ModelConfig.tiny(arch="decoder", pos="rotary").with_faults("no_pos_encoding")
    sd = make_model(ModelConfig.tiny(arch="decoder")).state_dict()
    make_model(ModelConfig.tiny(arch="decoder", pos="rotary")).load_state_dict(sd)   # no new weights
