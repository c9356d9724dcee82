"""nan-scores: the first NaN/Inf of a pass, named by module and op, and what breeds one."""
from __future__ import annotations

import math

import torch
from torch import nn

from tndebug.faults import FAULT_NOTES
from tndebug.probes._attn_stats import probe_batch, roles
from tndebug.probes._nan_checks import constant_rows_nonfinite, loss_story
from tndebug.probes.base import Probe, RunContext, StepInfo
from tndebug.probes.nan_scores_locate import bad_flags, fill_line, first_nonfinite, mask_fill
from tndebug.probes.schedule import log_spaced
from tndebug.capture.trace import Trace

FP16_MAX = 65504.0                      # torch.finfo(torch.float16).max
FP16_TINY = 2.0 ** -24                  # smallest positive float16 (subnormal), 6.0e-08
SAFE_FILLS = (torch.finfo(torch.float32).min, torch.finfo(torch.float64).min)  # finfo(dtype).min

FIX_NAN = ("Replay the batch under torch.autograd.detect_anomaly() and look at the op named; "
           "keep scores in range (eps 1e-5, clamp scores, lower lr) [notes 000, 002]")


def _half_nonfinite(module: nn.Module) -> bool | None:
    """Run a float16 copy of a norm module on constant rows; True if any output is NaN/Inf."""
    return constant_rows_nonfinite(module, torch.float16)


def _portability(dtype: torch.dtype) -> str:
    """Why an fp16 hazard is only an advisory in a model computing in `dtype`."""
    if dtype == torch.bfloat16:
        return "bf16 model, which has the fp32 range: only matters if you switch to fp16"
    name = {torch.float32: "fp32", torch.float64: "fp64"}.get(dtype, str(dtype).removeprefix("torch."))
    return f"{name} model: only matters if you switch on fp16 autocast"


class NanScores(Probe):
    """NaN/Inf in scores, probabilities or activations, and the settings that produce them.

    Failure: a query row whose every key is masked with -inf gives softmax 0/0 = NaN (an all-pad
    sequence, or a square padding mask that also hides pad queries); a literal mask fill of
    -1e9 overflows float16 (max 65504); LayerNorm eps=1e-12 rounds to 0 in float16, so a
    constant row gives 0/0.
    Symptom: the loss turns NaN, at once or when fp16 autocast is switched on; 0*NaN = NaN
    carries the NaN of a discarded pad row into every real row and into the gradients.
    Fix: fill with torch.finfo(scores.dtype).min and mask only the key axis; LayerNorm
    eps=1e-5 (notes 000, 002).

    Setup (eval, one padded random batch, every tap): the first non-finite tensor in execution
    order, with the fully-masked rows of its attention module; the mask fill actually used
    (masked_scores where they differ from scores) against float16; the `eps` of every norm
    module, and a float16 copy of it run on constant rows; an all-pad source. Every step:
    one isfinite flag per captured tensor and stream gradient, synced once with the other
    probes; on the first flag the batch is replayed with every tap to name the op.
    """

    name = "nan-scores"
    cause = (
        "Filling masks with -inf gives NaN on rows whose every key is masked (an all-pad "
        "sequence, or pad queries masked too) [notes 000, 002]; -1e9 is finite but overflows "
        "fp16, so fill with torch.finfo(dtype).min. A LayerNorm eps that rounds to 0 in fp16 "
        "(1e-8, 1e-12) gives 0/0 on constant rows there, never in fp32 [note 000, as measured] "
        "unless eps is 0, which gives 0/0 in every dtype; "
        "a too-high lr also sends the loss to NaN [note 002]. A loss that is NaN on finite "
        "logits comes from the loss code (a log of 0, a division by a zero count)."
    )
    summary = "first NaN/Inf in execution order; fully-masked rows; fp16-unsafe mask fill and LayerNorm eps"
    codes = {
        "norm-fp16": "a norm whose eps rounds to 0, or that gives NaN, in float16",
        "eps-zero": "a norm that gives NaN/Inf on a constant row in the model's dtype (eps = 0)",
        "fill-overflow-fp16": "a mask fill beyond the float16 range",
        "all-pad-source": "a source of pads only gives NaN/Inf (rows with every key masked)",
        "nonfinite-forward": "the first NaN/Inf of a forward pass, by module and op",
        "nonfinite-loss": "a NaN/Inf loss: the loss code, or the update diverged",
        "nonfinite-grad": "NaN/Inf in backward while the forward is finite",
    }
    reads = ("attn.out", "stream", "logits", "grad.stream")
    fix = FIX_NAN
    # Sparse: a sweep of every tensor (and the taps it turns on) cost ~12% of a small CPU step
    # when measured with per-tensor isfinite checks; one sum per tensor now, still not free.
    # A NaN between probed steps still gets named: the trainer calls on_divergence, which
    # replays that batch with every tap.
    default_schedule = staticmethod(lambda: log_spaced(50))
    # never deferred by a probe budget (probes/budget.py): the first step a NaN appears on is
    # what this probe names; its scheduled looks are sparse (9 in 400 steps) and one sum each
    budget_exempt = True

    def __init__(self, schedule=None) -> None:
        super().__init__(schedule)
        self._run: RunContext | None = None
        self._trace: Trace | None = None
        self._forward_done = False     # the first non-finite forward was reported
        self._grad_done = False
        self._replay_logits: torch.Tensor | None = None

    # -- setup -------------------------------------------------------------------------------
    def setup(self, run: RunContext) -> None:
        self._run = run
        subject = run.subject
        self._check_norms(subject.model)
        if subject.capture is None:
            self.skip("no capture: setup needs attention internals; steps are checked from outputs")
            return
        src, tgt = probe_batch(subject)
        with subject.evaluating():
            trace = subject.trace(src, tgt, reads=("all",))
        self.cover("", "checked")              # every captured tensor of the setup batch
        found = first_nonfinite(trace)
        if found:
            self._report_nonfinite(found, step=0, context="setup batch, eval mode")
        self._check_fill(trace)
        if not found:
            self._check_all_pad(src, tgt)

    @property
    def _half(self) -> bool:
        return self._run is not None and self._run.compute_dtype == torch.float16

    def _check_norms(self, model: nn.Module) -> None:
        eps_of, static, behaviour, own = {}, [], [], []
        dtype = self._run.compute_dtype
        for name, mod in model.named_modules():
            if not (isinstance(mod, nn.LayerNorm) or "Norm" in type(mod).__name__):
                continue
            eps = getattr(mod, "eps", None)
            if isinstance(eps, (int, float)) and not isinstance(eps, bool):
                eps_of[name] = float(eps)
                if float(torch.tensor(float(eps), dtype=torch.float16)) == 0.0:
                    static.append(name)
            if _half_nonfinite(mod):
                behaviour.append(name)
            if dtype != torch.float16 and constant_rows_nonfinite(mod, dtype):
                own.append(name)               # e.g. eps = 0: 0/0 on a constant row in fp32 too
        if eps_of or static or behaviour or own:
            self.cover("", "checked")          # the norms' eps against float16 and this dtype
        if own:
            self._report_own_dtype(own, eps_of, dtype)
        flagged = [n for n in dict.fromkeys(static + behaviour) if n not in own]
        if not flagged:
            return
        first, more = flagged[0], len(flagged) - 1
        tail = f" (+{more} more norm modules)" if more else ""
        if first in static:
            msg = (f"{first}: eps={eps_of[first]:g} rounds to 0 in float16{tail}; "
                   f"a constant row gives 0/0 under fp16")
        else:
            msg = f"{first}: a float16 copy gives NaN/Inf on constant rows{tail}"
        # docs/severity.md: in an fp16 model a float16 norm that gives NaN is the defect shown
        # (error), an eps that only rounds to 0 bites under this dtype (warning; nn.LayerNorm
        # stays finite); in any other dtype it is an fp16 portability advisory (info)
        if self._half:
            severity = "error" if behaviour else "warning"
        else:
            severity = "info"
            msg += f" ({_portability(self._run.compute_dtype)})"
        self.report(severity, msg, where=first, step=0,
                    evidence={"eps": {n: eps_of.get(n) for n in flagged},
                              "eps_rounds_to_0_in_float16": static,
                              "fp16_constant_row_nonfinite": behaviour,
                              "compute_dtype": str(self._run.compute_dtype),
                              "threshold": f"eps must not round to 0 in float16 (< {FP16_TINY / 2:.1e})"},
                    fix=FAULT_NOTES["tiny_ln_eps"][2], code="norm-fp16", source=self._eps_line(first))

    def _report_own_dtype(self, own: list[str], eps_of: dict, dtype: torch.dtype) -> None:
        """Norms that give NaN/Inf on a constant row in the model's own dtype: the hazard bites
        here (docs/severity.md: warning; a constant row is a rare input, not this run's batch)."""
        first, name = own[0], str(dtype).removeprefix("torch.")
        eps = eps_of.get(first)
        tail = f" (+{len(own) - 1} more norm modules)" if len(own) > 1 else ""
        self.report("warning", f"{first}: {'eps=' + format(eps, 'g') + ': ' if eps is not None else ''}"
                               f"a constant row gives NaN/Inf in {name}, the model's own dtype (0/0: "
                               f"bites in this dtype){tail}",
                    where=first, step=0,
                    evidence={"eps": {n: eps_of.get(n) for n in own}, "compute_dtype": str(dtype),
                              "constant_row_nonfinite": own,
                              "threshold": "a norm must stay finite on a constant row in its own dtype"},
                    fix="use eps=1e-5 (1e-6 for RMSNorm) inside the square root: the norm then "
                        "returns its bias on a constant row", code="eps-zero", source=self._eps_line(first))

    def _eps_line(self, path: str) -> dict | None:
        """Where the norm's eps is set: the line that constructs it (capture/assignments.py)."""
        from tndebug.capture.assignments import constructor_line
        subject = self._run.subject if self._run is not None else None
        return constructor_line(getattr(subject, "model", None), path)

    def _check_fill(self, trace: Trace) -> None:
        by_fill: dict[float, list[str]] = {}
        lines: dict[float, dict | None] = {}
        for rec in trace.records():
            fill = mask_fill(rec)
            if fill is not None:
                by_fill.setdefault(fill, []).append(rec.site)
                lines.setdefault(fill, fill_line(rec))
        dtype = self._run.compute_dtype
        for fill, sites in by_fill.items():
            if not math.isfinite(fill) or abs(fill) <= FP16_MAX or fill in SAFE_FILLS:
                continue      # finfo(dtype).min follows the dtype under autocast: safe
            tail = f" (+{len(sites) - 1} more attention modules)" if len(sites) > 1 else ""
            ev = {"fill": fill, "float16_max": FP16_MAX, "modules": sites, "compute_dtype": str(dtype),
                  "threshold": "|fill| <= 65504, or finfo(dtype).min / -inf"}
            if dtype == torch.float16:
                self.report("error", f"{sites[0]}: mask fill {fill:g} overflows float16 (max 65504){tail}",
                            where=sites[0], step=0, evidence=ev, fix=FAULT_NOTES["fill_1e9_fp16"][2], code="fill-overflow-fp16",
                            source=lines.get(fill))
            else:             # an fp16 portability advisory (docs/severity.md)
                self.report("info", f"{sites[0]}: mask fill {fill:g} would overflow float16 "
                            f"(max 65504){tail} ({_portability(dtype)})",
                            where=sites[0], step=0, evidence=ev, fix=FAULT_NOTES["fill_1e9_fp16"][2], code="fill-overflow-fp16",
                            source=lines.get(fill))

    def _check_all_pad(self, src: torch.Tensor, tgt: torch.Tensor) -> None:
        """A source made only of pads: its rows have no key at all in every source attention."""
        subject = self._run.subject
        src = src.clone()
        src[1] = subject.pad_id                      # an unpadded row becomes all pad
        with subject.evaluating():
            logits = subject.logits(src, tgt)
            if bool(logits.isfinite().all()):
                return
            found = first_nonfinite(subject.trace(src, tgt, reads=("all",)))
        source = found.pop("source", None) if found else None
        where = found["where"] if found else "logits"
        msg = (f"{where}: a source made only of pads gives {found['what'] if found else 'NaN/Inf'}"
               f" ({found['op'] if found else 'logits'}, rows with every key masked); real batches "
               f"are unaffected unless a sequence can be empty")
        # info (docs/severity.md): an input that is all padding is not one this model runs on
        # unless the data has empty sequences; a NaN on real inputs is reported as an error
        self.report("info", msg, where=where, step=0,
                    evidence={**(found or {}), "threshold": "any non-finite output"},
                    fix=FAULT_NOTES["neg_inf_fill_all_masked"][2], code="all-pad-source", source=source)

    def _report_nonfinite(self, found: dict, step: int, context: str) -> None:
        self._forward_done = True
        found = dict(found)
        source = found.pop("source", None)
        msg = f"{found['tensor']}: {found['op']} produced {found['what']} in {found['rows']} rows"
        fix = self.fix
        n_fm = found.get("fully_masked_nonfinite_rows", 0)
        if n_fm:
            fill = found.get("fill")
            msg += (f"; {n_fm} of them are rows with every key masked"
                    + (f" (fill {fill:g})" if fill is not None else ""))
            fix = FAULT_NOTES["neg_inf_fill_all_masked"][2]
        self.report("error", msg, where=found["where"], step=step,
                    evidence={**found, "context": context, "threshold": "any NaN/Inf (-inf allowed in masked scores)"},
                    fix=fix, code="nonfinite-forward", source=source)

    # -- every step --------------------------------------------------------------------------
    def observe(self, trace: Trace, info: StepInfo) -> dict:
        role_of = roles(trace)
        plain, masked = [], []          # masked scores may hold -inf; nothing else may
        for name, x in trace.order:
            if x.is_floating_point():
                (masked if role_of.get(id(x), (name, ""))[1] == "masked_scores" else plain).append((name, x))
        flags = bad_flags([x for _, x in plain], [x for _, x in masked])
        gflags = bad_flags(list(trace.grads.values()), [])
        self._trace = trace
        out: dict = {"names": [n for n, _ in plain + masked], "gnames": list(trace.grads)}
        if flags is not None:
            out["bad"] = flags                              # [n_tensors], on device
        if gflags is not None:
            out["gbad"] = gflags                            # [n_grads]
        if info.loss is not None:
            out["loss_bad"] = bad_flags([info.loss.detach()], [])[0]
        return out

    def update(self, stats: dict, info: StepInfo) -> None:
        trace, self._trace = self._trace, None
        if "bad" in stats or "loss_bad" in stats:
            self.cover("", "checked")          # this step's tensors (or loss) flagged finite or not
        bad = [n for n, b in zip(stats["names"], stats["bad"].tolist()) if b > 0] if "bad" in stats else []
        loss_bad = "loss_bad" in stats and float(stats["loss_bad"]) > 0
        if (bad or loss_bad) and not self._forward_done:
            found = self._replay(info)
            context = "replayed in eval mode with every tap"
            if found is None and trace is not None:
                found, context = first_nonfinite(trace), "training step"
            if found is not None:
                self._report_nonfinite(found, info.step, context)
            elif loss_bad:
                self._forward_done = True
                msg, ev, code, fix = loss_story(self._run, info, self._replay_logits)
                self.report("error", msg, where="loss" if code == "nonfinite-loss" else "logits",
                            step=info.step, evidence={**ev, "activations": "finite"}, fix=fix, code=code)
            return
        gbad = [n for n, b in zip(stats["gnames"], stats["gbad"].tolist()) if b > 0] if "gbad" in stats else []
        if gbad and not bad and not self._grad_done and not self._forward_done:
            self._grad_done = True
            self.report("error", f"{gbad[0]}: gradient is NaN/Inf in backward while the forward "
                        f"is finite ({len(gbad)} stream points)", where=gbad[0], step=info.step,
                        evidence={"grads_nonfinite": gbad, "threshold": "any non-finite gradient"}, code="nonfinite-grad")

    def on_divergence(self, run: RunContext, info: StepInfo) -> None:
        if self._forward_done:
            return
        self._run = self._run or run
        found = self._replay(info)
        if found is not None:
            self._report_nonfinite(found, info.step, "the diverged step's batch, replayed with every tap")
        else:
            self._forward_done = True
            msg, ev, code, fix = loss_story(self._run, info, self._replay_logits)
            self.report("error", msg, where="loss" if code == "nonfinite-loss" else "logits",
                        step=info.step, evidence=ev, fix=fix, code=code)

    def _replay(self, info: StepInfo) -> dict | None:
        """Re-run the step's batch with every tap (eval, no grad) to name the op."""
        self._replay_logits = None
        subject = self._run.subject if self._run is not None else None
        if subject is None or subject.capture is None or info.src is None or info.tgt_in is None:
            return None
        try:
            with subject.evaluating():
                trace = subject.trace(info.src, info.tgt_in, reads=("all",))
        except Exception:  # noqa: BLE001 - the step's own trace still names a tensor
            return None
        self._replay_logits = trace.logits
        return first_nonfinite(trace)
