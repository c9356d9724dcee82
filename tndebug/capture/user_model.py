"""The user's model from their own code, for `tndebug triage --model FILE.py:FACTORY`: the
config (`--config` JSON, or the checkpoint's), the factory called with it, the checkpoint's
weights loaded strictly, each failure one clear line."""
from __future__ import annotations

import inspect

from torch import nn

from tndebug.capture.user_files import line, load_callable
from tndebug.errors import UsageError
from tndebug.paths import config_json


def parse_config(text: str | None) -> dict | None:
    """--config: inline JSON or a JSON file (tndebug/paths.py: the CLI checks it before torch)."""
    return config_json(text)


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
    except UsageError:                      # a built-in factory's own line (triage/own_decoder.py)
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory may raise anything
        shown = ", ".join(f"{k}={v!r}" for k, v in list(used.items())[:6])
        raise UsageError(f"--model {spec} raised {type(e).__name__}: {line(e)} "
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
                         f"{lines[0] if lines else line(e)} (pass the sizes it was trained with: "
                         f"--config '{{...}}')") from None
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        raise UsageError(f"the checkpoint's keys do not match the model built by {spec}: "
                         f"{'; '.join(parts)}")
    refuse_meta(model, f"the model built by {spec}", "build it on a real device (not under "
                "torch.device('meta') or init_empty_weights): triage loads the checkpoint into it")


def refuse_meta(model: nn.Module, who: str = "the model", how: str = "") -> None:
    """A model whose parameters or buffers are on the meta device holds no numbers: every
    kernel would fail with torch's own text. One line instead (triage and the library)."""
    tensors = [*model.parameters(), *model.buffers()]
    meta = sum(t.is_meta for t in tensors)
    if meta:
        raise UsageError(f"{who} has no weights (meta device: {meta} of {len(tensors)} parameters "
                         f"and buffers): load or materialise them first"
                         + (f"; {how}" if how else " (model.to_empty(device='cpu') and "
                            "load_state_dict, or from_pretrained without device_map='meta')"))
