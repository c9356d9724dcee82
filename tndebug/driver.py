"""The probe driver: the one place that drives the probe engine over a model once.

    result = probe_once(subject, names, batch, compute_dtype=dtype)   # triage, HF triage, check
    report = judge.conclude(run, result.findings, result.statuses, context)   # every front-end

`tndebug run` and `tndebug.watch` step the engine themselves (their steps are the user's or the
trainer's); triage and `check` probe one forward and backward through `probe_once`. What happens
to the findings after the probes (re-judgements, dedupe, statuses, --select) is the judge's
(tndebug/judge/), and what the verdict is, `Report.verdict`'s.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from tndebug.findings import Finding
from tndebug.memory import give_back_freed  # noqa: F401 - triage calls it as driver.give_back_freed
from tndebug.probes import make_probes
from tndebug.probes.base import RunContext, StepInfo
from tndebug.probes.engine import ProbeEngine
from tndebug.subject import Subject

PROBE_BATCH = 8          # sequences of the held-out batch the probes' forward and backward see


@dataclass
class ProbeResult:
    """What one probed forward and backward gave: the probes' findings, their statuses
    (`Report.probes`), the seconds inside each probe, and the sinks' view of the step."""
    findings: list[Finding]
    statuses: dict[str, dict]
    seconds: dict[str, float]
    batch: tuple = ()                            # (src, tgt_in, tgt_out) the probes saw
    extras: dict[str, Any] = field(default_factory=dict)


def probe_once(subject: Subject, names: Iterable[str], batch, *,
               compute_dtype: torch.dtype = torch.float32, sinks: Iterable[Any] = (),
               token_names: dict[int, str] | None = None) -> ProbeResult:
    """Run the probes `names` on `subject` in triage mode: every probe's setup (the exact tests),
    one recorded forward and backward of the first `PROBE_BATCH` sequences of `batch`
    (src, tgt_in, tgt_out), no optimizer step, then every probe's finish.

    `sinks` (objects with `on_trace(step, trace)` / `on_metric(step, tag, value)`) see the step as
    the last one of a run: the figures' reads are recorded too. The model's mode is restored and
    its gradients cleared. `token_names` ({id: token}, from a saved tokenizer) go to the sinks
    that label tokens (`on_tokens`: the Recorder, for the figures' axes); this recorded batch
    is the only one the sinks see, so every figure of the pass shows it."""
    probes = make_probes(list(names))
    pad_id = subject.pad_id
    sinks = list(sinks)
    for sink in sinks:
        if token_names and hasattr(sink, "on_tokens"):
            sink.on_tokens(dict(token_names))
    run = RunContext(subject=subject, optimizer=None, mode="triage", compute_dtype=compute_dtype,
                     criterion=lambda lg, t: F.cross_entropy(lg.float(), t, ignore_index=pad_id),
                     device=str(subject.device), total_steps=1 if sinks else None)
    src, tgt_in, tgt_out = (t[:PROBE_BATCH].to(subject.device) for t in batch)
    model = subject.model
    was = model.training
    model.eval()
    give_back_freed()                # what loading and the caller's own passes freed
    try:
        with ProbeEngine(probes, run, sinks=sinks) as engine:
            engine.setup()
            give_back_freed()        # the setups' freed traces, before the pass's gradients
            engine.begin_step(0, src, tgt_in)
            logits = subject.logits(src, tgt_in)
            loss = run.criterion(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
            model.zero_grad(set_to_none=True)
            norms: dict[int, torch.Tensor] = {}
            if loss.requires_grad:
                with norms_as_freed(model, norms):
                    loss.backward()
            engine.end_step(StepInfo(0, loss=loss.detach(), logits=logits.detach(), src=src,
                                     tgt_in=tgt_in, tgt_out=tgt_out, grad_norms=norms))
            findings = engine.finish()
            statuses = engine.statuses()
            seconds = {k: round(v, 3) for k, v in engine.seconds_by_probe.items()}
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was)
    return ProbeResult(findings, statuses, seconds, (src, tgt_in, tgt_out))


@contextmanager
def norms_as_freed(model: torch.nn.Module, norms: dict[int, torch.Tensor]):
    """During a backward: keep each parameter's gradient norm in `norms` ({id(p): fp32 device
    scalar}) and free the gradient as soon as it is whole. The probes read only norms from a
    triage pass (StepInfo.grad_norms), and a weight-sized `.grad` for every parameter at once
    was the pass's peak (GPT-2 small: 0.5 GB of 2.1). A parameter used twice (a tied head) gets
    one call, after both contributions are summed."""
    def keep(p: torch.Tensor) -> None:
        if p.grad is not None:
            g = p.grad.detach()
            g = g.coalesce().values() if g.is_sparse else g      # a row-sparse vocabulary matrix
            norms[id(p)] = torch.linalg.vector_norm(g, dtype=torch.float32)
            p.grad = None

    handles = [p.register_post_accumulate_grad_hook(keep)
               for p in model.parameters() if p.requires_grad]
    try:
        yield norms
    finally:
        for h in handles:
            h.remove()
