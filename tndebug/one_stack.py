"""The user's data as one sequence per row, for a decoder-only or encoder-only model: {'ids':
[N, T]} (with an optional attention mask) -> the probes' Batch. Shared by triage (--data, --text)
and the library (check's data=), so it lives below both."""
from __future__ import annotations

import torch

from tndebug.data import Batch
from tndebug.errors import UsageError
from tndebug.padding import mid_sequence_pads, pad_text

MAX_SEQS = 64           # held-out sequences used (the first ones): 13 sweep forwards stay cheap
MASK_KEYS = ("attention_mask", "mask")        # {'ids', 'attention_mask'}: 1 real, 0 padding


def one_stack_batch(raw, pad: int, kind: str, spec: str, pad_name: str = "the config's pad id") -> Batch:
    """{'ids': [N, T]} (and optionally 'attention_mask' [N, T], 1 real, 0 padding: the ids are
    then set to `pad` where it is 0) -> the probes' Batch of a decoder-only model (src [N, 0],
    tgt_in = ids[:, :-1] with pad where tgt_out = ids[:, 1:] is pad) or of an encoder-only one
    (ids three times, its targets the ids: hf.encoder_only.MLM_LOSS); every problem one UsageError
    line. `pad` NO_PAD (-1, subject.py): the data hold no padding, every id is real."""
    want = f"{{'ids': LongTensor[N, T]}} (one sequence per row, right-padded with {pad_name})"
    t = raw.get("ids") if isinstance(raw, dict) else None
    if not isinstance(t, torch.Tensor):
        got = (f"the keys {', '.join(map(str, list(raw)[:8]))}" if isinstance(raw, dict) and raw
               else "an empty dict" if isinstance(raw, dict) else f"a {type(raw).__name__}")
        raise UsageError(f"{spec}: a {kind}-only model reads {want}; got {got}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() != 2:
        raise UsageError(f"{spec}: 'ids' is {str(t.dtype).removeprefix('torch.')} of shape "
                         f"{tuple(t.shape)}; expected {want}")
    t = t[:MAX_SEQS].long()
    if t.shape[0] < 2 or t.shape[1] < 2:
        raise UsageError(f"{spec}: need at least 2 sequences of at least 2 ids; got {tuple(t.shape)}")
    if int(t.min()) < 0:
        raise UsageError(f"{spec}: negative token id {int(t.min())}")
    t = _masked(raw, t, pad, spec, pad_name)
    pads = mid_sequence_pads({"ids": t}, pad)
    if pads:
        how = ("; pass the id your rows are padded with (--pad-id ID), or --pad-id none if your "
               "data have no padding" if pad_name == "--pad-id" else
               f"; rows are right-padded with {pad_name}")
        raise UsageError(f"{spec}: {pad_text(pads, pad)}{how}")
    if kind == "encoder":
        return Batch(t, t.clone(), t.clone())
    out = t[:, 1:]                                                          # [N, T-1]
    if not bool((out != pad).any()):
        raise UsageError(f"{spec}: every token after the first is the pad id {pad}: nothing to compare")
    return Batch(t.new_zeros((t.shape[0], 0)), t[:, :-1].masked_fill(out == pad, pad), out)


def _masked(raw: dict, t: torch.Tensor, pad: int, spec: str, pad_name: str) -> torch.Tensor:
    """The ids with `pad` wherever the optional attention mask is 0 (its rows padded only at
    their ends); `t` itself when there is no mask."""
    key = next((k for k in MASK_KEYS if k in raw), None)
    if key is None:
        return t
    m = raw[key]
    if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.shape[1] != raw["ids"].shape[1] \
            or m.shape[0] != raw["ids"].shape[0]:
        shape = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
        raise UsageError(f"{spec}: {key!r} is {shape}; expected [N, T] like 'ids' {tuple(raw['ids'].shape)} "
                         f"(1 at real tokens, 0 at padding)")
    m = m[:t.shape[0]].bool()                     # the rows kept (MAX_SEQS)
    holes = m.long().cumsum(1)
    hole = (~m) & (holes > 0) & (holes < holes[:, -1:])                      # a 0 between 1s
    if bool(hole.any()):
        r = int(hole.any(1).nonzero()[0, 0])
        raise UsageError(f"{spec}: {key!r} has a 0 between real tokens in row {r} (position "
                         f"{int(hole[r].nonzero()[0, 0])}); padding only fills the ends of a row")
    if not bool(m.all()) and pad < 0:
        raise UsageError(f"{spec}: {key!r} marks padding, but no pad id was given (pad_id=None: no "
                         f"padding); pass the id the rows are padded with ({pad_name})")
    return t.masked_fill(~m, pad)
