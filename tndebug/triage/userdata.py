"""`triage --data`: the user's own held-out batches, for every comparison triage makes.

    --data held_out.pt                 torch.save({"src": LongTensor[N, S], "tgt": LongTensor[N, T]})
    --data make_data.py:held_out       a function of no arguments returning that dict

A decoder-only or encoder-only model (`--model` code whose adapter is one stack, or tndebug's
decoder-only checkpoints) reads one sequence per row, as Hugging Face directories do
(tndebug/one_stack.py):

    --data held_out.pt                 torch.save({"ids": LongTensor[N, T]}) (or the bare tensor),
                                       optionally with "attention_mask" [N, T] (1 real, 0 padding)
    --data held_out.pt                 {"src": LongTensor[N, 0], "tgt": LongTensor[N, T]}: the
                                       same, decoder-only (the empty source, tgt the sequence)

`src` is the source, `tgt` the target *with* its BOS in column 0 (BOS target EOS, then pads),
both right-padded with --pad-id. Triage feeds the decoder `tgt_in = tgt[:, :-1]` and scores
`tgt_out = tgt[:, 1:]`, and sets `tgt_in` to pad wherever `tgt_out` is pad (the EOS of a short row
is not fed on): exactly how `tndebug.data` forms its batches (tgt_in = BOS + target, tgt_out =
target + EOS), so that `cat([tgt_in[:, :1], tgt_out], 1)` of any eval_set batch loads back as
the same batch. The .pt file is read with torch.load(weights_only=True); nothing in it is run.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

from tndebug.capture.adapters import load_callable
from tndebug.data import Batch
from tndebug.errors import UsageError
from tndebug.one_stack import MAX_SEQS, one_stack_batch
from tndebug.paths import data_file
from tndebug.padding import mid_sequence_pads, pad_text
from tndebug.subject import NO_PAD



@dataclass(frozen=True)
class OneStack:
    """--data of one sequence per row ({'ids': ...}, or an empty src): read by `for_kind` once
    the model's kind is known."""
    raw: dict
    spec: str
    form: str                                   # "ids" | "empty src"


def load_data(spec: str, pad_id: int, bos_id: int) -> Batch | OneStack:
    """`spec` (FILE.pt, or FILE.py:FUNCTION) -> a Batch of at most MAX_SEQS sequences, or, for
    one sequence per row, a OneStack (`for_kind` makes its Batch)."""
    path_s, sep, name = spec.rpartition(":")
    if sep and path_s.endswith(".py") and name:
        data = call_data_function(spec)
    else:
        data = read_data_file(Path(spec))
    if isinstance(data, torch.Tensor):
        data = {"ids": data}
    if isinstance(data, dict) and "ids" in data and "src" not in data and "tgt" not in data:
        return OneStack(data, spec, "ids")
    if isinstance(data, dict) and isinstance(data.get("src"), torch.Tensor) and data["src"].dim() == 2 \
            and data["src"].shape[1] == 0 and isinstance(data.get("tgt"), torch.Tensor):
        return OneStack({"ids": data["tgt"]}, spec, "empty src")
    return to_batch(data, pad_id, bos_id, spec)


def pad_ids(pad_id: int | None) -> tuple[int, int]:
    """--pad-id -> (the id the exact tests pad their own copies with, the id of the data's
    padding); `--pad-id none` (None: the data hold no padding) -> (0, NO_PAD): no id of the
    data is masked or ignored."""
    return (0, NO_PAD) if pad_id is None else (pad_id, pad_id)


def for_kind(data: Batch | OneStack, pad_id: int, kind: str) -> Batch:
    """The held-out Batch for a model of `kind`: one sequence per row for a decoder- or
    encoder-only model (one_stack.one_stack_batch); an encoder-decoder needs src and tgt."""
    if not isinstance(data, OneStack):
        return data
    if kind == "seq2seq":
        got = ("{'ids': ...}, one sequence per row" if data.form == "ids" else
               f"an empty src {tuple(data.raw['ids'].shape[:1]) + (0,)}")
        raise UsageError(f"--data {data.spec}: holds {got}, but the model is an encoder-decoder: "
                         f"it needs {{'src': LongTensor[N, S], 'tgt': LongTensor[N, T]}} (tgt "
                         f"BOS-led; docs/triage.md)")
    return one_stack_batch(data.raw, pad_id, kind, f"--data {data.spec}", pad_name="--pad-id")


def read_data_file(path: Path):
    """The object a --data FILE.pt holds (tensors only), or one UsageError line."""
    data_file(str(path))                     # missing, empty, a FIFO: one line (the CLI checks it first)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UsageError(f"--data {path}: holds pickled objects other than tensors; it was not "
                         f"loaded. Save plain tensors: torch.save({{'src': src, 'tgt': tgt}}, "
                         f"path)") from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        raise UsageError(f"--data {path}: not a torch.save file ({type(e).__name__}"
                         f"{': ' + first if first else ''})") from None


def call_data_function(spec: str):
    """What --data FILE.py:FUNCTION returns, called with no arguments, or one UsageError line."""
    fn, _ = load_callable(spec, "--data")
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise UsageError(f"--data {spec} raised {type(e).__name__}{': ' + first if first else ''} "
                         f"(it is called with no arguments and returns {{'src': ..., 'tgt': ...}})") from None


def to_batch(data, pad_id: int, bos_id: int, spec: str) -> Batch:
    """Check the dict and form (src, tgt_in, tgt_out); every problem is one UsageError line."""
    want = "{'src': LongTensor[N, S], 'tgt': LongTensor[N, T]}"
    if not isinstance(data, dict):
        raise UsageError(f"--data {spec}: expected {want}, got {type(data).__name__}")
    missing = [k for k in ("src", "tgt") if k not in data]
    if missing and "ids" in data:                 # the one-stack form, given to an encoder-decoder
        raise UsageError(f"--data {spec}: holds {{'ids': ...}}, one sequence per row, but the "
                         f"model is an encoder-decoder: it needs {want}")
    if missing:
        keys = ", ".join(map(str, list(data)[:8])) or "none"
        raise UsageError(f"--data {spec}: no {' and no '.join(repr(k) for k in missing)} key "
                         f"(keys: {keys}); expected {want}, or {{'ids': LongTensor[N, T]}} for "
                         f"a decoder- or encoder-only model")
    src, tgt = data["src"], data["tgt"]
    for key, t in (("src", src), ("tgt", tgt)):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"--data {spec}: {key!r} is a {type(t).__name__}, not a tensor; expected {want}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise UsageError(f"--data {spec}: {key!r} holds {str(t.dtype).removeprefix('torch.')}; "
                             f"token ids must be integers (torch.long)")
        if t.dim() != 2:
            raise UsageError(f"--data {spec}: {key!r} has shape {tuple(t.shape)}; expected [N, length] "
                             f"(batch first)")
    if src.shape[0] != tgt.shape[0]:
        raise UsageError(f"--data {spec}: src has {src.shape[0]} sequences but tgt has {tgt.shape[0]}")
    if src.shape[0] < 2 or src.shape[1] < 1 or tgt.shape[1] < 2:
        raise UsageError(f"--data {spec}: need at least 2 sequences, src length >= 1 and tgt length "
                         f">= 2 (BOS + one token); got src {tuple(src.shape)}, tgt {tuple(tgt.shape)}")
    src, tgt = src[:MAX_SEQS].long(), tgt[:MAX_SEQS].long()
    low = min(int(src.min()), int(tgt.min()))
    if low < 0:
        raise UsageError(f"--data {spec}: negative token id {low}")
    if not bool((tgt[:, 0] == bos_id).all()):
        bad = int((tgt[:, 0] != bos_id).nonzero()[0, 0])
        raise UsageError(f"--data {spec}: tgt must start with BOS (--bos-id {bos_id}) in column 0; "
                         f"row {bad} starts with {int(tgt[bad, 0])}")
    pads = mid_sequence_pads({"src": src, "tgt": tgt}, pad_id)
    if pads:
        raise UsageError(f"--data {spec}: {pad_text(pads, pad_id)}; pass the model's pad id "
                         f"(--pad-id)")
    tgt_out = tgt[:, 1:]                                                   # [N, T-1]
    tgt_in = tgt[:, :-1].masked_fill(tgt_out == pad_id, pad_id)            # [N, T-1]
    if not bool((tgt_out != pad_id).any()) or not bool((src != pad_id).any()):
        raise UsageError(f"--data {spec}: every {'target' if not bool((tgt_out != pad_id).any()) else 'source'} "
                         f"token is --pad-id {pad_id}: nothing to compare")
    return Batch(src.contiguous(), tgt_in.contiguous(), tgt_out.contiguous())


def check_vocab(batch: Batch, src_vocab: int | None, tgt_vocab: int | None, spec: str) -> None:
    """Ids must index the model's embeddings / logits."""
    for name, t, v in (("src", batch.src, src_vocab), ("tgt", torch.cat([batch.tgt_in, batch.tgt_out], 1), tgt_vocab)):
        if v is not None and t.numel() and int(t.max()) >= v:      # a decoder-only src is [N, 0]
            raise UsageError(f"--data {spec}: {name} holds token id {int(t.max())}, outside the "
                             f"model's {name} vocabulary of {v} (ids 0..{v - 1})")


