"""Probes: one file, one class per failure mode. `REGISTRY` maps stable names to classes."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tndebug.errors import ProbeError

if TYPE_CHECKING:
    from tndebug.probes.base import Probe

# base imports torch: its names come on first use (PEP 562), so that the CLI's parser, which
# lists PROBE_NAMES, builds without torch
_BASE = ("Probe", "ResumeInfo", "RunContext", "StepInfo")


def __getattr__(name):
    if name in _BASE:
        from tndebug.probes import base
        return getattr(base, name)
    raise AttributeError(f"module 'tndebug.probes' has no attribute {name!r}")

# name -> module (one file per probe); the order is the report's order.
MODULES = {
    "nan-scores": "nan_scores",
    "missing-scale": "missing_scale",
    "mask-broadcast": "mask_broadcast",
    "head-collapse": "head_collapse",
    "variance-drift": "variance_drift",
    "ln-placement": "ln_placement",
    "positional-encoding": "positional_encoding",
    "gradient-flow": "gradient_flow",
    "loss-health": "loss_health",
    "lr-schedule": "lr_schedule",
    "label-smoothing": "label_smoothing",
    "zero-grad": "zero_grad",
    "train-mode": "train_mode",
    "label-shift": "label_shift",
    "lm-decoding": "lm_decoding",
}
PROBE_NAMES = tuple(MODULES)
# Probes that judge weights and code from one forward/backward (triage, `check`); the others need
# a training run (an optimizer, a declared schedule, the user's criterion, a loss curve).
TRAINING_ONLY = ("lr-schedule", "label-smoothing", "loss-health", "zero-grad", "train-mode",
                 "label-shift")
TRIAGE_PROBES = tuple(n for n in PROBE_NAMES if n not in TRAINING_ONLY)


def probe_class(name: str) -> type[Probe]:
    if name not in MODULES:
        raise ProbeError(f"unknown probe {name!r}; valid: {', '.join(PROBE_NAMES)}, all, none")
    module = importlib.import_module(f"tndebug.probes.{MODULES[name]}")
    from tndebug.probes.base import Probe
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, Probe) and obj.name == name:
            return obj
    raise ProbeError(f"module tndebug.probes.{MODULES[name]} defines no probe named {name!r}")


def probe_cause(name: str) -> str | None:
    """The probable cause a probe's findings point to (its class's `cause`: report.md's
    "Probable cause"); None for a name that is no probe (triage's file checks, the front-ends')."""
    return (probe_class(name).cause or None) if name in MODULES else None


def parse_probe_spec(spec: str | None) -> list[str]:
    """'all' | 'none' | 'a,b' -> names, validated at once."""
    if spec is None or spec.strip() in ("", "none"):
        return []
    if spec.strip() == "all":
        return list(PROBE_NAMES)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for n in names:
        if n in ("all", "none"):          # only alone: 'all,none' or 'all,nan-scores' says nothing clear
            raise ProbeError(f"{spec.strip()!r}: {n!r} is a selection by itself, not a probe name; "
                             f"pass {n} alone, or a list of probe names without it")
        if n not in MODULES:
            raise ProbeError(f"unknown probe {n!r}; valid: {', '.join(PROBE_NAMES)}, all, none")
    return names


def make_probes(spec: str | list[str] | None) -> list[Probe]:
    names = parse_probe_spec(spec) if not isinstance(spec, list) else spec
    return [probe_class(n)() for n in names]


__all__ = ["Probe", "ProbeError", "ResumeInfo", "RunContext", "StepInfo", "PROBE_NAMES",
           "TRAINING_ONLY", "TRIAGE_PROBES",
           "probe_class", "parse_probe_spec", "make_probes"]
