"""Who raised: the user's model on an input a probe gave it (evidence about the model), or
tndebug's own code (a tndebug bug). Probes call the model through `call`, which tells them apart
by where the exception was raised."""
from __future__ import annotations

import traceback
from pathlib import Path

PACKAGE = str(Path(__file__).resolve().parents[1])       # .../tndebug
# tndebug files that only call the user's model the way it asks to be called (built-in
# adapters): an error raised there is the model's answer to the input, not a tndebug bug
ADAPTERS = ("adapters.py", "hf.py", "live.py", "subject.py")


class ModelRaised(Exception):
    """The user's model (or its adapter) raised on one of a probe's inputs: evidence, not a
    tndebug bug. `what` names the input."""

    def __init__(self, what: str, error: BaseException) -> None:
        super().__init__(f"{what}: {type(error).__name__}: {error}")
        self.what, self.error = what, error


def _frames(error: BaseException):
    """The traceback's frames outside torch, innermost last."""
    return [f for f in traceback.extract_tb(error.__traceback__)
            if "/torch/" not in f.filename.replace("\\", "/")]


def raised_in(error: BaseException) -> str:
    """file:line of the innermost frame outside torch."""
    frames = _frames(error)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def by_tndebug(error: BaseException) -> bool:
    """True when the innermost frame outside torch is tndebug's own code (not a built-in
    adapter): a tndebug bug."""
    frames = _frames(error)
    if not frames:
        return False
    path = str(Path(frames[-1].filename).resolve())
    return path.startswith(PACKAGE) and Path(path).name not in ADAPTERS


def call(what: str, fn, *args):
    """fn(*args); an exception the model raised becomes ModelRaised(what, error); one raised by
    tndebug's own code propagates unchanged."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - whatever the model raises is the evidence
        if by_tndebug(e):
            raise
        raise ModelRaised(what, e) from e
