"""A nanoGPT-style decoder-only model, written the way such files usually are: a GPTConfig
dataclass, `transformer.wte` / `transformer.wpe` / `transformer.h.N` / `transformer.ln_f`, a
fused `c_attn` split into q, k, v, a `bias` tril buffer filled with -inf above the diagonal
(or F.scaled_dot_product_attention(is_causal=True)), the output head tied to `wte`, and
`forward(idx, targets=None) -> (logits, loss)` that returns only the last position's logits
when no targets are given (what generation needs).

    tndebug triage ckpt.pt --model nanogpt.py:build              # the built-in `gpt` adapter
    tndebug triage ckpt.pt --model nanogpt.py:build --adapter nanogpt.py:forward

build(variant=..., bug=...):
    variant   manual (matmul, masked_fill) | sdpa (F.scaled_dot_product_attention)
    no_causal    the bias buffer all ones (manual) / is_causal=False (sdpa)
    triu         the bias buffer upper- instead of lower-triangular (the mask transposed)
    no_scale     scores not divided by sqrt(head size) (sdpa: scale=1.0)
    softmax_dim  the softmax over the queries (dim=-2), not the keys (manual only)
    pad_mask     a key-padding mask (idx != 0) in place of the causal one
    qkv_order    c_attn split as k, q, v: benign, the chunks are learnt under any labelling
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BUGS = ("no_causal", "triu", "no_scale", "softmax_dim", "pad_mask", "qkv_order")
VARIANTS = ("manual", "sdpa")


@dataclass
class GPTConfig:
    vocab_size: int = 11
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    variant: str = "manual"
    bug: str | None = None


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.variant, self.bug = config.variant, config.bug
        T = config.block_size
        mask = torch.ones(T, T)
        if self.bug == "triu":
            mask = mask.triu()
        elif self.bug != "no_causal":
            mask = mask.tril()
        self.register_buffer("bias", mask.view(1, 1, T, T), persistent=False)

    def forward(self, x, pad=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        if self.bug == "qkv_order":
            k, q, v = q, k, v
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)                    # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        allowed = self.bias[:, :, :T, :T] != 0                               # (1, 1, T, T)
        if self.bug == "pad_mask":
            allowed = pad[:, None, None, :]                                  # (B, 1, 1, T)
        if self.variant == "sdpa":
            scale = 1.0 if self.bug == "no_scale" else None
            if self.bug in ("triu", "pad_mask"):
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=self.bug != "no_causal",
                                                   scale=scale)
        else:
            att = q @ k.transpose(-2, -1)                                    # (B, nh, T, T)
            if self.bug != "no_scale":
                att = att * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~allowed, float("-inf"))
            att = F.softmax(att, dim=-2 if self.bug == "softmax_dim" else -1)
            y = att @ v                                                      # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                     # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, pad=None):
        x = x + self.attn(self.ln_1(x), pad)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight                    # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)       # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)           # (B, T, C)
        pad = idx != 0
        for block in self.transformer.h:
            x = block(x, pad)
        x = self.transformer.ln_f(x)
        if targets is None:                                                  # generation: last only
            return self.lm_head(x[:, [-1], :]), None                         # (B, 1, V)
        logits = self.lm_head(x)                                             # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def build(variant: str = "manual", bug: str | None = None, **sizes) -> GPT:
    return GPT(GPTConfig(variant=variant, bug=bug, **sizes))


def forward(model, ids, pad_id):
    """The user's adapter (decoder-only: three parameters): every position's logits."""
    logits, _ = model(ids, ids.contiguous())   # any targets: with them nanoGPT returns every position
    return logits                                                           # (B, T, V)
