"""User-style encoder-decoders for the library tests, written independently of tndebug's model,
and the user's own training loop that `tndebug.watch` wraps.

* `Annotated`: The Annotated Transformer's shape (EncoderDecoder, MultiHeadedAttention with
  `linears`, SublayerConnection, a `generator` giving log-probabilities), called as
  `model(src, tgt, src_mask, tgt_mask)` then `model.generator(out)`.
* `TorchTransformer`: a wrapper around `torch.nn.Transformer` (batch first).
* `FusedSDPA`: one fused QKV Linear and F.scaled_dot_product_attention, learned positions.
* `bart()`: Hugging Face BART from a small config (nothing downloaded).

Each comes with `forward(model, src, tgt, pad_id) -> logits` for the probes, and `loss_of`
(how the user's loop calls it and scores it).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

V, PAD, BOS = 16, 0, 1


# -- data: a copy task -----------------------------------------------------------------------------
def copy_batch(g: torch.Generator, batch: int = 16, length: int = 8):
    """src = content ids >= 2 with right padding on half the rows; tgt = [BOS] + src."""
    src = torch.randint(2, V, (batch, length), generator=g)
    lengths = torch.randint(3, length + 1, (batch,), generator=g)
    lengths[: batch // 2] = length
    src[torch.arange(length)[None, :] >= lengths[:, None]] = PAD
    tgt = torch.cat([torch.full((batch, 1), BOS), src], dim=1)
    return src, tgt                                                 # [B, S], [B, S + 1]


# -- The Annotated Transformer's shape -------------------------------------------------------------
def clones(module, n):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


def attention(query, key, value, mask=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)     # [B, h, T, S]
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model):
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.linears = clones(nn.Linear(d_model, d_model), 4)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)
        B = query.size(0)
        q, k, v = [lin(x).view(B, -1, self.h, self.d_k).transpose(1, 2)
                   for lin, x in zip(self.linears, (query, key, value))]             # [B, h, T, d_k]
        x, _ = attention(q, k, v, mask=mask)
        x = x.transpose(1, 2).contiguous().view(B, -1, self.h * self.d_k)
        return self.linears[-1](x)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.w_2(self.w_1(x).relu())


class SublayerConnection(nn.Module):
    """Pre-norm residual, as The Annotated Transformer writes it."""
    def __init__(self, size):
        super().__init__()
        self.norm = nn.LayerNorm(size)

    def forward(self, x, sublayer):
        return x + sublayer(self.norm(x))


class EncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward):
        super().__init__()
        self.self_attn, self.feed_forward = self_attn, feed_forward
        self.sublayer = clones(SublayerConnection(size), 2)

    def forward(self, x, mask):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, mask))
        return self.sublayer[1](x, self.feed_forward)


class DecoderLayer(nn.Module):
    def __init__(self, size, self_attn, src_attn, feed_forward):
        super().__init__()
        self.self_attn, self.src_attn, self.feed_forward = self_attn, src_attn, feed_forward
        self.sublayer = clones(SublayerConnection(size), 3)

    def forward(self, x, memory, src_mask, tgt_mask):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, tgt_mask))
        x = self.sublayer[1](x, lambda x: self.src_attn(x, memory, memory, src_mask))
        return self.sublayer[2](x, self.feed_forward)


class Encoder(nn.Module):
    def __init__(self, layer, n):
        super().__init__()
        self.layers, self.norm = clones(layer, n), nn.LayerNorm(layer.self_attn.linears[0].in_features)

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class Decoder(nn.Module):
    def __init__(self, layer, n):
        super().__init__()
        self.layers, self.norm = clones(layer, n), nn.LayerNorm(layer.self_attn.linears[0].in_features)

    def forward(self, x, memory, src_mask, tgt_mask):
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


class Embeddings(nn.Module):
    def __init__(self, d_model, vocab):
        super().__init__()
        self.lut, self.d_model = nn.Embedding(vocab, d_model), d_model

    def forward(self, x):
        return self.lut(x) * math.sqrt(self.d_model)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=64):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div_term), torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class Generator(nn.Module):
    def __init__(self, d_model, vocab):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        return self.proj(x).log_softmax(dim=-1)


class EncoderDecoder(nn.Module):
    def __init__(self, encoder, decoder, src_embed, tgt_embed, generator):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.src_embed, self.tgt_embed, self.generator = src_embed, tgt_embed, generator

    def forward(self, src, tgt, src_mask, tgt_mask):
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)

    def encode(self, src, src_mask):
        return self.encoder(self.src_embed(src), src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)


def annotated(d_model=32, h=4, d_ff=64, n=2):
    c = copy.deepcopy
    attn, ff = MultiHeadedAttention(h, d_model), PositionwiseFeedForward(d_model, d_ff)
    model = EncoderDecoder(
        Encoder(EncoderLayer(d_model, c(attn), c(ff)), n),
        Decoder(DecoderLayer(d_model, c(attn), c(attn), c(ff)), n),
        nn.Sequential(Embeddings(d_model, V), PositionalEncoding(d_model)),
        nn.Sequential(Embeddings(d_model, V), PositionalEncoding(d_model)),
        Generator(d_model, V))
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


def annotated_masks(src, tgt, pad_id):
    src_mask = (src != pad_id).unsqueeze(-2)                                   # [B, 1, S]
    T = tgt.size(-1)
    causal = torch.tril(torch.ones(1, T, T, dtype=torch.bool, device=tgt.device))
    return src_mask, (tgt != pad_id).unsqueeze(-2) & causal                    # [B, T, T]


def annotated_forward(model, src, tgt, pad_id):
    src_mask, tgt_mask = annotated_masks(src, tgt, pad_id)
    return model.generator(model(src, tgt, src_mask, tgt_mask))               # log-probs [B, T, V]


# -- a torch.nn.Transformer wrapper ----------------------------------------------------------------
class TorchTransformer(nn.Module):
    def __init__(self, d_model=32, nhead=4, layers=2, d_ff=64, max_len=64):
        super().__init__()
        self.d_model = d_model
        self.src_tok, self.tgt_tok = nn.Embedding(V, d_model), nn.Embedding(V, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.transformer = nn.Transformer(d_model, nhead, layers, layers, d_ff, dropout=0.0,
                                          batch_first=True, norm_first=True)
        self.out = nn.Linear(d_model, V)

    def embed(self, tok, ids):
        return tok(ids) * math.sqrt(self.d_model) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, src, tgt, pad_id=PAD):
        T = tgt.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=tgt.device)
        h = self.transformer(self.embed(self.src_tok, src), self.embed(self.tgt_tok, tgt),
                             tgt_mask=causal, tgt_is_causal=True,
                             src_key_padding_mask=src == pad_id, memory_key_padding_mask=src == pad_id,
                             tgt_key_padding_mask=tgt == pad_id)
        return self.out(h)                                                    # [B, T, V]


def torch_forward(model, src, tgt, pad_id):
    return model(src, tgt, pad_id)


# -- fused QKV + scaled_dot_product_attention ------------------------------------------------------
class FusedSelfAttention(nn.Module):
    def __init__(self, d, h, causal=False, scale=True):
        super().__init__()
        self.h, self.causal, self.scale = h, causal, None if scale else 1.0   # 1.0: the bug
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, keep):                                               # x [B, T, d], keep [B, T]
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.h, d // self.h).transpose(1, 2) for t in self.qkv(x).split(d, 2))
        mask = keep[:, None, None, :]
        if self.causal:
            mask = mask & torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)   # [B, h, T, d_k]
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class FusedCrossAttention(nn.Module):
    def __init__(self, d, h, scale=True):
        super().__init__()
        self.h, self.scale = h, None if scale else 1.0
        self.q, self.kv, self.proj = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x, memory, keep):
        B, T, d = x.shape
        S = memory.shape[1]
        q = self.q(x).view(B, T, self.h, d // self.h).transpose(1, 2)
        k, v = (t.view(B, S, self.h, d // self.h).transpose(1, 2) for t in self.kv(memory).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :], scale=self.scale)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class MLP(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc(x)))


class EncBlock(nn.Module):
    def __init__(self, d, h, d_ff, scale=True):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = FusedSelfAttention(d, h, scale=scale), MLP(d, d_ff)

    def forward(self, x, keep):
        x = x + self.attn(self.ln_1(x), keep)
        return x + self.mlp(self.ln_2(x))


class DecBlock(nn.Module):
    def __init__(self, d, h, d_ff, scale=True):
        super().__init__()
        self.ln_1, self.ln_2, self.ln_3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = FusedSelfAttention(d, h, causal=True, scale=scale)
        self.cross = FusedCrossAttention(d, h, scale=scale)
        self.mlp = MLP(d, d_ff)

    def forward(self, x, memory, tgt_keep, src_keep):
        x = x + self.attn(self.ln_1(x), tgt_keep)
        x = x + self.cross(self.ln_2(x), memory, src_keep)
        return x + self.mlp(self.ln_3(x))


class FusedSDPA(nn.Module):
    """`scale=False`: the bug, SDPA called with scale=1.0 (no 1/sqrt(d_k))."""
    def __init__(self, d=32, h=4, n_layer=2, d_ff=64, max_len=64, scale=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(max_len, d)
        self.enc = nn.ModuleList([EncBlock(d, h, d_ff, scale) for _ in range(n_layer)])
        self.dec = nn.ModuleList([DecBlock(d, h, d_ff, scale) for _ in range(n_layer)])
        self.ln_e, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)

    def embed(self, ids):
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, src, tgt, pad_id=PAD):
        x, keep = self.embed(src), src != pad_id
        for block in self.enc:
            x = block(x, keep)
        memory, y = self.ln_e(x), self.embed(tgt)
        for block in self.dec:
            y = block(y, memory, tgt != pad_id, keep)
        return self.lm_head(self.ln_f(y))                                      # [B, T, V]


def fused_forward(model, src, tgt, pad_id):
    return model(src, tgt, pad_id)


# -- Hugging Face BART -----------------------------------------------------------------------------
def bart(d_model=32, layers=2, heads=4, d_ff=64, attn="eager"):
    from transformers import BartConfig, BartForConditionalGeneration
    cfg = BartConfig(vocab_size=V, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                     encoder_attention_heads=heads, decoder_attention_heads=heads,
                     encoder_ffn_dim=d_ff, decoder_ffn_dim=d_ff, max_position_embeddings=64,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                     pad_token_id=PAD, bos_token_id=BOS, eos_token_id=2, decoder_start_token_id=BOS,
                     forced_eos_token_id=None, attn_implementation=attn)
    torch.manual_seed(0)
    return BartForConditionalGeneration(cfg)


# -- the user's loop -------------------------------------------------------------------------------
MODELS = {
    "annotated": (annotated, annotated_forward),
    "torch": (TorchTransformer, torch_forward),
    "sdpa": (FusedSDPA, fused_forward),
    "bart": (bart, None),
}


def train_step(kind: str, model, src, tgt, *, criterion=None):
    """One forward as the user writes it; returns the loss (backward is the caller's)."""
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    if kind == "bart":
        labels = tgt_out.masked_fill(tgt_out == PAD, -100)
        out = model(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=tgt_in,
                    labels=labels)
        if criterion is None:
            return out.loss
        logits = out.logits
    elif kind == "annotated":
        src_mask, tgt_mask = annotated_masks(src, tgt_in, PAD)
        logits = model.generator(model(src, tgt_in, src_mask, tgt_mask))
    else:
        logits = model(src, tgt_in, PAD)
    crit = criterion or (lambda lg, t: F.cross_entropy(lg, t, ignore_index=PAD))
    return crit(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))


def train(kind: str, model, optimizer, steps: int, *, seed: int = 0, scheduler=None, criterion=None,
          dbg=None, step_after=False, on_step=None):
    """The user's plain loop: forward, loss, backward, step. Returns the losses."""
    g = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for i in range(steps):
        src, tgt = copy_batch(g)
        loss = train_step(kind, model, src, tgt, criterion=criterion)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if on_step is not None:
            on_step(i, model)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if dbg is not None and step_after:
            dbg.step(loss=loss)
        losses.append(loss.item())
    return losses
