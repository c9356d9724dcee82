"""The two normalisations a block may use: the paper's LayerNorm, or RMSNorm.

LayerNorm (Ba et al., 2016):     y = (x - mean(x)) / sqrt(var(x) + eps) * g + b
RMSNorm (Zhang & Sennrich, 2019): y = x / sqrt(mean(x^2) + eps) * g     (no centring, no bias)
"""
from __future__ import annotations

import torch
from torch import nn

from tndebug.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last axis; weight only, eps inside the square root."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))    # g  [d_model]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the mean square in float32 (as Llama's), so a half-precision input cannot overflow it
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # [B, T, 1]
        return (x32 * inv_rms).type_as(x) * self.weight                     # [B, T, d_model]

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The config's normalisation over d_model: nn.LayerNorm or RMSNorm, eps = cfg.ln_eps."""
    if cfg.norm_kind == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.ln_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
