"""The library's argument checks: every bad argument of `watch` and `check` is one UsageError
line, raised on entry, that names the argument, quotes the bad value and says what to pass.

docs/bad_input.md (its library section) lists each one with the exact line it gets.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tndebug.errors import UsageError
from tndebug.outputs import LIBRARY, claim_output as claim, held_here, resolve_output
from tndebug.padding import mid_sequence_pads, pad_text
from tndebug.probes import TRAINING_ONLY
from tndebug.probes.base import Probe


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def callable_or_none(value: Any, where: str, name: str, expected: str) -> None:
    """`value` is None or callable; else `where: name=...: expected ..., got TYPE`."""
    if value is not None and not callable(value):
        raise UsageError(f"{where}: {name}={_shown(value)} is a {type(value).__name__}, not a "
                         f"callable; pass {expected}")


def count(value: Any, where: str, name: str, *, least: int, none: bool = True) -> None:
    """`value` is an int >= `least` (or None when `none`)."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UsageError(f"{where}: {name}={_shown(value)}; expected an integer >= {least}"
                         + (" or None" if none else ""))


def fraction_or_none(value: Any, where: str, name: str) -> None:
    """`value` is None or a number in (0, 1]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UsageError(f"{where}: {name}={_shown(value)}; expected a fraction in (0, 1] "
                         f"(0.03: the probes may cost 3% of the step time) or None")


def probe_spec(spec: Any, where: str) -> str | list:
    """`probes=`: "all", "none", "a,b", or a non-empty list of names (or, for watch, of Probe
    objects). An empty selection ("", [], ",") checks nothing and is refused: "none" says
    that on purpose."""
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise UsageError(f"{where}: probes={_shown(spec)} selects no probe; pass probe names "
                             f"(`tndebug probes` lists them), \"all\", or \"none\" on purpose")
        if all(isinstance(p, Probe) for p in spec):
            return list(spec)
        bad = next((p for p in spec if not isinstance(p, str)), None)
        if bad is not None:
            raise UsageError(f"{where}: probes= holds {_shown(bad)} ({type(bad).__name__}); pass "
                             f"probe names or Probe objects, not a mix")
        spec = ",".join(spec)
    if not isinstance(spec, str):
        raise UsageError(f"{where}: probes={_shown(spec)}; expected \"all\", \"none\", \"a,b\" or "
                         f"a list of probe names")
    if not [s for s in spec.split(",") if s.strip()]:
        raise UsageError(f"{where}: probes={spec!r} selects no probe; pass probe names (`tndebug "
                         f"probes` lists them), \"all\", or \"none\" on purpose")
    return spec


def training_only(names: list[str], where: str) -> None:
    """`check` runs one forward and backward: the probes that judge a training run refused."""
    asked = [n for n in names if n in TRAINING_ONLY]
    if asked:
        raise UsageError(f"{where}: probes {', '.join(asked)} judge a training run (the optimizer's "
                         f"steps, the loss, the lr), which check() does not make; use "
                         f"tndebug.watch(model, optimizer) around your loop, or `tndebug run`")


def scalar_loss(loss: Any) -> torch.Tensor | None:
    """`dbg.step(loss=...)` -> a 0-d float tensor (detached), None for None."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise UsageError(f"dbg.step(loss=...): got a tensor of shape {tuple(loss.shape)}; "
                             f"expected the step's scalar loss (a 0-d tensor or a number): pass "
                             f"the reduced loss, e.g. loss.mean()")
        return loss.detach().float().reshape(())
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise UsageError(f"dbg.step(loss=...): got {_shown(loss)} ({type(loss).__name__}); "
                         f"expected the step's scalar loss (a 0-d tensor or a number)")
    return torch.tensor(float(loss))


BATCH_SHAPE = "(src [B, S], tgt_in [B, T]) or (src, tgt_in, tgt_out [B, T]) of integer ids"


def user_batch(got: Any, name: str = "batch") -> tuple:
    """What `batch=` returned for the model's call -> (src, tgt_in, tgt_out or None); every
    other value is one UsageError naming what came back."""
    if got is None:
        raise UsageError(f"watch: {name}= returned None for the model's call; it must return "
                         f"{BATCH_SHAPE}")
    if not isinstance(got, (tuple, list)) or len(got) not in (2, 3):
        what = (f"a {type(got).__name__} of {len(got)} item{'s' if len(got) != 1 else ''}" if isinstance(got, (tuple, list))
                else f"a {type(got).__name__}")
        raise UsageError(f"watch: {name}= returned {what}; it must return {BATCH_SHAPE}")
    parts = list(got) + [None] * (3 - len(got))
    rows = None
    for label, t in zip(("src", "tgt_in", "tgt_out"), parts):
        if t is None and label == "tgt_out":
            continue
        what = _not_ids(t)
        if what:
            raise UsageError(f"watch: {name}= returned {what} as {label}; it must return "
                             f"{BATCH_SHAPE}")
        if rows is not None and t.shape[0] != rows:
            raise UsageError(f"watch: {name}= returned {label} with {t.shape[0]} rows, src has "
                             f"{rows}; it must return {BATCH_SHAPE}")
        rows = t.shape[0]
    src, tgt_in, tgt_out = parts
    if tgt_out is not None and tgt_out.shape != tgt_in.shape:
        raise UsageError(f"watch: {name}= returned tgt_out of shape {tuple(tgt_out.shape)} and "
                         f"tgt_in of shape {tuple(tgt_in.shape)}; they must be the same [B, T]")
    return src, tgt_in, tgt_out


def _not_ids(t) -> str:
    """What `t` is when it is not a 2-D tensor of integer ids ("" when it is one)."""
    if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() \
            and not t.is_complex() and t.dtype != torch.bool:
        return ""
    return (f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)}"
            if isinstance(t, torch.Tensor) else f"a {type(t).__name__}")


def user_data(tensors: dict[str, Any], pad_id: int, src_vocab: int, tgt_vocab: int) -> None:
    """`check(data=)`: 2-D integer tensors with one row count, ids inside the model's vocabulary,
    and the pad id only at the ends of a row (else it is a real token: the pad id is wrong)."""
    rows = None
    for name, t in tensors.items():
        what = _not_ids(t)
        if what:
            raise UsageError(f"check: data= {name} is {what}; expected integer ids [N, length] "
                             f"(batch first)")
        if rows is not None and t.shape[0] != rows:
            raise UsageError(f"check: data= {name} has {t.shape[0]} rows, src has {rows}")
        rows = t.shape[0]
        vocab = src_vocab if name == "src" else tgt_vocab
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
            raise UsageError(f"check: data= {name} holds token id {bad}, outside the model's "
                             f"vocabulary of {vocab} (ids 0..{vocab - 1})")
    tgt_in, tgt_out = tensors.get("tgt_in"), tensors.get("tgt_out")
    if tgt_in is not None and tgt_in.shape != tgt_out.shape:
        raise UsageError(f"check: data= tgt_in has shape {tuple(tgt_in.shape)}, tgt_out "
                         f"{tuple(tgt_out.shape)}; they must be the same [N, T]")
    found = mid_sequence_pads(tensors, pad_id)
    if found:
        raise UsageError(f"check: data= {pad_text(found, pad_id)}; pass the id your rows are "
                         f"padded with (pad_id=), or pad_id=None if your data have no padding")


def is_main_process(dist: Any = None) -> bool:
    """Rank 0 of the process group the user started (or of `dist`), or no group at all."""
    if dist is not None:
        return bool(dist.is_main)
    import torch.distributed as tdist
    return not (tdist.is_available() and tdist.is_initialized()) or tdist.get_rank() == 0


def output_dir(out: Any, *, overwrite: bool, start_step: int, main: bool = True):
    """`watch(out=)` checked by the CLI's rule (tndebug/outputs.py) without creating anything:
    a file, a place under a file, or a directory that holds a run (unless overwrite=True) is
    refused. A resumed watch (start_step > 0) continues in its own directory, as `run --resume`
    does."""

    if out is None:
        return None
    if not isinstance(out, (str, Path)):
        raise UsageError(f"watch: out={_shown(out)}; expected a directory path (str or Path)")
    if not main:                       # under DDP rank 0 alone writes: the others may find its files
        return Path(out)
    with _prefixed("watch"):
        resolve_output(str(out), str(out), overwrite=overwrite, kind="run", names=LIBRARY,
                       continuing=out if start_step > 0 else None)
    return Path(out)


def claim_output(stack, out, *, overwrite: bool, start_step: int):
    """Create, lock and (overwrite=True) clear `out` as `tndebug run` does, held by `stack`
    (an ExitStack the watch closes when the block ends): the old reports, figures and
    TensorBoard events go first, so tb/ never holds two runs."""

    if held_here(Path(out)):           # the lock lets this process in again: one run a tb/ all the same
        raise UsageError(f"watch: out='{out}' is in use by another tndebug.watch in this process; "
                         f"pass another out=, or leave that block first")
    with _prefixed("watch"):
        return Path(stack.enter_context(claim(
            str(out), str(out), overwrite=overwrite, kind="run", names=LIBRARY,
            continuing=out if start_step > 0 else None)))


class _prefixed:
    """A UsageError raised inside gets `where: ` in front (the output rule's lines name no caller)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is UsageError and not str(exc).startswith(self.where + ":"):
            raise UsageError(f"{self.where}: {exc}") from None
        return False


def ids_in_vocabulary(pad_id: int, bos_id: int, pad_vocab: int, bos_vocab: int) -> None:
    """The padding id indexes every token embedding (`pad_vocab`: the smallest), the decoder's
    first id the target one (`bos_vocab`)."""
    for name, value, vocab in (("pad_id", pad_id, pad_vocab), ("bos_id", bos_id, bos_vocab)):
        if not 0 <= value < vocab:
            raise UsageError(f"{name}={value} is outside the model's vocabulary (ids 0..{vocab - 1}); "
                             f"pass the id your data uses (e.g. tokenizer.{name[:3]}_token_id)")


def forward_vocab(logits_v: int, *, given: int | None, from_module: bool, sizes: set[int],
                  tokens: set[int], name: str) -> None:
    """The forward's logits are over the model's vocabulary: `tgt_vocab=` when given; else, when
    the forward computed them itself (they are no module's output), one of the model's sizes
    (`sizes`: token embeddings' rows, Linear layers' outputs; `tokens`: the embeddings', shown)."""
    if given is not None and logits_v != given:
        raise UsageError(f"{name} returns logits over {logits_v} ids, but tgt_vocab={given}; "
                         f"return the model's logits [B, T, {given}], or pass the right tgt_vocab=")
    if given is None and not from_module and sizes and logits_v not in sizes:
        shown = " and ".join(map(str, sorted(tokens or sizes)))
        raise UsageError(f"{name} returns logits over {logits_v} ids, but the model's token "
                         f"embeddings have {shown} rows; return the model's full logits "
                         f"[B, T, V], or pass tgt_vocab={logits_v} if {logits_v} is right")
