"""Load a checkpoint safely and find its state_dict.

    ckpt = load_checkpoint("model.pt")          # torch.load(weights_only=True), or .safetensors
    ckpt.state_dict                              # {"encoder.layers.0....": tensor}, prefixes stripped

Nothing in the file runs: a pickle that names globals outside torch's weights-only allowlist is
refused, and the globals are listed by reading the pickle statically
(`torch.serialization.get_unsafe_globals_in_checkpoint`), unless the user passes
`--trust-checkpoint`. Containers are unwrapped (`model`, `model_state_dict`, `state_dict`, a bare
state_dict) and the `module.` (DDP) and `_orig_mod.` (torch.compile) prefixes removed.
"""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tndebug.errors import UsageError
from tndebug.paths import checkpoint_file
from tndebug.safeload import damaged, describe_load_error, first_line, unsafe_globals

# Where people keep things in a checkpoint dict, most specific first.
STATE_KEYS = ("model_state_dict", "state_dict", "model", "module", "net", "network", "weights",
              "params")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optimizer_state", "optim", "opt")
STEP_KEYS = ("global_step", "step", "step_num", "schedule_step", "steps", "iteration", "iter", "iter_num",
             "num_updates")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "lr_scheduler_state_dict")
CONFIG_KEYS = ("model_config", "config", "cfg", "hparams", "hyper_parameters", "args", "model_args")
PREFIXES = ("module.", "_orig_mod.")


class UnsafeCheckpoint(UsageError):
    """The pickle names code outside torch's weights-only allowlist; it was not run."""

    def __init__(self, path: Path, globals_: list[str]) -> None:
        self.path, self.globals = path, globals_
        shown = ", ".join(globals_[:6]) + (f" (+{len(globals_) - 6} more)" if len(globals_) > 6 else "")
        super().__init__(
            f"{path} holds pickled code ({shown or 'unknown globals'}); it was not loaded. "
            f"Re-save it as a state_dict (torch.save(model.state_dict(), ...)) or .safetensors, "
            f"or pass --trust-checkpoint if you trust where it came from")


@dataclass
class Checkpoint:
    path: Path
    state_dict: dict[str, torch.Tensor]
    container: str = "bare"                 # where the state_dict was: "bare", "model", ...
    stripped_prefix: str = ""               # "module." for DDP checkpoints
    config: dict[str, Any] | None = None    # the checkpoint's own config entry, when it has one
    config_key: str = ""
    optimizer: dict | None = None           # optimizer state_dict, when present
    step: int | None = None                 # a global step counter, when present
    step_key: str = ""
    has_scheduler: bool = False
    fmt: str = "torch"                      # "torch" | "safetensors"
    top_keys: list[str] = field(default_factory=list)
    trusted: bool = False                   # loaded with weights_only=False (--trust-checkpoint)

    @property
    def has_optimizer_state(self) -> bool:
        """Optimizer moments are present (an empty `state` is a freshly built optimizer)."""
        return bool(self.optimizer and self.optimizer.get("state"))


def load_checkpoint(path: str | Path, *, trust: bool = False) -> Checkpoint:
    """Read `path` without running code in it; every failure is a one-line UsageError."""
    p = checkpoint_file(path)                # missing, empty, a FIFO or device: one line
    if p is None:
        raise UsageError(f"{path} is a directory with no checkpoint.pt, model.pt or "
                         f"model.safetensors in it; pass the checkpoint file itself")
    if p.suffix == ".safetensors":
        return _load_safetensors(p)
    broken = damaged(p)                      # integrity before diagnosis
    if broken:
        raise UsageError(broken)
    obj = _torch_load(p, trust)
    ckpt = _unwrap(p, obj)
    ckpt.trusted = trust
    return ckpt


# -- torch.load ---------------------------------------------------------------------------
def _torch_load(p: Path, trust: bool):
    try:
        # mmap: tensors are read when touched (an optimizer state is never read whole)
        return torch.load(p, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(p))
    except Exception as e:  # noqa: BLE001 - unpickling fails in many types
        if "Weights only load failed" not in str(e):
            raise UsageError(describe_load_error(p, e)) from None
        failure = e
    unsafe = unsafe_globals(p)
    if not trust:
        if not unsafe:   # no global to blame: the bytes themselves are not a checkpoint
            raise UsageError(describe_load_error(p, failure)) from None
        raise UnsafeCheckpoint(p, unsafe)
    try:
        return torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{p} could not be unpickled even with --trust-checkpoint: "
                         f"{type(e).__name__}: {first_line(e)} (the classes it names must be "
                         f"importable: run from the directory of the code that saved it)") from None


# -- safetensors ----------------------------------------------------------------------------
def _load_safetensors(p: Path) -> Checkpoint:
    try:
        from safetensors import safe_open
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{p} is not a readable .safetensors file ({first_line(e)[:120]}); "
                         f"it may be truncated: copy or save it again") from None
    if not sd:
        raise UsageError(f"{p} holds no tensors")
    config = None
    for key in ("config", "model_config"):
        if key in meta:
            try:
                config = json.loads(meta[key])
            except ValueError:
                pass
    sd, prefix = strip_prefixes(sd)
    return Checkpoint(p, sd, container="safetensors", stripped_prefix=prefix, config=config,
                      config_key="__metadata__" if config else "", fmt="safetensors",
                      top_keys=list(meta))


# -- containers -----------------------------------------------------------------------------
def _is_state_dict(x) -> bool:
    return (isinstance(x, dict) and len(x) > 0 and all(isinstance(k, str) for k in x)
            and all(isinstance(v, torch.Tensor) for v in x.values()))


def _as_state_dict(x):
    if isinstance(x, torch.nn.Module):     # torch.save(model), only with --trust-checkpoint
        return dict(x.state_dict())
    if _is_state_dict(x):
        return dict(x)
    return None


def _unwrap(p: Path, obj) -> Checkpoint:
    sd = _as_state_dict(obj)
    if sd is not None:
        sd, prefix = strip_prefixes(sd)
        return Checkpoint(p, sd, "bare" if isinstance(obj, dict) else "module", prefix)
    if not isinstance(obj, dict):
        raise UsageError(f"{p} holds a {type(obj).__name__}, not a state_dict or a dict with one; "
                         f"save {{'model': model.state_dict()}}")
    container, sd = "", None
    for key in STATE_KEYS:
        if key in obj:
            sd = _as_state_dict(obj[key])
            if sd is None and isinstance(obj[key], dict):      # {"model": {"state_dict": ...}}
                for inner in STATE_KEYS:
                    sd = _as_state_dict(obj[key].get(inner))
                    if sd is not None:
                        key = f"{key}.{inner}"
                        break
            if sd is not None:
                container = key
                break
    if sd is None:
        if not obj:
            raise UsageError(f"{p} holds an empty dict: no weights to triage; save "
                             f"{{'model': model.state_dict()}} or a bare state_dict")
        keys = ", ".join(map(str, list(obj)[:8])) + (f" (+{len(obj) - 8} more)" if len(obj) > 8 else "")
        raise UsageError(f"{p} has no state_dict (top-level keys: {keys}); expected a bare "
                         f"state_dict or one under 'model', 'model_state_dict' or 'state_dict'")
    sd, prefix = strip_prefixes(sd)
    ckpt = Checkpoint(p, sd, container, prefix, top_keys=[str(k) for k in obj])
    for key in OPTIMIZER_KEYS:
        if isinstance(obj.get(key), dict):
            ckpt.optimizer = obj[key]
            break
    for key in STEP_KEYS:
        v = obj.get(key)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = int(v.item())
        if isinstance(v, int) and not isinstance(v, bool):
            ckpt.step, ckpt.step_key = v, key
            break
    if ckpt.step is None and ckpt.optimizer:
        ckpt.step, ckpt.step_key = _optimizer_step(ckpt.optimizer), "optimizer.state[*].step"
    ckpt.has_scheduler = any(obj.get(k) for k in SCHEDULER_KEYS)
    for key in CONFIG_KEYS:
        cfg = _as_config(obj.get(key))
        if cfg is not None:
            ckpt.config, ckpt.config_key = cfg, key
            break
    return ckpt


def _optimizer_step(opt: dict) -> int | None:
    for st in (opt.get("state") or {}).values():
        s = st.get("step") if isinstance(st, dict) else None
        if s is not None:
            return int(s.item() if isinstance(s, torch.Tensor) else s)
    return None


def _as_config(x) -> dict | None:
    if isinstance(x, dict) and x and all(isinstance(k, str) for k in x):
        return dict(x)
    if isinstance(x, str):
        try:
            d = json.loads(x)
            return d if isinstance(d, dict) else None
        except ValueError:
            return None
    if hasattr(x, "__dict__") and not isinstance(x, torch.Tensor):   # argparse.Namespace (trusted)
        return {k: v for k, v in vars(x).items() if not k.startswith("_")}
    return None


def strip_prefixes(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """Remove `module.` / `_orig_mod.` when every key carries it."""
    stripped = ""
    changed = True
    while changed:
        changed = False
        for pre in PREFIXES:
            if sd and all(k.startswith(pre) for k in sd):
                sd = {k[len(pre):]: v for k, v in sd.items()}
                stripped += pre
                changed = True
    return sd, stripped
