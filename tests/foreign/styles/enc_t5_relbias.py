"""A character-level encoder (bidirectional) with T5's relative position bias: distances put in
log-spaced buckets, one learned bias per bucket and head, computed by the first layer and
shared by every layer; RMSNorm before each sublayer. Unlike T5 it scales the scores by
1/sqrt(d_head) (its weights use the default init, not T5's scaled one)."""
import math

import torch
from torch import nn


def relative_bucket(rel, num_buckets=16, max_distance=64):
    """T5's bidirectional buckets: half for each sign, exact for small distances, log beyond."""
    num_buckets //= 2
    bucket = (rel > 0).long() * num_buckets
    n = rel.abs()
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(n.float() / max_exact + 1e-6) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.minimum(large, torch.full_like(large, num_buckets - 1))
    return bucket + torch.where(n < max_exact, n, large)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class T5Attention(nn.Module):
    def __init__(self, d_model, n_heads, has_bias):
        super().__init__()
        self.h, self.d_head = n_heads, d_model // n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.relative_attention_bias = nn.Embedding(16, n_heads) if has_bias else None

    def compute_bias(self, T, device):
        pos = torch.arange(T, device=device)
        buckets = relative_bucket(pos[None, :] - pos[:, None])          # [T, T]: key - query
        return self.relative_attention_bias(buckets).permute(2, 0, 1)[None]   # [1, H, T, T]

    def forward(self, x, bias=None):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, self.h, self.d_head).transpose(1, 2) for f in (self.q, self.k, self.v))
        if bias is None:
            bias = self.compute_bias(T, x.device)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_head)         # [B, H, T, T]
        scores = scores + bias
        attn = torch.softmax(scores, dim=-1)
        return self.o((attn @ v).transpose(1, 2).reshape(B, T, -1)), bias


class T5Layer(nn.Module):
    def __init__(self, d_model, n_heads, has_bias):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
        self.attn = T5Attention(d_model, n_heads, has_bias)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model, bias=False), nn.ReLU(),
                                nn.Linear(4 * d_model, d_model, bias=False))

    def forward(self, x, bias):
        a, bias = self.attn(self.norm1(x), bias)
        x = x + a
        return x + self.ff(self.norm2(x)), bias


class T5Encoder(nn.Module):
    def __init__(self, vocab_size, d_model=32, n_heads=4, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(T5Layer(d_model, n_heads, has_bias=i == 0) for i in range(n_layers))
        self.final_norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, ids):                                             # [B, T]
        x, bias = self.embed(ids), None
        for layer in self.layers:
            x, bias = layer(x, bias)
        return self.lm_head(self.final_norm(x))                         # [B, T, V]


def build(vocab_size=96, **kw):
    return T5Encoder(vocab_size, **kw)


def forward(model, ids, pad_id):
    return model(ids)
