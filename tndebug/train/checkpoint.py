"""Checkpoints that load with `torch.load(path, weights_only=True)`.

Contents (tensors, numbers, strings, and plain dicts/lists only):

    {"format": "tndebug.checkpoint/1",
     "model": state_dict, "optimizer": state_dict | None, "scaler": state_dict | None,
     "schedule_step": int,      # the step the lr schedule is at (a warmup restart resets it)
     "global_step": int,        # optimizer steps taken in total
     "last_lr": float | None,   # the lr applied at the last step
     "model_config": dict, "train_config": dict,
     "rng": {"torch": ByteTensor, "cuda": [ByteTensor, ...], "data": ByteTensor},
     "status": "completed" | "diverged" | "interrupted"}

Written atomically: to `name.tmp`, then renamed over `name`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tndebug.errors import UsageError

FORMAT = "tndebug.checkpoint/1"
FILENAME = "checkpoint.pt"


def rng_state(data_generator: torch.Generator | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if data_generator is not None:
        state["data"] = data_generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], data_generator: torch.Generator | None = None) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        n = min(len(state["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(state["cuda"][:n])
    if data_generator is not None and "data" in state:
        data_generator.set_state(state["data"])


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` (see the module docstring) atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": FORMAT, **state}, tmp)
    os.replace(tmp, path)
    return path


def resolve(path: str | Path) -> Path:
    """A run directory or a checkpoint file -> the checkpoint file."""
    p = Path(path)
    if p.is_dir():
        p = p / FILENAME
    if not p.is_file():
        raise UsageError(f"no checkpoint at {path} (expected a run directory or a {FILENAME})")
    return p


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load safely (weights_only=True); a foreign or unsafe file is a one-line UsageError."""
    p = resolve(path)
    try:
        state = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot load {p} safely (weights_only=True): {first}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{p} is not a tndebug training checkpoint (format {FORMAT})")
    return state
