"""A character-level model with ALiBi (no position embeddings): per-head slopes times the
distance to each key, added to the scores before the causal mask and the softmax."""
import math

import torch
import torch.nn.functional as F
from torch import nn


def get_slopes(n_heads):
    start = 2 ** (-8 / n_heads)
    return torch.tensor([start ** (i + 1) for i in range(n_heads)])


class AlibiAttention(nn.Module):
    def __init__(self, d_model, n_heads, max_len):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        pos = torch.arange(max_len)
        distance = (pos[None, :] - pos[:, None]).clamp(max=0)           # -(i - j) for keys j <= i
        self.register_buffer("alibi", get_slopes(n_heads)[:, None, None] * distance, persistent=False)
        self.register_buffer("causal_mask", torch.ones(max_len, max_len).tril() == 0, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_head)
        att = att + self.alibi[:, :T, :T]
        att = att.masked_fill(self.causal_mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, max_len):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = AlibiAttention(d_model, n_heads, max_len)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class AlibiLM(nn.Module):
    def __init__(self, vocab_size, d_model=32, n_heads=4, n_layers=2, max_len=32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, max_len) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(vocab_size=96, **kw):
    return AlibiLM(vocab_size, **kw)


def forward(model, ids, pad_id):
    return model(ids)
