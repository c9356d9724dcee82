"""A character-level encoder (bidirectional, no mask) with each attention head its own
nn.Module, concatenated; the sinusoidal table of "Attention Is All You Need" in a buffer, added
to the token embeddings scaled by sqrt(d_model); Pre-LN blocks."""
import math

import torch
import torch.nn.functional as F
from torch import nn


def sinusoids(max_len, d):
    pos = torch.arange(max_len).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
    pe = torch.zeros(max_len, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class Head(nn.Module):
    def __init__(self, d_model, head_size):
        super().__init__()
        self.key = nn.Linear(d_model, head_size, bias=False)
        self.query = nn.Linear(d_model, head_size, bias=False)
        self.value = nn.Linear(d_model, head_size, bias=False)

    def forward(self, x):                                               # [B, T, d]
        k, q, v = self.key(x), self.query(x), self.value(x)             # [B, T, hs]
        wei = q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1])          # [B, T, T]
        wei = F.softmax(wei, dim=-1)
        return wei @ v


class MultiHead(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.heads = nn.ModuleList(Head(d_model, d_model // n_heads) for _ in range(n_heads))
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class Layer(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.sa = MultiHead(d_model, n_heads)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.ReLU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        return x + self.ff(self.ln2(x))


class SinusoidalEncoder(nn.Module):
    def __init__(self, vocab_size, d_model=32, n_heads=4, n_layers=2, max_len=64):
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.register_buffer("pe", sinusoids(max_len, d_model))
        self.layers = nn.Sequential(*[Layer(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, ids):                                             # [B, T]
        x = self.embedding(ids) * math.sqrt(self.d_model)
        x = x + self.pe[:ids.shape[1]]
        return self.out(self.ln_f(self.layers(x)))                      # [B, T, V]


def build(vocab_size=96, **kw):
    return SinusoidalEncoder(vocab_size, **kw)


def forward(model, ids, pad_id):
    return model(ids)
