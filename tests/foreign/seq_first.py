"""A user's Pre-LN Transformer that works sequence-first ([L, B, d] everywhere), with a
`ScaledDotProductAttention(temperature=sqrt(d_k))` that divides q before the product, an
additive float mask holding -1e9, the paper's sinusoids, embeddings times sqrt(d_model), and
the paper's xavier init. The adapter transposes in and out.

    tndebug triage ckpt.pt --model seq_first.py:build --adapter seq_first.py:forward

build(bug=...):
    no_scale           temperature = 1
    no_causal          the decoder's self-attention mask has no future part
    inverted_pad_mask  the additive mask holds -1e9 at the real tokens, 0 at padding
    no_emb_scale       embeddings not multiplied by sqrt(d_model)
    shared_qkv         w_ks and w_vs are w_qs
"""
from __future__ import annotations

import math

import torch
from torch import nn

BUGS = ("no_scale", "no_causal", "inverted_pad_mask", "no_emb_scale", "shared_qkv")


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature):
        super().__init__()
        self.temperature = temperature

    def forward(self, q, k, v, bias):                                         # q [B, h, T, dk]
        attn = torch.matmul(q / self.temperature, k.transpose(2, 3))          # [B, h, T, S]
        attn = torch.softmax(attn + bias, dim=-1)
        return torch.matmul(attn, v)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, bug=None):
        super().__init__()
        self.n_head, self.d_k = n_head, d_model // n_head
        self.w_qs = nn.Linear(d_model, d_model, bias=False)
        self.w_ks = self.w_qs if bug == "shared_qkv" else nn.Linear(d_model, d_model, bias=False)
        self.w_vs = self.w_qs if bug == "shared_qkv" else nn.Linear(d_model, d_model, bias=False)
        self.fc = nn.Linear(d_model, d_model, bias=False)
        self.attention = ScaledDotProductAttention(1.0 if bug == "no_scale" else self.d_k ** 0.5)

    def forward(self, q, k, v, bias):                                         # q [T, B, d], k/v [S, B, d]
        T, B, _ = q.shape
        S = k.shape[0]
        q = self.w_qs(q).view(T, B, self.n_head, self.d_k).permute(1, 2, 0, 3)   # [B, h, T, dk]
        k = self.w_ks(k).view(S, B, self.n_head, self.d_k).permute(1, 2, 0, 3)
        v = self.w_vs(v).view(S, B, self.n_head, self.d_k).permute(1, 2, 0, 3)
        out = self.attention(q, k, v, bias)                                   # [B, h, T, dk]
        return self.fc(out.permute(2, 0, 1, 3).reshape(T, B, -1))             # [T, B, d]


class FeedForward(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x):
        return self.w_2(torch.relu(self.w_1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d, h, d_ff, bug=None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.slf_attn, self.pos_ffn = MultiHeadAttention(h, d, bug), FeedForward(d, d_ff)

    def forward(self, x, bias):
        y = self.ln1(x)
        x = x + self.slf_attn(y, y, y, bias)
        return x + self.pos_ffn(self.ln2(x))


class DecoderLayer(nn.Module):
    def __init__(self, d, h, d_ff, bug=None):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.slf_attn, self.enc_attn = MultiHeadAttention(h, d, bug), MultiHeadAttention(h, d, bug)
        self.pos_ffn = FeedForward(d, d_ff)

    def forward(self, x, memory, self_bias, cross_bias):
        y = self.ln1(x)
        x = x + self.slf_attn(y, y, y, self_bias)
        x = x + self.enc_attn(self.ln2(x), memory, memory, cross_bias)
        return x + self.pos_ffn(self.ln3(x))


def sinusoid_table(n_position, d):
    pos = torch.arange(n_position, dtype=torch.float)[:, None]
    div = torch.pow(10000.0, torch.arange(0, d, 2, dtype=torch.float) / d)
    table = torch.zeros(n_position, d)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos / div), torch.cos(pos / div)
    return table


class Transformer(nn.Module):
    def __init__(self, vocab=16, d_model=32, n_head=4, n_layers=2, d_inner=64, bug=None):
        super().__init__()
        self.bug, self.d_model = bug, d_model
        self.src_word_emb, self.trg_word_emb = nn.Embedding(vocab, d_model), nn.Embedding(vocab, d_model)
        self.register_buffer("pos_table", sinusoid_table(64, d_model)[:, None, :])   # [L, 1, d]
        self.encoder_layers = nn.ModuleList([EncoderLayer(d_model, n_head, d_inner, bug) for _ in range(n_layers)])
        self.decoder_layers = nn.ModuleList([DecoderLayer(d_model, n_head, d_inner, bug) for _ in range(n_layers)])
        self.enc_norm, self.dec_norm = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.trg_word_prj = nn.Linear(d_model, vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def embed(self, table, seq):                                              # seq [L, B]
        scale = 1.0 if self.bug == "no_emb_scale" else math.sqrt(self.d_model)
        return table(seq) * scale + self.pos_table[: seq.shape[0]]

    def key_bias(self, seq, pad):                                             # -> [B, 1, 1, L]
        hide = (seq != pad) if self.bug == "inverted_pad_mask" else (seq == pad)
        return torch.zeros(hide.T.shape, device=seq.device).masked_fill(hide.T, -1e9)[:, None, None, :]

    def encode(self, src, pad):                                               # src [S, B]
        x, bias = self.embed(self.src_word_emb, src), self.key_bias(src, pad)
        for layer in self.encoder_layers:
            x = layer(x, bias)
        return self.enc_norm(x)                                               # [S, B, d]

    def forward(self, src, trg, pad=0):                                       # [S, B], [T, B]
        memory = self.encode(src, pad)
        T = trg.shape[0]
        future = torch.full((T, T), -1e9, device=trg.device).triu(1)
        self_bias = self.key_bias(trg, pad) + (0.0 if self.bug == "no_causal" else future)
        x = self.embed(self.trg_word_emb, trg)
        for layer in self.decoder_layers:
            x = layer(x, memory, self_bias, self.key_bias(src, pad))
        return self.trg_word_prj(self.dec_norm(x))                            # [T, B, V]


def build(**kw):
    return Transformer(**kw)


def forward(model, src, tgt, pad_id):
    return model(src.T, tgt.T, pad_id).transpose(0, 1)                        # [B, T, V]


def encode(model, src, pad_id):
    return model.encode(src.T, pad_id).transpose(0, 1)                        # [B, S, d]
