"""Issue 48's score: does a finding's source line (Finding.source, tndebug/capture/source.py)
point at the line the bug was written in?

A corpus says where each of its bugs is (never typed in by hand here):
* the user-style corpus (tests/foreign/styles_corpus.py): the one line its edit changed (for a
  deleted line, the lines either side of where it stood);
* the switch corpora (tests/foreign/*.py with `bug=` switches): the lines that test the bug's
  name, with the statement each one guards (`switch_lines`);
* the real-bug corpus (tests/realbugs): the methods of the mechanism classes the bug swaps in
  (`method_lines`), in tests/realbugs/mechanisms.py.

Per bug run, over the findings of the bug's own probe at warning or error:
* *line given*: one of them carries a source line of the user's code (not only a module's
  forward def, not an installed package's line), in whichever of the user's files;
* *line right*: one of those lines is one of the bug's lines (in the bug's file);
* *function right*: one is in the same function (Class.method) as a bug line.
"""
from __future__ import annotations

import ast
import inspect
import os
from functools import lru_cache
from pathlib import Path

SEV = ("warning", "error")


@lru_cache(maxsize=64)
def _functions(file: str) -> tuple[tuple[str, int, int], ...]:
    """(qualname, first line, last line) of every function in `file`, innermost last."""
    try:
        tree = ast.parse(Path(file).read_text())
    except (OSError, SyntaxError):
        return ()
    out: list[tuple[str, int, int]] = []

    def walk(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.lineno, child.end_lineno or child.lineno))
                walk(child, name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)
    walk(tree, "")
    return tuple(out)


def function_at(file: str, line: int) -> str | None:
    """The innermost function of `file` holding `line`."""
    best = None
    for name, a, b in _functions(str(file)):
        if a <= line <= b and (best is None or a >= best[1]):
            best = (name, a)
    return best[0] if best else None


def switch_lines(file: str | Path, bug: str) -> list[int]:
    """The lines of `file` that test the bug's name ('"no_scale"' in a comparison or a
    conditional), with every line of the statement that holds the test (an `if` block whole, a
    conditional expression's assignment)."""
    try:
        tree = ast.parse(Path(file).read_text())
    except (OSError, SyntaxError):
        return []
    lines: set[int] = set()
    inside = [n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)]                  # a module's list of bug names is no site
    for node in inside:
        if not isinstance(node, ast.stmt) or isinstance(node, (ast.FunctionDef, ast.ClassDef,
                                                                ast.AsyncFunctionDef)):
            continue
        heads = [node.test] if isinstance(node, (ast.If, ast.While)) else \
            [] if isinstance(node, (ast.For, ast.With, ast.Try)) else [node]
        if any(isinstance(c, ast.Constant) and c.value == bug for h in heads for c in ast.walk(h)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return sorted(lines)


def method_lines(classes) -> tuple[str | None, list[int]]:
    """(file, lines) of the methods each class in `classes` defines itself (its own code)."""
    file, lines = None, set()
    for cls in classes:
        for fn in vars(cls).values():
            if not inspect.isfunction(fn):
                continue
            try:
                src, first = inspect.getsourcelines(fn)
                file = inspect.getsourcefile(fn)
            except (OSError, TypeError):
                continue
            lines.update(range(first, first + len(src)))
    return file, sorted(lines)


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def score(findings: list[dict], probe: str | None, file: str | Path | None,
          lines: list[int], severities=SEV) -> dict | None:
    """The source-line record of one bug run (None when the corpus knows no line for it):
    {'given', 'right', 'function_right', 'sources': ['file:line (function)', ...]}. The
    findings read: the bug's probe's at `severities` (the ones that named it)."""
    if not probe or not file or not lines:
        return None
    own = [f for f in findings if f.get("probe") == probe and f.get("severity") in severities]
    srcs = [f["source"] for f in own if isinstance(f.get("source"), dict)]
    user = [s for s in srcs if not s.get("def") and "package" not in s and s.get("file")]
    here = [s for s in user if _same(s["file"], str(file))]
    funcs = {function_at(str(file), ln) for ln in lines} - {None}
    return {"given": bool(user), "right": any(s["line"] in lines for s in here),
            "function_right": any(function_at(str(file), s["line"]) in funcs for s in here),
            "bug_lines": lines,
            "sources": sorted({f"{Path(s['file']).name}:{s['line']} ({s.get('function', '?')})"
                               + (" def" if s.get("def") else "") + (f" [{s['package']}]" if "package" in s else "")
                               for s in srcs})}


def summary(records: list[dict]) -> dict:
    """Counts over the bug runs that carry a source-line record."""
    scored = [r["source_line"] for r in records if r.get("source_line") and r.get("named")]
    given = [s for s in scored if s["given"]]
    return {"named_with_known_line": len(scored), "line_given": len(given),
            "line_right": sum(s["right"] for s in given),
            "function_right": sum(s["function_right"] for s in given)}


def summary_line(s: dict) -> str:
    n, g, r = s["named_with_known_line"], s["line_given"], s["line_right"]
    return (f"line right {r}/{g} where a line is given ({r / g:.0%})" if g else "no line given") + \
        f", line given {g}/{n} named bugs, in the bug's function {s['function_right']}/{g}"


def spans(lines: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    out: list[str] = []
    for ln in sorted(set(lines)):
        if out and ln == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{ln}"
        else:
            out.append(str(ln))
    return ", ".join(out)
