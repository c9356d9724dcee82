"""Lines found by reading the model's source, not by an op that ran: where a buffer or tensor
attribute was assigned (`self.register_buffer("tril", ...)`, `self.tril = ...`), where a
submodule was constructed (a norm's eps, a dropout's rate), and where a position table made in
`__init__` (before any recording) sets its frequencies. A line read so is marked `"read": True`
where it is followed into a function (source.py).
"""
from __future__ import annotations

import ast
import inspect
import linecache
import re
import sys
import textwrap

import torch

from tndebug.capture.source import file_kind, location


def attribute_line(model, t) -> dict | None:
    """The line that assigned the buffer (or tensor attribute) `t` of a module of `model`:
    `self.register_buffer("tril", ...)` or `self.tril = ...` in the module's class (its own
    code or a base's), as a location; None when `t` is no module's or no such line is found."""
    if model is None or not isinstance(t, torch.Tensor):
        return None
    for module in model.modules():
        for attr, v in (*module._buffers.items(), *vars(module).items()):
            if v is t:
                return _assignment(type(module), attr)
    return None


def constructor_line(model, path: str) -> dict | None:
    """The line that made the submodule at `path` (`self.ln_1 = nn.LayerNorm(d, eps=1e-12)`: a
    norm's eps, a dropout's rate are set there), in the class of the module that holds it; a
    layer of a list: the line that made the list. None when not found."""
    if model is None or not path:
        return None
    parts = path.split(".")
    while parts and parts[-1].isdigit():
        parts.pop()
    if not parts:
        return None
    try:
        owner = model.get_submodule(".".join(parts[:-1]))
    except AttributeError:
        return None
    return _assignment(type(owner), parts[-1])


def table_line(model, rows) -> dict | None:
    """Where a position table made in `__init__` (outside every probed forward) was built:
    `rows` [L, d] is its part of the embedding (one token at every position); the model's
    buffer or tensor attribute whose first L rows, centred, are `rows` centred up to a scale
    (the table itself, found by its values) is followed to the line that assigned it, and from
    there into the function that line calls to make it (`self.table(d, L)`, resolved on the
    module's own class; `sinusoids(L, d)`, a function of its file): the statement there that
    holds the table's base (a number >= 100: 10000 in the paper, a rotary theta), where the
    frequencies are set. Found by reading the source, and marked so (`"read": True`); the
    assignment's line when that function is not found; None when no tensor of the model
    matches."""
    if model is None or not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        return None
    L, d = rows.shape
    r = (rows - rows.mean(0)).double().cpu()
    if not float(r.norm()) > 0:
        return None
    for module in model.modules():
        for attr, v in (*module._buffers.items(), *vars(module).items()):
            if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dim() < 2 \
                    or v.shape[-1] != d or v.numel() < L * d:
                continue
            t = v.detach().reshape(-1, d)[:L].double().cpu()
            t = t - t.mean(0)
            s = float((t * r).sum() / t.pow(2).sum().clamp_min(1e-30))     # the scale fitted
            # 1e-3: the table and the embedding's position part agree to float32 rounding
            # (~1e-7); another tensor of the model misses by O(1)
            if float((s * t - r).norm()) <= 1e-3 * float(r.norm()):
                return _built_by(module, attr)
    return None


def _built_by(module, attr: str) -> dict | None:
    """The line that assigned `module.<attr>`, followed into the function it calls (see
    `table_line`); marked `"read"`."""
    at = _assignment(type(module), attr)
    if at is None:
        return None
    at["read"] = True
    try:
        stmt = ast.parse(textwrap.dedent(_statement(at["file"], at["line"])))
    except (SyntaxError, ValueError):
        return at
    fns = []
    for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            fns.append(inspect.getattr_static(type(module), f.attr, None))
        elif isinstance(f, ast.Name):
            fns.append(getattr(sys.modules.get(type(module).__module__), f.id, None))
    for fn in fns:
        fn = getattr(fn, "__func__", fn)
        if not inspect.isfunction(fn):
            continue
        try:
            file = inspect.getsourcefile(fn)
            lines, first = inspect.getsourcelines(fn)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (TypeError, OSError, SyntaxError):
            continue
        kind = file_kind(file) if file else None
        if kind is None:
            continue
        based = sorted({s.lineno for s in ast.walk(tree) if isinstance(s, ast.stmt)
                        and not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and any(isinstance(c, ast.Constant) and isinstance(c.value, (int, float))
                                and not isinstance(c.value, bool) and c.value >= 100
                                for c in ast.walk(s))})
        if len(based) == 1:
            loc = location(file, first + based[0] - 1, fn.__qualname__, kind)
            loc["read"] = True
            return loc
    return at


def _statement(file: str, line: int) -> str:
    """The statement that starts at `line` of `file` (continued over its lines)."""
    text = ""
    for n in range(line, line + 20):
        text += linecache.getline(file, n)
        try:
            ast.parse(textwrap.dedent(text))
            return text
        except SyntaxError:
            continue
    return text


def _assignment(cls, attr: str) -> dict | None:
    a = re.escape(attr)
    pattern = re.compile(rf"""register_(?:buffer|parameter)\(\s*["']{a}["']|self\.{a}\s*(?:,\s*self\.\w+\s*)*=(?!=)""")
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "tndebug.")) or klass is object:
            continue
        try:
            file = inspect.getsourcefile(klass)
            lines, first = inspect.getsourcelines(klass)
        except (TypeError, OSError):
            continue
        kind = file_kind(file) if file else None
        if kind is None:
            continue
        for i, text in enumerate(lines):
            if pattern.search(text.split("#")[0]):
                defs = [m.group(1) for m in (re.match(r"\s*def (\w+)", t) for t in lines[:i]) if m]
                return location(file, first + i, f"{klass.__qualname__}.{defs[-1] if defs else '<class>'}", kind)
    return None
