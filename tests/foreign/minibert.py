"""A BERT-style encoder-only model written the way from-scratch tutorials write one: token and
learned position embeddings, an embedding LayerNorm, Post-LN blocks (attention, then a GELU
feed-forward), a padding mask built from the ids inside `forward`, and an MLM head over every
position. `forward(ids) -> logits [B, T, V]`: one input, as a GPT's, so tndebug tells the two
apart by the class name (a hint) or `--arch encoder`.

    tndebug triage ckpt.pt --model minibert.py:build            # read as encoder-only (MiniBert)
    tndebug triage ckpt.pt --model minibert.py:build_net --arch encoder   # the same, named Net

build(variant=..., bug=...):
    variant   manual (matmul, masked_fill) | sdpa (F.scaled_dot_product_attention, bool mask)
    causal     a causal (tril) mask in the encoder: a decoder's mask copied in
    triu       a one-sided mask the other way (each position sees only itself and later ones)
    pad_leak   the padding mask built but never applied: real tokens attend to pads
    no_scale   scores not divided by sqrt(head size) (sdpa: scale=1.0)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

BUGS = ("causal", "triu", "pad_leak", "no_scale")
VARIANTS = ("manual", "sdpa")
MASK_ID = 11            # copy's ids are 0 pad, 1 BOS, 2 EOS, 3..10 content; 11 is [MASK]


class SelfAttention(nn.Module):
    def __init__(self, d: int, h: int, variant: str, bug: str | None):
        super().__init__()
        self.h, self.variant, self.bug = h, variant, bug
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x, keep):                                  # x [B, T, d], keep [B, T]
        B, T, d = x.shape
        q, k, v = (lin(x).view(B, T, self.h, d // self.h).transpose(1, 2)
                   for lin in (self.query, self.key, self.value))  # [B, h, T, d_k]
        allowed = keep[:, None, None, :]                          # [B, 1, 1, T]
        if self.bug == "pad_leak":
            allowed = torch.ones_like(allowed)
        if self.bug in ("causal", "triu"):
            tri = torch.ones(T, T, dtype=torch.bool, device=x.device)
            allowed = allowed & (tri.tril() if self.bug == "causal" else tri.triu())
        if self.variant == "sdpa":
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                               scale=1.0 if self.bug == "no_scale" else None)
        else:
            scores = q @ k.transpose(-2, -1)                      # [B, h, T, T]
            if self.bug != "no_scale":
                scores = scores / math.sqrt(d // self.h)
            z = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        return self.out(z.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    def __init__(self, d: int, h: int, variant: str, bug: str | None):
        super().__init__()
        self.attention = SelfAttention(d, h, variant, bug)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.intermediate, self.output = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, keep):
        x = self.ln1(x + self.attention(x, keep))
        return self.ln2(x + self.output(F.gelu(self.intermediate(x))))


class MiniBert(nn.Module):
    def __init__(self, vocab_size: int = 12, d_model: int = 32, n_heads: int = 2, n_layers: int = 2,
                 max_len: int = 32, pad_id: int = 0, variant: str = "manual", bug: str | None = None):
        super().__init__()
        assert variant in VARIANTS and (bug is None or bug in BUGS), (variant, bug)
        self.pad_id = pad_id
        self.tok = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.pos = nn.Embedding(max_len, d_model)
        self.ln = nn.LayerNorm(d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads, variant, bug) for _ in range(n_layers))
        self.mlm = nn.Linear(d_model, vocab_size)

    def forward(self, ids):                                       # ids [B, T]
        keep = ids != self.pad_id                                 # [B, T]
        x = self.ln(self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device)))
        for layer in self.layers:
            x = layer(x, keep)
        return self.mlm(x)                                        # [B, T, V]


class Net(MiniBert):
    """The same model under a name that says nothing of its shape."""


def build(**kw) -> MiniBert:
    return MiniBert(**kw)


def build_net(**kw) -> Net:
    return Net(**kw)
