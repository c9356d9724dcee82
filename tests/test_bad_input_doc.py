"""docs/bad_input.md says what each bad input gets: the quick cases are rerun and compared."""
import importlib.util
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _cases_module():
    spec = importlib.util.spec_from_file_location("bad_input_doc", DOCS / "bad_input.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_document_says_what_each_quick_case_prints():
    m = _cases_module()
    doc = (DOCS / "bad_input.md").read_text()
    with m.scratch():
        for what, argv, quick in m.CASES:
            assert f"| {what} |" in doc, f"{what!r} missing from docs/bad_input.md"
            if not quick:
                continue
            code, line = m.run_case(argv)
            assert code == 2 and line.startswith("tndebug: error: "), (what, code, line)
            assert m.row(what, argv, code, line) in doc, \
                f"docs/bad_input.md is stale for {what!r} (python docs/bad_input.py): {line}"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_library_section_says_what_each_bad_argument_gets():
    """Each library case is refused with a UsageError, and the document quotes its line."""
    m = _cases_module()
    doc = (DOCS / "bad_input.md").read_text()
    assert "## The library: `tndebug.watch` and `tndebug.check`" in doc
    with m.scratch():
        for what, call, quick in m.LIBRARY_CASES:
            assert f"| {what} |" in doc, f"{what!r} missing from docs/bad_input.md"
            if not quick:
                continue
            line = m.run_library_case(call)
            assert line.startswith("UsageError: ") and "\n" not in line, (what, line)
            assert m.library_row(what, call, line) in doc, \
                f"docs/bad_input.md is stale for {what!r} (python docs/bad_input.py): {line}"


def test_the_readme_links_it():
    readme = (DOCS.parent / "README.md").read_text()
    assert "(docs/bad_input.md)" in readme
