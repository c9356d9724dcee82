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
    # the Hugging Face wing (issue 46): one folder, each file at the layer of what it imports
    "hf": 0,                          # the package itself imports nothing
    "hf.encoder_decoder": 2, "hf.decoder_only": 2, "hf.encoder_only": 2,  # how a family is called
    "hf.load": 2, "hf.build": 2,      # the weights; config.json and the model it builds
    "hf.checks": 2, "hf.head": 2,     # the head and file checks (findings from tensors)
    "hf.shift": 4,                    # label-shift's own pass over the whole vocabulary
    "hf.wording": 4,                  # HF words in findings (a judge pass)
    # `tndebug triage DIR` and what only it reads (--text, a Trainer's resume state) end in the
    # judge, so they are triage/hf_*.py: a wing file above the judge would tie hf/ and judge/
    # both ways (the judge reads hf.wording)
}
# triage's side of the front-ends
TRIAGE_SIDE = ("triage",)
# pairs that must not import one another: front-ends (the library and triage share only what lies
# below), and the healthy model, which knows nothing of its faults
APART = ({(a, b) for t in TRIAGE_SIDE for a, b in (("library", t), (t, "library"), ("train", t))}
         | {("train", "library"), ("model", "inject")})


def _module(parts: tuple[str, ...]) -> str:
    """The LAYERS key of a file or dotted name below tndebug: its top-level module, or for the
    HF wing `hf.<file>` (`hf` for the package itself)."""
    top = parts[0].removesuffix(".py")
    if top == "hf" and len(parts) > 1 and parts[1] != "__init__.py":
        return "hf." + parts[1].removesuffix(".py")
    return top


def _imports(path: Path) -> list[tuple[str, int]]:
    """(top-level tndebug module imported, line) for every import in the file."""
    own = _module(path.relative_to(PKG).parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                   # relative: within its own package
                names = [f"tndebug.{own}"]
            elif node.module in ("tndebug", "tndebug.hf"):   # from tndebug import driver, ...
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tndebug":
                out.append((_module(tuple(parts[1:])) if len(parts) > 1 else "__init__", node.lineno))
    return out


def _violations() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        own = _module(path.relative_to(PKG).parts)
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
    found = {_module(p.relative_to(PKG).parts) for p in PKG.rglob("*.py")}
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


def test_the_hf_wing_has_a_layer_per_file(tmp_path, monkeypatch):
    """tndebug/hf/ spans layers: each file is its own LAYERS key, so a capture-level HF file that
    imports the judge-level wording is caught (one key for the folder would let it through), and
    the library that imports triage's HF files too."""
    fake = tmp_path / "tndebug"
    (fake / "hf").mkdir(parents=True)
    (fake / "hf" / "load.py").write_text("from tndebug.hf import wording\n")
    (fake / "library").mkdir()
    (fake / "library" / "y.py").write_text("def f():\n    import tndebug.triage.hf_data\n")
    (fake / "judge").mkdir()
    (fake / "judge" / "z.py").write_text("from tndebug.hf.wording import hf_fix\n")
    monkeypatch.setitem(globals(), "PKG", fake)
    assert _violations() == [
        "tndebug/hf/load.py:1: hf.load (layer 2) imports hf.wording (layer 4)",
        "tndebug/library/y.py:2: library imports triage"]


FRONT_ENDS = ("triage/run.py", "triage/hf_dir.py", "library/check.py", "library/watch.py", "train/loop.py")


def test_every_front_end_ends_in_the_judge_and_only_the_judge_builds_a_report():
    """One tail (issue 46): each front-end hands its findings to `judge.conclude`, and no module
    but the judge assembles a Report from findings (a hand-built tail would skip its passes)."""
    import re
    for name in FRONT_ENDS:
        assert "judge.conclude(" in (PKG / name).read_text(), f"{name} does not end in judge.conclude"
    builders = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                      if re.search(r"(?<![\w.])Report\(", p.read_text()))
    assert builders == ["judge/stage.py"], builders


def _module_imports(pkg: Path) -> dict[str, set[str]]:
    """Each file's dotted name -> the files of `pkg` it imports (every import, the function-local
    and TYPE_CHECKING ones too: an annotation's import still ties the two files)."""
    files = {".".join(p.relative_to(pkg.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in pkg.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        wanted = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wanted += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                wanted += [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
        graph[name] = set()
        for target in wanted:
            while target and target not in files:        # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles (strongly connected groups of two files or more), each sorted."""
    order, low, stack, out = {}, {}, [], []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                out.append(sorted(group))
    for v in sorted(graph):
        if v not in order:
            visit(v)
    return sorted(out)


def test_no_import_circle():
    """No two files of tndebug import each other, straight or round a loop (issue 46): the flow
    runs one way inside a folder too."""
    assert _circles(_module_imports(PKG)) == []


def _folders(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph of the top-level folders and modules (tndebug.hf.load -> tndebug.hf)."""
    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(top(a), set()).update(top(b) for b in targets if top(b) != top(a))
    return out


def test_no_folder_circle():
    """The folders import one another one way too (issue 46): a file placed in a folder whose
    layer is not its own ties two folders both ways (hf/triage.py, a front-end that ends in the
    judge, sat in the HF wing that the judge reads, and in the wing that triage/ calls)."""
    assert _circles(_folders(_module_imports(PKG))) == []


def test_the_circle_check_can_fail(tmp_path):
    """A circle closed by a function-local or TYPE_CHECKING import is still found."""
    fake = tmp_path / "tndebug"
    (fake / "capture").mkdir(parents=True)
    (fake / "capture" / "a.py").write_text("from tndebug.capture.b import f\n")
    (fake / "capture" / "b.py").write_text("def f():\n    from .c import g\n")
    (fake / "capture" / "c.py").write_text("if TYPE_CHECKING:\n    from tndebug.capture import a\n")
    (fake / "capture" / "d.py").write_text("from tndebug.capture import a\n")
    assert _circles(_module_imports(fake)) == [
        ["tndebug.capture.a", "tndebug.capture.b", "tndebug.capture.c"]]
    (fake / "hf").mkdir()
    (fake / "hf" / "front.py").write_text("from tndebug.judge.stage import conclude\n")
    (fake / "judge").mkdir()
    (fake / "judge" / "stage.py").write_text("from tndebug.hf.wording import hf_fix\n")
    (fake / "hf" / "wording.py").write_text("")
    assert _circles(_folders(_module_imports(fake))) == [["tndebug.hf", "tndebug.judge"]]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_imports(pkg: Path) -> list[str]:
    """Every private name one file of `pkg` takes from another (issue 46, private means private):
    `from M import _name`, `M._name` on an imported module M, and a private module imported from
    outside the package that holds it (`tndebug.probes._tolerance` from `tndebug/library/`; from
    inside its own package it is the package's, as `probes/_depth_stats.py` is probes'). Every
    import counts, the function-local ones too. -> ["tndebug/x.py:LINE: tndebug.y._name"]"""
    files = {".".join(p.relative_to(pkg.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in pkg.rglob("*.py")}
    bad = []
    for name, path in sorted(files.items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        where = path.relative_to(pkg.parent)

        def outside(dotted: str) -> bool:        # a private part of `dotted` not of our package
            parts = dotted.split(".")
            return any(_private(p) and not (package + ".").startswith(".".join(parts[:i]) + ".")
                       for i, p in enumerate(parts))
        tree = ast.parse(path.read_text(), str(path))
        bound = {}                                  # local name -> the tndebug module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == pkg.name:
                        bound[a.asname or pkg.name] = a.name if a.asname else pkg.name
                        if outside(a.name):
                            bad.append(f"{where}:{node.lineno}: {a.name}")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] != pkg.name:
                    continue
                if outside(base):
                    bad.append(f"{where}:{node.lineno}: {base}")
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in files:
                        bound[a.asname or a.name] = full
                    if (outside(full) if full in files else _private(a.name) and base != name):
                        bad.append(f"{where}:{node.lineno}: {full}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain, inner = [], node.value
                while isinstance(inner, ast.Attribute):
                    chain.append(inner.attr)
                    inner = inner.value
                if isinstance(inner, ast.Name) and inner.id in bound:
                    owner = ".".join([bound[inner.id], *reversed(chain)])
                    if owner != name and (owner in files or owner.rpartition(".")[0] in files):
                        bad.append(f"{where}:{node.lineno}: {owner}.{node.attr}")
    return sorted(set(bad))


def test_no_private_name_is_imported_across_modules():
    """Private means private (issue 46): a name used by another file drops its underscore (as
    capture/source.py's `file_kind`, which origins.py reads), or the code moves."""
    assert _private_imports(PKG) == []


def test_the_private_import_check_can_fail(tmp_path):
    """A private name taken from another file is found however it is taken; a package's private
    module used inside its own package is not."""
    fake = tmp_path / "tndebug"
    (fake / "probes").mkdir(parents=True)
    (fake / "probes" / "__init__.py").write_text("")
    (fake / "probes" / "_helpers.py").write_text("def g(): pass\ndef _h(): pass\n")
    (fake / "probes" / "one.py").write_text(
        "from tndebug.probes import _helpers\nfrom tndebug.probes._helpers import g\n"
        "from ._helpers import g as g2\ndef _own(): pass\n_own()\n")
    (fake / "probes" / "two.py").write_text("from tndebug.probes.one import _own\n")
    (fake / "library").mkdir()
    (fake / "library" / "w.py").write_text(
        "import tndebug.probes.one as one\nfrom tndebug.probes import one as o2\n"
        "def f():\n    from tndebug.probes._helpers import g\n    return one._own, o2._own\n")
    assert _private_imports(fake) == [
        "tndebug/library/w.py:4: tndebug.probes._helpers",
        "tndebug/library/w.py:5: tndebug.probes.one._own",
        "tndebug/probes/two.py:1: tndebug.probes.one._own"]
