"""Adapters: how tndebug calls a user's model, and loading the user's own code.

An adapter is a function

    def forward(model, src, tgt, pad_id) -> logits      # src [B, S], tgt [B, T] (BOS-led),
                                                        # -> [B, T, V] logits or log-probs
and, optionally, in the same file,

    def encode(model, src, pad_id) -> memory            # [B, S, d]

A user's adapter may also return a tuple (its first tensor is taken: `(logits, attn)`), an
object with `.logits` (a Hugging Face output), or flattened logits [B*T, V]; anything else is a
UsageError naming the shape.

Built in: `annotated` (The Annotated Transformer's call: `model(src, tgt, src_mask, tgt_mask)`
then `model.generator`, masks built by the model module's own `Batch.make_std_mask` /
`subsequent_mask` where it defines them, else by tndebug, which `Adapter.note` then says) and
`tndebug` (`model(src, tgt)`). Anything else: `--adapter FILE.py:FUNCTION`.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tndebug.errors import UsageError

BUILTIN = ("annotated", "tndebug")


# -- built-in adapters --------------------------------------------------------------------------
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


def tndebug_forward(model, src, tgt, pad_id):
    return model(src, tgt)


def tndebug_encode(model, src, pad_id):
    return model.encode(src)


@dataclass
class Adapter:
    name: str
    forward: Callable
    encode: Callable | None = None
    note: str | None = None          # what the report should say about how the model was called


def builtin_adapter(name: str, model: nn.Module | None = None) -> Adapter:
    if name == "annotated":
        note = None
        if model is not None and annotated_mask_source(model) == "tndebug":
            note = TNDEBUG_MASKS_NOTE
        return Adapter("annotated", annotated_forward, annotated_encode, note)
    if name == "tndebug":
        return Adapter("tndebug", tndebug_forward, tndebug_encode)
    raise UsageError(f"unknown adapter {name!r}; use annotated, tndebug or FILE.py:FUNCTION")


def first_tensor(out) -> torch.Tensor | None:
    """The logits a model or adapter returned: the tensor itself, the first tensor of a tuple or
    list, or `.logits` of an output object (Hugging Face); else None."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def as_logits(out, tgt: torch.Tensor, name: str) -> torch.Tensor:
    """A user adapter's output -> logits [B, T, V]: the first tensor of a tuple or list, `.logits`
    of an output object, [B*T, V] reshaped; otherwise a UsageError naming what came back."""
    found = first_tensor(out)
    out = found if found is not None else out
    B, T = tgt.shape[:2]
    if isinstance(out, torch.Tensor):
        if out.dim() == 3 and tuple(out.shape[:2]) == (B, T):
            return out
        if out.dim() == 2 and out.shape[0] == B * T:
            return out.reshape(B, T, out.shape[1])                            # [B*T, V] -> [B, T, V]
        hint = (" (it looks sequence-first: return logits.transpose(0, 1))"
                if out.dim() == 3 and tuple(out.shape[:2]) == (T, B) else "")
        got = f"a tensor of shape {tuple(out.shape)}"
    else:
        got = (f"a {type(out).__name__} with no tensor in it" if isinstance(out, (tuple, list))
               else f"a {type(out).__name__}")
        hint = ""
    raise UsageError(f"the adapter {name} returned {got}; expected logits [B, T, V] = [{B}, {T}, V] "
                     f"(batch first), flattened [B*T, V] = [{B * T}, V], or a tuple whose first "
                     f"tensor is one of these{hint}")


def _normalised(fn: Callable, name: str) -> Callable:
    def forward(model, src, tgt, pad_id):
        return as_logits(fn(model, src, tgt, pad_id), tgt, name)
    forward.__wrapped__ = fn
    forward.__doc__ = fn.__doc__
    return forward


def guess_adapter(model: nn.Module) -> str | None:
    """A built-in adapter that fits the model's shape, or None."""
    from tndebug.model import Transformer
    if isinstance(model, Transformer):
        return "tndebug"
    names = dict(model.named_children())
    if {"encoder", "decoder", "src_embed", "tgt_embed", "generator"} <= set(names) \
            and hasattr(model, "encode") and hasattr(model, "decode"):
        return "annotated"
    return None


def resolve_adapter(spec: str | None, model: nn.Module) -> Adapter:
    if spec is None:
        guess = guess_adapter(model)
        if guess is None:
            raise UsageError(
                f"do not know how to call {type(model).__name__}: pass --adapter FILE.py:FUNCTION "
                f"with def forward(model, src, tgt, pad_id) -> logits (see docs/triage.md)")
        return builtin_adapter(guess, model)
    if spec in BUILTIN:
        return builtin_adapter(spec, model)
    fn, module = load_callable(spec, "--adapter")
    enc = getattr(module, "encode", None)
    return Adapter(spec, _normalised(fn, spec), enc if callable(enc) and enc is not fn else None)


# -- user code ------------------------------------------------------------------------------------
def load_callable(spec: str, flag: str):
    """'path/to/file.py:name' -> (the function, its module). Errors are one line."""
    path_s, sep, name = spec.rpartition(":")
    if not sep or not path_s or not name:
        raise UsageError(f"{flag} {spec!r}: expected FILE.py:NAME")
    path = Path(path_s)
    if not path.is_file():
        raise UsageError(f"{flag}: no such file {path_s}")
    module = import_file(path, flag)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        have = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                and getattr(v, "__module__", None) == module.__name__]
        raise UsageError(f"{flag}: {path_s} defines no function {name!r} "
                         f"(it has: {', '.join(have[:8]) or 'none'})")
    return fn, module


_imported: dict[str, object] = {}


def import_file(path: Path, flag: str = "--model"):
    """Import a user's .py file as a module (its directory goes on sys.path while importing)."""
    key = str(path.resolve())
    if key in _imported:
        return _imported[key]
    mod_name = f"tndebug_user_{abs(hash(key)) % 10**8}_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{flag}: cannot import {path} (not a Python file?)")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's code may raise anything
        sys.modules.pop(mod_name, None)
        raise UsageError(f"{flag}: importing {path} raised {type(e).__name__}: {_line(e)}") from None
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    _imported[key] = module
    return module


def parse_config(text: str | None) -> dict | None:
    """--config: inline JSON or a JSON file."""
    if text is None:
        return None
    p = Path(text)
    if not text.lstrip().startswith("{") and p.suffix == ".json":
        if not p.is_file():
            raise UsageError(f"--config: no such file {text}")
        text = p.read_text()
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--config is not valid JSON ({e}); pass '{{\"d_model\": 512}}' or a .json file") from None
    if not isinstance(cfg, dict):
        raise UsageError("--config must be a JSON object of keyword arguments")
    return cfg


def build_user_model(spec: str, kwargs: dict | None) -> tuple[nn.Module, dict]:
    """Call the user's factory with the kwargs it accepts; returns (model, kwargs used)."""
    factory, _ = load_callable(spec, "--model")
    used = dict(kwargs or {})
    try:
        sig = inspect.signature(factory)
        if not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
            used = {k: v for k, v in used.items() if k in sig.parameters}
    except (TypeError, ValueError):
        pass
    try:
        model = factory(**used)
    except Exception as e:  # noqa: BLE001 - the user's factory may raise anything
        shown = ", ".join(f"{k}={v!r}" for k, v in list(used.items())[:6])
        raise UsageError(f"--model {spec} raised {type(e).__name__}: {_line(e)} "
                         f"(called with {shown or 'no arguments'}; pass --config '{{...}}')") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec} returned a {type(model).__name__}, not an nn.Module")
    return model, used


def load_weights(model: nn.Module, state_dict: dict, spec: str) -> None:
    """Strict load; a mismatch is one line naming the first differences."""
    try:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln]
        raise UsageError(f"the checkpoint's shapes do not match the model built by {spec}: "
                         f"{lines[0] if lines else _line(e)} (pass the sizes it was trained with: "
                         f"--config '{{...}}')") from None
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        raise UsageError(f"the checkpoint's keys do not match the model built by {spec}: "
                         f"{'; '.join(parts)}")


def _line(e: Exception) -> str:
    s = str(e).strip()
    return s.splitlines()[0][:200] if s else type(e).__name__
