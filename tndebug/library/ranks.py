"""`tndebug.watch` over several processes (DDP, FSDP2): which sharding the run uses, the one
line a rank other than 0 says instead of writing a report, the facts each rank saw (gathered
to rank 0 for the report where they differ), and the guard that keeps an FSDP2 model sharded
after a probe's own forward raised inside it.

Every rank enters and leaves the watch at the same point of the user's script, so the one
collective here (`gather_facts`, at the end) is matched on every rank.
"""
from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn

from tndebug.sharded import sharding


def sharding_of(model: nn.Module) -> str | None:
    """The model as given to watch: "fsdp2" (parameters are DTensors), "ddp" (a
    DistributedDataParallel wrapper), None (a plain module)."""
    return sharding(model)


def run_fields(w) -> dict:
    """report.json's `run` fields of a multi-process watch: the sharding ("fsdp2", "ddp", or
    "replicated": each rank holds the whole model, DDP's inner module given, or the user's own
    all-reduce) and, where the ranks differ, each rank's facts. In one process: the sharding only
    when the parameters are DTensors (FSDP2 on a one-rank mesh), else nothing."""
    if w._dist is None or not w._dist.active:
        return {"sharding": "fsdp2"} if w._sharding == "fsdp2" else {}   # a one-rank mesh
    fields = {"sharding": w._sharding or "replicated", "backend": w._dist.backend}
    differ = differing(getattr(w, "_per_rank", None))
    if differ:
        fields["per_rank"] = differ
    return fields


def say_not_writing(rank: int, world: int, out) -> None:
    """Ranks other than 0 write nothing to `out`; one line on stderr says so."""
    print(f"tndebug: rank {rank} of {world}: no report here; rank 0 writes the run's one "
          f"report to {out}", file=sys.stderr, flush=True)


def keep_sharded(model: nn.Module, busy) -> list:
    """Forward hooks on the roots of the FSDP2 trees in `model` that put the model back to its
    shards after the watch's own calls (`busy()` true) that ran without gradients or raised:
    FSDP2 keeps the root's parameters gathered after a forward until the backward that then
    never comes, and reshards nothing after a forward that raised. Left so, the model hands
    the probes its gathered parameters, not the ones the optimizer holds, and FSDP frees their
    memory at the next backward (a probe reading them then crashed in torch). A forward the
    capture stopped (StopForward, a BaseException) runs no hook: the watch also calls
    `reshard` before each probe moment. Returns the handles (none without FSDP2)."""
    hook = _Reshard(busy)
    return [m.register_forward_hook(hook, always_call=True) for m in _fsdp_roots(model)]


def _fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules of `model` that no other FSDP2 module of it contains."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    owners = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    return [model.get_submodule(n) for n in owners
            if not any(o != n and (o == "" or n.startswith(o + ".")) for o in owners)]


def reshard(model: nn.Module | None) -> None:
    """Every FSDP2 module of `model` back to its shards, when one is not: the topmost FSDP
    module's `reset_iter_state()` (torch >= 2.13: FSDP2's recovery after a forward that did not
    finish; `reshard()` alone keeps the root gathered while it thinks it is in a forward), else
    each module's `reshard()`. Called only between the user's steps, so no gradient in flight
    is lost."""
    if model is None:
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    if not any(isinstance(p, _dtensor()) for p in model.parameters()) and \
            not isinstance(model, FSDPModule):
        return                                 # no FSDP2 here
    if all(isinstance(p, _dtensor()) for p in model.parameters()):
        return                                 # already sharded everywhere
    for top in _fsdp_roots(model):
        _reset(top)


def _reset(top: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule
    try:
        top.reset_iter_state()
    except (AttributeError, RuntimeError):      # torch < 2.13, or a tree never run
        for m in top.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def _dtensor():
    from torch.distributed.tensor import DTensor
    return DTensor


def working(ref):
    """`busy()` for keep_sharded: the watch (a weak reference) is entering or calling probes."""
    def busy() -> bool:
        w = ref()
        return w is not None and (w._busy or w._state != "open")
    return busy


class _Reshard:
    def __init__(self, busy) -> None:
        self.busy = busy

    def __call__(self, module, args, output):
        raised = sys.exc_info()[0] is not None        # called from the forward's exception path
        if self.busy() and (raised or not torch.is_grad_enabled()):
            _reset(module)                            # the whole tree: this is its root
        return None


def rank_facts(w, status: str) -> dict:
    """What this rank saw of the run (watch `w`, ending with `status`); rank 0's report lists a
    rank's value only where the ranks differ (`differing`)."""
    tail = [x for x in w._history["loss"][-10:] if math.isfinite(x)]
    return {"steps": w._steps_seen, "stopped_at_step": w._step, "status": status,
            "diverged_at_step": w.diverged, "device": str(w._device),
            "final_loss": sum(tail) / len(tail) if tail else None,
            "failed_probes": sorted(w._failed), "own_failure": w._own_failure}


def gather_facts(dist, facts: dict) -> list[dict] | None:
    """Every rank's facts on rank 0 (None elsewhere, or after a failure: no collective then)."""
    import torch.distributed as tdist
    if dist is None or not dist.active or dist.broken:
        return None
    out = [None] * dist.world if dist.is_main else None
    tdist.gather_object(facts, out, dst=0, group=dist.control)
    return out


def differing(per_rank: list[dict] | None) -> dict:
    """{fact: [value on rank 0, rank 1, ...]} for the facts on which the ranks disagree (a loss
    within 1e-6 relative is the same loss: the ranks' mean is what every rank logs)."""
    if not per_rank:
        return {}
    out = {}
    for key in per_rank[0]:
        values = [r.get(key) for r in per_rank]
        if key == "final_loss":
            same = all(_close(v, values[0], 1e-6) for v in values)
        else:
            same = all(v == values[0] for v in values)
        if not same:
            out[key] = values
    return out


def _close(a: Any, b: Any, rel: float) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)
