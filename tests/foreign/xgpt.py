"""lucidrains' x-transformers as a GPT (pip install x-transformers, the `xt` extra):
`TransformerWrapper(attn_layers=Decoder(...))`, configured by keyword flags the way its README
does. Nothing of the package is edited: the bugs are put into the built instance from outside,
the way a user's patch would (tests/foreign/xtransformers.py does the same for XTransformer).

    tndebug triage ckpt.pt --model xgpt.py:build --adapter xgpt.py:forward --config '{"variant": "rotary"}'

Variants (`build(variant=...)`):
    abs      learned absolute positions (x-transformers' default), LayerNorm, einsum attention
    rotary   rotary_pos_emb=True (the absolute table is then off)
    flash    attn_flash=True (F.scaled_dot_product_attention) with the absolute table

build(bug=...):
    no_scale    every attention's `attend.scale` = 1.0
    no_causal   every self-attention's `causal` (Attention and its Attend) off
    shared_qkv  one Linear serves as to_q, to_k and to_v in every attention

The tokens are tied to nothing (x-transformers' default head is its own Linear, `to_logits`).
"""
from __future__ import annotations

import torch
from torch import nn

from x_transformers import Decoder, TransformerWrapper
from x_transformers.x_transformers import Attention

VARIANTS = {"abs": {}, "rotary": {"rotary_pos_emb": True}, "flash": {"attn_flash": True}}
BUGS = ("no_scale", "no_causal", "shared_qkv")


def build(variant: str = "abs", bug: str | None = None, vocab: int = 11, dim: int = 32,
          depth: int = 2, heads: int = 4, max_seq_len: int = 64) -> TransformerWrapper:
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {', '.join(VARIANTS)}")
    model = TransformerWrapper(num_tokens=vocab, max_seq_len=max_seq_len, attn_layers=Decoder(
        dim=dim, depth=depth, heads=heads, attn_dim_head=dim // heads, ff_mult=2,
        **VARIANTS[variant]))
    if bug is not None:
        if bug not in BUGS:
            raise ValueError(f"no bug {bug!r}; one of {', '.join(BUGS)}")
        attns = [m for m in model.modules() if isinstance(m, Attention)]
        for attn in attns:
            if bug == "no_scale":
                attn.attend.scale = 1.0
            elif bug == "no_causal":
                attn.causal = attn.attend.causal = False
            elif bug == "shared_qkv":
                attn.to_k = attn.to_v = attn.to_q
    return model


def forward(model, ids, pad_id):
    """The logits of every position, as a user calls the wrapper: model(ids) [B, T, V] (no mask:
    x-transformers' README trains and samples without one)."""
    return model(ids)


def incremental(model, ids, pad_id, split):
    """The logits of positions split.. decoded one token at a time through x-transformers' own
    KV cache, as its AutoregressiveWrapper.generate does: the prefix once with
    return_intermediates=True, then each next token with cache=. [B, T - split, V]"""
    _, cache = model(ids[:, :split], return_intermediates=True)
    out = []
    for t in range(split, ids.shape[1]):
        logits, cache = model(ids[:, :t + 1], cache=cache, return_intermediates=True)
        out.append(logits[:, -1:])
    return torch.cat(out, 1)
