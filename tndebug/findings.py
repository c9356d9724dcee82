"""Findings: frozen values that probes produce and reporters format."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("info", "warning", "error")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


def severity_rank(severity: str) -> int:
    return _RANK[severity]


# Attributes that wrappers put between a user's modules and never appear in the model the user
# wrote: activation checkpointing, FSDP1, torch.compile, TransformerLens's bridge.
WRAPPERS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod", "_original_component")
_WRAPPED = re.compile(r"(?<![\w.])(?:%s)\.|\.(?:%s)(?![\w])" % ("|".join(WRAPPERS), "|".join(WRAPPERS)))


def user_path(value):
    """Module paths as the user's model prints them, wrappers' attributes dropped
    (`transformer.h.0._checkpoint_wrapped_module.attn` -> `transformer.h.0.attn`), in a string or
    in the strings and keys of a dict or list."""
    if isinstance(value, str):
        return _WRAPPED.sub("", value) if "_" in value else value
    if isinstance(value, dict):
        return {user_path(k): user_path(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(user_path(v) for v in value)
    return value


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
    code: str = ""                   # the kind of finding, stable: "<probe>/<kind>" (tndebug probes --codes)
    # the line in the user's code where the evidence was made (tndebug/capture/source.py):
    # {file, line, function, code} (+ "package" for an installed package's code, "def" when it is
    # only the module's forward def); None when unknown or not the user's code
    source: dict | None = None

    def __post_init__(self) -> None:
        if self.severity not in _RANK:
            raise ValueError(f"severity {self.severity!r}; expected one of {SEVERITIES}")
        for name in ("where", "message", "fix", "evidence"):        # the user's module paths
            value = getattr(self, name)
            if (new := user_path(value)) != value:
                object.__setattr__(self, name, new)

    def at_least(self, severity: str) -> bool:
        return _RANK[self.severity] >= _RANK[severity]

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["source"] is None:       # a report without source lines reads as before
            del d["source"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        return cls(**d)               # a tndebug.report/1 finding has no code: ""


def matches(code: str, patterns) -> bool:
    """`code` ("mask-broadcast/causal-leak") is one of `patterns`: a whole code, or a probe name
    (every code of that probe), as ruff's --select / --ignore take a rule or its prefix."""
    return any(code == p or code.startswith(p.rstrip("/") + "/") for p in patterns)


def select(findings, select=None, ignore=None) -> list:
    """The findings `--select` keeps (None: all) and `--ignore` does not drop."""
    return [f for f in findings if (not select or matches(f.code, select))
            and not (ignore and matches(f.code, ignore))]


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
    for i, f in enumerate(findings):           # the code is the kind; a message without one is grouped by its template
        keyed.setdefault((f.probe, f.severity, f.code or message_template(f), f.fix), []).append(i)
    groups = []
    for (probe, severity, _, fix), idx in keyed.items():
        idx = sorted(idx, key=lambda i: (findings[i].step if findings[i].step is not None else -1, i))
        wheres = tuple(dict.fromkeys(findings[i].where for i in idx))
        steps = [findings[i].step for i in idx if findings[i].step is not None]
        groups.append(FindingGroup(probe, severity, findings[idx[0]].message, fix, tuple(idx),
                                   wheres, min(steps) if steps else None))
    return groups


def jsonable(x):
    """What json cannot write: a tensor as a list, a numpy scalar as its item, else str."""
    try:
        import torch
        if isinstance(x, torch.Tensor):
            return x.tolist()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(x, "item"):
        return x.item()
    return str(x)
