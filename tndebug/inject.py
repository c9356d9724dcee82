"""The notes' faults, put into the paper model from outside it.

    model = make_model(ModelConfig.tiny().with_faults("no_scale"))

tndebug/model/ is the healthy model and reads no fault switch. Each fault here takes the built
model and substitutes one attribute, method or module, the way the bug reads in a user's code
(a method that forgets the scale, a mask built with triu, a sublayer without its residual), so
the faulty step is the only difference. Methods are replaced on the instance (`_swap`); a fault
that changes a step of attention's explicit path turns off its fused path (`fusable`), which
would skip that step. Probes never read any of this: they see the model's behaviour.

Faults are applied in INJECT's order, whatever the config's; two faults on one method compose
(the later wraps or overrides the earlier) as the switches inside the model once did.
"""
from __future__ import annotations

import math
import types

import torch
from torch import nn

from tndebug.config import ModelConfig
from tndebug.model.attention import MultiHeadAttention
from tndebug.model.embedding import Embeddings, sinusoid_table
from tndebug.model.hooks import tap
from tndebug.model.layers import DecoderLayer, EncoderLayer, Stack, Sublayer
from tndebug.model.norm import RMSNorm
from tndebug.model.transformer import build

SHORT_PE = 8    # rows of the too-short PE table of `pos_max_len_small`


def make_model(cfg: ModelConfig | None = None, **kw) -> nn.Module:
    """The model a config describes (default: the `small` preset), with its faults in."""
    cfg = cfg or ModelConfig.small(**kw)
    return put_in(build(cfg), *cfg.faults)


def put_in(module: nn.Module, *faults: str) -> nn.Module:
    """`module` (a whole model, or one part: an attention, a stack) with `faults` in, in place.
    The mask faults need the whole model (its `masks`)."""
    for name, inject in INJECT.items():          # INJECT's order, whatever the caller's
        if name in faults:
            inject(module)
    if MASK_FAULTS & set(faults) and hasattr(module, "masks"):
        _faulty_masks(module, set(faults))
    return module


def _swap(obj: nn.Module, method: str, fn) -> None:
    """obj.method = fn(obj, previous method, *args): the instance's own, wrapping the old one."""
    previous = getattr(obj, method)
    setattr(obj, method, types.MethodType(lambda self, *a: fn(self, previous, *a), obj))


def _attentions(model):
    return [m for m in model.modules() if isinstance(m, MultiHeadAttention)]


def _each_attention(step):
    """A fault of every attention module; it changes the explicit path, so no fused one."""
    def inject(model):
        for attn in _attentions(model):
            attn.fusable = False
            step(attn)
    return inject


# -- attention ---------------------------------------------------------------------------------
def _no_scale(attn):
    attn.scale = 1.0                                           # scores = q @ k^T


def _scale_by_d_model(attn):
    attn.scale = 1.0 / math.sqrt(attn.h * attn.d_k)            # sqrt(d_model), not sqrt(d_k)


def _fill(value):
    def step(attn):
        _swap(attn, "fill_value", lambda self, prev, dtype: value)
    return step


def _mask_after_softmax(attn):
    """masked_fill after the softmax: pads stay in the denominator."""
    _swap(attn, "masked", lambda self, prev, scores, keep: scores)

    def normalised(self, prev, scores, keep):
        probs = prev(scores, keep)
        return probs if keep is None else probs.masked_fill(~keep, 0.0)
    _swap(attn, "normalised", normalised)


def _softmax_wrong_dim(attn):
    _swap(attn, "normalised", lambda self, prev, scores, keep: scores.softmax(dim=-2))


def _view_without_transpose(attn):
    """.view(B, h, T, d_k) with no transpose, and the matching wrong merge."""
    def split(self, prev, x):
        B, T, _ = x.shape
        return x.reshape(B, self.h, T, self.d_k)

    def merge(self, prev, z):
        B, _, T, _ = z.shape
        return z.reshape(B, T, self.h * self.d_k)
    _swap(attn, "split_heads", split)
    _swap(attn, "merge_heads", merge)


def _mask_inverted(attn):
    """masked_fill on the keep-mask itself: real keys hidden, pads seen."""
    _swap(attn, "explicit", lambda self, prev, q, k, v, keep:
          prev(q, k, v, None if keep is None else ~keep))


def _shared_qkv(model):
    for attn in _attentions(model):                            # one Linear for Q, K and V
        attn.w_k = attn.w_v = attn.w_q


# -- rotary positions (the attention's `positioned` step; both paths call it) --------------------
def _rotary_attentions(model):
    return [a for a in _attentions(model) if a.rope is not None]


def _rotary_q_only(model):
    """apply_rotary(q) alone: k keeps the projection's output."""
    def positioned(self, prev, q, k, v, pos):
        return prev(q, k, v, pos)[0], k, v
    for attn in _rotary_attentions(model):
        _swap(attn, "positioned", positioned)


def _rotary_on_v(model):
    """q, k and v all rotated, as `apply_rotary(q, k, v)` with one line too many."""
    def positioned(self, prev, q, k, v, pos):
        q, k, v = prev(q, k, v, pos)
        return q, k, (v if pos is None else self.rope(v, pos))
    for attn in _rotary_attentions(model):
        _swap(attn, "positioned", positioned)


def rotate_interleaved(rope, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The rotation with the pairs (2i, 2i + 1) (RoFormer's equations, GPT-J), the same angles
    as the model's (i, i + d_k/2) layout.  # [B, h, T, d_k]"""
    ang = rope.angles(pos).repeat_interleave(2, dim=-1)                   # [B, 1, T, d_k]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]                                   # [B, h, T, d_k/2]
    return x * cos + torch.stack((-x2, x1), dim=-1).flatten(-2) * sin


def _rotary_halves(model):
    """q rotated with rotate_half (pairs i, i + d_k/2), k with interleaved pairs (2i, 2i + 1):
    two helpers from two codebases, one for each."""
    def positioned(self, prev, q, k, v, pos):
        q, _, v = prev(q, k, v, pos)
        return q, (k if pos is None else rotate_interleaved(self.rope, k, pos)), v
    for attn in _rotary_attentions(model):
        _swap(attn, "positioned", positioned)


# -- masks (the model's `masks` method) --------------------------------------------------------
MASK_FAULTS = {"pad_mask_query_axis", "no_memory_mask", "causal_transposed", "no_causal_mask",
               "neg_inf_fill_all_masked", "positions_ignore_left_pad"}


def _faulty_masks(model, faults: set[str]) -> None:
    """The model's `masks`, written with the mask faults the config names."""
    pad = model.cfg.pad_id

    def causal(T, device):
        ones = torch.ones(T, T, dtype=torch.bool, device=device)
        return ones.triu() if "causal_transposed" in faults else ones.tril()

    def seq2seq(self, prev, src, tgt):
        src_keep, tgt_keep = src != pad, tgt != pad                        # [B, S], [B, T]
        enc = src_keep[:, None, None, :]                                   # [B, 1, 1, S]
        if "pad_mask_query_axis" in faults:
            enc = src_keep[:, None, :, None]                               # [B, 1, S, 1]
        memory = None if "no_memory_mask" in faults else src_keep[:, None, None, :]
        dec = tgt_keep[:, None, None, :]                                   # [B, 1, 1, T]
        if "no_causal_mask" not in faults:
            dec = dec & causal(tgt.shape[1], tgt.device)                   # [B, 1, T, T]
        if "neg_inf_fill_all_masked" in faults:   # a "square" padding mask hides pad queries too
            enc = enc & src_keep[:, None, :, None]
            dec = dec & tgt_keep[:, None, :, None]
        return enc, dec, memory

    def decoder(self, prev, ids):
        keep, lead = prev(ids)
        real = ids != pad                                                  # [B, T]
        keep = real[:, None, None, :]                                      # [B, 1, 1, T]
        if "pad_mask_query_axis" in faults:
            keep = real[:, None, :, None]                                  # [B, 1, T, 1]
        if "no_causal_mask" not in faults:
            keep = keep & causal(ids.shape[1], ids.device)                 # [B, 1, T, T]
        if "neg_inf_fill_all_masked" in faults:
            keep = keep & real[:, None, :, None]
        if "positions_ignore_left_pad" in faults:                          # counted from column 0
            lead = torch.zeros_like(lead)
        return keep, lead

    _swap(model, "masks", decoder if model.cfg.arch == "decoder" else seq2seq)
    if faults - {"positions_ignore_left_pad"}:
        for attn in _attentions(model):
            # as before faults lived outside the model: the faulted model never takes the fused
            # path, so its numbers are one path's whether or not a probe watches
            attn.fusable = False


# -- the decoder-only model's KV cache ---------------------------------------------------------
def _kv_cache_causal_top_left(model):
    """SDPA's is_causal=True on a query block shorter than its keys aligns tril(ones(L, S))
    top-left, so a one-token query sees only the first key."""
    def block_mask(self, prev, keep, a, b):
        return prev(keep, a, b) & torch.ones(b - a, b, dtype=torch.bool, device=keep.device).tril()
    _swap(model, "block_mask", block_mask)


def _kv_cache_position_off_by_one(model):
    def block_positions(self, prev, pos, a, b):
        p = prev(pos, a, b)
        return p + 1 if a > 0 else p                   # the new token one position late
    _swap(model, "block_positions", block_positions)


# -- embeddings --------------------------------------------------------------------------------
def _embeddings(model):
    return [m for m in model.modules() if isinstance(m, Embeddings)]


def _no_emb_scale(model):
    for e in _embeddings(model):
        e.scale = 1.0


def _no_pos_encoding(model):
    for e in _embeddings(model):                      # computed (and tapped), never added
        _swap(e, "add_positions", lambda self, prev, tok, pe: tok)


def _pos_max_len_small(model):
    """A PE table of SHORT_PE rows; later positions silently reuse its last row."""
    def positions(self, prev, T):
        idx = torch.arange(T, device=self.pe.device).clamp(max=self.pe.shape[0] - 1)
        return self.pe[:T] if T <= self.pe.shape[0] else self.pe[idx]
    for e in _embeddings(model):
        e.pe = sinusoid_table(SHORT_PE, e.pe.shape[1]).to(e.pe.device)
        _swap(e, "positions", positions)


# -- blocks ------------------------------------------------------------------------------------
def _residual_dropped(self, prev, x, f):
    """Sublayer.forward without its residual: x = f(x)."""
    y = self.dropout(f(self.norm(x) if self.pre else x))
    return tap(self.hook_resid, y if self.pre else self.norm(y))


def _no_residual(model):
    """x = f(x): the sublayer's output replaces the stream."""
    for m in model.modules():
        if isinstance(m, Sublayer):
            _swap(m, "forward", _residual_dropped)


def _no_attn_residual(model):
    """x = attn(x) in every layer's self-attention sublayer (sublayer 0); the others keep theirs."""
    for m in model.modules():
        if isinstance(m, (EncoderLayer, DecoderLayer)):
            _swap(m.sublayer[0], "forward", _residual_dropped)


def _pre_ln_no_final_norm(model):
    for m in model.modules():
        if isinstance(m, Stack):
            m.norm = None


def _tiny_ln_eps(model):
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, RMSNorm)):
            m.eps = 1e-12                              # rounds to 0 in float16


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


# -- initialisation ----------------------------------------------------------------------------
def copy_head_zero(attn: nn.Module) -> None:
    """Every head's slice of W_Q, W_K, W_V and W_O copies head 0 (a deepcopy of one head)."""
    h, d_k = attn.h, attn.d_k
    with torch.no_grad():
        for lin in {id(l): l for l in (attn.w_q, attn.w_k, attn.w_v)}.values():
            w, b = lin.weight.view(h, d_k, -1), lin.bias.view(h, d_k)
            w[1:] = w[0]
            b[1:] = b[0]
        wo = attn.w_o.weight.view(-1, h, d_k)   # [d_model, h, d_k]: column block per head
        wo[:, 1:] = wo[:, :1]


def _identical_head_init(model):
    for name, m in model.named_modules():
        if name.endswith("attn"):
            copy_head_zero(m)


def _dead_relu_init(model):
    for name, m in model.named_modules():
        if name.endswith("ffn"):
            nn.init.constant_(m.w_1.bias, -3.0)


# fault -> what it does to a built model; the mask faults are `_faulty_masks`, the training
# faults live in the trainer (tndebug/train)
INJECT = {
    "scale_by_d_model": _each_attention(_scale_by_d_model),
    "no_scale": _each_attention(_no_scale),               # after scale_by_d_model: it wins
    "mask_inverted": _each_attention(_mask_inverted),
    "softmax_wrong_dim": _each_attention(_softmax_wrong_dim),
    "mask_after_softmax": _each_attention(_mask_after_softmax),
    "view_without_transpose": _each_attention(_view_without_transpose),
    "shared_qkv": _shared_qkv,
    "identical_head_init": _identical_head_init,
    "no_pos_encoding": _no_pos_encoding,
    "no_emb_scale": _no_emb_scale,
    "pos_max_len_small": _pos_max_len_small,
    "no_residual": _no_residual,
    "no_attn_residual": _no_attn_residual,
    "pre_ln_no_final_norm": _pre_ln_no_final_norm,
    "tiny_ln_eps": _tiny_ln_eps,
    "fill_1e9_fp16": _each_attention(_fill(-1e9)),
    "neg_inf_fill_all_masked": _each_attention(_fill(float("-inf"))),   # after 1e9: it wins
    "dead_relu_init": _dead_relu_init,
    "kv_cache_causal_top_left": _kv_cache_causal_top_left,
    "kv_cache_position_off_by_one": _kv_cache_position_off_by_one,
    # the step runs on the fused path too: it stays (the same numbers whether or not one watches)
    "rotary_q_only": _rotary_q_only,
    "rotary_on_v": _rotary_on_v,
    "rotary_halves": _rotary_halves,
    "no_dropout": _no_dropout,
}
