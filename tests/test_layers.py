"""The package's flow, kept by its imports: model -> capture -> probes -> driver -> reporters ->
front-ends (run/train, triage, library, CLI). No module imports from a layer above its own, and
the library (check, watch) never imports triage, so `tndebug.check` is not built on `tndebug
triage` (issue 20). Every import counts, the function-local ones too: a deferred import is still
a dependency."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tndebug"

# Each top-level module or package of tndebug and its layer; a module may import its own layer
# and the layers below.
LAYERS = {
    # types and utilities every stage uses
    "errors": 0, "notes": 0, "faults": 0, "config": 0, "data": 0, "findings": 0, "report": 0,
    "outputs": 0, "padding": 0, "safeload": 0, "memory": 0, "manifest": 0,
    "paths": 0, "task_names": 0,      # torch-free: the CLI refuses a bad path or flag before torch
    "tags": 0,                        # the metric tag vocabulary: probes write it, reporters read it
    "frames": 0,                      # the report as pandas frames (pandas imported only there)
    "one_stack": 0,                   # the user's one-sequence-per-row data (triage and check)
    "sharded": 0,                     # FSDP2's DTensor parameters and gradients, as probes read them
    "model": 1,                       # the paper model and its tap points, healthy
    "inject": 1,                      # the notes' faults, put into that model from outside
    "capture": 2, "subject": 2,       # a Trace from any model; the model as the probes call it
    "probes": 3, "harness": 3,        # the probes (harness: the probes on our model, for tests)
    "driver": 4,                      # drives the probes once (probe_once)
    "judge": 4,                       # every re-judgement after the probes; conclude() -> Report
    "reporters": 5,                   # console, markdown, plots, TensorBoard
    # front-ends
    "train": 6, "triage": 6, "library": 6, "commands": 6, "integrations": 6, "cli": 7,
    "pytest_plugin": 7, "__main__": 7, "__init__": 7,
}
# pairs that must not import one another: front-ends (the library and triage share only what lies
# below), and the healthy model, which knows nothing of its faults
APART = {("library", "triage"), ("triage", "library"), ("train", "triage"), ("train", "library"),
         ("model", "inject")}


def _imports(path: Path) -> list[tuple[str, int]]:
    """(top-level tndebug module imported, line) for every import in the file."""
    own = path.relative_to(PKG).parts[0].removesuffix(".py")
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                   # relative: within its own package
                names = [f"tndebug.{own}"]
            elif node.module == "tndebug":   # from tndebug import driver, ...
                names = [f"tndebug.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tndebug":
                out.append((parts[1] if len(parts) > 1 else "__init__", node.lineno))
    return out


def _violations() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        own = path.relative_to(PKG).parts[0].removesuffix(".py")
        for target, line in _imports(path):
            if target == own or target not in LAYERS:
                continue
            where = f"{path.relative_to(PKG.parent)}:{line}"
            if LAYERS[target] > LAYERS[own]:
                bad.append(f"{where}: {own} (layer {LAYERS[own]}) imports {target} "
                           f"(layer {LAYERS[target]})")
            elif (own, target) in APART:
                bad.append(f"{where}: {own} imports {target}")
    return bad


def test_every_top_level_module_has_a_layer():
    found = {p.relative_to(PKG).parts[0].removesuffix(".py") for p in PKG.rglob("*.py")}
    assert found - set(LAYERS) == set(), "give each new module a layer in LAYERS"


def test_no_module_imports_from_a_higher_layer_and_the_library_never_imports_triage():
    assert _violations() == []


def test_the_check_sees_function_local_imports(tmp_path, monkeypatch):
    """The check can fail: a deferred import from a higher layer is found."""
    fake = tmp_path / "tndebug"
    (fake / "capture").mkdir(parents=True)
    (fake / "capture" / "x.py").write_text("def f():\n    from tndebug.triage import run\n")
    (fake / "library").mkdir()
    (fake / "library" / "y.py").write_text("from tndebug import triage\n")
    monkeypatch.setitem(globals(), "PKG", fake)
    assert _violations() == [
        "tndebug/capture/x.py:2: capture (layer 2) imports triage (layer 6)",
        "tndebug/library/y.py:1: library imports triage"]


FRONT_ENDS = ("triage/run.py", "triage/hf.py", "library/check.py", "library/watch.py", "train/loop.py")


def test_every_front_end_ends_in_the_judge_and_only_the_judge_builds_a_report():
    """One tail (issue 46): each front-end hands its findings to `judge.conclude`, and no module
    but the judge assembles a Report from findings (a hand-built tail would skip its passes)."""
    import re
    for name in FRONT_ENDS:
        assert "judge.conclude(" in (PKG / name).read_text(), f"{name} does not end in judge.conclude"
    builders = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                      if re.search(r"(?<![\w.])Report\(", p.read_text()))
    assert builders == ["judge/stage.py"], builders
