"""Findings: frozen values that probes produce and reporters format."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("info", "warning", "error")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


def severity_rank(severity: str) -> int:
    return _RANK[severity]


@dataclass(frozen=True)
class Finding:
    """One thing a probe concluded.

    `where` is a module path in the model's own naming (`encoder.layers.0.self_attn`), or ""
    for the run as a whole; `evidence` holds the numbers the probe decided on and the threshold.
    """
    probe: str
    severity: str
    message: str
    where: str = ""
    step: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    layer: int | None = None
    head: int | None = None
    rank: int | None = None          # the process that saw it, under DDP

    def __post_init__(self) -> None:
        if self.severity not in _RANK:
            raise ValueError(f"severity {self.severity!r}; expected one of {SEVERITIES}")

    def at_least(self, severity: str) -> bool:
        return _RANK[self.severity] >= _RANK[severity]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        return cls(**d)


def worst(findings) -> str | None:
    """The highest severity among `findings`, or None."""
    ranks = [_RANK[f.severity] for f in findings]
    return SEVERITIES[max(ranks)] if ranks else None
