"""docs/thresholds.md's "set on / checked on / held out?" columns are data (issue 50): every
corpus, test file, bench script, results file and commit they name exists, and every threshold
row's "checked on" names only those.

* The corpora table: each row's script and tests exist, each results file it names is in
  bench/results/, each commit it names is in git.
* Each threshold row (tests/test_thresholds_corpora.threshold_rows): its "checked on" cell is a
  list of items (`;` or `,` between them, outside brackets, up to a `:` that starts the item's
  detail), each led by a corpus of the table (`det-eval`, `realbugs'`, `hf_unseen HELD-OUT`), a
  path (`tests/...`, `bench/...`), `as NAME` (another row's constant), or one of WORDS; "held
  out?" opens with one of HELD; a corpus "held out: yes" on is one the row is checked on; and
  every path and commit named in the three columns exists.
The values themselves: tests/test_thresholds_doc.py (each constant exists in code with the
value printed); the seeds and step counts: tests/test_thresholds_corpora.py."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from test_thresholds_corpora import DOC, ROOT, threshold_rows

WORDS = ("tests only", "none", "-", "all", "by hand", "no 16-bit corpus")
HELD = ("exact", "seeds only", "not held out", "naming", "yes", "no", "partly", "held out on",
        "decoder-only yes", "not a calibration", "-")
PATH = re.compile(r"(?<![\w/.])((?:tests|bench)/[\w/.-]+\.(?:py|sh|md|json|jsonl))")
COMMIT = re.compile(r"(?<![\w/.-])([0-9a-f]{7,12})(?![\w.-])")


def corpora() -> dict[str, str]:
    """corpus name -> its row in the corpora table (a row naming two, `**a** / **b**`, gives
    both and their common prefix: `lnwarm`)."""
    text = DOC.read_text().split("## The corpora")[1].split("\n## ")[0]
    out = {}
    for line in text.splitlines():
        if line.startswith("| **"):
            names = re.findall(r"\*\*([\w-]+)\*\*", line.split(" | ")[0])
            for name in names:
                out[name] = line
            if len(names) > 1:
                out[names[0].rsplit("-", 1)[0]] = line
    return out


def items(cell: str) -> list[str]:
    """The heads of a "checked on" cell's items: split at `;` and `,` outside brackets, each
    item's detail (from a `:` outside brackets) dropped, a `;` after a detail starting the next."""
    out, cur, depth, detail = [], "", 0, False
    for ch in cell:
        depth += ch in "([" and 1 or ch in ")]" and -1 or 0
        if depth == 0 and ch == ";":
            out.append(cur)
            cur, detail = "", False
        elif depth == 0 and ch == "," and not detail:
            out.append(cur)
            cur = ""
        elif depth == 0 and ch == ":" and not detail:
            detail = True
        elif not detail:
            cur += ch
    out.append(cur)
    return [re.sub(r"\(.*", "", c).strip().strip("`") for c in out]


def leads(head: str, names: dict[str, str]) -> str | None:
    """Why an item's head names nothing known, or None."""
    word = re.split(r"[\s']", head)[0] if head else ""
    if word in names or head.startswith(WORDS) or re.fullmatch(r"as `?[A-Z][A-Z0-9_]*`?", head):
        return None
    if PATH.match(head) or head.startswith(("tests/", "bench/")):
        return None if (ROOT / PATH.match(head).group(1)).exists() else f"{head}: no such file"
    return f"{head!r} is no corpus of the table, no path and none of {WORDS}"


def _git_has(commit: str) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True, timeout=30).returncode == 0


def _history() -> bool:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                         capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and out.stdout.strip() == "false"


ROWS = threshold_rows()
NAMES = corpora()


def test_the_tables_are_found():
    assert len(ROWS) >= 150 and {"det-eval", "det-calib", "foreign", "realbugs", "hf_unseen"} <= set(NAMES)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_each_corpus_names_what_exists(name):
    row = NAMES[name]
    what, results = row.split(" | ")[1], row.split(" | ")[-1]
    scripts = PATH.findall(what) + re.findall(r"`(tests/[\w/.]*)`", what)
    api = re.findall(r"`tndebug\.(\w+)`", what)
    assert scripts or api, f"{name}: the row names no script, tests or API that run it"
    for path in scripts:
        assert (ROOT / path).exists(), f"{name}: {path} does not exist"
    exported = (ROOT / "tndebug" / "__init__.py").read_text()
    for attr in api:
        assert (ROOT / "tndebug" / attr).is_dir() or (ROOT / "tndebug" / f"{attr}.py").exists() \
            or re.search(rf"\b{attr}\b", exported), f"{name}: tndebug.{attr} does not exist"
    for path in re.findall(r"`(?:bench/results/)?([\w.-]+\.(?:md|json|jsonl))`", results):
        assert (ROOT / "bench" / "results" / path).exists(), f"{name}: bench/results/{path} does not exist"


@pytest.mark.parametrize("row", ROWS, ids=[r[0][:40] for r in ROWS])
def test_each_threshold_row_names_what_exists(row):
    name, _, _, _, set_on, checked, held = row
    problems = [why for head in items(checked) if (why := leads(head, NAMES))]
    assert not problems, f"{name}: checked on: {problems}"
    assert held.startswith(HELD), f"{name}: held out? {held[:40]!r} opens with none of {HELD}"
    said = re.match(r"yes: ([\w-]+)", held)
    if said and said.group(1) in NAMES:
        assert said.group(1) in checked, f"{name}: held out on {said.group(1)}, which it is not checked on"
    for cell in (set_on, checked, held):
        for path in PATH.findall(cell):
            assert (ROOT / path).exists(), f"{name}: {path} does not exist"


def test_every_commit_the_columns_name_is_in_git():
    if not _history():
        pytest.skip("no git history in this checkout (a shallow clone or none)")
    cells = [c for r in ROWS for c in r[4:]] + list(NAMES.values())
    named = {c for cell in cells for c in COMMIT.findall(cell) if not c.isdigit()}
    assert len(named) >= 20
    missing = sorted(c for c in named if not _git_has(c))
    assert not missing, f"docs/thresholds.md names commits git does not have: {missing}"


def test_the_grammar_rejects_what_it_must():
    assert items("det-eval (a, b), foreign: x, y; realbugs' z") == ["det-eval", "foreign", "realbugs' z"]
    assert leads("det-eval at ad7b555", NAMES) is None and leads("realbugs' healthy", NAMES) is None
    assert leads("mBART reverse", NAMES) and leads("tests/no_such_file.py", NAMES)
    assert leads("as UPDATE_RATIO", NAMES) is None and leads("as update ratio", NAMES)
