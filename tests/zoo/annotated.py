"""A user's model written in The Annotated Transformer's style (harvardnlp), independently of
tndebug's model: clones, SublayerConnection, MultiHeadedAttention with `linears`, LayerNorm
with a_2/b_2, and an `attention()` function with masked_fill(mask == 0, -1e9).

Bugs the notes describe are written by hand behind constructor arguments:

    scale=False          scores = q k^T with no 1/sqrt(d_k)
    causal=False         the decoder's self-attention gets the padding mask only
    mask_axis="query"    the source padding mask is shaped (B, S, 1): it masks queries, not keys
    pe=False             the positional encoding is computed but never added
    shared_qkv=True      one Linear serves as W_Q, W_K and W_V
    final_norm=False     Pre-LN stacks without the final LayerNorm
    fill=-1e9            the annotated code's literal fill value, which overflows float16
                         (None: torch.finfo(dtype).min, safe in every dtype)

Call it through `tndebug triage --adapter annotated` (masks built as below).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn


def clones(module, N):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


class LayerNorm(nn.Module):
    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class SublayerConnection(nn.Module):
    """A residual connection followed by a layer norm (norm first, as the annotated code does)."""

    def __init__(self, size, dropout):
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


def attention(query, key, value, mask=None, dropout=None, scale=True, fill=-1e9):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1))
    if scale:
        scores = scores / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min if fill is None else fill)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1, scale=True, shared_qkv=False, fill=-1e9):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        if shared_qkv:
            self.linears[1] = self.linears[0]
            self.linears[2] = self.linears[0]
        self.attn = None
        self.scale, self.fill = scale, fill
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)          # same mask for every head
        nbatches = query.size(0)
        query, key, value = [
            lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
            for lin, x in zip(self.linears, (query, key, value))
        ]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout, scale=self.scale,
                                 fill=self.fill)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        del query, key, value
        return self.linears[-1](x)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.w_2(self.dropout(self.w_1(x).relu()))


class Embeddings(nn.Module):
    def __init__(self, d_model, vocab):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        return self.lut(x) * math.sqrt(self.d_model)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout, max_len=5000, add=True):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))
        self.add = add

    def forward(self, x):
        pe = self.pe[:, : x.size(1)].requires_grad_(False)
        if self.add:
            x = x + pe
        return self.dropout(x)


class EncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 2)
        self.size = size

    def forward(self, x, mask):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, mask))
        return self.sublayer[1](x, self.feed_forward)


class Encoder(nn.Module):
    def __init__(self, layer, N, final_norm=True):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size) if final_norm else None

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x) if self.norm is not None else x


class DecoderLayer(nn.Module):
    def __init__(self, size, self_attn, src_attn, feed_forward, dropout):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 3)

    def forward(self, x, memory, src_mask, tgt_mask):
        m = memory
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, tgt_mask))
        x = self.sublayer[1](x, lambda x: self.src_attn(x, m, m, src_mask))
        return self.sublayer[2](x, self.feed_forward)


class Decoder(nn.Module):
    def __init__(self, layer, N, final_norm=True):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size) if final_norm else None

    def forward(self, x, memory, src_mask, tgt_mask):
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x) if self.norm is not None else x


class Generator(nn.Module):
    def __init__(self, d_model, vocab):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        return self.proj(x).log_softmax(dim=-1)


class EncoderDecoder(nn.Module):
    def __init__(self, encoder, decoder, src_embed, tgt_embed, generator, *, causal=True,
                 mask_axis="key"):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.generator = generator
        self.causal = causal
        self.mask_axis = mask_axis

    def forward(self, src, tgt, src_mask, tgt_mask):
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)

    def encode(self, src, src_mask):
        if self.mask_axis == "query":     # bug: (B, 1, S) -> (B, S, 1), masks queries
            src_mask = src_mask.transpose(-2, -1)
        return self.encoder(self.src_embed(src), src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        if not self.causal:               # bug: padding only, the decoder sees the future
            tgt_mask = tgt_mask[:, -1:, :]    # (B, 1, T): the last row masks pads only
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)


def make_model(src_vocab, tgt_vocab, N=2, d_model=32, d_ff=64, h=4, dropout=0.1, *, scale=True,
               causal=True, mask_axis="key", pe=True, shared_qkv=False, final_norm=True, fill=-1e9):
    c = copy.deepcopy
    attn = MultiHeadedAttention(h, d_model, dropout, scale=scale, shared_qkv=shared_qkv, fill=fill)
    ff = PositionwiseFeedForward(d_model, d_ff, dropout)
    position = PositionalEncoding(d_model, dropout, max_len=64, add=pe)
    model = EncoderDecoder(
        Encoder(EncoderLayer(d_model, c(attn), c(ff), dropout), N, final_norm),
        Decoder(DecoderLayer(d_model, c(attn), c(attn), c(ff), dropout), N, final_norm),
        nn.Sequential(Embeddings(d_model, src_vocab), c(position)),
        nn.Sequential(Embeddings(d_model, tgt_vocab), c(position)),
        Generator(d_model, tgt_vocab),
        causal=causal, mask_axis=mask_axis,
    )
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


def subsequent_mask(size):
    attn_shape = (1, size, size)
    return torch.triu(torch.ones(attn_shape), diagonal=1).type(torch.uint8) == 0


def forward_logits(model, src, tgt, pad=0):
    """How the user trains it: masks as in The Annotated Transformer's Batch."""
    src_mask = (src != pad).unsqueeze(-2)
    tgt_mask = (tgt != pad).unsqueeze(-2) & subsequent_mask(tgt.size(-1)).type_as(src_mask)
    return model.generator(model(src, tgt, src_mask, tgt_mask))
