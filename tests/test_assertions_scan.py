"""Every test asserts something (issue 50): an AST scan of tests/ fails on a `test_*` function
whose body has no `assert`, no `pytest.raises` / `pytest.warns` / `pytest.fail`, no call of an
`assert*` function or method (`torch.testing.assert_close`, pytester's `assert_outcomes`), and
no call of an asserting helper.

The asserting helpers are found by the same scan, transitively: a function defined anywhere in
tests/ asserts when its own body does one of the above or calls a function that asserts, bare
(`helper(x)`, `from conftest import helper`; a module-level alias `bad = helper` too) or as
`self.helper(x)`. Names are matched across files (a helper imported from another test module
counts), which can only over-count helpers that share a name; `tndebug.check(...)` or
`obj.run(...)` never match a helper. The allow-list below is explicit."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# (file relative to tests/, test name) -> why it needs no assertion. Empty: every test asserts.
ALLOWED: dict[tuple[str, str], str] = {}

RAISING = {"raises", "warns", "fail", "deprecated_call"}      # pytest.<name>


def _called(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _direct(fn: ast.AST) -> bool:
    """The body asserts by itself (nested functions included: a closure's assert runs when called)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in RAISING and \
                    isinstance(f.value, ast.Name) and f.value.id == "pytest":
                return True
            name = _called(node)
            if name and name.startswith("assert"):
                return True
    return False


def _calls(fn: ast.AST) -> set[str]:
    """The names a function calls bare (`helper(...)`, as imported) or on self/cls: not
    `tndebug.check(...)` or `x.run(...)`, which would match a test helper of the same name."""
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                out.add(f.id)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                    and f.value.id in ("self", "cls"):
                out.add(f.attr)
    return out


def _functions(tree: ast.Module):
    """(qualified name, node, is a test) for every function in a module, methods included."""
    out = []

    def visit(body, prefix, in_test_class):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                is_test = node.name.startswith("test") and (not prefix or in_test_class)
                out.append((prefix + node.name, node, is_test))
                visit(node.body, prefix + node.name + ".", False)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".", node.name.startswith("Test"))
    visit(tree.body, "", False)
    return out


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Module-level `bad = assert_bad_input` (or `run, bad = f, g`): alias -> the name it binds."""
    out = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                pairs = [(t, stmt.value)]
                if isinstance(t, ast.Tuple) and isinstance(stmt.value, ast.Tuple):
                    pairs = list(zip(t.elts, stmt.value.elts))
                out.update({a.id: v.id for a, v in pairs
                            if isinstance(a, ast.Name) and isinstance(v, ast.Name)})
    return out


def scan() -> tuple[list[tuple[str, str]], set[str]]:
    """(tests that assert nothing, as (file, name); the names of the asserting helpers)."""
    funcs = []          # (file, qualname, node, is_test)
    aliases: dict[str, str] = {}
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = str(path.relative_to(TESTS))
        funcs += [(rel, q, n, t) for q, n, t in _functions(tree)]
        aliases.update(_aliases(tree))
    asserting = {n.name for _, _, n, _ in funcs if _direct(n)}
    calls = {id(n): _calls(n) for _, _, n, _ in funcs}
    while True:        # transitive: a helper that calls an asserting helper (or its alias) asserts
        more = {a for a, v in aliases.items() if v in asserting or v.startswith("assert")} - asserting
        more |= {n.name for _, _, n, _ in funcs if n.name not in asserting and calls[id(n)] & asserting}
        if not more:
            break
        asserting |= more
    bare = [(rel, q) for rel, q, n, is_test in funcs
            if is_test and not _direct(n) and not (calls[id(n)] & asserting)]
    return bare, asserting


def test_every_test_function_asserts():
    bare, _ = scan()
    unexplained = [f"{rel}: {q}" for rel, q in bare if (rel, q) not in ALLOWED]
    assert not unexplained, "tests with no assertion and no asserting helper:\n" + "\n".join(unexplained)


def test_the_allow_list_is_live_and_explained():
    bare, _ = scan()
    for key, why in ALLOWED.items():
        assert why, key
        assert key in bare, f"ALLOWED lists {key}, which asserts now (or is gone): remove it"


def test_the_scan_sees_what_it_should(tmp_path):
    """The scan itself on a known module: a bare test, a test with a helper two calls deep, and
    one with pytest.raises."""
    src = ("import pytest\n"
           "def check(x):\n    assert x\n"
           "def outer(x):\n    check(x)\n"
           "def test_bare():\n    print(1)\n"
           "def test_helper():\n    outer(1)\n"
           "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
           "class TestK:\n    def test_m(self):\n        pass\n")
    tree = ast.parse(src)
    funcs = _functions(tree)
    asserting = {n.name for _, n, _ in funcs if _direct(n)}
    for _ in range(3):
        asserting |= {n.name for _, n, _ in funcs if _calls(n) & asserting}
    bare = {q for q, n, t in funcs if t and not _direct(n) and not (_calls(n) & asserting)}
    assert bare == {"test_bare", "TestK.test_m"}
    assert {"check", "outer"} <= asserting
    assert len(scan()[1]) > 10          # the real tests/ has asserting helpers
