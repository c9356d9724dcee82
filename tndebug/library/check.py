"""`tndebug.check`: triage's static and exact checks on a live model object, no checkpoint file.

    report = tndebug.check(model, forward)            # a tndebug.report.Report
    tndebug.check(model, forward).exit_code("error")  # 0 clean, 1 findings, 4 not all checked

The probes that judge code and weights from one forward and backward (`TRIAGE_PROBES`: the
mask tests, the fitted scale, NaN provenance, head and depth statistics, ...) run as
`tndebug triage --model` runs them (`tndebug.driver.probe_once`), on `data` or on random
ids from the model's vocabulary; duplicated heads are read from the weights; grouped-query
key/value heads repeated in the other order than the weights were trained with are found on
`data` the model solves (`run.kv_head_order`: "inconclusive" on random ids). The model's
gradients are cleared (`zero_grad(set_to_none=True)`) and its train/eval mode restored.

`CheckResult` (the pytest plugin's value) wraps the report with `assert_clean`.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from tndebug import driver, judge
from tndebug.capture import projection_weights
from tndebug.capture.source import source_text
from tndebug.errors import UsageError
from tndebug.findings import Finding, severity_rank, SEVERITIES
from tndebug.judge.fresh import SEED, seeded
from tndebug.hf.wording import package_code, scale_switches
from tndebug.hf.encoder_decoder import attention_weights
from tndebug.one_stack import one_stack_batch
from tndebug.probes.head_collapse_weights import duplicate_heads
from tndebug.probes import TRIAGE_PROBES, parse_probe_spec
from tndebug.probes.base import ProbeError
from tndebug.probes.kv_order import kv_order, undecided as kv_undecided
from tndebug.probes.mask_broadcast import tndebug_masks_note
from tndebug.library import args as A
from tndebug.library.live import live_subject, set_max_len, unwrap
from tndebug.report import Report
from tndebug.reporters.oneshot import writing, written

N_SEQUENCES = 16            # as triage's held-out batch


def check(model: nn.Module, forward: Callable | None = None, data=None, *, pad_id: int | None = 0,
          bos_id: int | None = None, probes: str | Iterable[str] | None = None,
          src_vocab: int | None = None, tgt_vocab: int | None = None,
          max_len: int | None = None, out=None, overwrite: bool = False, sinks=(),
          select=None, ignore=None, arch: str | None = None) -> Report:
    """Run triage's probes on `model` as it is now.

    Args:
        model: an encoder-decoder nn.Module (a DDP wrapper is unwrapped).
        forward: `forward(model, src [B, S], tgt [B, T], pad_id) -> logits [B, T, V]`; not needed
            for a Hugging Face encoder-decoder, tndebug's model or The Annotated Transformer's.
            The built-in calls by name: "annotated" (The Annotated Transformer's), "tndebug"
            (`model(src, tgt)`).
        data: (src [B, S], tgt_in [B, T], tgt_out [B, T]) or (src, tgt) with tgt BOS-led
            (split into tgt[:, :-1] and tgt[:, 1:]); a decoder- or encoder-only model: ids
            [N, T] or {'ids': ids} (optionally with 'attention_mask'), one sequence per row;
            None: random ids, a third of the rows padded.
        pad_id, bos_id: padding and decoder-start ids (HF models: from the config); pad_id=None:
            the data hold no padding (character-level text): no pad warnings, and the tests
            that need padding pad their own copies.
        probes: names ("a,b" or a list); default: every probe that needs no training run.
        select, ignore: finding codes or probe names to keep only / to drop, as ruff's
            --select / --ignore (`tndebug probes --codes` lists them).
        max_len: the longest sequence the model takes (default: its config's
            max_position_embeddings, else found by calling it); the probes' batches fit it.
        out: a directory for report.json, report.md, figures/ and tb/ (docs/triage.md,
            Outputs); one that already holds a report is refused unless overwrite=True.
        sinks: reporters shown the probed step (`ReportSession.sinks`; `out=` makes its own).
        arch: "decoder" (GPT-style) or "encoder" (BERT-style) for your own one-stack model, which
            both take forward(model, ids, pad_id); None: an encoder when the class name says
            Bert/Roberta/Electra/Encoder/MLM, else a decoder (run.arch_from says which).
    Returns:
        A Report (`verdict`, `findings`, `probes`, `exit_code(fail_on)`), as `tndebug triage`'s.
    Raises:
        UsageError for a model it cannot call, a forward of the wrong shape, no attention found.
    """
    if out is not None:                    # claimed before any work; written once it is done
        with writing(out, overwrite=overwrite, where="check") as session:
            return written(session, check(model, forward, data, pad_id=pad_id, bos_id=bos_id,
                                          probes=probes, src_vocab=src_vocab, tgt_vocab=tgt_vocab,
                                          max_len=max_len, sinks=session.sinks,
                                          select=select, ignore=ignore, arch=arch))
    t0 = time.perf_counter()
    names = _names(probes)
    subject, info = live_subject(model, forward, pad_id=pad_id, bos_id=bos_id,
                                 src_vocab=src_vocab, tgt_vocab=tgt_vocab, arch=arch)
    set_max_len(subject, max_len, "check")
    model = unwrap(model)
    batch = _batch(subject, data)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    with torch.random.fork_rng(devices=[subject.device] if subject.device.type == "cuda" else []):
        probed = driver.probe_once(subject, names, batch, compute_dtype=dtype, sinks=sinks)
    # weights ported from code that repeats grouped-query kv heads the other way (triage's test)
    kv, kv_evidence = kv_order(lambda s, t: subject.logits(s, t), subject.capture, batch,
                               subject.pad_id, subject.tgt_vocab,
                               data="data=" if data is not None else "random ids")
    undecided = kv_undecided(kv_evidence)  # applied to trained weights, decided nothing: no pass
    if info["hf"]:
        heads = duplicate_heads(attention_weights(model))
    else:
        heads = duplicate_heads(projection_weights(model))
    notes = [] if not info.get("adapter_note") else [
        tndebug_masks_note(info["adapter_note"], info["adapter"], "forward=")]
    run = {**_run_record(model, info, subject, data, batch, dtype, names),
           "kv_head_order": kv_evidence, "probe_seconds": probed.seconds,
           "wall_s": round(time.perf_counter() - t0, 3), "status": "completed"}
    context = judge.Context(
        one_pass=True, checks=kv + heads, notes=notes,
        not_run=[("checkpoint", "grouped-query head order", undecided)] if undecided else [],
        select=judge.codes_option(select, "select="), ignore=judge.codes_option(ignore, "ignore="),
        started=t0)
    if info["hf"]:                         # findings in its terms, a missing scale judged where
        context = hf_context(context, model, forward, subject, batch, dtype,   # the design is
                             pad_id=pad_id, bos_id=bos_id, src_vocab=src_vocab,
                             tgt_vocab=tgt_vocab, arch=arch)
    return judge.conclude(run, probed.findings, probed.statuses, context)


def _run_record(model: nn.Module, info: dict, subject, data, batch, dtype, names) -> dict:
    """report.json's `run` of a check, before its kv-order evidence and timings: the model and
    how it is called, its ids and vocabularies, the data, the probes run."""
    return {"mode": "check", "model": type(model).__name__, "adapter": info["adapter"],
            "arch": subject.kind, **({"arch_from": info["arch_from"]} if info.get("arch_from") else {}),
            "pad_id": subject.pad_id if subject.padded else None,     # None: no padding in the data
            "bos_id": subject.bos_id, "src_vocab": subject.src_vocab,
            "tgt_vocab": subject.tgt_vocab, "data": "data=" if data is not None else
            "random ids from the model's vocabulary", "held_out_sequences": int(batch[0].shape[0]),
            "compute_dtype": str(dtype).removeprefix("torch."),
            "attention_modules": info["attention_modules"], "probes_run": names,
            "probe_inputs": subject.inputs()}


def hf_context(context: judge.Context, model, forward, subject, batch=None,
               dtype=torch.float32, wording: bool = True, **kw) -> judge.Context:
    """`context` for a Hugging Face model: its fixes and module paths (hf/wording.py), and its
    missing-scale error re-judged on a fresh `_from_config` model of its class, as `tndebug
    triage DIR` does (judge/scale.py): folded into the initialisation (T5) or the installed
    package's own unmodified code (GPT-Neo) is the architecture's design, an info; else the
    error stays. `check` and `watch` both call it. The fresh model is built only for such an
    error; `batch` None: random ids as `check` draws them. `wording` False: tndebug's own
    fixes and module names (watch's findings have never been reworded)."""
    config = getattr(model, "config", None)
    build = getattr(type(model), "_from_config", None)
    if wording:
        context = dataclasses.replace(context, hf_model=model, hf_switches=scale_switches(config)
                                      if config is not None else {})
    if config is None or build is None:
        return context

    def probe_fresh(wanted):
        fresh_batch = _batch(subject, None) if batch is None else batch
        fresh = seeded(lambda: build(config)).to(subject.device).eval()
        sub, _ = live_subject(fresh, forward, **kw)
        with torch.random.fork_rng(devices=[subject.device] if subject.device.type == "cuda" else []):
            return driver.probe_once(sub, list(wanted), fresh_batch, compute_dtype=dtype)
    return dataclasses.replace(
        context, probe_fresh=probe_fresh, at_init=("missing-scale",),
        fresh_how=f"{type(model).__name__}._from_config(model.config), seed {SEED}",
        package_code=lambda: package_code(model, config))


def _names(spec) -> list[str]:
    """`probes=` -> names: None or "all" are the probes one forward and backward can judge;
    an empty selection, and a probe that needs a training run, are refused."""
    if spec is None:
        return list(TRIAGE_PROBES)
    spec = A.probe_spec(spec, "check")
    if not isinstance(spec, str):
        raise UsageError("check: probes= takes probe names (\"a,b\" or a list), not Probe objects")
    if spec.strip() == "all":
        return list(TRIAGE_PROBES)
    try:
        names = parse_probe_spec(spec)
    except ProbeError as e:
        raise UsageError(f"check: probes={spec!r}: {e}") from None
    A.training_only(names, "check")
    return names


def _batch(subject, data):
    dev = subject.device
    if data is None:
        g = torch.Generator().manual_seed(1234)
        src, tgt = subject.random_batch(N_SEQUENCES, 10, 11, pad_share=0.3, generator=g)
        if not subject.has_target:     # encoder-only: its ids are the targets (every real position)
            return src, src, src
        return src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()
    if isinstance(data, torch.Tensor) or isinstance(data, dict) and "ids" in data \
            and not {"src", "tgt", "tgt_in"} & set(data):
        return _one_stack(subject, data)
    if isinstance(data, dict):
        data = tuple(data[k] for k in ("src", "tgt_in", "tgt_out") if k in data) or \
            tuple(data[k] for k in ("src", "tgt") if k in data)
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        got = f"{len(data)} items" if isinstance(data, (tuple, list)) else f"a {type(data).__name__}"
        raise UsageError(f"check: data= expected (src, tgt) or (src, tgt_in, tgt_out), got {got}")
    names = ("src", "tgt") if len(data) == 2 else ("src", "tgt_in", "tgt_out")
    A.user_data(dict(zip(names, data)), subject.data_pad_id, subject.src_vocab, subject.tgt_vocab)
    if len(data) == 2:
        src, tgt = data
        if not subject.has_target:     # encoder-only: (ids, labels), labels unshifted
            return src.to(dev), src.to(dev), tgt.to(dev)
        return src.to(dev), tgt[:, :-1].to(dev), tgt[:, 1:].to(dev)
    return tuple(t.to(dev) for t in data)


def _one_stack(subject, data) -> tuple:
    """data= ids [N, T] or {'ids': [N, T]} (optionally 'attention_mask'): one sequence per row,
    a decoder- or encoder-only model's batch (as triage --data reads it: one_stack.one_stack_batch)."""
    raw = {"ids": data} if isinstance(data, torch.Tensor) else data
    if subject.kind == "seq2seq":
        raise UsageError("check: data= holds one sequence per row (ids), but the model is an "
                         "encoder-decoder: pass data=(src [N, S], tgt [N, T]) with tgt BOS-led")
    A.user_data({"ids": raw["ids"]}, subject.data_pad_id, subject.src_vocab, subject.tgt_vocab)
    batch = one_stack_batch(raw, subject.data_pad_id, subject.kind, "check: data",
                            pad_name="pad_id= (pad_id=None: no padding)")
    return tuple(t.to(subject.device) for t in batch)


# -- for tests: the pytest plugin's value ----------------------------------------------------------
@dataclass
class CheckResult:
    """`tndebug_check(...)`'s value: the report, and assertions that print the findings."""
    report: Report
    fail_on: str = "warning"

    @property
    def findings(self) -> list[Finding]:
        return self.report.findings

    def at_least(self, severity: str, probes: Iterable[str] | None = None) -> list[Finding]:
        wanted = set(probes) if probes else None
        return [f for f in self.report.findings if f.at_least(severity)
                and (wanted is None or f.probe in wanted)]

    def assert_clean(self, severity: str | None = None, *, probes: Iterable[str] | None = None) -> None:
        """AssertionError listing every finding at or above `severity` (default: the plugin's
        `--tndebug-fail-on`, else "warning"), each with probe, module, evidence and fix; also
        when a probe that applies (of `probes`, if given) could not check the model (verdict
        incomplete or unchecked), naming the probe and the reason."""
        severity = severity or self.fail_on
        if severity not in SEVERITIES:
            raise ValueError(f"severity {severity!r}; expected one of {', '.join(SEVERITIES)}")
        bad = self.at_least(severity, probes)
        if bad:
            raise AssertionError(format_findings(bad, header=f"tndebug: {len(bad)} finding(s) at or "
                                                 f"above {severity} in {self.report.run.get('model')}"))
        missing = {n: why for n, why in self.report.incomplete().items()
                   if probes is None or n in set(probes)}
        if self.report.verdict == "unchecked" or missing:
            what = "; ".join(f"{n}: {why or 'no verdict'}" for n, why in missing.items()) or \
                "no probe reached a verdict"
            raise AssertionError(f"tndebug: {self.report.run.get('model')} is not clean: not "
                                 f"everything that applies could be checked ({what})")

    def assert_finding(self, probe: str, severity: str = "warning", where: str | None = None) -> Finding:
        """The first finding of `probe` at or above `severity` (at `where`); AssertionError if none."""
        for f in self.at_least(severity, [probe]):
            if where is None or f.where == where:
                return f
        raise AssertionError(format_findings(self.report.findings,
                                             header=f"tndebug: no {probe} finding at or above "
                                                    f"{severity}; the findings were") or "none")


def format_findings(findings: list[Finding], header: str = "") -> str:
    """Findings as a readable block, worst first: severity, probe, module, message, evidence, fix."""
    lines = [header] if header else []
    order = sorted(findings, key=lambda f: -severity_rank(f.severity))
    for f in order:
        where = f.where or "(model)"
        step = f" at step {f.step}" if f.step is not None else ""
        lines.append(f"  {f.severity.upper():7} {f.probe} in {where}{step}: {f.message}")
        if f.source:                   # the line of the user's code that made the evidence
            lines.append(f"          source: {source_text(f.source)}")
        if f.evidence:
            ev = ", ".join(f"{k}={_short(v)}" for k, v in list(f.evidence.items())[:8])
            lines.append(f"          evidence: {ev}")
        if f.fix:
            lines.append(f"          fix: {f.fix}")
    if not findings:
        lines.append("  (none)")
    return "\n".join(lines)


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    text = str(v)
    return text if len(text) <= 80 else text[:77] + "..."
