"""Checkpoints that load with `torch.load(path, weights_only=True)`.

Contents (tensors, numbers, strings, and plain dicts/lists only):

    {"format": "tndebug.checkpoint/1",
     "model": state_dict, "optimizer": state_dict | None, "scaler": state_dict | None,
     "schedule_step": int,      # the step the lr schedule is at (a warmup restart resets it)
     "global_step": int,        # optimizer steps taken in total
     "last_lr": float | None,   # the lr applied at the last step
     "model_config": dict, "train_config": dict,
     "rng": {"torch": ByteTensor, "cuda": [ByteTensor, ...], "data": ByteTensor},
     "status": "completed" | "diverged" | "interrupted" | "running"}   # running: a --save-every save

Written atomically: to `name.tmp`, then renamed over `name`.
"""
from __future__ import annotations

import copy
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from tndebug.config import ModelConfig
from tndebug.errors import UsageError
from tndebug.inject import make_model
from tndebug.paths import run_checkpoint
from tndebug.safeload import damaged, describe_load_error, unsafe_globals
from tndebug.train.config import apply_config_faults

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
    """A run directory or a checkpoint file -> the checkpoint file (tndebug/paths.py)."""
    return run_checkpoint(path)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load safely (weights_only=True); a foreign or unsafe file is a one-line UsageError."""
    p = resolve(path)
    if p.stat().st_size == 0:
        raise UsageError(f"{p} is empty (0 bytes); the save was probably interrupted")
    broken = damaged(p)                      # torch.load checks no CRC: bit flips would load
    if broken:
        raise UsageError(broken)
    try:
        state = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many types
        unsafe = unsafe_globals(p) if "Weights only load failed" in str(e) else []
        if unsafe:          # the globals, read statically, never run; not torch's advice
            shown = ", ".join(unsafe[:6]) + (f" (+{len(unsafe) - 6} more)" if len(unsafe) > 6 else "")
            raise UsageError(f"{p} holds pickled code ({shown}); it was not loaded, and --resume "
                             f"takes only checkpoints written by `tndebug run`") from None
        raise UsageError(describe_load_error(p, e)) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        what = (f"format {state.get('format')!r}" if isinstance(state, dict) and "format" in state
                else f"a {type(state).__name__} without a 'format' key")
        raise UsageError(f"{p} is not a tndebug training checkpoint ({what}; expected {FORMAT}); "
                         f"--resume takes a directory or checkpoint.pt written by `tndebug run` "
                         f"(`tndebug triage` reads other checkpoints)")
    return state


def describe_mismatch(e: RuntimeError, limit: int = 3) -> str:
    """load_state_dict's many-line error -> its first details, in one line."""
    lines = [ln.strip().rstrip(".") for ln in str(e).splitlines()[1:] if ln.strip()]
    if not lines:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    details = []
    for ln in lines:
        details += [d.strip() for d in ln.split(". ") if d.strip()] if ln.startswith("size mismatch") else [ln]
    shown = "; ".join(details[:limit])
    return shown + (f" (+{len(details) - limit} more)" if len(details) > limit else "")


def unwrap_state_dict(state: dict) -> dict:
    """A state dict saved from a DDP-wrapped model (`module.` keys) as the plain model's."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}
    return state


def check_resume_fits(model_cfg: ModelConfig, state: dict) -> None:
    """A checkpoint whose weights do not fit the model is a UsageError before any work: the
    model is built on the meta device (no memory, no init) and loaded there."""
    try:
        with torch.device("meta"):
            model = make_model(apply_config_faults(model_cfg))
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: checked when loaded
        return
    weights = unwrap_state_dict(state["model"])
    # load_state_dict(assign=True) writes its switch into the dict's `_metadata` (torch 2.x), so
    # the run's own load of the same dict would swap new Parameters into the model, away from
    # the optimizer's (which then stepped orphans; the model's .grad summed forever): a copy
    trial = OrderedDict(weights)
    if getattr(weights, "_metadata", None) is not None:
        trial._metadata = copy.deepcopy(weights._metadata)
    try:   # assign: meta tensors take the checkpoint's (shapes are still checked), no copy
        model.load_state_dict(trial, assign=True)
    except RuntimeError as e:
        raise UsageError(f"checkpoint does not fit this model: {describe_mismatch(e)}") from None
    groups = (state.get("optimizer") or {}).get("param_groups") or []
    saved, have = sum(len(g.get("params", ())) for g in groups), len(list(model.parameters()))
    if groups and saved != have and not model_cfg.has("warmup_restart_on_resume"):
        raise UsageError(f"the checkpoint's optimizer state is for {saved} parameter tensors, this "
                         f"model has {have}: a --fault that changes the parameters (shared_qkv "
                         f"shares them) cannot be added on resume; start a new run with it")
