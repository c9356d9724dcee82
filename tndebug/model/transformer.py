"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017, Fig. 1).

    model = Transformer(ModelConfig.small())
    logits = model(src, tgt_in)          # src [B, S], tgt_in [B, T] -> [B, T, tgt_vocab]

Masks are built inside from `pad_id` (True = may attend, see attention.py).
"""
from __future__ import annotations

import torch
from torch import nn

from tndebug.config import ModelConfig
from tndebug.model.embedding import Embeddings
from tndebug.model.gpt import DecoderOnly
from tndebug.model.hooks import HookPoint, name_hook_points, tap
from tndebug.model.layers import DecoderLayer, EncoderLayer, Generator, Stack, init_parameters


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.src_embed = Embeddings(cfg.src_vocab, cfg)
        self.tgt_embed = Embeddings(cfg.tgt_vocab, cfg)
        self.encoder = Stack(cfg, EncoderLayer)
        self.decoder = Stack(cfg, DecoderLayer)
        self.generator = Generator(cfg)
        self.hook_logits = HookPoint()   # [B, T, tgt_vocab]
        self.reset_parameters()
        self.hook_points = name_hook_points(self)

    # -- initialisation ------------------------------------------------------------
    def reset_parameters(self) -> None:
        init_parameters(self, (self.src_embed, self.tgt_embed))

    # -- masks ---------------------------------------------------------------------
    def masks(self, src: torch.Tensor, tgt: torch.Tensor):
        """Keep-masks: encoder self [B,1,1,S], decoder self [B,1,T,T], memory [B,1,1,S]."""
        cfg, T = self.cfg, tgt.shape[1]
        src_keep, tgt_keep = src != cfg.pad_id, tgt != cfg.pad_id          # [B, S], [B, T]
        enc = memory = src_keep[:, None, None, :]                            # [B, 1, 1, S]
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device).tril()   # [T, T]
        dec = tgt_keep[:, None, None, :] & causal                            # [B, 1, T, T]
        return enc, dec, memory

    # -- forward -------------------------------------------------------------------
    def encode(self, src: torch.Tensor, enc_keep: torch.Tensor | None = None) -> torch.Tensor:
        if enc_keep is None:
            enc_keep = self.masks(src, src[:, :1])[0]
        return self.encoder(self.src_embed(src), enc_keep)                  # [B, S, d_model]

    def decode(self, memory, src, tgt, dec_keep=None, memory_keep=None) -> torch.Tensor:
        """Logits for every target position.  # [B, T, tgt_vocab]"""
        if dec_keep is None:
            _, dec_keep, memory_keep = self.masks(src, tgt)
        x = self.decoder(self.tgt_embed(tgt), memory, dec_keep, memory_keep)
        return tap(self.hook_logits, self.generator(x))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        enc, dec, memory_keep = self.masks(src, tgt)
        memory = self.encode(src, enc)
        return self.decode(memory, src, tgt, dec, memory_keep)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build(cfg: ModelConfig) -> nn.Module:
    """The model a config describes, without its faults: a Transformer, or the decoder-only model
    (tndebug.model.gpt) for `arch="decoder"`. `tndebug.inject.make_model` is this plus the
    config's faults, each substituted from outside the model."""
    if cfg.arch == "decoder":
        return DecoderOnly(cfg)
    return Transformer(cfg)


__all__ = ["Transformer", "Generator", "build", "count_parameters"]
