"""A character-level encoder (bidirectional, no mask): attention written with einsum on
batch-first [B, T, H, D] tensors, the scores laid out [B, H, Tq, Tk]; a learned position table
kept as a bare nn.Parameter; Post-LN blocks as in BERT."""
import torch
from torch import nn


class EinsumSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h, self.d_head = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):                                               # [B, T, d]
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d_head).unbind(2)   # [B, T, H, D] each
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.d_head ** 0.5  # [B, H, T, T]
        attn = scores.softmax(dim=-1)
        z = torch.einsum("bhqk,bkhd->bqhd", attn, v)                    # [B, T, H, D]
        return self.out(z.reshape(B, T, -1))


class PostLNLayer(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.attn = EinsumSelfAttention(d_model, n_heads)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ff(x))


class EinsumEncoder(nn.Module):
    def __init__(self, vocab_size, d_model=32, n_heads=4, n_layers=2, max_len=64):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        self.layers = nn.ModuleList(PostLNLayer(d_model, n_heads) for _ in range(n_layers))
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids):                                             # [B, T]
        T = ids.shape[1]
        x = self.tok(ids) + self.pos[:T]
        for layer in self.layers:
            x = layer(x)
        return self.head(x)                                             # [B, T, V]


def build(vocab_size=96, **kw):
    return EinsumEncoder(vocab_size, **kw)


def forward(model, ids, pad_id):
    return model(ids)
