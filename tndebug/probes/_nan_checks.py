"""Helpers of `nan-scores`: where a non-finite loss with finite logits comes from, and how a
norm module behaves on constant rows in a given dtype. Tensors and behaviour only."""
from __future__ import annotations

import copy

import torch
from torch import nn

FIX_LOSS = ("Check the loss computation on these finite logits: a log of 0 or of a negative (use "
            "F.log_softmax / F.cross_entropy, not torch.log(softmax)), a division by a zero count "
            "(every target ignored: divide by max(n, 1)), 0 * inf; run it under "
            "torch.autograd.detect_anomaly() to see the op")


def _finite(x: torch.Tensor | None) -> bool | None:
    return None if x is None else bool(x.isfinite().all())


FIX_FORWARD = ("The forward returns NaN/Inf logits while every activation tndebug taps inside the "
               "model is finite: look at what runs after them (the output head, and the code that "
               "returns the logits: your forward/adapter, a temperature or a mask applied to the "
               "logits); run it under torch.autograd.detect_anomaly() to see the op")


def loss_story(run, info, replay_logits: torch.Tensor | None) -> tuple[str, dict, str, str]:
    """(message, evidence, code, fix) for a loss that is NaN/Inf while no tapped activation is.

    The logits decide first: non-finite ones (the step's own, or a replay's) are the forward's
    doing, whatever the loss then does with them ("nonfinite-forward", issue 47). Finite ones
    hand it to the loss: the step's own logits decide when the step handed them over, else a
    replay's, and the declared criterion (`run.criterion`) is run on them."""
    own = _finite(info.logits)
    replay = _finite(replay_logits)
    ev = {"step_logits": {None: "not captured", True: "finite", False: "non-finite"}[own],
          "replay_logits": {None: "not run", True: "finite", False: "non-finite"}[replay],
          "threshold": "finite loss"}
    if own is False or (own is None and replay is False):
        which = "this step's logits" if own is False else "a replay of the batch gives logits that"
        return (f"the forward pass returns NaN/Inf logits ({which} are non-finite) while every "
                f"activation tapped inside the model is finite: the forward produced the NaN "
                f"(after its last tapped activation: the output head or the code returning the "
                f"logits), not the loss computation", {**ev, "threshold": "finite logits"},
                "nonfinite-forward", FIX_FORWARD)
    logits = info.logits if own else replay_logits
    crit = None
    if logits is not None and run is not None and run.criterion is not None and info.tgt_out is not None:
        try:
            with torch.no_grad():
                value = run.criterion(logits.reshape(-1, logits.shape[-1]), info.tgt_out.reshape(-1))
            crit = bool(torch.as_tensor(value).isfinite().all())
        except Exception:  # noqa: BLE001 - a criterion that cannot run here decides nothing
            crit = None
    ev["criterion_on_finite_logits"] = {None: "not run", True: "finite", False: "non-finite"}[crit]
    which = "this step's logits are finite" if own else "a replay of the batch gives finite logits"
    if crit is False:
        tail = "the criterion gives NaN/Inf on these finite logits: the loss computation produced it"
    elif crit is True and not own:
        tail = ("the declared criterion is finite on them: the loss code the step ran produced it "
                "(or an op of training mode only, such as dropout)")
    else:
        tail = "the loss computation (the criterion / your loss code) produced it"
    return (f"loss is NaN/Inf while {which}: {tail}, not the forward pass or the update", ev,
            "nonfinite-loss", FIX_LOSS)


def constant_rows_nonfinite(module: nn.Module, dtype: torch.dtype) -> bool | None:
    """Run a copy of a norm module in `dtype` on constant rows (0, 1, -3 in every feature);
    True if any output is NaN/Inf, None when the module cannot be run so."""
    shape = getattr(module, "normalized_shape", None)
    if shape is None:
        w = next((p for p in module.parameters(recurse=False) if p.dim() == 1), None)
        shape = None if w is None else tuple(w.shape)
    if not shape:
        return None
    shape = tuple(shape)
    try:
        dev = next(iter(module.parameters()), torch.empty(0)).device
        twin = copy.deepcopy(module).to(device=dev, dtype=dtype)
        x = torch.tensor([0.0, 1.0, -3.0], device=dev).view(3, *[1] * len(shape)).expand(3, *shape)
        with torch.no_grad():
            y = twin(x.to(dtype).contiguous())
        return not bool(y.isfinite().all())
    except Exception:  # noqa: BLE001 - a norm that cannot run in this dtype is simply not tested
        return None
