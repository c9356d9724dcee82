"""Token embeddings scaled by sqrt(d_model) and sinusoidal positional encoding (paper §3.4-3.5).

With rotary positions (`cfg.pos == "rotary"`) nothing positional is added here: attention rotates
q and k (tndebug/model/rotary.py). The table still bounds the length (max_len) alike. With learned
positions (`cfg.pos == "learned"`, GPT-2's wpe) the rows added are `wpe`, a trained
[max_len, d_model] table, in place of the sinusoids."""
from __future__ import annotations

import math

import torch
from torch import nn

from tndebug.config import ModelConfig
from tndebug.model.dropout import make_dropout
from tndebug.model.hooks import HookPoint, tap


class PositionLimitError(ValueError):
    """A sequence is longer than the positional-encoding table."""


def sinusoid_table(max_len: int, d_model: int) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...).  # [max_len, d_model]"""
    pos = torch.arange(max_len, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class Embeddings(nn.Module):
    """lut(x) * sqrt(d_model) + PE[:T], then dropout."""

    def __init__(self, vocab: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.lut = nn.Embedding(vocab, cfg.d_model)
        self.scale = math.sqrt(cfg.d_model)
        self.register_buffer("pe", sinusoid_table(cfg.max_len, cfg.d_model), persistent=False)
        self.wpe = nn.Embedding(cfg.max_len, cfg.d_model) if cfg.pos == "learned" else None
        self.adds_pe = cfg.pos in ("sinusoidal", "learned")
        self.dropout = make_dropout(cfg)
        self.hook_tok = HookPoint()   # scaled token embeddings  [B, T, d_model]
        self.hook_pe = HookPoint()    # the PE rows added          [1, T, d_model]
        self.hook_out = HookPoint()   # token + PE                [B, T, d_model]

    def positions(self, T: int) -> torch.Tensor:
        """The rows added at positions 0..T-1: the sinusoids, or the learned table.  # [T, d_model]"""
        table = self.pe if self.wpe is None else self.wpe.weight
        max_len = table.shape[0]
        if T <= max_len:
            return table[:T]
        raise PositionLimitError(
            f"sequence length {T} exceeds the positional-encoding table (max_len={max_len}); "
            f"raise ModelConfig.max_len")

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        """`shift` [B]: each row's positions start `shift` later in the sequence (the left pads a
        decoder-only row carries), so row b's token t gets PE[t - shift[b]] (0 for the pads)."""
        tok = tap(self.hook_tok, self.lut(x) * self.scale)               # [B, T, d_model]
        pe = self.positions(x.shape[1]).unsqueeze(0).to(tok.dtype)       # [1, T, d_model]
        if not self.adds_pe:                                             # rotary: in attention
            return self.dropout(tap(self.hook_out, tok))
        if shift is not None and bool(shift.any()):
            idx = (torch.arange(x.shape[1], device=x.device)[None] - shift[:, None]).clamp(min=0)
            pe = self.positions(x.shape[1])[idx].to(tok.dtype)            # [B, T, d_model]
        out = self.add_positions(tok, tap(self.hook_pe, pe))
        return self.dropout(tap(self.hook_out, out))

    def add_positions(self, tok: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        """The token embeddings with their positions added (paper §3.5: summed)."""
        return tok + pe
