"""A user's compact Pre-LN model: one embedding shared by source, target and the output layer
(tied), a fused QKV projection, F.scaled_dot_product_attention with a float attn_mask bias
(0 where allowed, torch.finfo(dtype).min where not), the paper's sinusoids and embeddings times
sqrt(d_model).

    tndebug triage ckpt.pt --model tied_fused.py:build --adapter tied_fused.py:forward

build(bug=...):
    no_scale           SDPA called with scale=1.0
    no_causal          the decoder's bias has no future part
    inverted_pad_mask  the bias hides the real tokens and shows the padding
    no_emb_scale       embeddings not multiplied by sqrt(d_model)
    shared_qkv         q = k = v = the first third of the fused projection
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

BUGS = ("no_scale", "no_causal", "inverted_pad_mask", "no_emb_scale", "shared_qkv")


class FusedSelfAttn(nn.Module):
    def __init__(self, d, heads, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, bias):                                               # x [B, T, d]
        B, T, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.bug == "shared_qkv":
            k = v = q
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))   # [B, h, T, dk]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                           scale=1.0 if self.bug == "no_scale" else None)
        return self.out(y.transpose(1, 2).reshape(B, T, d))


class FusedCrossAttn(nn.Module):
    def __init__(self, d, heads, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, memory, bias):
        B, T, d = x.shape
        S = memory.shape[1]
        q = self.q(x).view(B, T, self.heads, -1).transpose(1, 2)
        k, v = (t.view(B, S, self.heads, -1).transpose(1, 2) for t in self.kv(memory).chunk(2, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                           scale=1.0 if self.bug == "no_scale" else None)
        return self.out(y.transpose(1, 2).reshape(B, T, d))


class Layer(nn.Module):
    def __init__(self, d, heads, d_ff, cross, bug=None):
        super().__init__()
        self.ln_self, self.self_attn = nn.LayerNorm(d), FusedSelfAttn(d, heads, bug)
        self.ln_cross = nn.LayerNorm(d) if cross else None
        self.cross_attn = FusedCrossAttn(d, heads, bug) if cross else None
        self.ln_ff = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, d_ff), nn.GELU(), nn.Linear(d_ff, d))

    def forward(self, x, bias, memory=None, memory_bias=None):
        x = x + self.self_attn(self.ln_self(x), bias)
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.ln_cross(x), memory, memory_bias)
        return x + self.ff(self.ln_ff(x))


class TiedTransformer(nn.Module):
    def __init__(self, vocab=16, d_model=32, heads=4, layers=2, d_ff=64, bug=None):
        super().__init__()
        self.bug, self.d_model = bug, d_model
        self.embedding = nn.Embedding(vocab, d_model)
        nn.init.normal_(self.embedding.weight, std=d_model ** -0.5)
        pos = torch.arange(64)[:, None]
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(64, d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)
        self.enc = nn.ModuleList([Layer(d_model, heads, d_ff, False, bug) for _ in range(layers)])
        self.dec = nn.ModuleList([Layer(d_model, heads, d_ff, True, bug) for _ in range(layers)])
        self.enc_ln, self.dec_ln = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.generator = nn.Linear(d_model, vocab, bias=False)
        self.generator.weight = self.embedding.weight                        # tied

    def embed(self, ids):
        scale = 1.0 if self.bug == "no_emb_scale" else math.sqrt(self.d_model)
        return self.embedding(ids) * scale + self.pe[: ids.shape[1]]

    def key_bias(self, ids, pad):                                            # [B, 1, 1, L] float
        hide = (ids != pad) if self.bug == "inverted_pad_mask" else (ids == pad)
        bias = torch.zeros(hide.shape, dtype=self.pe.dtype, device=ids.device)
        return bias.masked_fill(hide, torch.finfo(bias.dtype).min)[:, None, None, :]

    def encode(self, src, pad=0):
        x, bias = self.embed(src), self.key_bias(src, pad)
        for layer in self.enc:
            x = layer(x, bias)
        return self.enc_ln(x)

    def forward(self, src, tgt, pad=0):
        memory, src_bias = self.encode(src, pad), self.key_bias(src, pad)
        T = tgt.shape[1]
        causal = torch.full((T, T), torch.finfo(self.pe.dtype).min, device=tgt.device).triu(1)
        bias = self.key_bias(tgt, pad)
        if self.bug != "no_causal":
            bias = (bias + causal).clamp(min=torch.finfo(self.pe.dtype).min)   # [B, 1, T, T]
        x = self.embed(tgt)
        for layer in self.dec:
            x = layer(x, bias, memory, src_bias)
        return self.generator(self.dec_ln(x))                                 # [B, T, V]


def build(**kw):
    return TiedTransformer(**kw)


def forward(model, src, tgt, pad_id):
    return model(src, tgt, pad_id)


def encode(model, src, pad_id):
    return model.encode(src, pad_id)
