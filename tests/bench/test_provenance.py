"""bench/_provenance.py: a results file says at which commit it was measured, and whether the
code it ran had uncommitted changes (bench/results/ itself does not count)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str, file: str | None = None):
    if name not in sys.modules:                   # dataclasses look their module up there
        spec = importlib.util.spec_from_file_location(name, BENCH / (file or f"{name}.py"))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


P = _load("_provenance")


@pytest.fixture()
def repo(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    for rel in ("tndebug/a.py", "bench/x.py", "bench/results/x.json", "README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("1\n")
    git("add", ".")
    git("commit", "-q", "-m", "init")
    return tmp_path


def test_a_clean_tree_is_clean_and_results_or_docs_changes_do_not_count(repo):
    (repo / "bench/results/x.json").write_text("2\n")          # what the scripts write
    (repo / "README.md").write_text("2\n")                     # not code the run imports
    state = P.tree_state(repo)
    assert state["clean"] and state["dirty"] == [] and len(state["commit"]) == 40


def test_an_edited_or_untracked_code_file_makes_it_dirty_and_is_named(repo):
    (repo / "tndebug/a.py").write_text("2\n")
    (repo / "tndebug/new.py").write_text("x\n")
    state = P.tree_state(repo)
    assert not state["clean"] and state["dirty"] == ["tndebug/a.py", "tndebug/new.py"]


def test_the_block_records_command_machine_and_load_and_a_change_during_the_run(repo):
    prov = P.Provenance.start(repo / "bench/x.py", ["--steps", "3", "a b"], root=repo)
    block = prov.finish()
    assert block["clean"] and block["command"].endswith("x.py --steps 3 'a b'")
    assert block["machine"]["cpus"] and len(block["load_before"]) == len(block["load_after"]) == 3
    assert "code_changed_during_run" not in block
    (repo / "bench/x.py").write_text("2\n")                    # edited while it ran
    block = prov.finish()
    assert not block["clean"] and block["code_changed_during_run"]["dirty_at_end"] == ["bench/x.py"]
    line = P.provenance_line(block)
    assert "DIRTY tree" in line and "do not quote" in line


def test_every_bench_script_records_its_provenance():
    jobs = _load("_jobs")
    scripts = {c[0] for j in jobs.JOBS for c in j.commands if c[0].startswith("bench/")}
    assert scripts == {p.relative_to(BENCH.parent).as_posix() for p in BENCH.glob("[a-z]*.py")}
    for s in scripts:
        assert "Provenance.start(" in (BENCH.parent / s).read_text(), s


def test_the_runner_lists_every_job_with_its_files_and_time():
    sys.path.insert(0, str(BENCH))                # as `python -m bench` has it
    main = _load("bench_runner", "__main__.py")
    text = main.listing(list(main.JOBS), quick=False)
    for job in main.JOBS:
        assert job.name in text and all(w in text for w in job.writes)
    assert "total (without the GPU job): about" in text
    for job in main.JOBS:
        quick = main.commands(job, quick=True, out=Path("/scratch"))
        assert all("bench/results" not in a for cmd in quick for a in cmd), f"{job.name}: --quick must not overwrite results"
        assert any("/scratch" in a for cmd in quick for a in cmd), job.name
