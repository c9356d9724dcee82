"""A small encoder-decoder for the real-bug corpus, written here in a plain user style.

Pre-LN blocks with a final LayerNorm on each stack, sinusoidal positions added after the
token embedding (times sqrt(d_model), as in the paper), separate Q/K/V/O projections,
masks that are True where a query may attend (`[B, 1, T|1, S]`), filled with the dtype's
most negative finite value.
The model carries no bug switches: every reported bug in `bugs.py` is a subclass that
replaces one method (or one setting) of a part named here, swapped in from outside.

    model = Seq2Seq(Config())                    # logits = model(src, tgt_in)  [B, T, V]
    logits = forward(model, src, tgt_in, pad_id)  # the function tndebug.check calls
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 16          # ids 0 = <pad>, 1 = <bos>, 2.. = content
    d_model: int = 32
    heads: int = 4
    layers: int = 2
    d_ff: int = 64
    dropout: float = 0.1
    max_len: int = 64        # longest sequence the positional table covers
    pad_id: int = 0
    ln_eps: float = 1e-5     # nn.LayerNorm's default


class PositionalEncoding(nn.Module):
    """x + PE[:T], the paper's sinusoids (section 3.5)."""

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.d_model, self.max_len = d_model, max_len
        self.register_buffer("pe", self.table(d_model, max_len).unsqueeze(0))   # [1, L, d]

    def table(self, d_model: int, max_len: int) -> torch.Tensor:
        pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)            # [L, 1]
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32)
                        * (-math.log(10000.0) / d_model))                       # [d/2]
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        return pe                                                                # [L, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[:, : x.size(1)]                                       # [B, T, d]


class Embeddings(nn.Module):
    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lut(ids) * math.sqrt(self.d_model)                           # [B, T, d]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        assert d_model % heads == 0
        self.h, self.d_k = heads, d_model // heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.p_drop = dropout

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.d_k).transpose(1, 2)                    # [B, h, T, d_k]

    def merge_heads(self, z: torch.Tensor) -> torch.Tensor:
        B, h, T, d_k = z.shape
        return z.transpose(1, 2).contiguous().view(B, T, h * d_k)                # [B, T, d]

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-2, -1) / math.sqrt(self.d_k)                     # [B, h, T, S]

    def apply_mask(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)

    def normalise(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.softmax(dim=-1)

    def attend(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.dropout(p) @ v                                               # [B, h, T, d_k]

    def forward(self, query, key, value, mask=None):
        q = self.split_heads(self.w_q(query))
        k = self.split_heads(self.w_k(key))
        v = self.split_heads(self.w_v(value))
        s = self.scores(q, k)
        if mask is not None:
            s = self.apply_mask(s, mask)
        return self.w_o(self.merge_heads(self.attend(self.normalise(s), v)))     # [B, T, d]


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.w_2(self.dropout(F.relu(self.w_1(x))))


class Residual(nn.Module):
    """x + dropout(sublayer(norm(x))): Pre-LN, as the Annotated Transformer (not the paper's Post-LN)."""

    def __init__(self, d_model: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class EncoderLayer(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(c.d_model, c.heads, c.dropout)
        self.ff = FeedForward(c.d_model, c.d_ff, c.dropout)
        self.res = nn.ModuleList([Residual(c.d_model, c.dropout, c.ln_eps) for _ in range(2)])

    def forward(self, x, src_mask):
        x = self.res[0](x, lambda y: self.self_attn(y, y, y, src_mask))
        return self.res[1](x, self.ff)


class DecoderLayer(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(c.d_model, c.heads, c.dropout)
        self.cross_attn = MultiHeadAttention(c.d_model, c.heads, c.dropout)
        self.ff = FeedForward(c.d_model, c.d_ff, c.dropout)
        self.res = nn.ModuleList([Residual(c.d_model, c.dropout, c.ln_eps) for _ in range(3)])

    def forward(self, x, memory, src_mask, tgt_mask):
        x = self.res[0](x, lambda y: self.self_attn(y, y, y, tgt_mask))
        x = self.res[1](x, lambda y: self.cross_attn(y, memory, memory, src_mask))
        return self.res[2](x, self.ff)


class Encoder(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.layers = nn.ModuleList([EncoderLayer(c) for _ in range(c.layers)])
        self.norm = nn.LayerNorm(c.d_model, eps=c.ln_eps)

    def forward(self, x, src_mask):
        for layer in self.layers:
            x = layer(x, src_mask)
        return self.norm(x)


class Decoder(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.layers)])
        self.norm = nn.LayerNorm(c.d_model, eps=c.ln_eps)

    def forward(self, x, memory, src_mask, tgt_mask):
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


class Seq2Seq(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.cfg, self.pad_id = c, c.pad_id
        self.src_embed = nn.Sequential(Embeddings(c.vocab, c.d_model), PositionalEncoding(c.d_model, c.max_len),
                                       nn.Dropout(c.dropout))
        self.tgt_embed = nn.Sequential(Embeddings(c.vocab, c.d_model), PositionalEncoding(c.d_model, c.max_len),
                                       nn.Dropout(c.dropout))
        self.encoder, self.decoder = Encoder(c), Decoder(c)
        self.generator = nn.Linear(c.d_model, c.vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def src_mask(self, src: torch.Tensor) -> torch.Tensor:
        return (src != self.pad_id)[:, None, None, :]                            # [B, 1, 1, S]

    def tgt_mask(self, tgt: torch.Tensor) -> torch.Tensor:
        T = tgt.size(1)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=tgt.device))  # [T, T]
        return (tgt != self.pad_id)[:, None, None, :] & causal                   # [B, 1, T, T]

    def encode(self, src, src_mask):
        return self.encoder(self.src_embed(src), src_mask)                       # [B, S, d]

    def decode(self, memory, src_mask, tgt, tgt_mask):
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)     # [B, T, d]

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        src_mask = self.src_mask(src)
        memory = self.encode(src, src_mask)
        return self.generator(self.decode(memory, src_mask, tgt, self.tgt_mask(tgt)))  # [B, T, V]


def forward(model: Seq2Seq, src: torch.Tensor, tgt: torch.Tensor, pad_id: int) -> torch.Tensor:
    """What tndebug.check calls: logits [B, T, V] for BOS-led tgt."""
    return model(src, tgt)


# -- data and the user's loop ----------------------------------------------------------------------
def copy_batch(g: torch.Generator, vocab: int = 16, batch: int = 16, length: int = 8, pad_id: int = 0,
               bos_id: int = 1):
    """A copy task: src = content ids with right padding on half the rows; tgt = [BOS] + src."""
    src = torch.randint(2, vocab, (batch, length), generator=g)
    lengths = torch.randint(3, length + 1, (batch,), generator=g)
    lengths[: batch // 2] = length
    src[torch.arange(length)[None, :] >= lengths[:, None]] = pad_id
    tgt = torch.cat([torch.full((batch, 1), bos_id), src], dim=1)
    return src, tgt[:, :-1], tgt[:, 1:]                                          # [B,S] [B,T] [B,T]


def cross_entropy(pad_id: int = 0):
    return nn.CrossEntropyLoss(ignore_index=pad_id)
