"""Rotary position embedding (RoPE; Su et al., 2021, "RoFormer", §3.4).

Each pair of features of q and k is rotated by an angle proportional to the token's position,
pos * theta_i with theta_i = base^(-2i/d_k), so that q_m . k_n depends on m - n only. Here the
pairs are (i, i + d_k/2) (the "rotate_half" layout of GPT-NeoX and Llama); RoFormer's own
equations pair (2i, 2i + 1), the same rotation on permuted features. v is not rotated.
"""
from __future__ import annotations

import torch
from torch import nn

BASE = 10000.0     # RoFormer's base, as the sinusoidal table's (paper §3.5)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1), the halves of the last axis.  # same shape as x"""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """x [B, h, T, d_k] rotated by the positions pos [B, T] (each row its own)."""

    def __init__(self, d_k: int, base: float = BASE) -> None:
        super().__init__()
        if d_k % 2:
            raise ValueError(f"rotary positions need an even d_k, not {d_k}")
        inv_freq = base ** (-torch.arange(0, d_k, 2, dtype=torch.float32) / d_k)     # [d_k/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, pos: torch.Tensor) -> torch.Tensor:
        """pos * theta_i, one per pair.  # [B, 1, T, d_k/2]"""
        return (pos.float()[..., None] * self.inv_freq)[:, None]

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ang = self.angles(pos)
        ang = torch.cat((ang, ang), dim=-1)                                 # [B, 1, T, d_k]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        return x * cos + rotate_half(x) * sin                               # [B, h, T, d_k]
