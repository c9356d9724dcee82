"""Refusals of bad flag values before torch is imported (issue 47: each took 2-7 s, the torch
import, to say one line): finding codes for --select/--ignore, probe names for --probe, a
built-in adapter's name, --config's JSON. Each says the line the later, torch-side check says.

The codes each probe declares are read from the probe modules' source (their class attribute
`codes = {...}`, a literal), not by importing them: tests/test_cheap_refusals.py holds this list
equal to `probes.codes.all_codes()`, which imports the classes.
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

from tndebug.errors import UsageError
from tndebug.outputs import check_place
from tndebug.probes import MODULES, ProbeError, parse_probe_spec
from tndebug.probes.codes import OTHER_CODES
from tndebug.task_names import ADAPTER_NAMES

PROBES_DIR = Path(__file__).resolve().parents[1] / "probes"


@lru_cache(maxsize=1)
def declared_codes() -> tuple[str, ...]:
    """Every finding code, as `probes.codes.all_codes()` lists them, torch-free: each probe's
    `codes` dict read from its module's source, then the codes no probe makes."""
    out: list[str] = []
    for name, module in MODULES.items():
        tree = ast.parse((PROBES_DIR / f"{module}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            body = {s.targets[0].id: s.value for s in node.body if isinstance(s, ast.Assign)
                    and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)}
            own = body.get("name")
            if isinstance(own, ast.Constant) and own.value == name and "codes" in body:
                out += [f"{name}/{kind}" for kind in ast.literal_eval(body["codes"])]
                break
    return tuple(out + sorted(OTHER_CODES))


def codes(value: str | None, who: str) -> None:
    """--select/--ignore: each comma-separated item a known code or probe name (the rule of
    judge.codes_option, whose line this is)."""
    if value is None:
        return
    known = declared_codes()
    for item in (v.strip() for v in value.split(",")):
        if item and not any(c == item or c.startswith(item.rstrip("/") + "/")
                            or c.startswith("<probe>/") and item.endswith("/" + c.split("/", 1)[1])
                            for c in known):
            raise UsageError(f"{who} {item!r}: no such finding code or probe; `tndebug probes "
                             f"--codes` lists them")


def probes(spec: str | None) -> None:
    """--probe of triage: known probe names, all or none (the probes' own parser and line)."""
    if spec is None:
        return
    try:
        parse_probe_spec(spec)
    except ProbeError as e:
        raise UsageError(str(e)) from None


def adapter(name: str | None, advice: str) -> None:
    """--adapter NAME (not FILE.py:FUNCTION): one of the built-in adapters."""
    if name and ":" not in name and name not in ADAPTER_NAMES:
        raise UsageError(f"--adapter {name!r}: not a built-in adapter (built-in: "
                         f"{', '.join(ADAPTER_NAMES)}); or pass FILE.py:FUNCTION{advice}")


def out_place(out: str | None) -> None:
    """--out that does not exist yet and cannot be made (under /proc, below a file, a read-only
    place): the line tndebug/outputs.claim_output says, before torch. Tried by making the
    directories and removing at once those this call made (nothing else is touched), because
    only the file system knows (root passes os.access on /proc, where mkdir still fails)."""
    if not out:
        return
    p = Path(out).expanduser()
    check_place(p)                        # a file, under a file, not writable: its own line
    made: list[Path] = []
    q = p
    while not q.exists() and q != q.parent:
        made.append(q)
        q = q.parent
    if not made:
        return                            # exists: the later rules (empty, manifest) apply
    try:
        p.mkdir(parents=True)
    except FileExistsError:
        return                            # made meanwhile by someone else: not ours to judge
    except OSError as e:
        raise UsageError(f"--out {p}: cannot create it ({e.strerror}); pass a directory you "
                         f"can write") from None
    for d in made:                        # deepest first: only what this call created
        try:
            d.rmdir()
        except OSError:
            break
