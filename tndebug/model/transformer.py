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
from tndebug.model.hooks import HookPoint, name_hook_points, tap
from tndebug.model.layers import DecoderLayer, EncoderLayer, Stack


class Generator(nn.Module):
    """Final linear projection to the target vocabulary (logits; softmax lives in the loss)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.tgt_vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


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
        enc = src_keep[:, None, None, :]                                     # [B, 1, 1, S]
        if cfg.has("pad_mask_query_axis"):
            enc = src_keep[:, None, :, None]                                 # [B, 1, S, 1] (wrong axis)
        memory = None if cfg.has("no_memory_mask") else src_keep[:, None, None, :]
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device)
        causal = causal.triu() if cfg.has("causal_transposed") else causal.tril()   # [T, T]
        dec = tgt_keep[:, None, None, :]                                     # [B, 1, 1, T]
        if not cfg.has("no_causal_mask"):
            dec = dec & causal                                               # [B, 1, T, T]
        if cfg.has("neg_inf_fill_all_masked"):   # a "square" padding mask hides pad queries too
            enc = enc & src_keep[:, None, :, None]
            dec = dec & tgt_keep[:, None, :, None]
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


def init_parameters(model: nn.Module, embeddings) -> None:
    """Xavier-uniform for matrices (as The Annotated Transformer), N(0, 1/d) token embeddings,
    tied to the generator when the config says so; the init faults. For `Transformer` and the
    decoder-only model alike (`model.cfg`, `model.generator`)."""
    cfg = model.cfg
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    for emb in embeddings:
        nn.init.normal_(emb.lut.weight, std=cfg.d_model ** -0.5)
        if cfg.tie_embeddings:
            emb.lut.weight = model.generator.proj.weight
    if cfg.has("identical_head_init"):
        for name, m in model.named_modules():
            if name.endswith("attn"):
                copy_head_zero(m)
    if cfg.has("dead_relu_init"):
        for name, m in model.named_modules():
            if name.endswith("ffn"):
                nn.init.constant_(m.w_1.bias, -3.0)


def copy_head_zero(attn: nn.Module) -> None:
    """Fault `identical_head_init`: every head's slice of W_Q, W_K, W_V and W_O copies head 0."""
    h, d_k = attn.h, attn.d_k
    with torch.no_grad():
        for lin in {id(l): l for l in (attn.w_q, attn.w_k, attn.w_v)}.values():
            w, b = lin.weight.view(h, d_k, -1), lin.bias.view(h, d_k)
            w[1:] = w[0]
            b[1:] = b[0]
        wo = attn.w_o.weight.view(-1, h, d_k)   # [d_model, h, d_k]: column block per head
        wo[:, 1:] = wo[:, :1]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_model(cfg: ModelConfig | None = None, **kw) -> nn.Module:
    """Build a Transformer from a config (default: the `small` preset); `arch="decoder"` gives
    the decoder-only model (tndebug.model.gpt)."""
    cfg = cfg or ModelConfig.small(**kw)
    if cfg.arch == "decoder":
        from tndebug.model.gpt import DecoderOnly
        return DecoderOnly(cfg)
    return Transformer(cfg)


__all__ = ["Transformer", "Generator", "make_model", "count_parameters"]
