"""What `tndebug.watch` does on each step of the user's loop (a mixin of `Watch`): the model's
forward pre-hook opens a recording on a probed step, the output and logits hooks and the backward
tap find the loss, and the optimizer's step pre-hook is the probes' moment (`end_step`), the NaN
check and the budget's timing; the step post-hook advances the step. `_call` runs the engine's
code so that an error of tndebug's own stops probing, never training.
"""
from __future__ import annotations

import contextlib
import math
import time
import traceback

import torch

from tndebug.errors import UsageError
from tndebug.library import args as A
from tndebug.library import ranks
from tndebug.library.user_batch import default_batch, pad_id_findings
from tndebug.library.watch_parts import BACKWARD_TAP, complete_batch
from tndebug.probes.base import StepInfo
from tndebug.capture.adapters import first_tensor


class WatchHooks:
    """The per-step half of `Watch` (its state lives on the Watch: see `Watch.__init__`)."""

    # -- hooks (through weak references) ----------------------------------------------------------
    def _on_forward(self, module, args, kwargs):
        if self._busy or self._stopped() or not torch.is_grad_enabled():
            return None
        if not module.training and not self._trains_in_eval:
            self._eval_forward = self._step   # an evaluation with gradients on, or a step taken
            return None                       # in eval mode: the optimizer's step tells (_moment)
        if self._forward_seen == self._step:          # gradient accumulation: one batch a step
            return None
        self._forward_seen = self._step
        got = (self._user_batch(args, kwargs) if self._batch_fn is not None
               else default_batch(args, kwargs, self._pad_id, self._start_id, self._subject.kind))
        if got is not None and len(got) == 2:
            got = (got[0], got[1], None)
        if self._data_findings is None:                   # the first batch seen: its pads
            self._data_findings = pad_id_findings(got, self._pad_id, self._step)
        self._batch = got
        src, tgt_in = (got[0], got[1]) if got is not None else (None, None)
        self._busy = True
        self._step_t0 = time.perf_counter()       # the step's time, for the probes' budget
        try:
            self._capture.step_mode = True
            trace = self._engine.begin_step(self._step, src, tgt_in)
        except Exception as e:  # noqa: BLE001 - never break the user's forward
            self._own_error("begin_step", e)
            return None
        finally:
            self._capture.step_mode = False
            self._busy = False
        if trace is not None:
            self._open = True
            self._recording = self._capture.is_recording
        # the loss: on a probed step, and on every CPU step (the NaN check costs nothing there)
        if self._recording or (self._loss is None and self._device.type == "cpu"):
            BACKWARD_TAP.watch(self)
        return None

    def _user_batch(self, args, kwargs):
        """`batch=`'s value for the model's call, checked: at its first call a bad one (None, a
        wrong shape, or the function raising) is a UsageError out of the user's forward; later,
        a step whose value does not fit is a step with no batch."""
        first, self._batch_checked = not self._batch_checked, True
        try:
            got = self._batch_fn(args, kwargs)
        except Exception as e:  # noqa: BLE001 - the user's function may raise anything
            if not first:
                return None
            raise UsageError(f"watch: batch= raised {type(e).__name__}: {e} (it is called as "
                             f"batch(args, kwargs) with the model's positional and keyword "
                             f"arguments)") from None
        try:
            return A.user_batch(got)
        except UsageError:
            if first:
                raise
            return None

    def _on_output(self, module, args, kwargs, output):
        if not self._open or self._output_seen or self._busy:
            return None
        self._output_seen = True          # the recording stays open until backward starts:
                                          # closing it here would unhook modules mid-dispatch
        self._on_logits(module, args, kwargs, output)
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.dim() == 0 and self._loss is None:
            self._loss = loss.detach()
        return None

    def _on_logits(self, module, args, kwargs, output):
        if not self._open or self._logits is not None or self._busy:
            return None
        logits = first_tensor(output)
        tgt_in = self._batch[1] if self._batch is not None else None
        if logits is None or tgt_in is None:
            return None
        if logits.dim() == 2 and tgt_in.dim() == 2 and logits.shape[0] == tgt_in.numel():
            logits = logits.view(*tgt_in.shape, logits.shape[-1])   # flattened [B*T, V]
        if logits.dim() != 3:
            return None
        vocab = self._subject.tgt_vocab
        # a Hugging Face output's `.logits` is the logits by name: its width is the output
        # layer's, which may hold ids past the content range the subject's vocabulary keeps
        # (GPT-2's eos 50256: tgt_vocab 50256 of 50257 columns); any other tensor must have
        # exactly the vocabulary's width (a hidden state [B, T, d] is not logits)
        named = isinstance(getattr(output, "logits", None), torch.Tensor)
        if logits.shape[-1] != vocab and not (named and logits.shape[-1] > vocab):
            return None
        if tuple(logits.shape[:2]) == tuple(tgt_in.shape):
            self._logits = logits.detach()
        elif tuple(logits.shape[:2]) == tuple(tgt_in.shape[::-1]):
            # a sequence-first model (`model(src.T, tgt.T)` -> [T, B, V]) whose batch= gave the
            # batch-first ids: its logits read the same way. B != T here, so no other reading
            # fits; a square batch (B == T) matched the line above, read batch-first as before
            self._logits = logits.detach().transpose(0, 1)
        return None

    def _on_opt_step(self, optimizer, args, kwargs):
        self._moment()
        return None

    def _on_opt_done(self, optimizer, args, kwargs):
        self._advance(self._step + 1)
        return None

    def _saw_backward(self, tensors) -> None:
        t = tensors if isinstance(tensors, torch.Tensor) else (
            tensors[0] if isinstance(tensors, (tuple, list)) and tensors else None)
        if self._loss is None and isinstance(t, torch.Tensor) and t.numel() == 1:
            self._loss = t.detach().reshape(())
        BACKWARD_TAP.unwatch(self)
        self._capture.stop()              # forward done: backward fills the gradients only

    # -- the probes' moment ---------------------------------------------------------------------
    def _moment(self) -> None:
        """After backward, before the update: end_step (on probed steps) and the NaN check."""
        if self._moment_done or self._state != "open":
            return
        self._moment_done = True
        if self._forward_seen != self._step and self._eval_forward == self._step:
            # this step's only forward ran in eval mode: the loop trains so (`model.train()`
            # forgotten; train-mode names it). Its later forwards in eval mode are its steps,
            # for every probe to count (only this step is lost to them)
            self._trains_in_eval = True
        BACKWARD_TAP.unwatch(self)
        self._capture.stop()
        step, loss = self._step, self._loss
        lr = self._lr if self._lr is not None else self._optimizer_lr()
        self._steps_seen += 1
        if self._open:
            self._open = False
            # a step of host_only probes (lr-schedule's every step) needs no batch: no target
            src, tgt_in, tgt_out = (None, None, None) if self._engine.host_only \
                else complete_batch(self._batch, self._pad_id, self._subject.kind)
            info = StepInfo(step, lr=lr, loss=loss, logits=self._logits, src=src, tgt_in=tgt_in,
                            tgt_out=tgt_out)
            self._call(self._engine.end_step, info, full=self._recording)
            if loss is not None and self._recording:
                value = float(loss)            # this step synced for the probes already
                self._history["step"].append(step)
                self._history["loss"].append(value)
                self._history["lr"].append(lr)
                if self._session is not None:
                    self._session.log_scalars(step, {"train/loss": value, "train/lr": lr})
        if loss is not None and (self._recording or loss.device.type == "cpu"):
            self._check_finite(step, loss, self._batch, lr)
        if self._engine.budget is not None and self._step_t0 is not None:
            now = time.perf_counter()
            # the hook we are in counts up to now for this step, not again for the next (it
            # did: each probed step's moment and each ranks' exchange were spent twice)
            inside = now - max(self._hook_t0, self._own_since) if self._hook_t0 is not None else 0.0
            self._engine.budget.record(now - self._step_t0, probed=self._recording,
                                       own=self._own_s + inside)
            self._step_t0, self._own_s, self._own_since = None, 0.0, time.perf_counter()
        self._logits = None

    def _check_finite(self, step: int, loss: torch.Tensor, batch, lr: float | None = None) -> None:
        if self.diverged is not None or self._stopped() or (self._dist is not None and self._dist.active):
            return                            # under DDP the ranks' losses differ: loss-health judges
        if math.isfinite(float(loss)):          # a scalar: on the CPU, or a step synced already
            return
        self.diverged = step
        src, tgt_in, tgt_out = complete_batch(batch, self._pad_id, self._subject.kind)
        self._call(self._engine.diverged, StepInfo(step, lr=lr, loss=loss, src=src, tgt_in=tgt_in,
                                                   tgt_out=tgt_out), full=True)

    def _advance(self, step: int) -> None:
        if not self._moment_done and self._forward_seen == self._step:
            self._moment()                      # a step that never reached the optimizer hook
        self._prev_batch = self._batch
        self._reset_step(step)

    def _reset_step(self, step: int) -> None:
        self._step = step
        self._forward_seen: int | None = None
        self._moment_done = False
        self._open = self._recording = self._output_seen = False
        self._step_t0: float | None = None
        self._loss: torch.Tensor | None = None
        self._logits = None
        self._lr: float | None = None
        if not hasattr(self, "_batch"):
            self._batch = self._prev_batch = None
            self._trains_in_eval = False          # steps taken in eval mode (see _moment)
            self._eval_forward: int | None = None  # the last step with a forward in eval mode

    # -- engine calls ----------------------------------------------------------------------------
    def _call(self, fn, *args, full: bool = True):
        """Run engine code: probes' model calls bypass the hooks; RNG, grads (full) and the
        train/eval mode come back as they were; an error of ours stops probing, not training."""
        model = self._model_ref()
        was = model.training if model is not None else None
        grads = [(p, p.grad) for p in self._params] if full and model is not None else ()
        self._busy = True
        try:
            rng = torch.random.fork_rng(devices=self._rng_devices) if full else contextlib.nullcontext()
            with rng:
                return fn(*args)
        except Exception as e:  # noqa: BLE001
            self._own_error(getattr(fn, "__name__", "engine"), e)
            return None
        finally:
            for p, g in grads:
                p.grad = g
            if self._sharding == "fsdp2" and model is not None:
                ranks.reshard(model)          # the probes' own forwards leave the root gathered
            if was is not None and model.training != was:
                model.train(was)
            self._busy = False

    def _own_error(self, what: str, e: Exception) -> None:
        if self._own_failure is None:
            self._own_failure = f"{what} at step {self._step}: {type(e).__name__}: {e}"
            self._own_tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])

    def _stopped(self) -> bool:
        return self._state != "open" or self._own_failure is not None or self.diverged is not None

    def _optimizer_lr(self) -> float | None:
        if self._optimizer is None or not self._optimizer.param_groups:
            return None
        lr = self._optimizer.param_groups[0].get("lr")
        return float(lr) if lr is not None else None
