"""A user's model built around torch.nn.Transformer, in the style of the PyTorch translation
tutorial's `Seq2SeqTransformer` (sequence-first tensors, its own TokenEmbedding,
PositionalEncoding and generator), written independently of tndebug's model.

Bugs behind constructor arguments:

    pe=False           positional encoding computed but never added
    emb_scale=False    token embeddings not multiplied by sqrt(emb_size)
    causal=False       no tgt_mask: the decoder sees the future
    memory_mask=False  no memory_key_padding_mask: cross-attention reads source pads
    norm_first=True    Pre-LN (nn.Transformer keeps its final norms either way)

`forward` and `encode` below are the adapter: `tndebug triage --adapter THIS_FILE.py:forward`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class PositionalEncoding(nn.Module):
    def __init__(self, emb_size: int, dropout: float, maxlen: int = 64, add: bool = True):
        super().__init__()
        den = torch.exp(-torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        pos_embedding = pos_embedding.unsqueeze(-2)            # [maxlen, 1, emb]
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pos_embedding", pos_embedding)
        self.add = add

    def forward(self, token_embedding: Tensor):              # [T, B, emb]
        if not self.add:
            return self.dropout(token_embedding)
        return self.dropout(token_embedding + self.pos_embedding[: token_embedding.size(0), :])


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, emb_size: int, scale: bool = True):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.emb_size = emb_size
        self.scale = scale

    def forward(self, tokens: Tensor):
        x = self.embedding(tokens.long())
        return x * math.sqrt(self.emb_size) if self.scale else x


class Seq2SeqTransformer(nn.Module):
    def __init__(self, num_encoder_layers: int = 2, num_decoder_layers: int = 2, emb_size: int = 32,
                 nhead: int = 4, src_vocab_size: int = 11, tgt_vocab_size: int = 11,
                 dim_feedforward: int = 64, dropout: float = 0.1, *, pe: bool = True,
                 emb_scale: bool = True, causal: bool = True, memory_mask: bool = True,
                 norm_first: bool = False):
        super().__init__()
        self.transformer = nn.Transformer(d_model=emb_size, nhead=nhead,
                                          num_encoder_layers=num_encoder_layers,
                                          num_decoder_layers=num_decoder_layers,
                                          dim_feedforward=dim_feedforward, dropout=dropout,
                                          norm_first=norm_first)
        self.generator = nn.Linear(emb_size, tgt_vocab_size)
        self.src_tok_emb = TokenEmbedding(src_vocab_size, emb_size, emb_scale)
        self.tgt_tok_emb = TokenEmbedding(tgt_vocab_size, emb_size, emb_scale)
        self.positional_encoding = PositionalEncoding(emb_size, dropout=dropout, add=pe)
        self.causal, self.memory_mask = causal, memory_mask
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask,
                memory_key_padding_mask):
        src_emb = self.positional_encoding(self.src_tok_emb(src))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(trg))
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask if self.causal else None, None,
                                src_padding_mask, tgt_padding_mask,
                                memory_key_padding_mask if self.memory_mask else None)
        return self.generator(outs)

    def encode(self, src: Tensor, src_mask: Tensor, src_padding_mask=None):
        return self.transformer.encoder(self.positional_encoding(self.src_tok_emb(src)), src_mask,
                                        src_padding_mask)


def generate_square_subsequent_mask(sz):
    mask = (torch.triu(torch.ones((sz, sz))) == 1).transpose(0, 1)
    return mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))


def create_mask(src, tgt, pad_idx):                       # src [S, B], tgt [T, B]
    src_seq_len, tgt_seq_len = src.shape[0], tgt.shape[0]
    tgt_mask = generate_square_subsequent_mask(tgt_seq_len)
    src_mask = torch.zeros((src_seq_len, src_seq_len)).type(torch.bool)
    src_padding_mask = (src == pad_idx).transpose(0, 1)
    tgt_padding_mask = (tgt == pad_idx).transpose(0, 1)
    return src_mask, tgt_mask, src_padding_mask, tgt_padding_mask


# -- the adapter tndebug calls: batch-first ids in, batch-first logits out ----------------------
def forward(model, src, tgt, pad_id):
    """src [B, S], tgt [B, T] -> logits [B, T, V]."""
    s, t = src.T, tgt.T                                       # the tutorial is sequence-first
    src_mask, tgt_mask, src_pad, tgt_pad = create_mask(s, t, pad_id)
    logits = model(s, t, src_mask, tgt_mask, src_pad, tgt_pad, src_pad)
    return logits.transpose(0, 1)


def encode(model, src, pad_id):
    """src [B, S] -> memory [B, S, d]."""
    s = src.T
    src_mask = torch.zeros((s.shape[0], s.shape[0])).type(torch.bool)
    return model.encode(s, src_mask, (s == pad_id).T).transpose(0, 1)


def build(**kw):
    """The factory `--model THIS_FILE.py:build` calls."""
    return Seq2SeqTransformer(**kw)
