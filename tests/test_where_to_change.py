"""README's Development section and docs/DEVELOPING.md answer "where do I change X" in a table
(issue 46): each answer names 1-3 files, and every file or folder a table names exists. A path
with a <placeholder> names its folder (`tndebug/probes/<name>.py`: the folder tndebug/probes/)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "DEVELOPING.md")
QUESTIONS = ("add a probe", "support an architecture", "change a severity rule", "add an output format")
ROW = re.compile(r"^\s*\|\s*(add a probe|support an architecture|change a severity rule|add an output format)\s*\|(.*)\|\s*$")
PATH = re.compile(r"`((?:tndebug|tests|docs|bench)/[^`\s]*)`")


def table(doc: Path) -> dict[str, list[str]]:
    """question -> the paths its answer names, from the doc's "where do I change X" table."""
    rows = {}
    for line in doc.read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = PATH.findall(m.group(2))
    return rows


def exists(path: str) -> bool:
    if "<" in path:                       # a placeholder: its folder must exist
        return (ROOT / path.split("<", 1)[0]).is_dir()
    return (ROOT / path).exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_question_is_answered_in_one_to_three_files_that_exist(doc):
    rows = table(doc)
    assert set(rows) == set(QUESTIONS), f"{doc.name}: the table lacks {set(QUESTIONS) - set(rows)}"
    for question, paths in rows.items():
        assert paths, f"{doc.name}: '{question}' names no file"
        files = [p for p in paths if not p.startswith("tests/")]
        assert 1 <= len(files) <= 3, f"{doc.name}: '{question}' names {len(files)} files: {files}"
        missing = [p for p in paths if not exists(p)]
        assert not missing, f"{doc.name}: '{question}' names files that do not exist: {missing}"


def test_the_two_tables_agree():
    assert table(DOCS[0]) == table(DOCS[1])


def test_the_check_fails_on_a_missing_file(tmp_path):
    """The check can fail: a table naming a file that is not there."""
    doc = tmp_path / "X.md"
    doc.write_text("| add a probe | `tndebug/probes/no_such_probe.py` |\n")
    assert table(doc) == {"add a probe": ["tndebug/probes/no_such_probe.py"]}
    assert not exists("tndebug/probes/no_such_probe.py") and exists("tndebug/probes/<name>.py")
