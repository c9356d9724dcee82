"""A decoder-only (GPT-style) Transformer: the same blocks as the encoder-decoder, one causal
stack over prompt + continuation, a head tied to the token embedding or not.

    model = DecoderOnly(ModelConfig.small(arch="decoder"))
    logits = model(ids)                  # ids [B, T] -> [B, T, vocab]

Each row's positions count from its first real token, so a left-padded row (batched generation)
gets the same positions, and the same logits, as the row alone. Keys that are pads are masked
whatever side they are on. `encode`/`decode` let the seq2seq greedy decoder drive it: the prompt
(BOS + source + EOS) is left-padded once, and each step runs the whole prefix.
"""
from __future__ import annotations

import torch
from torch import nn

from tndebug.config import ModelConfig
from tndebug.data import BOS, EOS
from tndebug.model.embedding import Embeddings
from tndebug.model.hooks import HookPoint, name_hook_points, tap
from tndebug.model.layers import EncoderLayer, Stack
from tndebug.model.transformer import Generator, copy_head_zero


class DecoderOnly(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tgt_embed = Embeddings(cfg.tgt_vocab, cfg)
        self.decoder = Stack(cfg, EncoderLayer)        # self-attention + FFN blocks, causal mask
        self.generator = Generator(cfg)
        self.hook_logits = HookPoint()   # [B, T, vocab]
        self.reset_parameters()
        self.hook_points = name_hook_points(self)

    def reset_parameters(self) -> None:
        """As the encoder-decoder: Xavier-uniform matrices, N(0, 1/d) token embeddings."""
        cfg = self.cfg
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        nn.init.normal_(self.tgt_embed.lut.weight, std=cfg.d_model ** -0.5)
        if cfg.tie_embeddings:
            self.tgt_embed.lut.weight = self.generator.proj.weight
        if cfg.has("identical_head_init"):
            for name, m in self.named_modules():
                if name.endswith("attn"):
                    copy_head_zero(m)
        if cfg.has("dead_relu_init"):
            for name, m in self.named_modules():
                if name.endswith("ffn"):
                    nn.init.constant_(m.w_1.bias, -3.0)

    def masks(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep [B, 1, T, T]: causal and not a pad key, left pads per row [B])."""
        cfg, T = self.cfg, ids.shape[1]
        real = ids != cfg.pad_id                                              # [B, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device)
        causal = causal.triu() if cfg.has("causal_transposed") else causal.tril()
        keep = real[:, None, None, :]                                         # [B, 1, 1, T]
        if cfg.has("pad_mask_query_axis"):
            keep = real[:, None, :, None]                                     # [B, 1, T, 1] (wrong axis)
        if not cfg.has("no_causal_mask"):
            keep = keep & causal                                              # [B, 1, T, T]
        if cfg.has("neg_inf_fill_all_masked"):
            keep = keep & real[:, None, :, None]
        # a row's leading pads; a row of pads only keeps position 0 for all
        lead = torch.where(real.any(1), real.int().argmax(1), torch.zeros_like(real[:, 0], dtype=torch.long))
        if cfg.has("positions_ignore_left_pad"):
            lead = torch.zeros_like(lead)
        return keep, lead

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep, lead = self.masks(ids)
        x = self.decoder(self.tgt_embed(ids, lead), keep)
        return tap(self.hook_logits, self.generator(x))                      # [B, T, vocab]

    # -- the greedy decoder's interface (tndebug.train.evaluate) ---------------------------
    def encode(self, src: torch.Tensor) -> torch.Tensor:
        """The prompt BOS + source + EOS of each row, left-padded.  # [B, S + 2]"""
        pad = self.cfg.pad_id
        real = src != pad                                                     # [B, S] right-padded
        n = real.sum(1)                                                       # [B]
        S = src.shape[1]
        prompt = torch.full((src.shape[0], S + 2), pad, dtype=src.dtype, device=src.device)
        for b in range(src.shape[0]):
            row = src[b, :int(n[b])]
            if row.numel() and int(row[-1]) == EOS:                           # the task's source EOS
                row = row[:-1]
            body = torch.cat([row.new_tensor([BOS]), row, row.new_tensor([EOS])])
            prompt[b, prompt.shape[1] - body.numel():] = body
        return prompt

    def decode(self, prompt, src, ys) -> torch.Tensor:
        """Logits for each position of `ys` (BOS-led): the prompt's last position predicts the
        first target token.  # [B, t, vocab]"""
        ids = torch.cat([prompt, ys[:, 1:]], dim=1)
        return self(ids)[:, prompt.shape[1] - 1:]
