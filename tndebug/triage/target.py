"""What triage examines, whichever way the model came in (tndebug's layouts: run.py's
`_layout_target`; the user's own code: user_code.py): the Subject and what goes with it."""
from __future__ import annotations

from dataclasses import dataclass, field

from tndebug.errors import UsageError
from tndebug.findings import Finding
from tndebug.subject import Subject
from tndebug.triage.userdata import check_vocab as check_data_vocab


@dataclass
class Target:
    """What triage examines: a Subject, how to scale its scores, how to name its modules."""
    subject: Subject
    scaled: object                           # alpha -> context manager
    run: dict = field(default_factory=dict)
    user_path: object = staticmethod(lambda p: p)
    findings: list[Finding] = field(default_factory=list)
    attention_weights: list = field(default_factory=list)   # (where, W_Q, W_K, W_V, h)
    fresh: object = None     # names -> ProbeResult on a fresh initialisation (--model), or None
    batch: object = None     # the held-out batch as this model takes it (decoder-only: as_lm)


def check_ids(subject, pad_id: int | None, bos_id: int) -> None:
    """--pad-id and --bos-id are ids of the model's vocabulary (a pad id of 999999 was fed to
    the probes, which crashed on it); --pad-id none (None) is not checked, an encoder-only
    model has no start id."""
    pad_v = subject.src_vocab if subject.kind == "encoder" else min(subject.src_vocab,
                                                                    subject.tgt_vocab)
    checks = [("--pad-id", pad_id, pad_v)]
    if subject.kind != "encoder":
        checks.append(("--bos-id", bos_id, subject.tgt_vocab))
    for flag, value, vocab in checks:
        if value is not None and not 0 <= value < vocab:
            raise UsageError(f"{flag} {value} is outside the model's vocabulary (ids 0..{vocab - 1}); "
                             f"pass the id your data use")


def check_task_vocab(src_vocab: int, tgt_vocab: int, task, batch=None, data: str | None = None) -> None:
    """The held-out ids fit the model's vocabularies: --data's own, else --task's."""
    if data:                                 # --data: its ids must fit; the task is not used
        check_data_vocab(batch, src_vocab, tgt_vocab, data)
        return
    if src_vocab < task.src_vocab or tgt_vocab < task.tgt_vocab:
        raise UsageError(
            f"--task {task.name} uses token ids up to {max(task.src_vocab, task.tgt_vocab) - 1}, "
            f"but the model's vocabularies are {src_vocab}/{tgt_vocab}: pass the task it was "
            f"trained on (copy, reverse and sort use 11 ids)")
