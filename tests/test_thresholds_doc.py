"""docs/thresholds.md stays true to the code: every module-level UPPER_CASE numeric constant of the
audited files is in its file's table with its current value (or excluded below as a size, seed or
count, with the reason), and every constant the doc names exists there with that value.

Read with ast where it can: a value is a literal, or an expression of literals, `math` and the
module's earlier constants (`math.sqrt(2)`, `2.0 ** -24`, `1 << 25`); a dict of numbers gives one
entry per key (`TOL[False]`). A constant the ast cannot evaluate (a call, an imported name:
`torch.finfo(torch.float32).min`, `range(-6, 7)`) is not dropped: the module is imported and the
value read; numeric ones (a range counts as its tuple) are checked like the rest, and a module
that cannot be imported fails the test (issue 50)."""
from __future__ import annotations

import ast
import importlib
import math
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "thresholds.md"
AUDITED = ("tndebug/probes/*.py", "tndebug/triage/*.py", "tndebug/judge/*.py", "tndebug/library/live.py",
           "tndebug/capture/*.py", "tndebug/hf/*.py")

# Constants that decide nothing by comparison: sizes of a test batch or a sample, seeds,
# cadences of memory, display counts. Each says why it is not a threshold.
NOT_THRESHOLDS = {
    ("tndebug/probes/_depth_stats.py", "MAX_SVD_TOKENS"): "subsample size of the null-vector test (cost)",
    ("tndebug/probes/_depth_setup.py", "GRAD_ROWS"): "rows of the setup gradient pass (memory)",
    ("tndebug/probes/_depth_setup.py", "BLOCK_TOKENS"): "tokens per forward of the wide batch (memory)",
    ("tndebug/triage/hygiene.py", "FINITE_BLOCK"): "elements per isfinite call (memory)",
    ("tndebug/hf/shift.py", "LOGIT_BYTES"): "logit bytes per forward of label-shift's pass (memory)",
    ("tndebug/probes/_depth_stats.py", "THREADED_WIDTH"): "width from which LAPACK keeps torch's threads (cost)",
    ("tndebug/probes/_head_stats.py", "JS_MAX_SEQ"): "sequences sampled for the JS statistic (cost)",
    ("tndebug/probes/_head_stats.py", "JS_MAX_ROWS"): "query rows sampled for the JS statistic (cost)",
    ("tndebug/probes/_head_stats.py", "LN2"): "ln 2, nats to bits",
    ("tndebug/probes/gradient_flow.py", "SETUP_ROWS"): "rows per forward of the dead-unit test (memory)",
    ("tndebug/probes/lm_decoding_left_pad.py", "LEFT_PADS"): "pads put before each row in the test input",
    ("tndebug/probes/_mask_tests.py", "EXTRA_PADS"): "pad columns appended in the test input",
    ("tndebug/probes/positional_encoding_table.py", "MAX_PROBE_LEN"): "longest test sequence (cost)",
    ("tndebug/probes/zero_grad.py", "TRACKED"): "parameters watched; the test itself is exact",
    ("tndebug/probes/budget.py", "MIN_PLAIN"): "plain steps timed before the budget judges",
    ("tndebug/probes/budget.py", "WINDOW"): "steps the budget's medians are taken over",
    ("tndebug/probes/budget.py", "SYNC_EVERY"): "steps between the ranks' exchanges of the budget's numbers",
    ("tndebug/capture/attention_calls.py", "MAX_RECOMPUTED"): "memory cap on recomputed SDPA scores",
    ("tndebug/judge/fresh.py", "SEED"): "the fresh initialisation's seed",
    ("tndebug/judge/scale.py", "NO_SCALE"): "missing-scale's diagnosis text, matched",
    ("tndebug/triage/hf_dir.py", "PROBE_VOCAB"): "logit columns the probes see (exact for those ids)",
    ("tndebug/triage/hf_dir.py", "HELD_OUT"): "rows of the probes' random batch",
    ("tndebug/triage/hf_dir.py", "SRC_LEN"): "source length of the probes' random batch",
    ("tndebug/triage/hf_dir.py", "TGT_LEN"): "target length of the probes' random batch",
    ("tndebug/triage/hf_data.py", "TEXT_MAX_TOKENS"): "--text truncation length",
    ("tndebug/hf/encoder_only.py", "MASK_SHARE"): "masking rate of the encoder-only sweep's batch (BERT's 15%)",
    ("tndebug/triage/run.py", "HELD_OUT"): "held-out sequences for the loss comparisons",
    ("tndebug/one_stack.py", "MAX_SEQS"): "--data / data= sequences used (cost of 13 sweep forwards)",
    ("tndebug/padding.py", "PLACES_SHOWN"): "(row, position) pairs quoted in a message",
}


def _files() -> list[str]:
    """The audited files git tracks (a file another hand is still writing joins once committed);
    every file matching AUDITED where there is no git checkout."""
    found = {str(p.relative_to(ROOT)) for pat in AUDITED for p in ROOT.glob(pat)}
    try:
        tracked = subprocess.run(["git", "ls-files", "--", *AUDITED], cwd=ROOT, capture_output=True,
                                 text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return sorted(found)
    return sorted(found & set(tracked)) if tracked else sorted(found)


def _number(v) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float)):
        return True
    return isinstance(v, tuple) and bool(v) and all(_number(x) for x in v)


def _value(node: ast.AST, env: dict):
    """The value of a constant expression, or None when it is not numeric or not evaluable."""
    try:
        v = eval(compile(ast.Expression(node), "<const>", "eval"),
                 {"__builtins__": {}, "math": math}, dict(env))
    except Exception:
        return None
    if isinstance(v, dict):
        return v if v and all(_number(x) for x in v.values()) else None
    return v if _number(v) else None


def _upper(name: str) -> bool:
    return name.upper() == name and any(c.isalpha() for c in name)


def constants(path: str) -> tuple[dict[str, object], set[str]]:
    """(entry -> value for the numeric ones, every UPPER_CASE module-level name) of one file;
    entries are NAME, or NAME[key] for a dict of numbers."""
    tree = ast.parse((ROOT / path).read_text())
    env: dict[str, object] = {}
    out: dict[str, object] = {}
    names: set[str] = set()
    for stmt in tree.body:
        pairs: list[tuple[str, ast.AST]] = []
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    pairs.append((t.id, stmt.value))
                elif isinstance(t, ast.Tuple) and isinstance(stmt.value, ast.Tuple) \
                        and len(t.elts) == len(stmt.value.elts):
                    pairs += [(e.id, v) for e, v in zip(t.elts, stmt.value.elts) if isinstance(e, ast.Name)]
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            pairs.append((stmt.target.id, stmt.value))
        for name, node in pairs:
            if not _upper(name):
                continue
            names.add(name)
            v = _value(node, env)
            if v is None and _evaluable(node, env):
                continue        # evaluated, and not a number (a string, a set of names)
            if v is None:
                v = _imported(path, name)
            if v is None:
                continue
            env[name] = v
            if isinstance(v, dict):
                out.update({f"{name}[{k!r}]": x for k, x in v.items()})
            else:
                out[name] = v
    return out, names


def _evaluable(node: ast.AST, env: dict) -> bool:
    try:
        eval(compile(ast.Expression(node), "<const>", "eval"), {"__builtins__": {}, "math": math}, dict(env))
    except Exception:
        return False
    return True


def _imported(path: str, name: str):
    """The value of a constant the ast could not evaluate, read from the imported module (an
    import error fails the caller's test): a number, a tuple or range of numbers, a dict of
    numbers; None when it is something else."""
    module = importlib.import_module(path[:-3].replace("/", ".").removesuffix(".__init__"))
    v = getattr(module, name)
    if isinstance(v, range):
        v = tuple(v)
    if isinstance(v, dict):
        return v if v and all(_number(x) for x in v.values()) else None
    return v if _number(v) else None


_SECTION = re.compile(r"^#{2,4} .*")
_PATH = re.compile(r"`(tndebug/[\w/]+\.py)`")
_ROW = re.compile(r"^\|\s*`([A-Z][A-Z0-9_]*(?:\[[^\]`]+\])?)`(?:\s*\((`?)(tndebug/[\w/]+\.py|[\w]+\.py)\2\))?\s*\|\s*([^|]+?)\s*\|")


def _entry(cell: str) -> str:
    """`TOL[False]`, `GROWTH_ENVELOPE["pre"]` -> the key spelled as the code's repr."""
    node = ast.parse(cell, mode="eval").body
    if isinstance(node, ast.Subscript):
        return f"{node.value.id}[{ast.literal_eval(node.slice)!r}]"
    return node.id


def doc_rows() -> list[tuple[str, str, str]]:
    """(file, entry, value cell) for every table row of docs/thresholds.md naming a constant.
    A row belongs to the files its section heading names; `NAME` (`other.py`) picks one of them."""
    rows, files = [], []
    for line in DOC.read_text().splitlines():
        if _SECTION.match(line):
            files = _PATH.findall(line)
            continue
        m = _ROW.match(line)
        if not m or not files:
            continue
        name, _, where, value = m.groups()
        if where:
            target = [f for f in files if f == where or f.endswith("/" + where)]
            assert len(target) == 1, f"docs/thresholds.md: row {name} names {where}, not in {files}"
        else:
            target = files[:1]
        rows.append((target[0], _entry(name), value))
    return rows


def _equal(doc_value: str, code_value) -> bool:
    v = _value(ast.parse(doc_value, mode="eval").body, {}) if _parses(doc_value) else None
    if v is None and _parses(doc_value) and "torch." in doc_value:     # `torch.finfo(...).min`
        import torch
        try:
            v = eval(doc_value, {"__builtins__": {}, "torch": torch, "math": math})
        except Exception:
            v = None
    if v is None:
        return False
    if isinstance(code_value, tuple):
        return isinstance(v, tuple) and len(v) == len(code_value) and all(
            math.isclose(a, b, rel_tol=1e-12) for a, b in zip(v, code_value))
    return not isinstance(v, tuple) and math.isclose(v, code_value, rel_tol=1e-12, abs_tol=0.0)


def _parses(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
        return True
    except SyntaxError:
        return False


def test_every_constant_is_documented_with_its_value():
    rows = doc_rows()
    documented = {(f, e): v for f, e, v in rows}
    missing, wrong = [], []
    for path in _files():
        values, _ = constants(path)
        for entry, value in values.items():
            base = entry.split("[")[0]
            if (path, base) in NOT_THRESHOLDS:
                continue
            if (path, entry) not in documented:
                missing.append(f"{path}: {entry} = {value!r}")
            elif not _equal(documented[(path, entry)], value):
                wrong.append(f"{path}: {entry} is {value!r} in the code, "
                             f"{documented[(path, entry)]!r} in docs/thresholds.md")
    assert not missing, "constants missing from docs/thresholds.md:\n" + "\n".join(missing)
    assert not wrong, "values that differ:\n" + "\n".join(wrong)


def test_every_documented_constant_exists():
    stale = []
    for path, entry, _ in doc_rows():
        if not (ROOT / path).exists():
            stale.append(f"{path}: no such file")
            continue
        values, names = constants(path)
        if entry not in values and entry.split("[")[0] not in names:
            stale.append(f"{path}: {entry}")
    assert not stale, "docs/thresholds.md names constants the code no longer has:\n" + "\n".join(stale)


def test_exclusions_are_live_and_not_documented_as_thresholds():
    documented = {(f, e.split("[")[0]) for f, e, _ in doc_rows()}
    for (path, name), why in NOT_THRESHOLDS.items():
        assert why, (path, name)
        _, names = constants(path)
        assert name in names, f"NOT_THRESHOLDS lists {path}: {name}, which the code no longer has"
        assert (path, name) not in documented, f"{path}: {name} is both excluded and documented"


def test_the_doc_has_a_table_row_per_audited_constant_at_least_once():
    """The parser itself: it finds rows in most sections (a format change would make the first
    test pass vacuously on an empty doc)."""
    rows = doc_rows()
    assert len(rows) >= 90
    assert ("tndebug/probes/missing_scale.py", "TOL[False]") in {(f, e) for f, e, _ in rows}
    assert ("tndebug/probes/_depth_stats.py", "SPHERE_TOL") in {(f, e) for f, e, _ in rows}
