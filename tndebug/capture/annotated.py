"""The Annotated Transformer's call, as the built-in `annotated` adapter makes it:
`model(src, tgt, src_mask, tgt_mask)` then `model.generator`, its masks built by the model
module's own `Batch.make_std_mask` / `subsequent_mask` where it defines them (a bug in them is
then exercised), else by tndebug (TNDEBUG_MASKS_NOTE says so).
"""
from __future__ import annotations

import sys

import torch
from torch import nn


def subsequent_mask(size: int, device=None) -> torch.Tensor:
    """True where position i may attend to j <= i.  # [1, T, T]"""
    return torch.ones(1, size, size, dtype=torch.bool, device=device).tril()


TNDEBUG_MASKS_NOTE = ("masks built by tndebug: the model's module defines neither subsequent_mask "
                      "nor Batch.make_std_mask, so the model's own mask code was not exercised")


def _model_module(model: nn.Module):
    """The module the model's class was defined in (the user's file), or None."""
    return sys.modules.get(type(model).__module__)


def annotated_mask_source(model: nn.Module) -> str:
    """Where the annotated adapter's decoder mask comes from: 'Batch.make_std_mask',
    'subsequent_mask' (the user's own functions) or 'tndebug'."""
    mod = _model_module(model)
    if callable(getattr(getattr(mod, "Batch", None), "make_std_mask", None)):
        return "Batch.make_std_mask"
    if callable(getattr(mod, "subsequent_mask", None)):
        return "subsequent_mask"
    return "tndebug"


def annotated_masks(model: nn.Module, src, tgt, pad_id):
    """(src_mask [B, 1, S], tgt_mask [B, T, T]) as The Annotated Transformer's `Batch` builds them,
    with the user's own mask functions when the model's module defines them (a bug in them is
    then exercised, not hidden)."""
    src_mask = (src != pad_id).unsqueeze(-2)                                   # [B, 1, S]
    source, mod = annotated_mask_source(model), _model_module(model)
    if source == "Batch.make_std_mask":
        tgt_mask = mod.Batch.make_std_mask(tgt, pad_id)
    elif source == "subsequent_mask":
        tgt_mask = (tgt != pad_id).unsqueeze(-2) & mod.subsequent_mask(tgt.shape[-1]).to(tgt.device).bool()
    else:
        tgt_mask = (tgt != pad_id).unsqueeze(-2) & subsequent_mask(tgt.shape[-1], tgt.device)
    return src_mask, tgt_mask.to(tgt.device)                                   # [B, T, T]


def annotated_forward(model, src, tgt, pad_id):
    src_mask, tgt_mask = annotated_masks(model, src, tgt, pad_id)
    return model.generator(model(src, tgt, src_mask, tgt_mask))               # [B, T, V]


def annotated_encode(model, src, pad_id):
    return model.encode(src, (src != pad_id).unsqueeze(-2))                   # [B, S, d]
