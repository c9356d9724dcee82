"""Where in the user's code a piece of evidence was made: the Python line that called the op.

The recording wrappers (`patching._patched`) see every attention op a probe reads while it
runs; at the op that makes a tensor a probe judges (the score product, the softmax, the mask,
the SDPA call) they ask `user_line()` for the innermost frame of the caller's own code: not
torch, not tndebug, not the standard library nor an installed package, except transformers,
whose lines are marked `"package": "transformers"` (the model's code is the package's). Only
the probed passes pay for it: the wrappers run only while a probe reads those ops.

A location is a plain dict {file, line, function, code} ("function" is Class.method), so it
travels into a Finding, report.json and back unchanged; "read": True marks a line found by
reading the source, not by an op that ran (a table built in `__init__`, assignments.table_line).
"""
from __future__ import annotations

import inspect
import linecache
import os
import sys
import sysconfig
import weakref
from functools import lru_cache
from pathlib import Path

import torch

_TNDEBUG = str(Path(__file__).resolve().parents[1]) + os.sep
_TORCH = str(Path(torch.__file__).resolve().parent) + os.sep
_STDLIB = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) + os.sep
                 for k in ("stdlib", "platstdlib")})
PACKAGES = ("transformers",)          # installed packages whose lines are the model's code


@lru_cache(maxsize=512)
def file_kind(filename: str) -> str | None:
    """"user", a package's name from PACKAGES, or None (a frame to skip)."""
    if not filename or filename.startswith("<"):
        return None
    path = os.path.realpath(filename)
    if path.startswith((_TNDEBUG, _TORCH)):
        return None
    top = _package(path)
    if top is not None:
        return top if top in PACKAGES else None
    if path.startswith(_STDLIB):
        return None
    return "user"


def _package(path: str) -> str | None:
    """The installed package a file belongs to (its folder under site-packages), else None."""
    parts = Path(path).parts
    if "site-packages" not in parts and "dist-packages" not in parts:
        return None
    i = max(i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages"))
    return parts[i + 1] if i + 1 < len(parts) else ""


def _ours(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_TNDEBUG)


def user_line(skip: int = 1) -> dict | None:
    """The innermost frame of user (or transformers) code on the stack, as a location; None
    when there is none: the op was called from torch alone, from tndebug's own model, or from
    another installed package. The walk stops where tndebug called the model (a tndebug frame
    above the model's), so a line of the script that called tndebug is never taken."""
    frame = sys._getframe(skip)
    while frame is not None and _ours(frame.f_code.co_filename):     # the recording wrappers
        frame = frame.f_back
    while frame is not None:
        code = frame.f_code
        if _ours(code.co_filename):             # back in tndebug: the model's frames are over
            return None
        kind = file_kind(code.co_filename)
        if kind is not None:
            return location(code.co_filename, frame.f_lineno,
                            getattr(code, "co_qualname", code.co_name), kind)
        frame = frame.f_back
    return None


def location(file: str, line: int, function: str, kind: str = "user") -> dict:
    loc = {"file": file, "line": int(line), "function": function,
           "code": linecache.getline(file, line).strip()}
    if kind != "user":
        loc["package"] = kind
    return loc


def forward_def(module) -> dict | None:
    """Where no op's line is known: the module's `forward` def (its file and line)."""
    loc = _forward_def(type(module))
    return dict(loc) if loc else None


@lru_cache(maxsize=256)
def _forward_def(cls) -> dict | None:
    """Per class, once: reading the source on every probed step would cost a file parse."""
    fn = getattr(cls, "forward", None)
    try:
        file = inspect.getsourcefile(fn)
        _, line = inspect.getsourcelines(fn)
    except (TypeError, OSError):
        return None
    if file is None or file_kind(file) is None and _package(os.path.realpath(file)) is None:
        return None                        # torch's or tndebug's own modules: not the user's
    kind = file_kind(file) or _package(os.path.realpath(file))
    loc = location(file, line, getattr(fn, "__qualname__", "forward"), kind)
    loc["def"] = True                    # the forward's def line, not the op's
    return loc


def pick(sources: dict, *roles: str) -> dict | None:
    """The first of `roles` that `sources` holds, else its module's forward def."""
    for r in roles:
        if sources.get(r):
            return sources[r]
    return sources.get("forward")


# model -> {module path (or "<stack>:embedding"): the line that made its output}, from the
# recordings of its probed passes (capture/origins.py); read where a finding has no op's line
_MADE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def remember_made(model, made: dict) -> None:
    if made:
        try:
            _MADE.setdefault(model, {}).update(made)
        except TypeError:                  # a model that cannot be weakly referenced
            pass


def made_line(model, key: str) -> dict | None:
    """The line that made the output of the module at `key` (or "encoder:embedding", the
    embedding addition whose result enters that stack) in a recorded pass of `model`."""
    try:
        loc = _MADE.get(model, {}).get(key)
    except TypeError:
        return None
    return dict(loc) if loc else None


def same_line(a: dict | None, b: dict | None) -> bool:
    return bool(a and b) and (a.get("file"), a.get("line")) == (b.get("file"), b.get("line"))


def with_also(primary: dict | None, *others: tuple[dict | None, str]) -> dict | None:
    """`primary` carrying the other relevant lines of the finding as `also`: [{...location,
    "why"}] (the line that applies a mask built elsewhere), each once, none equal to primary."""
    if primary is None:
        return None
    out, also = dict(primary), []
    for loc, why in others:
        if loc and not loc.get("def") and not same_line(loc, primary) \
                and not any(same_line(loc, a) for a in also):
            also.append({k: v for k, v in loc.items() if k not in ("also", "why")} | {"why": why})
    if also:
        out["also"] = also
    return out


def also_text(src: dict) -> list[str]:
    """`also model.py:91 (MultiHeadAttention.apply_mask), the mask is applied here`, one per
    other line of the finding."""
    return [f"also {shown_path(a['file'])}:{a['line']} ({a['function']}), {a['why']}: {a.get('code', '')}".rstrip(": ")
            for a in src.get("also", ()) if a.get("file")]


def shown_path(file: str) -> str:
    """`file` relative to the working directory when it lies under it; an installed package's
    file from its package folder (`transformers/models/gpt2/modeling_gpt2.py`: the 60
    characters of `/root/.pyenv/.../site-packages/` in front say nothing at 80 columns);
    report.json keeps the whole path."""
    parts = Path(file).parts
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in ("site-packages", "dist-packages"):
            return "/".join(parts[i + 1:])
    try:
        rel = os.path.relpath(file)
    except ValueError:
        return file
    return file if rel.startswith("..") else rel


def source_text(src: dict) -> str:
    """`model.py:52 (CausalSelfAttention.forward): att = q @ k.transpose(-2, -1)`."""
    where = f"{shown_path(src['file'])}:{src['line']} ({src['function']})"
    if src.get("package"):
        where += f" [package: {src['package']}]"
    if src.get("def"):
        where += " (its forward; no line of the op was found)"
    elif src.get("read"):
        where += " (found by reading the source)"
    return f"{where}: {src['code']}" if src.get("code") else where


def context_lines(src: dict, around: int = 2) -> list[tuple[int, str]]:
    """(line number, text) of the source line and `around` lines either side."""
    lo = max(1, src["line"] - around)
    rows = [(n, linecache.getline(src["file"], n).rstrip("\n")) for n in range(lo, src["line"] + around + 1)]
    return [(n, t) for n, t in rows if t or n <= src["line"]]


def excerpt(src: dict, width: int, around: int = 2) -> list[tuple[bool, str]]:
    """The lines around `src`'s line as (is the line itself, text) rows of at most `width`
    characters: `> 52 | att = q @ k.transpose(-2, -1)`, dedented together; a line too long is
    continued on the next row at a space, never inside a name or number (a single token longer
    than the row is left whole)."""
    import textwrap
    rows = context_lines(src, around)
    indent = min((len(t) - len(t.lstrip()) for _, t in rows if t.strip()), default=0)
    out: list[tuple[bool, str]] = []
    for n, line in rows:
        text, mine = line[indent:], n == src["line"]
        head = f"{'>' if mine else ' '}{n:4d} | "
        pad = len(text) - len(text.lstrip())
        room = max(16, width - len(head) - pad)
        parts = textwrap.wrap(text.strip(), room, break_long_words=False, break_on_hyphens=False,
                              subsequent_indent="    ") or [""]
        out.append((mine, head + " " * pad + parts[0]))
        out += [(mine, " " * (len(head) - 2) + "| " + " " * pad + p) for p in parts[1:]]
    return out


def call_site(model, path: str) -> dict | None:
    """The line of the model's own code that calls the module at `path`, for a finding on a
    module no recorded op located (an embedding, a norm, a block, a feed-forward layer): the
    forward of each ancestor, the innermost first, is searched for the call by the path below
    that ancestor (`self.ln_1(`, `self.transformer.wte(`), or, for a layer of a list, for the loop
    over the list (`for block in self.h`). Only the user's code and transformers' are read (as
    `user_line`); None when no ancestor's forward names it."""
    if not path:
        return None
    modules = dict(model.named_modules())
    parts = path.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        owner = modules.get(".".join(parts[:cut]))
        if owner is None:
            continue
        rest = parts[cut:]
        loc = _call_in(type(owner), ".".join(rest))
        if loc is None and rest[-1].isdigit() and len(rest) > 1:      # a layer of a ModuleList
            loc = _call_in(type(owner), ".".join(rest[:-1]), call=False)
        if loc is not None:
            return dict(loc)
    return None


@lru_cache(maxsize=1024)
def _call_in(cls, attr: str, call: bool = True) -> dict | None:
    """The first line of `cls.forward` that calls `self.<attr>(` (with `call`) or names
    `self.<attr>` (a loop over a list of layers), as a location; None when there is none or the
    forward is not the user's or transformers' code."""
    fn = getattr(cls, "forward", None)
    try:
        fn = inspect.unwrap(fn)            # transformers decorates forwards (functools.wraps)
        file = inspect.getsourcefile(fn)
        lines, first = inspect.getsourcelines(fn)
    except (TypeError, OSError):
        return None
    kind = file_kind(file) if file else None
    if kind is None:
        return None
    needle = f"self.{attr}" + ("(" if call else "")
    for i, text in enumerate(lines):
        code = text.split("#")[0]
        if needle in code and (call or not code[code.index(needle) + len(needle):][:1].isidentifier()):
            return location(file, first + i, getattr(fn, "__qualname__", "forward"), kind)
    return None


def module_place(model, path: str, modules: dict | None = None, *,
                 by_output: bool = True) -> dict | None:
    """Where a finding on the module at `path` sits in the model's code: the line of the
    module's own code that made its output in a recorded pass (the residual add of a block,
    `made_line`; only `by_output`: a finding about the module's output), else its forward (its def line, marked `def`) when that is the user's or
    transformers' code; else,
    for torch's modules (an embedding, a norm, a Linear), the line that calls it (`call_site`);
    else the forward def wherever it is."""
    module = (modules if modules is not None else dict(model.named_modules())).get(path)
    if module is None or not path:
        return None
    own = _forward_def(type(module))
    if own is not None and file_kind(own["file"]) is not None:
        made = made_line(model, path) if by_output else None   # the op that made its output
        cls = own["function"].rpartition(".")[0]
        if made is not None and cls and made["function"].startswith(cls + "."):
            return made
        return dict(own)
    site = call_site(model, path)
    return site if site is not None else (dict(own) if own else None)
