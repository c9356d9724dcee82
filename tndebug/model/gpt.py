"""A decoder-only (GPT-style) Transformer: the same blocks as the encoder-decoder, one causal
stack over prompt + continuation, a head tied to the token embedding or not.

    model = DecoderOnly(ModelConfig.small(arch="decoder"))
    logits = model(ids)                  # ids [B, T] -> [B, T, vocab]

Each row's positions count from its first real token, so a left-padded row (batched generation)
gets the same positions, and the same logits, as the row alone. Keys that are pads are masked
whatever side they are on. `encode`/`decode` let the seq2seq greedy decoder drive it: the prompt
(BOS + source + EOS) is left-padded once, and each step runs the whole prefix.

With `cfg.pos == "rotary"` the same positions rotate q and k in every self-attention instead of
adding the sinusoidal table at the embedding (tndebug/model/rotary.py).

`incremental(ids, split)` decodes the way generation does: the prefix once, filling a KV cache
(each layer's keys and values [B, h, S, d_k]), then one token at a time through it; healthy, it
gives the full forward's logits (tests/model/test_gpt.py).
"""
from __future__ import annotations

import torch
from torch import nn

from tndebug.config import ModelConfig
from tndebug.data import BOS, EOS
from tndebug.model.embedding import Embeddings
from tndebug.model.hooks import HookPoint, name_hook_points, tap
from tndebug.model.attention import MultiHeadAttention
from tndebug.model.layers import EncoderLayer, Generator, Stack, init_parameters


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
        init_parameters(self, (self.tgt_embed,))         # as the encoder-decoder

    def masks(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep [B, 1, T, T]: causal and not a pad key, left pads per row [B])."""
        T = ids.shape[1]
        real = ids != self.cfg.pad_id                                         # [B, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        keep = real[:, None, None, :] & causal                                # [B, 1, T, T]
        # a row's leading pads; a row of pads only keeps position 0 for all
        lead = torch.where(real.any(1), real.int().argmax(1), torch.zeros_like(real[:, 0], dtype=torch.long))
        return keep, lead

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep, lead = self.masks(ids)
        x = self.decoder(self.tgt_embed(ids, lead), keep, self.rotary_positions(ids, lead))
        return tap(self.hook_logits, self.generator(x))                      # [B, T, vocab]

    def rotary_positions(self, ids: torch.Tensor, lead: torch.Tensor) -> torch.Tensor | None:
        """Each token's position from its row's first real token (pads 0), for the rotary
        self-attention; None when positions are the embedding's table.  # [B, T]"""
        if self.cfg.pos != "rotary":
            return None
        return (torch.arange(ids.shape[1], device=ids.device)[None] - lead[:, None]).clamp(min=0)

    # -- the KV cache: generation one token at a time ------------------------------------------
    def incremental(self, ids: torch.Tensor, split: int) -> torch.Tensor:
        """Logits of positions split.. of `ids` [B, T], computed as generation does: the prefix
        ids[:, :split] in one block, which fills each layer's KV cache, then each later token
        alone, attending to the cache and itself.  # [B, T - split, vocab]

        Position t's query row is row t of the full forward's mask (causal, aligned bottom-right:
        the new query is the last key), and its position counts from the row's first real token,
        as in `forward`."""
        T = ids.shape[1]
        keep, lead = self.masks(ids)
        keep = keep.expand(ids.shape[0], 1, T, T)                             # [B, 1, T, T]
        pos = (torch.arange(T, device=ids.device)[None] - lead[:, None]).clamp(min=0)  # [B, T]
        caches: list[dict[str, torch.Tensor]] = [{} for _ in self.decoder.layers]
        blocks = [(0, split)] if split > 0 else []
        blocks += [(t, t + 1) for t in range(max(split, 0), T)]
        out = []
        for a, b in blocks:
            mask = self.block_mask(keep, a, b)                                 # [B, 1, b-a, b]
            at = self.block_positions(pos, a, b)                               # [B, b-a]
            x = self.embed_at(ids[:, a:b], at)                                 # [B, b-a, d_model]
            for layer, cache in zip(self.decoder.layers, caches):
                x = layer.sublayer[0](x, lambda y, l=layer, c=cache, m=mask, p=at:
                                      attend(l.self_attn, y, c, m, p))
                x = layer.sublayer[1](x, layer.ffn)
            if self.decoder.norm is not None:
                x = self.decoder.norm(x)
            if b > split:
                out.append(self.generator(x)[:, max(split - a, 0):])           # [B, b-max(a,split), vocab]
        if not out:
            return self.generator(self.embed_at(ids[:, :0], pos[:, :0]))       # [B, 0, vocab]
        return torch.cat(out, 1)                                               # [B, T - split, vocab]

    def block_mask(self, keep: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """The keep-mask of query block a..b over keys 0..b: rows a..b of the full forward's
        mask (causal aligned bottom-right: the block's last query is the last key).
        keep [B, 1, T, T] -> [B, 1, b - a, b]"""
        return keep[:, :, a:b, :b]

    def block_positions(self, pos: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """The positions of tokens a..b, as the full forward gives them.  # [B, b - a]"""
        return pos[:, a:b]

    def embed_at(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The embedding of tokens `ids` [B, n] at positions `pos` [B, n], as `Embeddings` adds
        them (scaled token, PE row, dropout).  # [B, n, d_model]"""
        e = self.tgt_embed
        tok = e.lut(ids) * e.scale                                             # [B, n, d_model]
        if not e.adds_pe:                                                      # rotary: in attention
            return e.dropout(tok)
        pe = e.positions(int(pos.max()) + 1 if pos.numel() else 1)[pos]       # [B, n, d_model]
        return e.dropout(e.add_positions(tok, pe.to(tok.dtype)))

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


def attend(attn: MultiHeadAttention, x: torch.Tensor, cache: dict, keep: torch.Tensor,
           pos: torch.Tensor) -> torch.Tensor:
    """Self-attention of the query block x [B, n, d_model] at positions pos [B, n] over the
    cached keys and values and its own, which it appends to `cache` ({"k", "v"}: [B, h, S, d_k];
    rotary keys are cached rotated). keep [B, 1, n, S].
    The explicit path of `MultiHeadAttention`, with keys from the cache."""
    q = attn.split_heads(attn.w_q(x))                                          # [B, h, n, d_k]
    k, v = attn.split_heads(attn.w_k(x)), attn.split_heads(attn.w_v(x))       # [B, h, n, d_k]
    q, k, v = attn.positioned(q, k, v, pos if attn.rope is not None else None)
    if cache:
        k = torch.cat([cache["k"], k], dim=2)                                  # [B, h, S, d_k]
        v = torch.cat([cache["v"], v], dim=2)
    cache["k"], cache["v"] = k, v
    z = attn.explicit(q, k, v, keep)                                           # [B, h, n, d_k]
    return attn.w_o(attn.merge_heads(z))                                       # [B, n, d_model]
