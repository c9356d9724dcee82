"""What one `triage` call is asked, and the rules that every triage front-end (a checkpoint with
tndebug's layouts or the user's code: run.py; a Hugging Face directory: hf.py) shares about it:
which probes run, how long the held-out rows may be, what the weights compute in. Its own module
so that run.py and hf.py both read it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tndebug.errors import UsageError
from tndebug.probes import PROBE_NAMES, TRIAGE_PROBES, parse_probe_spec
from tndebug.probes.base import ProbeError
from tndebug.subject import Subject


@dataclass(frozen=True)
class TriageOptions:
    checkpoint: str
    model: str | None = None            # FILE.py:FACTORY
    config: str | None = None           # JSON or a .json file
    adapter: str | None = None          # annotated | tndebug | FILE.py:FUNCTION
    task: str = "copy"
    pad_id: int | None = 0              # None (--pad-id none): the data hold no padding
    max_len: int | None = None          # the longest sequence the model takes (--max-len)
    bos_id: int = 1
    heads: int | None = None
    norm: str | None = None
    probes: str | None = None           # None: TRIAGE_PROBES
    trust: bool = False
    data: str | None = None             # FILE.pt or FILE.py:FUNCTION: the user's held-out batches
    attn: str | None = None             # Hugging Face dir: eager | sdpa (default: its config's)
    text: str | None = None             # Hugging Face dir: source<TAB>target lines
    arch: str | None = None             # --model: seq2seq | decoder | encoder (None: told from it)


def refuse_longer(subject: Subject, tensors, what: str) -> None:
    """UsageError when the held-out batches are longer than the model takes (its position table,
    its config's limit, or --max-len): every comparison would index past the table."""
    width = max(int(t.shape[1]) for t in tensors)
    fits = subject.fit(width)
    if fits < width:
        known = (f"max_len {subject.max_len} (its config, or --max-len)" if subject.max_len
                 else "the model raised on longer sequences")
        raise UsageError(f"{what}: rows are {width} positions long, but the model takes at most "
                         f"{fits} ({known}): pass shorter sequences, or --max-len if the limit "
                         f"is wrong")


# Triage of a model's own code also asks which labels the trained weights learnt from (label-
# shift's one-pass judgement; `tndebug.check`, often of an untrained model, does not: a tied head
# predicts its input at initialisation, which only triage's fresh re-judgement tells apart).
# A Hugging Face decoder-only directory gets it too, in a pass of its own over the whole
# vocabulary (hf/shift.py: its probes see a sliced output layer, triage.hf_dir.PROBE_VOCAB).
OWN_CODE_PROBES = tuple(n for n in PROBE_NAMES if n in TRIAGE_PROBES or n == "label-shift")


def probes_of(spec: str | None, default: tuple[str, ...] = TRIAGE_PROBES) -> list[str]:
    if spec is None:
        return list(default)
    try:
        return parse_probe_spec(spec)
    except ProbeError as e:
        raise UsageError(str(e)) from None


def weights_dtype(sd: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype holding most of the checkpoint's weights: what the model computes in
    (RunContext.compute_dtype), float32 when there are none."""
    count: dict[torch.dtype, int] = {}
    for t in sd.values():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            count[t.dtype] = count.get(t.dtype, 0) + t.numel()
    return max(count, key=count.get) if count else torch.float32
