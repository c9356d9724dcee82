"""A character-level encoder (bidirectional) with rotary positions on q and k (rotate_half,
cos/sin cached in buffers, as RoFormer and ModernBERT do) and F.scaled_dot_product_attention
with no mask; fused qkv; Pre-LN blocks."""
import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_len=64, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
        freqs = torch.outer(torch.arange(max_len).float(), inv_freq)    # [L, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)                         # [L, dim]
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, q, k):                                            # [B, H, T, D]
        T = q.shape[-2]
        cos, sin = self.cos_cached[:T], self.sin_cached[:T]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotarySelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h, self.d_head = n_heads, d_model // n_heads
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.Wo = nn.Linear(d_model, d_model, bias=False)
        self.rotary = RotaryEmbedding(self.d_head)

    def forward(self, x):                                               # [B, T, d]
        B, T, _ = x.shape
        q, k, v = self.Wqkv(x).view(B, T, 3, self.h, self.d_head).permute(2, 0, 3, 1, 4)   # [B, H, T, D]
        q, k = self.rotary(q, k)
        z = F.scaled_dot_product_attention(q, k, v)
        return self.Wo(z.transpose(1, 2).reshape(B, T, -1))


class Layer(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = RotarySelfAttention(d_model, n_heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class RotaryEncoder(nn.Module):
    def __init__(self, vocab_size, d_model=32, n_heads=4, n_layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(Layer(d_model, n_heads) for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.decoder = nn.Linear(d_model, vocab_size)

    def forward(self, ids):                                             # [B, T]
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.decoder(self.final_norm(x))                         # [B, T, V]


def build(vocab_size=96, **kw):
    return RotaryEncoder(vocab_size, **kw)


def forward(model, ids, pad_id):
    return model(ids)
