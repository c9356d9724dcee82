"""Encoder and decoder layers (paper §3.1), with the residual + norm placement selectable, and
what the encoder-decoder (transformer.py) and the decoder-only model (gpt.py) share: the
generator and the initialisation.

post (the paper):               x = norm(x + dropout(f(x)))
pre  (The Annotated Transformer): x = x + dropout(f(norm(x))), and a final norm after the stack
norm: the paper's LayerNorm, or RMSNorm (`cfg.norm_kind`, tndebug/model/norm.py).
"""
from __future__ import annotations

import torch
from torch import nn

from tndebug.config import ModelConfig
from tndebug.model.attention import MultiHeadAttention
from tndebug.model.dropout import make_dropout
from tndebug.model.hooks import HookPoint, tap
from tndebug.model.norm import make_norm


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (paper §3.3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w_2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = make_dropout(cfg)
        self.hook_hidden = HookPoint()   # after ReLU  [B, T, d_ff]
        self.hook_out = HookPoint()      # [B, T, d_model]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = tap(self.hook_hidden, torch.relu(self.w_1(x)))
        return tap(self.hook_out, self.w_2(self.dropout(h)))


class Sublayer(nn.Module):
    """Residual connection around one sublayer, with its LayerNorm placed pre or post."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre = cfg.norm == "pre"
        self.norm = make_norm(cfg)
        self.dropout = make_dropout(cfg)
        self.hook_resid = HookPoint()    # the residual stream after this sublayer  [B, T, d_model]

    def forward(self, x: torch.Tensor, f) -> torch.Tensor:
        if self.pre:
            out = x + self.dropout(f(self.norm(x)))
        else:
            out = self.norm(x + self.dropout(f(x)))
        return tap(self.hook_resid, out)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.ffn = FeedForward(cfg)
        self.sublayer = nn.ModuleList([Sublayer(cfg) for _ in range(2)])
        self.hook_out = HookPoint()   # [B, S, d_model]

    def forward(self, x: torch.Tensor, keep: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """pos [B, S]: the tokens' positions, for rotary self-attention (None: not rotary)."""
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, keep, pos))
        return tap(self.hook_out, self.sublayer[1](x, self.ffn))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.cross_attn = MultiHeadAttention(cfg)
        self.ffn = FeedForward(cfg)
        self.sublayer = nn.ModuleList([Sublayer(cfg) for _ in range(3)])
        self.hook_out = HookPoint()   # [B, T, d_model]

    def forward(self, x, memory, self_keep, memory_keep) -> torch.Tensor:
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, self_keep))
        x = self.sublayer[1](x, lambda y: self.cross_attn(y, memory, memory_keep))
        return tap(self.hook_out, self.sublayer[2](x, self.ffn))


class Stack(nn.Module):
    """N identical layers, then the final norm in pre-LN (none in post-LN, as in the paper)."""

    def __init__(self, cfg: ModelConfig, layer_cls) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer_cls(cfg) for _ in range(cfg.n_layers)])
        self.norm = make_norm(cfg) if cfg.norm == "pre" else None
        self.hook_out = HookPoint()   # the stack's output  [B, T, d_model]

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, *args)
        if self.norm is not None:
            x = self.norm(x)
        return tap(self.hook_out, x)


class Generator(nn.Module):
    """Final linear projection to the target vocabulary (logits; softmax lives in the loss)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.tgt_vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def init_parameters(model: nn.Module, embeddings) -> None:
    """Xavier-uniform for matrices (as The Annotated Transformer), N(0, 1/d) token embeddings,
    tied to the generator when the config says so. For `Transformer` and the decoder-only model
    alike (`model.cfg`, `model.generator`)."""
    cfg = model.cfg
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    for emb in embeddings:
        nn.init.normal_(emb.lut.weight, std=cfg.d_model ** -0.5)
        if emb.wpe is not None:
            # learned positions start at the sinusoids' size (each entry's RMS 1/sqrt(2)), so
            # token and position parts keep the paper's balance at initialisation
            nn.init.normal_(emb.wpe.weight, std=2 ** -0.5)
        if cfg.tie_embeddings:
            emb.lut.weight = model.generator.proj.weight
