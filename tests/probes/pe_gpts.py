"""Small decoder-only models in the styles users write positions: a learned table, a sinusoidal
buffer, rotary (q and k rotated in attention), ALiBi (a distance bias on the scores) and none
(NoPE, by design). `bug="not_applied"` keeps the mechanism declared and never applies it: the
table is looked up and dropped (`x = tok`), the rotation is computed and the unrotated q, k
used, the ALiBi bias built and not added."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

V, T_MAX = 24, 32
STYLES = ("learned", "sinusoidal", "rotary", "alibi", "none")


def rotate(x, cos, sin):                                   # x [B, h, T, d], pairs (2i, 2i+1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d, h, style, bug):
        super().__init__()
        self.h, self.dk, self.style, self.bug = h, d // h, style, bug
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        if style == "rotary":
            inv = 1.0 / 10000 ** (torch.arange(0, self.dk, 2).float() / self.dk)
            self.register_buffer("inv_freq", inv)
        if style == "alibi":
            self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, h + 1) / h))

    def forward(self, x):                                  # [B, T, d]
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dk).permute(2, 0, 3, 1, 4)  # [B, h, T, dk]
        if self.style == "rotary":
            ang = torch.arange(T, device=x.device)[:, None].float() * self.inv_freq  # [T, dk/2]
            qr, kr = rotate(q, ang.cos(), ang.sin()), rotate(k, ang.cos(), ang.sin())
            if self.bug != "not_applied":
                q, k = qr, kr
        att = q @ k.transpose(-2, -1) / math.sqrt(self.dk)                          # [B, h, T, T]
        if self.style == "alibi":
            pos = torch.arange(T, device=x.device)
            bias = -(pos[:, None] - pos[None, :]).clamp(min=0).float() * self.slopes[:, None, None]
            if self.bug != "not_applied":
                att = att + bias
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    def __init__(self, d, h, style, bug):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, h, style, bug)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PosGPT(nn.Module):
    def __init__(self, style="learned", bug=None, d=32, h=4, layers=2):
        super().__init__()
        self.style, self.bug = style, bug
        self.tok = nn.Embedding(V, d)
        if style == "learned":
            self.pos = nn.Embedding(T_MAX, d)
        if style == "sinusoidal":
            p = torch.arange(T_MAX)[:, None].float()
            div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
            pe = torch.zeros(T_MAX, d)
            pe[:, 0::2], pe[:, 1::2] = torch.sin(p * div), torch.cos(p * div)
            self.register_buffer("pe", pe)
        self.blocks = nn.ModuleList(Block(d, h, style, bug) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, V, bias=False)

    def forward(self, idx):                                # [B, T] -> [B, T, V]
        T = idx.shape[1]
        x = self.tok(idx)
        if self.style == "learned":
            p = self.pos(torch.arange(T, device=idx.device))
            x = x if self.bug == "not_applied" else x + p
        if self.style == "sinusoidal" and self.bug != "not_applied":
            x = x + self.pe[:T]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def forward(model, ids, pad_id):
    return model(ids)


def train(model, steps=150, seed=0, lr=3e-3):
    """Next-token training on a language where position matters: each row counts up from a
    random start (mod V-2, ids >= 2), with a reset every 5 tokens."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        start = torch.randint(2, V, (16, 1), generator=g)
        col = torch.arange(16)[None, :]
        ids = 2 + (start - 2 + col % 5) % (V - 2)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model
