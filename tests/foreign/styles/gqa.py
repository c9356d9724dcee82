"""A character-level model with grouped-query attention: 4 query heads share 2 key/value heads,
repeated with repeat_interleave (HF's repeat_kv order: query head i reads kv head i // 2),
rotary positions with rotate_half, RMSNorm, an explicit causal mask."""
import math

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    return x.repeat_interleave(n_rep, dim=1)                 # [b, kv_heads * n_rep, t, d]


class GQAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, max_len):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(max_len).float(), inv_freq)
        self.register_buffer("cos", torch.cat((freqs, freqs), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((freqs, freqs), -1).sin(), persistent=False)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:t], self.sin[:t]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = repeat_kv(k, self.n_heads // self.n_kv_heads)
        v = repeat_kv(v, self.n_heads // self.n_kv_heads)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = F.softmax(scores, dim=-1)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, t, -1))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, max_len):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim), RMSNorm(dim)
        self.self_attn = GQAttention(dim, n_heads, n_kv_heads, max_len)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.SiLU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x, mask):
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class GQALM(nn.Module):
    def __init__(self, vocab_size, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, max_len=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, n_heads, n_kv_heads, max_len) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, input_ids):
        t = input_ids.size(1)
        mask = torch.full((t, t), float("-inf"), device=input_ids.device).triu(1)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return self.lm_head(self.norm(x))


def build(vocab_size=96, **kw):
    return GQALM(vocab_size, **kw)


def forward(model, ids, pad_id):
    return model(ids)
