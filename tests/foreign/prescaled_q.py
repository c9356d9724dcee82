"""A user's Post-LN translator in the fairseq manner: the query is scaled as it is projected
(`q = self.q_proj(x) * self.scaling`), the model keeps its pad index and builds every mask
itself, masked_fill with -1e4, learned positions, embeddings times sqrt(d_model), and the
forward returns flattened logits [B*T, V] ready for the loss.

    tndebug triage ckpt.pt --model prescaled_q.py:build --adapter prescaled_q.py:forward

build(bug=...):
    no_scale           q is not multiplied by head_dim ** -0.5
    no_causal          the decoder's self-attention gets the padding mask only
    inverted_pad_mask  key_padding_mask = tokens != pad (True at real tokens)
    no_emb_scale       embeddings not multiplied by sqrt(d_model)
    shared_qkv         k_proj and v_proj are q_proj
    zero_positions     the learned position table is zero and frozen
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

BUGS = ("no_scale", "no_causal", "inverted_pad_mask", "no_emb_scale", "shared_qkv", "zero_positions")


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, bug=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scaling = 1.0 if bug == "no_scale" else self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = self.q_proj if bug == "shared_qkv" else nn.Linear(embed_dim, embed_dim)
        self.v_proj = self.q_proj if bug == "shared_qkv" else nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, key_padding_mask=None, attn_mask=None):
        B, T, C = query.shape
        S = key.shape[1]
        q = self.q_proj(query) * self.scaling
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)          # [B, h, T, hd]
        k = self.k_proj(key).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(key).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        attn_weights = q @ k.transpose(-1, -2)                                 # [B, h, T, S]
        if attn_mask is not None:                                              # [T, S] True = hide
            attn_weights = attn_weights.masked_fill(attn_mask, -1e4)
        if key_padding_mask is not None:                                       # [B, S] True = pad
            attn_weights = attn_weights.masked_fill(key_padding_mask[:, None, None, :], -1e4)
        attn_probs = F.softmax(attn_weights, dim=-1)
        out = (attn_probs @ v).transpose(1, 2).reshape(B, T, C)
        return self.out_proj(out)


class EncoderLayer(nn.Module):
    def __init__(self, d, h, d_ff, bug=None):
        super().__init__()
        self.self_attn = MultiheadAttention(d, h, bug)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, pad):
        x = self.self_attn_layer_norm(x + self.self_attn(x, x, key_padding_mask=pad))
        return self.final_layer_norm(x + self.fc2(F.relu(self.fc1(x))))


class DecoderLayer(nn.Module):
    def __init__(self, d, h, d_ff, bug=None):
        super().__init__()
        self.self_attn = MultiheadAttention(d, h, bug)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = MultiheadAttention(d, h, bug)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, memory, self_mask, tgt_pad, src_pad):
        x = self.self_attn_layer_norm(x + self.self_attn(x, x, tgt_pad, self_mask))
        x = self.encoder_attn_layer_norm(x + self.encoder_attn(x, memory, src_pad))
        return self.final_layer_norm(x + self.fc2(F.relu(self.fc1(x))))


class Translator(nn.Module):
    def __init__(self, vocab=16, d_model=32, heads=4, layers=2, d_ff=64, max_positions=64,
                 pad_idx=0, bug=None):
        super().__init__()
        self.pad_idx, self.bug = pad_idx, bug
        self.embed_scale = 1.0 if bug == "no_emb_scale" else math.sqrt(d_model)
        self.embed_src = nn.Embedding(vocab, d_model, padding_idx=pad_idx)
        self.embed_tgt = nn.Embedding(vocab, d_model, padding_idx=pad_idx)
        nn.init.normal_(self.embed_src.weight, 0, d_model ** -0.5)         # fairseq's init
        nn.init.normal_(self.embed_tgt.weight, 0, d_model ** -0.5)
        self.embed_positions = nn.Embedding(max_positions, d_model)
        if bug == "zero_positions":
            nn.init.zeros_(self.embed_positions.weight)
            self.embed_positions.weight.requires_grad_(False)
        self.encoder = nn.ModuleList([EncoderLayer(d_model, heads, d_ff, bug) for _ in range(layers)])
        self.decoder = nn.ModuleList([DecoderLayer(d_model, heads, d_ff, bug) for _ in range(layers)])
        self.output_projection = nn.Linear(d_model, vocab)

    def padding_mask(self, tokens):                                            # [B, L] True = pad
        return tokens.ne(self.pad_idx) if self.bug == "inverted_pad_mask" else tokens.eq(self.pad_idx)

    def embed(self, table, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return table(tokens) * self.embed_scale + self.embed_positions(pos)    # [B, L, d]

    def encode(self, src):
        x, pad = self.embed(self.embed_src, src), self.padding_mask(src)
        for layer in self.encoder:
            x = layer(x, pad)
        return x

    def forward(self, src, tgt):
        memory = self.encode(src)
        T = tgt.shape[1]
        future = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)
        if self.bug == "no_causal":
            future = None
        x = self.embed(self.embed_tgt, tgt)
        for layer in self.decoder:
            x = layer(x, memory, future, self.padding_mask(tgt), self.padding_mask(src))
        logits = self.output_projection(x)
        return logits.view(-1, logits.shape[-1])                               # [B*T, V] for the loss


def build(**kw):
    return Translator(**kw)


def forward(model, src, tgt, pad_id):
    return model(src, tgt)                                                     # [B*T, V]


def encode(model, src, pad_id):
    return model.encode(src)
