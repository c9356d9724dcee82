"""A user's Post-LN Transformer on torch.bmm over [B*h, L, d_k], whose mask fill value and
way of masking are constructor arguments: `fill` in -1e4, -1e9, "-inf", "finfo"
(torch.finfo(dtype).min), applied by masked_fill or by adding a float mask. Sinusoids computed
on the fly, embeddings times sqrt(d_model).

    tndebug triage ckpt.pt --model mask_fills.py:build --adapter mask_fills.py:forward \
        --config '{"fill": "-inf", "masking": "additive"}'

build(bug=...):
    no_scale           scores not multiplied by d_k ** -0.5
    no_causal          the decoder's self-attention gets the padding mask only
    inverted_pad_mask  the key mask hides the real tokens
    no_emb_scale       embeddings not multiplied by sqrt(d_model)
    shared_qkv         one Linear serves as W_Q, W_K and W_V
"""
from __future__ import annotations

import math

import torch
from torch import nn

BUGS = ("no_scale", "no_causal", "inverted_pad_mask", "no_emb_scale", "shared_qkv")
FILLS = ("-1e4", "-1e9", "-inf", "finfo")
MASKINGS = ("masked_fill", "additive")


def fill_value(fill: str, dtype) -> float:
    return torch.finfo(dtype).min if fill == "finfo" else float(fill)


class BmmAttention(nn.Module):
    def __init__(self, d, heads, fill, masking, bug=None):
        super().__init__()
        self.heads, self.d_k, self.fill, self.masking, self.bug = heads, d // heads, fill, masking, bug
        self.W_Q = nn.Linear(d, d)
        self.W_K = self.W_Q if bug == "shared_qkv" else nn.Linear(d, d)
        self.W_V = self.W_Q if bug == "shared_qkv" else nn.Linear(d, d)
        self.W_O = nn.Linear(d, d)

    def forward(self, x, kv, hide):                                           # hide [B, T|1, S] True = hide
        B, T, d = x.shape
        S = kv.shape[1]
        fold = lambda t, L: t.view(B, L, self.heads, self.d_k).transpose(1, 2).reshape(B * self.heads, L, self.d_k)
        q, k, v = fold(self.W_Q(x), T), fold(self.W_K(kv), S), fold(self.W_V(kv), S)   # [B*h, L, dk]
        scores = torch.bmm(q, k.transpose(1, 2))                              # [B*h, T, S]
        if self.bug != "no_scale":
            scores = scores * self.d_k ** -0.5
        hide = hide.repeat_interleave(self.heads, dim=0)                      # [B*h, T|1, S]
        value = fill_value(self.fill, scores.dtype)
        if self.masking == "masked_fill":
            scores = scores.masked_fill(hide, value)
        else:
            scores = scores + torch.zeros(hide.shape, dtype=scores.dtype, device=x.device).masked_fill(hide, value)
        p = torch.softmax(scores, dim=-1)
        out = torch.bmm(p, v).view(B, self.heads, T, self.d_k).transpose(1, 2).reshape(B, T, d)
        return self.W_O(out)


class EncoderLayer(nn.Module):
    def __init__(self, d, heads, d_ff, **kw):
        super().__init__()
        self.self_attn = BmmAttention(d, heads, **kw)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, d_ff), nn.ReLU(), nn.Linear(d_ff, d))

    def forward(self, x, hide):
        x = self.norm1(x + self.self_attn(x, x, hide))
        return self.norm2(x + self.ff(x))


class DecoderLayer(nn.Module):
    def __init__(self, d, heads, d_ff, **kw):
        super().__init__()
        self.self_attn, self.src_attn = BmmAttention(d, heads, **kw), BmmAttention(d, heads, **kw)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, d_ff), nn.ReLU(), nn.Linear(d_ff, d))

    def forward(self, x, memory, self_hide, src_hide):
        x = self.norm1(x + self.self_attn(x, x, self_hide))
        x = self.norm2(x + self.src_attn(x, memory, src_hide))
        return self.norm3(x + self.ff(x))


class Seq2Seq(nn.Module):
    def __init__(self, vocab=16, d_model=32, heads=4, layers=2, d_ff=64, fill="-1e9",
                 masking="masked_fill", bug=None):
        super().__init__()
        if fill not in FILLS or masking not in MASKINGS:
            raise ValueError(f"fill in {FILLS}, masking in {MASKINGS}; got {fill!r}, {masking!r}")
        self.d_model, self.bug = d_model, bug
        kw = dict(fill=fill, masking=masking, bug=bug)
        self.src_embedding, self.tgt_embedding = nn.Embedding(vocab, d_model), nn.Embedding(vocab, d_model)
        self.encoder_layers = nn.ModuleList([EncoderLayer(d_model, heads, d_ff, **kw) for _ in range(layers)])
        self.decoder_layers = nn.ModuleList([DecoderLayer(d_model, heads, d_ff, **kw) for _ in range(layers)])
        self.out = nn.Linear(d_model, vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def embed(self, table, ids):
        L, d = ids.shape[1], self.d_model
        pos = torch.arange(L, device=ids.device, dtype=torch.float)[:, None]
        angle = pos / 10000 ** (torch.arange(0, d, 2, device=ids.device) / d)
        pe = torch.stack([angle.sin(), angle.cos()], dim=-1).view(L, d)       # sin, cos interleaved
        scale = 1.0 if self.bug == "no_emb_scale" else math.sqrt(d)
        return table(ids) * scale + pe

    def hide_keys(self, ids, pad):                                            # [B, 1, L]
        return ((ids != pad) if self.bug == "inverted_pad_mask" else (ids == pad))[:, None, :]

    def encode(self, src, pad=0):
        x, hide = self.embed(self.src_embedding, src), self.hide_keys(src, pad)
        for layer in self.encoder_layers:
            x = layer(x, hide)
        return x

    def forward(self, src, tgt, pad=0):
        memory = self.encode(src, pad)
        T = tgt.shape[1]
        self_hide = self.hide_keys(tgt, pad)
        if self.bug != "no_causal":
            self_hide = self_hide | torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)
        x = self.embed(self.tgt_embedding, tgt)
        for layer in self.decoder_layers:
            x = layer(x, memory, self_hide, self.hide_keys(src, pad))
        return self.out(x)                                                    # [B, T, V]


def build(**kw):
    return Seq2Seq(**kw)


def forward(model, src, tgt, pad_id):
    return model(src, tgt, pad_id)


def encode(model, src, pad_id):
    return model.encode(src, pad_id)
