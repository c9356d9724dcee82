"""Every model fault of tndebug/faults.py changes behaviour measurably, and the healthy model
lacks that behaviour. One test per fault, named `test_<fault>`; training-loop faults live in
tests/train. Each test measures from outputs and tap points, the way a probe would.
"""
from __future__ import annotations

import math

import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.faults import FAULTS, TRAINING_FAULTS
from tndebug.model import PositionLimitError
from tndebug.inject import make_model, put_in
from tndebug.model.attention import MultiHeadAttention

MODEL_FAULTS = sorted(set(FAULTS) - TRAINING_FAULTS)
B, S, T = 4, 9, 7
LEAK = 1e-3      # a change this large is a leak; healthy changes are float noise (< 1e-5)


# -- helpers ---------------------------------------------------------------------------------
def build(*faults: str, **kw):
    torch.manual_seed(0)
    return make_model(ModelConfig.tiny(**{"dropout": 0.0, **kw}).with_faults(*faults)).eval()


def batch(pad_src=True, pad_tgt=False):
    """src [B, S] with rows 1.. right-padded (pad_src); tgt [B, T] BOS-led."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(2, 11, (B, S), generator=g)
    tgt = torch.randint(2, 11, (B, T), generator=g)
    tgt[:, 0] = 1
    for b in range(1, B):
        if pad_src:
            src[b, S - 2 * b:] = 0
        if pad_tgt:
            tgt[b, T - b:] = 0
    return src, tgt


@torch.no_grad()
def taps(model, names, src, tgt) -> dict[str, torch.Tensor]:
    """The outputs of the named tap points (suffix match) on one forward pass."""
    got = {}
    handles = [p.register_forward_hook(lambda m, i, o, n=n: got.__setitem__(n, o.clone()))
               for n, p in model.hook_points.items() if n.endswith(tuple(names))]
    try:
        got["logits"] = model(src, tgt)
    finally:
        for h in handles:
            h.remove()
    return got


@torch.no_grad()
def causal_leak(model) -> float:
    """How much earlier logits move when only the last target token changes."""
    src, tgt = batch(pad_src=False)
    other = tgt.clone()
    other[:, -1] = (tgt[:, -1] - 1) % 9 + 2
    return (model(src, tgt)[:, :-1] - model(src, other)[:, :-1]).abs().max().item()


@torch.no_grad()
def pad_content_leak(model) -> float:
    """How much logits move when the source pads' embeddings are replaced by noise."""
    src, tgt = batch()
    pad = (src == 0)[..., None]                                          # [B, S, 1]
    noise = torch.randn(B, S, model.cfg.d_model) * 3

    def scramble(module, inputs, out):
        return torch.where(pad, noise, out)

    clean = model(src, tgt)
    handle = model.src_embed.hook_out.register_forward_hook(scramble)
    try:
        noisy = model(src, tgt)
    finally:
        handle.remove()
    return (clean - noisy).abs().max().item()


@torch.no_grad()
def appended_pad_leak(model) -> float:
    """How much logits move when three more pads are appended to every source."""
    src, tgt = batch()
    longer = torch.cat([src, torch.zeros(B, 3, dtype=src.dtype)], dim=1)   # [B, S + 3]
    return (model(src, tgt) - model(longer, tgt)).abs().max().item()


def row_sum_error(model) -> float:
    """max |sum over keys of the attention weights - 1|, over every attention module."""
    src, tgt = batch()
    got = taps(model, ["hook_probs"], src, tgt)
    return max((p.sum(-1) - 1).abs().max().item() for n, p in got.items() if n != "logits")


def fitted_scale(model) -> float:
    """s in scores = s * q k^T, fitted from the taps of the first encoder attention."""
    got = taps(model, ["encoder.layers.0.self_attn.hook_q", "encoder.layers.0.self_attn.hook_k",
                       "encoder.layers.0.self_attn.hook_scores"], *batch())
    a = "encoder.layers.0.self_attn."
    qk = got[a + "hook_q"] @ got[a + "hook_k"].transpose(-2, -1)          # [B, h, S, S]
    return ((got[a + "hook_scores"] * qk).sum() / (qk * qk).sum()).item()


@torch.no_grad()
def permutation_error(model) -> float:
    """|encode(src)[perm] - encode(src[perm])|: 0 for a permutation-equivariant encoder."""
    src, _ = batch(pad_src=False)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(2))
    return (model.encode(src)[:, perm] - model.encode(src[:, perm])).abs().max().item()


# -- defaults --------------------------------------------------------------------------------
def test_faults_are_off_by_default_and_healthy_config_has_none():
    for cfg in (ModelConfig(), ModelConfig.tiny(), ModelConfig.small(), ModelConfig.base()):
        assert cfg.faults == ()
        assert not any(cfg.has(f) for f in FAULTS)
    assert build().cfg.faults == ()


def test_every_model_fault_has_a_test_here():
    missing = [f for f in MODEL_FAULTS if f"test_{f}" not in globals()]
    assert not missing, f"faults without a behaviour test: {missing}"


@pytest.mark.parametrize("fault", MODEL_FAULTS)
def test_every_model_fault_builds_and_runs(fault):
    norm = "pre" if "pre" in FAULTS[fault].norms else "post"
    rotary = {"pos": "rotary"} if FAULTS[fault].needs == "rotary" else {}
    if FAULTS[fault].arch == "decoder":
        logits = build(fault, norm=norm, arch="decoder", **rotary)(batch()[1])
    else:
        logits = build(fault, norm=norm)(*batch())
    assert logits.shape == (B, T, 11)


def test_a_fault_of_one_architecture_is_refused_on_the_other():
    with pytest.raises(ValueError, match="only in a decoder model"):
        ModelConfig.tiny().with_faults("positions_ignore_left_pad")
    with pytest.raises(ValueError, match="only in a seq2seq model"):
        ModelConfig.tiny(arch="decoder").with_faults("no_memory_mask")


# -- decoder-only --------------------------------------------------------------------------------
@torch.no_grad()
def left_pad_change(model) -> float:
    """How much the logits of real tokens move when two pads are put before every row."""
    _, ids = batch()
    lp = torch.cat([torch.zeros(B, 2, dtype=ids.dtype), ids], dim=1)         # [B, T + 2]
    return (model(ids) - model(lp)[:, 2:]).abs().max().item()


def test_positions_ignore_left_pad():
    assert left_pad_change(build(arch="decoder")) < 1e-5
    assert left_pad_change(build("positions_ignore_left_pad", arch="decoder")) > LEAK


# -- masks -----------------------------------------------------------------------------------
def test_no_causal_mask():
    assert causal_leak(build()) < 1e-5
    assert causal_leak(build("no_causal_mask")) > LEAK


def test_causal_transposed():
    assert causal_leak(build()) < 1e-5
    assert causal_leak(build("causal_transposed")) > LEAK


def test_pad_mask_query_axis():
    assert pad_content_leak(build()) < 1e-5 and appended_pad_leak(build()) < 1e-5
    faulty = build("pad_mask_query_axis")
    assert pad_content_leak(faulty) > LEAK
    assert appended_pad_leak(faulty) > LEAK


def test_mask_inverted():
    assert pad_content_leak(build()) < 1e-5 and appended_pad_leak(build()) < 1e-5
    faulty = build("mask_inverted")
    assert pad_content_leak(faulty) > LEAK
    assert appended_pad_leak(faulty) > LEAK


def test_no_memory_mask():
    assert pad_content_leak(build()) < 1e-5 and appended_pad_leak(build()) < 1e-5
    faulty = build("no_memory_mask")
    assert pad_content_leak(faulty) > LEAK
    assert appended_pad_leak(faulty) > LEAK
    # the leak is in cross-attention only: the encoder's real positions stay clean
    src, _ = batch()
    longer = torch.cat([src, torch.zeros(B, 3, dtype=src.dtype)], dim=1)
    with torch.no_grad():
        diff = faulty.encode(src) - faulty.encode(longer)[:, :S]
    assert diff[src != 0].abs().max() < 1e-5


def test_mask_after_softmax():
    assert row_sum_error(build()) < 1e-5 and pad_content_leak(build()) < 1e-5
    faulty = build("mask_after_softmax")
    assert row_sum_error(faulty) > 0.05
    assert pad_content_leak(faulty) > LEAK


def test_neg_inf_fill_all_masked():
    src, tgt = batch(pad_tgt=True)
    with torch.no_grad():
        assert torch.isfinite(build()(src, tgt)).all()
        assert torch.isnan(build("neg_inf_fill_all_masked")(src, tgt)).any()
        # without padding there is no fully masked row and no NaN
        assert torch.isfinite(build("neg_inf_fill_all_masked")(*batch(pad_src=False))).all()


# -- attention -------------------------------------------------------------------------------
def test_no_scale():
    d_k = ModelConfig.tiny().d_k
    assert fitted_scale(build()) == pytest.approx(1 / math.sqrt(d_k), rel=1e-4)
    assert fitted_scale(build("no_scale")) == pytest.approx(1.0, rel=1e-4)


def test_scale_by_d_model():
    assert fitted_scale(build("scale_by_d_model")) == pytest.approx(1 / math.sqrt(ModelConfig.tiny().d_model), rel=1e-4)
    # sqrt(n_heads) times too small
    assert fitted_scale(build()) / fitted_scale(build("scale_by_d_model")) == pytest.approx(2.0, rel=1e-4)


def test_softmax_wrong_dim():
    assert row_sum_error(build()) < 1e-5
    assert row_sum_error(build("softmax_wrong_dim")) > 0.05


def test_view_without_transpose():
    # Heads cut from memory without the transpose: head i's "position" t holds features of
    # another token, so an encoder without positions stops being permutation-equivariant,
    # and the key padding mask lands on the wrong slots. (The slot -> token map is monotone,
    # so the causal mask still hides the future: a causal-leak check would not see this.)
    assert permutation_error(build("no_pos_encoding")) < 1e-5 and appended_pad_leak(build()) < 1e-5
    assert permutation_error(build("no_pos_encoding", "view_without_transpose")) > LEAK
    assert appended_pad_leak(build("view_without_transpose")) > LEAK


def test_shared_qkv():
    def asymmetry(model):
        got = taps(model, ["self_attn.hook_scores"], *batch())
        return max((s - s.transpose(-2, -1)).abs().max().item() for n, s in got.items() if n != "logits")
    assert asymmetry(build()) > 0.1
    assert asymmetry(build("shared_qkv")) < 1e-5


def test_identical_head_init():
    def head_spread(model):
        got = taps(model, ["hook_probs"], *batch())
        return max((p - p[:, :1]).abs().max().item() for n, p in got.items() if n != "logits")
    assert head_spread(build()) > 0.05
    assert head_spread(build("identical_head_init")) < 1e-6


def test_fill_1e9_fp16():
    # float16 tops out at 65504: masked_fill with the literal -1e9 cannot be represented.
    cfg = ModelConfig.tiny(dropout=0.0)
    x = torch.randn(2, 5, cfg.d_model).half()
    keep = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]   # [2, 1, 1, 5]
    healthy = MultiHeadAttention(cfg).half().eval()
    healthy.hook_scores.register_forward_hook(lambda *a: None)     # the explicit path
    assert healthy.fill_value(torch.float16) == torch.finfo(torch.float16).min
    assert torch.isfinite(healthy(x, x, keep)).all()
    faulty = put_in(MultiHeadAttention(cfg), "fill_1e9_fp16").half().eval()
    with pytest.raises(RuntimeError, match="overflow"):
        faulty(x, x, keep)
    with torch.no_grad():                                           # float32 hides it
        assert torch.isfinite(build("fill_1e9_fp16")(*batch())).all()


# -- embeddings ------------------------------------------------------------------------------
def test_no_pos_encoding():
    assert permutation_error(build()) > LEAK
    assert permutation_error(build("no_pos_encoding")) < 1e-5


def test_no_emb_scale():
    def tok_to_pe(model):
        got = taps(model, ["src_embed.hook_tok", "src_embed.hook_pe"], *batch(pad_src=False))
        rms = lambda x: x.pow(2).mean().sqrt().item()   # noqa: E731
        return rms(got["src_embed.hook_tok"]) / rms(got["src_embed.hook_pe"])
    healthy, faulty = tok_to_pe(build()), tok_to_pe(build("no_emb_scale"))
    assert healthy > 1.0 > 0.5 > faulty                        # the PE drowns the tokens
    assert healthy / faulty == pytest.approx(math.sqrt(ModelConfig.tiny().d_model), rel=1e-4)


def test_pos_max_len_small():
    src, _ = batch(pad_src=False)
    tgt = torch.randint(2, 11, (B, 12))
    pe = lambda m: taps(m, ["tgt_embed.hook_pe"], src, tgt)["tgt_embed.hook_pe"][0]   # noqa: E731  [12, d]
    faulty, healthy = pe(build("pos_max_len_small")), pe(build())
    assert torch.equal(faulty[8:], faulty[7:8].expand(4, -1))        # positions 7.. share one row
    assert torch.cdist(healthy, healthy).add(torch.eye(12)).min() > 0.1   # every healthy row distinct


def test_healthy_model_raises_past_max_len():
    model = build(max_len=16)
    src, _ = batch(pad_src=False)
    model(src, torch.randint(2, 11, (B, 16)))                          # at the limit: fine
    with pytest.raises(PositionLimitError, match=r"sequence length 20 exceeds .*max_len=16.*ModelConfig.max_len"):
        model(src, torch.randint(2, 11, (B, 20)))
    with pytest.raises(ValueError):                                    # PositionLimitError is a ValueError
        model.encode(torch.randint(2, 11, (B, 17)))


# -- blocks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_no_residual(norm):
    def stream_parts(model):
        a = "encoder.layers.0."
        got = taps(model, ["src_embed.hook_out", a + "self_attn.hook_out", a + "sublayer.0.hook_resid"], *batch())
        x, f, out = got["src_embed.hook_out"], got[a + "self_attn.hook_out"], got[a + "sublayer.0.hook_resid"]
        norm_ = model.encoder.layers[0].sublayer[0].norm
        if norm == "post":
            return (out - norm_(x + f)).abs().max().item(), (out - norm_(f)).abs().max().item()
        return (out - (x + f)).abs().max().item(), (out - f).abs().max().item()
    with torch.no_grad():
        with_res, without = stream_parts(build(norm=norm))
        assert with_res < 1e-5 < 0.1 < without                     # healthy: out = x + f(...)
        with_res, without = stream_parts(build("no_residual", norm=norm))
        assert without < 1e-5 < 0.1 < with_res                     # faulted: the stream is replaced


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_no_attn_residual(norm):
    """The self-attention sublayer's output replaces the stream; the FFN keeps its residual."""
    def parts(model):
        a = "encoder.layers.0."
        names = ["src_embed.hook_out", a + "self_attn.hook_out", a + "sublayer.0.hook_resid",
                 a + "ffn.hook_out", a + "sublayer.1.hook_resid"]
        got = taps(model, names, *batch())
        x, f, h, g, out = (got[n] for n in names)
        sub = model.encoder.layers[0].sublayer
        if norm == "post":
            return (h - sub[0].norm(f)).abs().max().item(), (out - sub[1].norm(h + g)).abs().max().item()
        return (h - f).abs().max().item(), (out - (h + g)).abs().max().item()
    with torch.no_grad():
        attn, ffn = parts(build("no_attn_residual", norm=norm))
        assert attn < 1e-5 and ffn < 1e-5                          # h = attn(x); out = h + ffn(h)
        attn, _ = parts(build(norm=norm))
        assert attn > 0.1                                          # healthy: h = x + attn(x)


def test_pre_ln_no_final_norm():
    def off_norm(model):
        with torch.no_grad():
            e = model.encode(batch()[0])                                   # [B, S, d]
        return max(e.mean(-1).abs().max().item(), (e.std(-1, unbiased=False) - 1).abs().max().item())
    assert off_norm(build(norm="pre")) < 1e-3                          # LayerNorm at init: mean 0, std 1
    assert off_norm(build("pre_ln_no_final_norm", norm="pre")) > 0.1


def half_layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm with every step in float16, as a half-precision kernel computes it."""
    x, eps16 = x.half(), torch.tensor(eps, dtype=torch.float16)
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps16)


def test_tiny_ln_eps():
    constant_row = torch.full((1, 8), 2.0)              # variance 0: only eps keeps x / sqrt(var + eps) finite
    for model, finite in ((build(), True), (build("tiny_ln_eps"), False)):
        norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
        assert norms
        for m in norms:
            assert bool(torch.tensor(m.eps, dtype=torch.float16) != 0) is finite    # 1e-12 -> 0 in float16
            assert bool(torch.isfinite(half_layer_norm(constant_row, m.eps)).all()) is finite


def test_dead_relu_init():
    def active_share(model):
        got = taps(model, ["ffn.hook_hidden"], *batch(pad_src=False))
        fired = [(v > 0).flatten(0, 1) for n, v in got.items() if n != "logits"]   # [tokens, d_ff] each
        ever = torch.cat([f.any(0) for f in fired]).float().mean().item()           # units that ever fire
        return ever, torch.cat([f.flatten() for f in fired]).float().mean().item()
    ever, mean = active_share(build())
    assert ever > 0.9 and mean > 0.3
    ever, mean = active_share(build("dead_relu_init"))
    assert ever < 0.2 and mean < 0.01                   # most units never fire


def test_no_dropout():
    def run_twice(model):
        model.train()
        src, tgt = batch()
        with torch.no_grad():
            return (model(src, tgt) - model(src, tgt)).abs().max().item()
    healthy, faulty = build(dropout=0.1), build("no_dropout", dropout=0.1)
    assert run_twice(healthy) > LEAK                    # dropout makes two training passes differ
    assert run_twice(faulty) == 0.0
    assert all(m.p == 0.0 for m in faulty.modules() if isinstance(m, torch.nn.Dropout))


# -- the decoder-only KV cache ---------------------------------------------------------------------
@torch.no_grad()
def cache_gap(model, split=3) -> float:
    """max |logits through the KV cache - the full forward's| at positions split.."""
    _, ids = batch()
    return (model.incremental(ids, split) - model(ids)[:, split:]).abs().max().item()


def test_kv_cache_causal_top_left():
    assert cache_gap(build(arch="decoder")) < 1e-5
    m = build("kv_cache_causal_top_left", arch="decoder")
    assert cache_gap(m) > LEAK
    _, ids = batch()
    other = ids.clone()
    other[:, 1:-1] = (ids[:, 1:-1] - 1) % 9 + 2                      # every key but the first
    with torch.no_grad():                                             # the last step sees only key 0
        assert (m.incremental(ids, T - 1) - m.incremental(other, T - 1)).abs().max() < 1e-5
        assert torch.equal(m(ids), build(arch="decoder")(ids))        # the full forward is healthy


def test_kv_cache_position_off_by_one():
    m = build("kv_cache_position_off_by_one", arch="decoder")
    assert cache_gap(m) > LEAK
    _, ids = batch()
    with torch.no_grad():
        assert torch.equal(m(ids), build(arch="decoder")(ids))
        assert (m.incremental(ids, 0)[:, :1] - m(ids)[:, :1]).abs().max() < 1e-5   # the prefix is exact


# -- rotary positions (pos="rotary") ---------------------------------------------------------------
@torch.no_grad()
def shifted_attention(model, c=5) -> dict[str, float]:
    """The first self-attention on one input at positions 0.. and at c..: how much its scores
    (row differences would do; RoPE keeps them exactly), its values and its output move."""
    attn = model.decoder.layers[0].self_attn
    x = torch.randn(B, T, model.cfg.d_model, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(T).expand(B, T)
    got, handles = {}, []
    for name in ("scores", "v"):
        point = getattr(attn, f"hook_{name}")
        handles.append(point.register_forward_hook(
            lambda m, i, o, n=name: got.setdefault(n, []).append(o)))
    try:
        out = [attn(x, x, None, pos), attn(x, x, None, pos + c)]
    finally:
        for h in handles:
            h.remove()
    return {"scores": (got["scores"][0] - got["scores"][1]).abs().max().item(),
            "v": (got["v"][0] - got["v"][1]).abs().max().item(),
            "out": (out[0] - out[1]).abs().max().item()}


def rotary(*faults):
    return build(*faults, arch="decoder", pos="rotary")


def test_rotary_q_only():
    healthy = shifted_attention(rotary())
    assert max(healthy.values()) < 1e-5
    assert shifted_attention(rotary("rotary_q_only"))["scores"] > LEAK


def test_rotary_on_v():
    moved = shifted_attention(rotary("rotary_on_v"))
    assert moved["scores"] < 1e-5                     # q and k are rotated as they should be
    assert moved["v"] > LEAK and moved["out"] > LEAK


def test_rotary_halves():
    m = rotary("rotary_halves")
    assert shifted_attention(m)["scores"] > LEAK
    attn = m.decoder.layers[0].self_attn              # at position 0 no rotation: no difference
    x = torch.randn(1, 1, m.cfg.d_model)
    q, k, _ = attn.positioned(*(attn.split_heads(x),) * 3, torch.zeros(1, 1, dtype=torch.long))
    assert torch.equal(q, k)
