"""The reported bugs' mechanisms, each a subclass that replaces one method of a part of
`model.py` (applied from outside by `swap`). The thread each one reconstructs is in
`bugs.py`; the code here is written from the thread's description, not copied.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from model import Embeddings, MultiHeadAttention, PositionalEncoding, Residual, Seq2Seq


def swap(model: torch.nn.Module, base: type, buggy: type) -> int:
    """Every module of class `base` in `model` (the model itself too) becomes `buggy`."""
    n = 0
    for m in model.modules():
        if type(m) is base:
            m.__class__ = buggy
            n += 1
    if n == 0:
        raise ValueError(f"no {base.__name__} in {type(model).__name__} to swap for {buggy.__name__}")
    return n


# -- masks built in the model ----------------------------------------------------------------------
class PadMaskOnQueries(Seq2Seq):
    """The decoder's pad mask built as [B, 1, T, 1] (unsqueeze(1).unsqueeze(3)): it masks query
    rows, not keys; a pad row is then fully masked."""

    def tgt_mask(self, tgt):
        T = tgt.size(1)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=tgt.device))
        return (tgt != self.pad_id)[:, None, :, None] & causal                  # [B, 1, T, T]


class PadOnlyTgtMask(Seq2Seq):
    """The decoder self-attention gets the (bidirectional) padding mask, no causal mask."""

    def tgt_mask(self, tgt):
        return (tgt != self.pad_id)[:, None, None, :].expand(-1, 1, tgt.size(1), -1)


class NoTgtMask(Seq2Seq):
    """No target mask at all in training: every position attends to every position."""

    def tgt_mask(self, tgt):
        T = tgt.size(1)
        return torch.ones(tgt.size(0), 1, T, T, dtype=torch.bool, device=tgt.device)


class AllOnesSrcMask(Seq2Seq):
    """The source attention mask initialised to 1 everywhere: pads are attended."""

    def src_mask(self, src):
        return torch.ones_like(src, dtype=torch.bool)[:, None, None, :]


class InvertedSrcMask(Seq2Seq):
    """`src == pad` handed to code where True means 'attend' (the key_padding_mask convention
    read the other way round)."""

    def src_mask(self, src):
        return (src == self.pad_id)[:, None, None, :]


class FloatTrilTgtMask(Seq2Seq):
    """The causal mask as a float 0/1 tril (1 = keep), for an attention that adds float masks."""

    def tgt_mask(self, tgt):
        return super().tgt_mask(tgt).float()


class TrueIsPadMasks(Seq2Seq):
    """Masks built True at pads (and at the future), filled where True: the same positions."""

    def src_mask(self, src):
        return ~super().src_mask(src)

    def tgt_mask(self, tgt):
        T = tgt.size(1)
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=tgt.device), diagonal=1)
        return (tgt == self.pad_id)[:, None, None, :] | future


class TrueIsPadFill(MultiHeadAttention):
    def apply_mask(self, scores, mask):
        return scores.masked_fill(mask, torch.finfo(scores.dtype).min)


# -- the mask fill ----------------------------------------------------------------------------------
class NegInfFill(MultiHeadAttention):
    def apply_mask(self, scores, mask):
        return scores.masked_fill(~mask, float("-inf"))


class Fill1e10(MultiHeadAttention):
    def apply_mask(self, scores, mask):
        return scores.masked_fill(~mask, -1e10)


class Fill1e4(MultiHeadAttention):
    def apply_mask(self, scores, mask):
        return scores.masked_fill(~mask, -10000.0)


class FillFromMask(MultiHeadAttention):
    """paddings = mask * -1e9, then where(mask == 0, paddings, scores): the fill is mask's own 0."""

    def apply_mask(self, scores, mask):
        paddings = mask.to(scores.dtype) * -1e9
        return torch.where(mask, scores, paddings)


class AddFloatMask(MultiHeadAttention):
    """A float mask is added to the scores (nn.MultiheadAttention's rule for float attn_mask)."""

    def apply_mask(self, scores, mask):
        return scores + mask if mask.is_floating_point() else super().apply_mask(scores, mask)


class AdditiveMask(MultiHeadAttention):
    """(1 - mask) * -10000 added to the scores (BERT's extended attention mask)."""

    def apply_mask(self, scores, mask):
        return scores + (1.0 - mask.to(scores.dtype)) * -10000.0


class TriuForbidden(Seq2Seq):
    """The forbidden positions as triu(ones, diagonal=1), negated into the allowed ones."""

    def tgt_mask(self, tgt):
        T = tgt.size(1)
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=tgt.device), diagonal=1)
        return (tgt != self.pad_id)[:, None, None, :] & ~future


# -- the scale --------------------------------------------------------------------------------------
class NoScale(MultiHeadAttention):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1)


class ScaleByDk(MultiHeadAttention):
    """The scale without its square root: 1/d_k."""

    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / self.d_k


class ScaleAfterSoftmax(MultiHeadAttention):
    """softmax(q k^T) * scaling: the scale multiplies the probabilities, not the scores."""

    def scores(self, q, k):
        return q @ k.transpose(-2, -1)

    def normalise(self, scores):
        return scores.softmax(dim=-1) * (1.0 / math.sqrt(self.d_k))


class ScaleSplitQK(MultiHeadAttention):
    """1/d_k^(1/4) on q and on k: their product carries 1/sqrt(d_k)."""

    def scores(self, q, k):
        s = 1.0 / math.sqrt(math.sqrt(self.d_k))
        return (q * s) @ (k * s).transpose(-2, -1)


class ScaleOnQ(MultiHeadAttention):
    """q / sqrt(d_k) before the product instead of the [T, S] scores after it."""

    def scores(self, q, k):
        return (q / math.sqrt(self.d_k)) @ k.transpose(-2, -1)


# -- the softmax ------------------------------------------------------------------------------------
class SoftmaxBatchDim(MultiHeadAttention):
    def normalise(self, scores):
        return scores.softmax(dim=0)


class SoftmaxDim2(MultiHeadAttention):
    """softmax(dim=2), written for 3-D scores, on [B, h, T, S]: over the queries."""

    def normalise(self, scores):
        return scores.softmax(dim=2)


# -- heads ------------------------------------------------------------------------------------------
class SplitNoTranspose(MultiHeadAttention):
    """view(B, h, T, d_k) straight from [B, T, d]: positions and heads mixed."""

    def split_heads(self, x):
        B, T, _ = x.shape
        return x.reshape(B, self.h, T, self.d_k)


class MergeNoPermute(MultiHeadAttention):
    """reshape(B, T, h * d_k) straight from [B, h, T, d_k]."""

    def merge_heads(self, z):
        B, h, T, d_k = z.shape
        return z.reshape(B, T, h * d_k)


class DropoutAlways(MultiHeadAttention):
    """Attention dropout passed as a bare probability (dropout_p=self.p), also in eval mode."""

    def attend(self, p, v):
        return F.dropout(p, self.p_drop, training=True) @ v


# -- positions --------------------------------------------------------------------------------------
class PESingleRow(PositionalEncoding):
    """x + pe[:, T]: one row (position T's) added at every position."""

    def forward(self, x):
        return x + self.pe[:, x.size(1)].unsqueeze(1)


class PEByBatch(PositionalEncoding):
    """A sequence-first PE table indexed by x.size(0) on batch-first input: row b of the batch
    gets pe[b] at every position."""

    def forward(self, x):
        return x + self.pe[0, : x.size(0)].unsqueeze(1)


class PEPrecedence(PositionalEncoding):
    """-log(10000) / d // 2 parsed as (-log(10000) / d) // 2 = -1: frequencies exp(-2i)."""

    def table(self, d_model, max_len):
        pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model // 2))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        return pe


class PEIntegerDivision(PositionalEncoding):
    """10000^(2i / d) with integer division: exponent 0, every frequency 1."""

    def table(self, d_model, max_len):
        pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
        i = torch.arange(0, d_model, 2)
        div = 1.0 / torch.pow(10000.0, (i // d_model).float())
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        return pe


class ScaleInPE(PositionalEncoding):
    """x * sqrt(d_model) + PE inside the PE class (the embedding then returns lut(x) as is)."""

    def forward(self, x):
        return x * math.sqrt(self.d_model) + self.pe[:, : x.size(1)]


class UnscaledEmbedding(Embeddings):
    def forward(self, ids):
        return self.lut(ids)


class LogitScale(Seq2Seq):
    """Tied target embedding and generator; the sqrt(d_model) ratio put on the logits side
    (logits * d_model^-0.5) instead of the embedding side."""

    def forward(self, src, tgt):
        return super().forward(src, tgt) * self.cfg.d_model ** -0.5


# -- residuals --------------------------------------------------------------------------------------
class ResidualOfNorm(Residual):
    """x = norm(x); x + f(x): the stream carries the normalised input."""

    def forward(self, x, sublayer):
        x = self.norm(x)
        return x + self.dropout(sublayer(x))


class ResidualDoubled(Residual):
    """x = f(x); x = x + x: the sublayer's output added to itself, the input lost."""

    def forward(self, x, sublayer):
        x = self.dropout(sublayer(self.norm(x)))
        return x + x
