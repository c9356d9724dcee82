"""Findings: frozen values that probes produce and reporters format."""
from __future__ import annotations

import re
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


# -- one defect in many modules ------------------------------------------------------------
PATH = re.compile(r"\b[A-Za-z_]\w*(?:\.\w+)+\b")          # a dotted module path
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?", re.I)


def message_template(f: Finding) -> str:
    """The message with module paths and numbers blanked: what two modules with the same defect
    share (`Q, K and V come from one projection in <module>: ... <n>% of tokens ...`)."""
    text = f.message.replace(f.where, "<module>") if f.where else f.message
    return NUMBER.sub("<n>", PATH.sub("<module>", text))


@dataclass(frozen=True)
class FindingGroup:
    """Findings of one probe and severity whose messages differ only in the module named (and
    in its numbers) and that share a fix: one defect seen in several places.

    `members` are indices into the list given to `group_findings`, earliest step first."""
    probe: str
    severity: str
    message: str                      # the first member's message
    fix: str
    members: tuple[int, ...]
    wheres: tuple[str, ...]           # each distinct place, "" for the run, in member order
    step: int | None                  # the earliest step of any member

    @property
    def count(self) -> int:
        return len(self.members)

    def to_dict(self) -> dict:
        return {"probe": self.probe, "severity": self.severity, "message": self.message,
                "fix": self.fix, "modules": list(self.wheres), "count": self.count,
                "step": self.step, "findings": list(self.members)}


def group_findings(findings: list[Finding]) -> list[FindingGroup]:
    """Findings grouped by (probe, severity, message template, fix), in order of the first
    member; a finding like no other is a group of one."""
    keyed: dict[tuple, list[int]] = {}
    for i, f in enumerate(findings):
        keyed.setdefault((f.probe, f.severity, message_template(f), f.fix), []).append(i)
    groups = []
    for (probe, severity, _, fix), idx in keyed.items():
        idx = sorted(idx, key=lambda i: (findings[i].step if findings[i].step is not None else -1, i))
        wheres = tuple(dict.fromkeys(findings[i].where for i in idx))
        steps = [findings[i].step for i in idx if findings[i].step is not None]
        groups.append(FindingGroup(probe, severity, findings[idx[0]].message, fix, tuple(idx),
                                   wheres, min(steps) if steps else None))
    return groups
