"""Recorder: a sink that keeps what the end-of-run figures need, and nothing else.

* probe metrics as series `{tag: [(step, value), ...]}` (from `on_metric`);
* training scalars the same way (`log_scalars`: `train/loss`, `train/lr`, `eval/...`);
* a small snapshot of the probe batch at the first probed step, every `every` steps and at
  `final_step` (the run's last, which the engine captures for the sinks): the RMS of every
  stream point and stream gradient, and, for the last snapshot with attention and the last
  one where it was finite, the attention probabilities of the first few examples; the Trace
  itself (and its device memory) is never held.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from tndebug.capture.trace import Trace

_LAYER = re.compile(r"(encoder|decoder)\.layers\.(\d+)")
SNAPSHOT_EXAMPLES = 4          # examples of the probe batch kept for attention figures
EVERY_UNIT = 50                # snapshot / histogram cadence is a multiple of this (probe schedules)


def plan_every(total_steps: int) -> int:
    """About 20 snapshots per run: every N steps, N a multiple of 50."""
    return EVERY_UNIT * max(1, round(total_steps / 20 / EVERY_UNIT))


def on_cadence(step: int, every: int, grow: bool = False) -> bool:
    """Is `step` a snapshot step: a multiple of `every`; with `grow` (a run of unknown length,
    `tndebug.watch` without total_steps) the interval doubles each time the run passes 20 of
    them, so a run of n steps gets about 20 + 10 log2(n / (20 every)) snapshots, not n / every."""
    if grow:
        while step >= 20 * every:
            every *= 2
    return step % every == 0


@dataclass
class AttentionSnapshot:
    site: str                            # module path
    kind: str                            # enc_self | dec_self | cross
    layer: int | None
    probs: torch.Tensor                  # [b, h, T, S] on the CPU, b <= SNAPSHOT_EXAMPLES


@dataclass
class TraceSnapshot:
    step: int
    src: torch.Tensor | None             # [b, S] on the CPU
    tgt: torch.Tensor | None             # [b, T] on the CPU
    pad_id: int
    rows: list[int] = field(default_factory=list)   # which examples of the batch were kept
    attention: list[AttentionSnapshot] = field(default_factory=list)
    # (stack, layer, kind, name) -> RMS; stacks "embed" | "encoder" | "decoder"
    stream_rms: dict[tuple, float] = field(default_factory=dict)
    grad_norm: dict[tuple, float] = field(default_factory=dict)


def _stream_key(name: str) -> tuple:
    """(stack, layer, kind, name) for a stream tap name, as far as the name tells."""
    m = _LAYER.search(name)
    if m:
        kind = "sublayer" if name.endswith("hook_resid") else "layer"
        return m.group(1), int(m.group(2)), kind, name
    stack = name.split(".")[0]
    return stack, None, "stack", name


class Recorder:
    """Sink for `ProbeEngine` plus the trainer's scalars; reporters read it at the end."""

    def __init__(self, every: int = 1) -> None:
        self.every = every               # snapshot the probe batch on the first trace and every N steps
        self.metrics: dict[str, list[tuple[int, float]]] = {}
        self.scalars: dict[str, list[tuple[int, float]]] = {}
        self.snapshots: list[TraceSnapshot] = []     # every probed step: RMS only
        self.last: TraceSnapshot | None = None       # the last probed step, with attention
        self.last_attention: TraceSnapshot | None = None   # the last one with attention
        self.last_finite: TraceSnapshot | None = None   # the last one whose attention is finite
        self.final_step: int | None = None           # the run's last step: always snapshotted
        self.grow = False                            # the run's length is unknown: see on_cadence
        self.last_step = 0
        self.token_names: dict[int, str] = {}        # id -> the saved tokenizer's token (labels)

    # -- sink interface -------------------------------------------------------------------
    def on_metric(self, step: int, tag: str, value: float) -> None:
        self.metrics.setdefault(tag, []).append((step, float(value)))
        self.last_step = max(self.last_step, step)

    def on_tokens(self, names: dict[int, str]) -> None:
        """The tokens of the probe batch's ids (a saved tokenizer's): the figures' axis labels."""
        self.token_names.update(names)

    def log_scalars(self, step: int, scalars: dict) -> None:
        for tag, value in scalars.items():
            self.scalars.setdefault(tag, []).append((step, to_float(value)))
        self.last_step = max(self.last_step, step)

    def on_trace(self, step: int, trace: Trace) -> None:
        self.last_step = max(self.last_step, step)
        if not (trace.streams or trace.grads or any(r.probs is not None for r in trace.records())):
            return
        if self.snapshots and not on_cadence(step, self.every, self.grow) \
                and step != self.snapshots[-1].step and step != self.final_step:
            return
        rows = _rows(trace)
        snap = TraceSnapshot(step, _cpu_rows(trace.src, rows), _cpu_rows(trace.tgt, rows),
                             trace.pad_id, rows.tolist())
        keys, values = [], []
        for p in trace.streams:
            keys.append(("s", (p.stack, p.layer, p.kind, p.name)))
            values.append(p.x.detach().float().pow(2).mean().sqrt())
        for name, g in trace.grads.items():
            keys.append(("g", _stream_key(name)))
            values.append(g.detach().float().norm())
        if values:
            host = torch.stack([v.to(values[0].device) for v in values]).cpu().tolist()   # one sync
            for (which, key), v in zip(keys, host):
                (snap.stream_rms if which == "s" else snap.grad_norm)[key] = v
        for rec in trace.records():
            if rec.probs is not None and rec.probs.dim() == 4:
                probs = rec.probs.detach()[rows.to(rec.probs.device)].float().cpu()
                snap.attention.append(AttentionSnapshot(rec.site, rec.kind, rec.layer, probs))
        # attention is kept for the last snapshot that has any, and for the last one where it
        # is finite (what a diverged run's figures can still draw)
        before = [x for x in (self.last_attention, self.last_finite) if x is not None]
        if snap.attention:
            self.last_attention = snap
            if all(bool(torch.isfinite(a.probs).all()) for a in snap.attention):
                self.last_finite = snap
        for old in before:
            if old is not self.last_attention and old is not self.last_finite:
                old.attention = []
        self.snapshots.append(snap)
        self.last = snap

    # -- reading --------------------------------------------------------------------------
    def attention_snapshot(self) -> tuple[TraceSnapshot | None, str]:
        """(the snapshot the attention figures draw, a note): the last one with attention; if
        its attention is not finite and an earlier one's was, that earlier one, with the note
        `no finite attention after step N (non-finite at step M)`."""
        snap = self.last_attention
        if snap is None or snap is self.last_finite or self.last_finite is None:
            return snap, ""
        return self.last_finite, (f"no finite attention after step {self.last_finite.step} "
                                  f"(non-finite at step {snap.step})")

    def recorded(self) -> dict[str, list[tuple[int, float]]]:
        """Every scalar shown to this sink, tag -> [(step, value), ...]: the trainer's scalars,
        then the probes' metrics (Report.metrics)."""
        out = {tag: list(series) for tag, series in self.scalars.items()}
        for tag, series in self.metrics.items():
            out.setdefault(tag, []).extend(series)
        return out

    def latest(self, tag: str) -> tuple[int, float] | None:
        series = self.metrics.get(tag) or self.scalars.get(tag)
        return series[-1] if series else None

    def matching(self, pattern: re.Pattern) -> dict[tuple, tuple[int, float]]:
        """{match.groups(): (step, value) latest} for every metric tag matching `pattern`."""
        out = {}
        for tag, series in self.metrics.items():
            m = pattern.fullmatch(tag)
            if m and series:
                out[m.groups()] = series[-1]
        return out

    def series_of(self, family, **fixed) -> dict[tuple, list[tuple[int, float]]]:
        """{the parts not in `fixed`, in the template's order: series} of every metric of the
        tag family (tndebug/tags.py) whose parts equal `fixed`."""
        out = {}
        for tag, series in self.metrics.items():
            parts = family.parse(tag) if series else None
            if parts is not None and all(parts[k] == v for k, v in fixed.items()):
                out[tuple(v for k, v in parts.items() if k not in fixed)] = series
        return out

    def series_matching(self, pattern: re.Pattern) -> dict[tuple, list[tuple[int, float]]]:
        out = {}
        for tag, series in self.metrics.items():
            m = pattern.fullmatch(tag)
            if m and series:
                out[m.groups()] = series
        return out


def _rows(trace: Trace) -> torch.Tensor:
    """Which examples to keep: the longest one that still has source padding first (the
    masks show there, and so does the content), then the first ones.  -> [b] indices"""
    n = next((r.probs.shape[0] for r in trace.records() if r.probs is not None), None)
    if n is None:
        n = trace.src.shape[0] if trace.src is not None else 0
    first = list(range(min(n, SNAPSHOT_EXAMPLES)))
    if trace.src is not None and trace.src.dim() == 2 and trace.src.shape[0] == n and n:
        n_pad = (trace.src == trace.pad_id).sum(1).cpu()
        if int(n_pad.max()) > 0:
            best = int(torch.where(n_pad > 0, n_pad, n_pad.max() + 1).argmin())
            first = [best] + [i for i in first if i != best][:SNAPSHOT_EXAMPLES - 1]
    return torch.tensor(first, dtype=torch.long)


def _cpu_rows(x: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    if x is None or not rows.numel() or x.dim() == 0 or x.shape[0] <= int(rows.max()):
        return None
    return x.detach()[rows.to(x.device)].cpu()


def to_float(value) -> float:
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return math.nan
