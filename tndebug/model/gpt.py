"""A decoder-only (GPT-style) Transformer: the same blocks as the encoder-decoder, one causal
stack over prompt + continuation, a head tied to the token embedding or not.

    model = DecoderOnly(ModelConfig.small(arch="decoder"))
    logits = model(ids)                  # ids [B, T] -> [B, T, vocab]

Each row's positions count from its first real token, so a left-padded row (batched generation)
gets the same positions, and the same logits, as the row alone. Keys that are pads are masked
whatever side they are on. `encode`/`decode` let the seq2seq greedy decoder drive it: the prompt
(BOS + source + EOS) is left-padded once, and each step runs the whole prefix.

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
from tndebug.model.layers import EncoderLayer, Stack
from tndebug.model.transformer import Generator, init_parameters


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

    # -- the KV cache: generation one token at a time ------------------------------------------
    def incremental(self, ids: torch.Tensor, split: int) -> torch.Tensor:
        """Logits of positions split.. of `ids` [B, T], computed as generation does: the prefix
        ids[:, :split] in one block, which fills each layer's KV cache, then each later token
        alone, attending to the cache and itself.  # [B, T - split, vocab]

        Position t's query row is row t of the full forward's mask (causal, aligned bottom-right:
        the new query is the last key), and its position counts from the row's first real token,
        as in `forward`."""
        cfg, T = self.cfg, ids.shape[1]
        keep, lead = self.masks(ids)
        keep = keep.expand(ids.shape[0], 1, T, T)                             # [B, 1, T, T]
        pos = (torch.arange(T, device=ids.device)[None] - lead[:, None]).clamp(min=0)  # [B, T]
        caches: list[dict[str, torch.Tensor]] = [{} for _ in self.decoder.layers]
        blocks = [(0, split)] if split > 0 else []
        blocks += [(t, t + 1) for t in range(max(split, 0), T)]
        out = []
        for a, b in blocks:
            mask = keep[:, :, a:b, :b]                                         # [B, 1, b-a, b]
            if cfg.has("kv_cache_causal_top_left"):
                # fault: SDPA's is_causal=True on a query block shorter than its keys aligns
                # tril(ones(L, S)) top-left, so a one-token query sees only the first key
                mask = mask & torch.ones(b - a, b, dtype=torch.bool, device=ids.device).tril()
            p = pos[:, a:b]
            if a > 0 and cfg.has("kv_cache_position_off_by_one"):
                p = p + 1                                 # fault: the new token one position late
            x = self.embed_at(ids[:, a:b], p)                                  # [B, b-a, d_model]
            for layer, cache in zip(self.decoder.layers, caches):
                x = layer.sublayer[0](x, lambda y, l=layer, c=cache, m=mask: attend(l.self_attn, y, c, m))
                x = layer.sublayer[1](x, layer.ffn)
            if self.decoder.norm is not None:
                x = self.decoder.norm(x)
            if b > split:
                out.append(self.generator(x)[:, max(split - a, 0):])           # [B, b-max(a,split), vocab]
        if not out:
            return self.generator(self.embed_at(ids[:, :0], pos[:, :0]))       # [B, 0, vocab]
        return torch.cat(out, 1)                                               # [B, T - split, vocab]

    def embed_at(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The embedding of tokens `ids` [B, n] at positions `pos` [B, n], as `Embeddings` adds
        them (scaled token, PE row, dropout).  # [B, n, d_model]"""
        e = self.tgt_embed
        tok = e.lut(ids) * e.scale                                             # [B, n, d_model]
        if not e.add_pe:
            return e.dropout(tok)
        pe = e.positions(int(pos.max()) + 1 if pos.numel() else 1)[pos]       # [B, n, d_model]
        return e.dropout(tok + pe.to(tok.dtype))

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


def attend(attn: MultiHeadAttention, x: torch.Tensor, cache: dict, keep: torch.Tensor) -> torch.Tensor:
    """Self-attention of the query block x [B, n, d_model] over the cached keys and values and
    its own, which it appends to `cache` ({"k", "v"}: [B, h, S, d_k]). keep [B, 1, n, S].
    The explicit path of `MultiHeadAttention` (its faults included), with keys from the cache."""
    B, n, _ = x.shape
    q = attn.split_heads(attn.w_q(x))                                          # [B, h, n, d_k]
    k, v = attn.split_heads(attn.w_k(x)), attn.split_heads(attn.w_v(x))       # [B, h, n, d_k]
    if cache:
        k = torch.cat([cache["k"], k], dim=2)                                  # [B, h, S, d_k]
        v = torch.cat([cache["v"], v], dim=2)
    cache["k"], cache["v"] = k, v
    if attn.invert_mask:
        keep = ~keep
    z = attn.explicit(q, k, v, keep)                                           # [B, h, n, d_k]
    z = z.reshape(B, n, -1) if attn.view_bug else z.transpose(1, 2).reshape(B, n, -1)
    return attn.w_o(z)                                                         # [B, n, d_model]
