"""Dropout with P_drop from the config (paper §5.4: on every sublayer output and on embeddings + PE)."""
from __future__ import annotations

from torch import nn

from tndebug.config import ModelConfig


def make_dropout(cfg: ModelConfig) -> nn.Dropout:
    """nn.Dropout(cfg.dropout)."""
    return nn.Dropout(cfg.dropout)
