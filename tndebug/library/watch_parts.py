"""The pieces `tndebug.watch` hooks into the user's model, optimizer and autograd (watch.py is
the block and its report, watch_hooks.py what runs on each step): the weak-reference hook and
probe shield, the step-scoped capture, the one backward tap, the checks and findings of the
block's own (the optimizer is the model's, a probe that raised), and small helpers.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
import traceback
import weakref

import torch
from torch import nn

from tndebug.errors import UsageError
from tndebug.findings import Finding
from tndebug.library import ranks
from tndebug.library.user_batch import shift_left
from tndebug.probes.raised import by_tndebug, raised_in
from tndebug.probes.budget import Budget


class WeakHook:
    """A hook that holds the watch weakly: the model never keeps a watch alive."""

    def __init__(self, ref, method: str) -> None:
        self.ref, self.method = ref, method

    def __call__(self, *args):
        w = self.ref()
        if w is None or w._state != "open":
            return None
        t0 = time.perf_counter()
        outer = w._hook_t0 is None        # a hook inside ours (a probe's own forward) is ours
        if outer:
            w._hook_t0 = t0
        try:
            return getattr(w, self.method)(*args)
        except UsageError:
            raise                         # a bad argument of the user's (batch=): refused, clearly
        except Exception as e:  # noqa: BLE001 - the user's training goes on
            w._own_error(self.method, e)
            return None
        finally:
            if outer:   # every step's cost of the watch (budget); a step recorded in this hook
                        # took the time up to its record (`_own_since`), the rest is the next's
                w._own_s += time.perf_counter() - max(t0, w._own_since)
                w._hook_t0 = None


class Shielded:
    def __init__(self, ref, name: str, what: str, fn) -> None:
        self.ref, self.name, self.what, self.fn = ref, name, what, fn
        self.__name__ = what

    def __call__(self, *args):
        w = self.ref()
        if w is not None and self.name in w._failed:
            return {} if self.what == "observe" else None
        if w is not None and w._sharding == "fsdp2":
            # a probe sees the parameters the optimizer holds: FSDP2 leaves modules gathered
            # after a forward without backward or one the capture stopped (StopForward is a
            # BaseException: no always_call hook runs for it)
            ranks.reshard(w._model_ref())
        try:
            return self.fn(*args)
        except Exception as e:
            if w is not None:
                w._probe_failed(self.name, self.what, e)
            raise


class StepCapture:
    """The subject's capture, with the step's recording closeable at the end of the forward
    (its gradient hooks live on the tensors and still fire in backward)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.step_mode = False
        self._open = None

    @property
    def is_recording(self) -> bool:
        return self._open is not None

    @contextlib.contextmanager
    def recording(self, reads, trace=None, **stop):
        if not self.step_mode:
            with self.inner.recording(reads, trace, **stop) as t:
                yield t
            return
        cm = self.inner.recording(reads, trace, **stop)
        t = cm.__enter__()
        self._open = cm
        try:
            yield t
        finally:
            self.stop()

    def stop(self) -> None:
        cm, self._open = self._open, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _BackwardTap:
    """`torch.autograd.backward` patched only between a probed step's forward and its
    optimizer step: the tensor backward is called on is the step's loss."""

    def __init__(self) -> None:
        self._orig = None
        self._watch = None

    def watch(self, w) -> None:
        if self._orig is not None:
            return
        self._watch = weakref.ref(w)
        self._orig = orig = torch.autograd.backward
        tap = self

        def backward(tensors, *args, **kwargs):
            target = tap._watch() if tap._watch is not None else None
            if target is not None:
                try:
                    target._saw_backward(tensors)
                except Exception:  # noqa: BLE001
                    pass
            return orig(tensors, *args, **kwargs)
        self._patched = backward
        torch.autograd.backward = backward

    def unwatch(self, w=None) -> None:
        if self._orig is None or (w is not None and self._watch is not None and self._watch() is not w):
            return
        if torch.autograd.backward is self._patched:
            torch.autograd.backward = self._orig
        self._orig = self._watch = self._patched = None


BACKWARD_TAP = _BackwardTap()


def complete_batch(batch, pad_id: int, kind: str = "seq2seq"):
    """(src, tgt_in, tgt_out): the target, when the call gave none, is tgt_in shifted left
    (computed here, on the steps that need it, not in every forward); an encoder-only model's
    labels are not its input shifted, so it keeps None."""
    if batch is None:
        return None, None, None
    src, tgt_in, tgt_out = batch
    if tgt_out is None and kind != "encoder" and isinstance(tgt_in, torch.Tensor) and tgt_in.dim() == 2:
        tgt_out = shift_left(tgt_in, pad_id)
    return src, tgt_in, tgt_out


def optimizes(optimizer: torch.optim.Optimizer, *models: nn.Module) -> None:
    """The optimizer holds at least one parameter of the model (a subset is fine-tuning);
    none is another model's optimizer: its steps would never change this model (issue 47)."""
    mine = {id(p) for m in models for p in m.parameters()}
    held = [p for g in optimizer.param_groups for p in g.get("params", ())]
    if held and not any(id(p) in mine for p in held):
        raise UsageError(f"watch: the optimizer holds no parameter of the model ({len(held)} "
                         f"parameters, none of {type(models[-1]).__name__}'s): it is another "
                         f"model's, or was built before the model's parameters were replaced "
                         f"(.to_empty, load_state_dict(assign=True)); pass the optimizer built "
                         f"from model.parameters()")



def probe_failed_finding(name: str, what: str, e: Exception, step: int) -> Finding:
    """The info finding of a probe whose `what` moment raised `e` at `step`: switched off, and
    whose bug it is (tndebug's, or the user's model raising on the probe's input)."""
    frames = traceback.format_exception(type(e), e, e.__traceback__)
    return Finding(
        name, "info", f"probe {name} failed at {what} (step {step}): "
        f"{type(e).__name__}: {e}; switched off, training went on", step=step,
        evidence={"moment": what, "error": f"{type(e).__name__}: {e}",
                  "traceback": "".join(frames[-3:]).strip()},
        fix=("A tndebug bug, not yours: the rest of the report stands; please report it "
             "with this traceback") if by_tndebug(e) else
            (f"Your model's code raised on the probe's input (at {raised_in(e)}): the "
             f"probe could not check it; the rest of the report stands"), code=f"{name}/probe-failed")


def inner_optimizer(opt):
    """accelerate's / Lightning's wrapper -> the torch optimizer whose hooks fire."""
    seen = 0
    while not type(opt).__module__.startswith("torch.optim") and \
            isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer) and seen < 4:
        opt, seen = opt.optimizer, seen + 1
    return opt


def _thinned_note(budget: Budget | None) -> str | None:
    if budget is None or not budget.thinned:
        return None
    each = ", ".join(f"{name} {n}" for name, n in sorted(budget.thinned.items()))
    return (f"probes thinned to keep their cost within {budget.fraction:.0%} of your step time "
            f"(budget=): scheduled steps skipped: {each}; each probe still looked at least once")


def dist_from_env():
    """The process group the user started (DDP), as the trainer's Dist; None in one process."""
    import torch.distributed as tdist
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() < 2:
        return None
    from tndebug.train.distributed import Dist
    backend = tdist.get_backend()
    # host-side ints and objects (the reducer's size check, gathered findings) go over gloo;
    # every rank enters the watch at the same point, so this collective is matched
    control = tdist.new_group(backend="gloo") if backend == "nccl" else None
    return Dist(rank=tdist.get_rank(), world=tdist.get_world_size(), backend=backend,
                control=control)


def quiet_session(session_cls):
    class QuietSession(session_cls):
        """Files only: no summary on the console."""
        def _print(self, report, md, paths):
            return None
    return QuietSession


def brief_session(session_cls):
    class BriefSession(session_cls):
        """The files, and a few lines on stderr (verdict, counts, the findings' codes, paths):
        the training script's stdout stays its own."""
        def _print(self, report, md, paths):
            from tndebug.reporters.common import brief_text
            print(brief_text(report, paths), file=sys.stderr, flush=True)
    return BriefSession


def run_record(w, engine, status: str, error: str | None) -> dict:
    """report.json's `run` of a watch `w` that has finished: what was watched, how the block
    ended, what the probes cost (and the budget spent and thinned), the notes for the reader."""
    hist = w._history
    tail = [x for x in hist["loss"][-10:] if math.isfinite(x)]
    opt = w._optimizer
    run = {"mode": "watch", "model": type(w._subject.model).__name__,
           "adapter": w._info.get("adapter"), "arch": w._subject.kind,
           **({"arch_from": w._info["arch_from"]} if w._info.get("arch_from") else {}),
           "pad_id": w._pad_id if w._subject.padded else None,     # None: no padding in the data
           "bos_id": w._subject.bos_id, "src_vocab": w._subject.src_vocab,
           "tgt_vocab": w._subject.tgt_vocab,
           "attention_modules": w._info.get("attention_modules"),
           "probe_inputs": w._subject.inputs(),
           "optimizer": type(opt).__name__ if opt is not None else None,
           "lr_schedule": ("declared" if w._schedule is not None else None),
           "start_step": w.start_step, "steps": w._steps_seen,
           "stopped_at_step": w._step, "status": status, "error": error,
           "diverged_at_step": w.diverged, "device": str(w._device),
           "final_loss": sum(tail) / len(tail) if tail else None,
           "final_lr": w._optimizer_lr(),
           "world_size": w._dist.world if w._dist is not None else 1,
           **ranks.run_fields(w),                  # sharding, per-rank facts (several processes)
           "wall_s": round(time.perf_counter() - w._t0, 3),
           "probe_s": round(engine.probe_seconds, 3),
           "probe_s_by_probe": {k: round(v, 3) for k, v in engine.seconds_by_probe.items()}}
    if engine.budget is not None:
        run["probe_budget"] = engine.budget.summary()
    notes = [n for n in (w._schedule_note, w._info.get("adapter_note"),
                         _thinned_note(engine.budget)) if n]
    if opt is None:
        notes.append("no optimizer: steps are the dbg.step() calls; the lr is dbg.step(lr=) "
                     "or unknown, so lr-schedule has nothing to compare")
    if w._steps_seen == 0:
        notes.append("no training step was observed (no optimizer.step() and no dbg.step() "
                     "inside the block, or the model was never called in train mode)")
    if notes:
        run["notes"] = notes
    return run
