"""A nanoGPT-style decoder-only model with rotary positions (RoPE), written the way such files
usually are: no `wpe`, q and k rotated after the head split with `rotate_half` (the Llama/HF
pairing: feature i with feature i + hs/2), a fused `c_attn`, manual or SDPA attention, tied head.

    tndebug triage ckpt.pt --model rotary_gpt.py:build --adapter rotary_gpt.py:forward

Bugs are not switches of this file: `broken(model, bug)` substitutes one method of every
attention, the way a user's edit would (tests/probes/test_rotary.py):

    q_only      rotary applied to q, not to k (scores depend on the query's absolute position)
    v_too       rotary applied to v as well (the scores stay relative, the outputs do not)
    pairing     q rotated with rotate_half, k with interleaved pairs (2i, 2i+1)
    chunks      positions restart every 4 tokens (arange(T) % 4)
    kv_tiled    grouped-query attention (n_kv_head < n_head): the k/v heads tiled,
                k.repeat(1, n_rep, 1, 1), where the weights were trained with repeat_interleave
                (HF's repeat_kv: q head h reads kv head h // n_rep)
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BUGS = ("q_only", "v_too", "pairing", "chunks")      # the rotary bugs; kv_tiled is GQA's
VARIANTS = ("manual", "sdpa")


@dataclass
class GPTConfig:
    vocab_size: int = 11
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    n_kv_head: int | None = None        # grouped-query attention when < n_head
    variant: str = "manual"
    rope_base: float = 10000.0


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(x, pos, base):
    """x (B, nh, T, hs) rotated by its positions pos (T,), the halves paired (i, i + hs/2)."""
    hs = x.size(-1)
    inv = 1.0 / (base ** (torch.arange(0, hs, 2, device=x.device).float() / hs))   # (hs/2,)
    ang = pos.float()[:, None] * inv[None]                                           # (T, hs/2)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()      # (T, hs)
    return x * cos + rotate_half(x) * sin


def rope_interleaved(x, pos, base):
    """The same rotation with the pairs (2i, 2i + 1), as GPT-J / Meta's original code."""
    hs = x.size(-1)
    inv = 1.0 / (base ** (torch.arange(0, hs, 2, device=x.device).float() / hs))
    ang = pos.float()[:, None] * inv[None]                                           # (T, hs/2)
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rot = torch.stack((-x2, x1), -1).flatten(-2)
    return x * cos + rot * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_kv = config.n_kv_head or config.n_head
        kv = self.n_kv * (config.n_embd // config.n_head)
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * kv)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head, self.n_embd, self.variant = config.n_head, config.n_embd, config.variant
        self.base = config.rope_base
        T = config.block_size
        self.register_buffer("bias", torch.ones(T, T).tril().view(1, 1, T, T), persistent=False)

    def positions(self, T, device):
        return torch.arange(T, device=device)

    def rotate_q(self, q, pos):
        return rope(q, pos, self.base)

    def rotate_k(self, k, pos):
        return rope(k, pos, self.base)

    def rotate_v(self, v, pos):
        return v

    def repeat_kv(self, x):
        """(B, n_kv, T, hs) -> (B, nh, T, hs): q head h reads kv head h // n_rep."""
        return x.repeat_interleave(self.n_head // self.n_kv, dim=1)

    def forward(self, x):
        B, T, C = x.size()
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split([C, self.n_kv * hs, self.n_kv * hs], dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)                    # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv, hs).transpose(1, 2)                      # (B, n_kv, T, hs)
        v = v.view(B, T, self.n_kv, hs).transpose(1, 2)
        pos = self.positions(T, x.device)
        q, k, v = self.rotate_q(q, pos), self.rotate_k(k, pos), self.rotate_v(v, pos)
        if self.n_kv != self.n_head:
            k, v = self.repeat_kv(k), self.repeat_kv(v)                      # (B, nh, T, hs)
        if self.variant == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))          # (B, nh, T, T)
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v                                   # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))    # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight                    # weight tying

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)                                        # (B, T, C): no wpe
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))                      # (B, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)


def build(variant: str = "manual", **sizes) -> GPT:
    return GPT(GPTConfig(variant=variant, **sizes))


def forward(model, ids, pad_id):
    """The user's adapter (decoder-only: three parameters): every position's logits."""
    return model(ids)[0]                                                     # (B, T, V)


def _interleaved_k(self, k, pos):
    return rope_interleaved(k, pos, self.base)


def _rotary_v(self, v, pos):
    return rope(v, pos, self.base)


def _chunked(self, T, device):
    return torch.arange(T, device=device) % 4


def _tiled(self, x):
    return x.repeat(1, self.n_head // self.n_kv, 1, 1)


_SUBSTITUTE = {"kv_tiled": ("repeat_kv", _tiled), "q_only": ("rotate_k", lambda self, k, pos: k), "v_too": ("rotate_v", _rotary_v),
               "pairing": ("rotate_k", _interleaved_k), "chunks": ("positions", _chunked)}


def broken(model: GPT, bug: str) -> GPT:
    """`model` with one method of every attention substituted (in place)."""
    name, fn = _SUBSTITUTE[bug]
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            setattr(m, name, types.MethodType(fn, m))
    return model
