"""tndebug/outputs.py: the output-place rule, numbering, clearing and the lock (issue 12)."""
import os
import subprocess
import sys

import pytest

from tndebug import outputs
from tndebug.errors import UsageError


def _run_in(d, *names):
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).parent.mkdir(parents=True, exist_ok=True)
        (d / n).write_text("x")
    return d


def test_a_file_a_path_under_a_file_and_an_unwritable_parent_are_refused(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        outputs.resolve_output(str(tmp_path / "f"), "d", overwrite=False, kind="run")
    with pytest.raises(UsageError, match="is a file, so no directory can be made under it"):
        outputs.resolve_output(str(tmp_path / "f" / "x" / "y"), "d", overwrite=False, kind="run")
    monkeypatch.setattr(os, "access", lambda p, mode: False)   # root may write anywhere
    with pytest.raises(UsageError, match="is not writable"):
        outputs.resolve_output(str(tmp_path / "new"), "d", overwrite=False, kind="run")


def test_a_directory_with_tndebug_output_needs_overwrite(tmp_path):
    d = _run_in(tmp_path / "run", "report.json", "tb/events.out.tfevents.1.host")
    with pytest.raises(UsageError, match=r"already holds tndebug output \(report.json, tb/\); pass --overwrite"):
        outputs.resolve_output(str(d), "x", overwrite=False, kind="run")
    assert outputs.resolve_output(str(d), "x", overwrite=True, kind="run") == (d, True)
    other = _run_in(tmp_path / "mine", "notes.txt")            # not tndebug's: written into
    assert outputs.resolve_output(str(other), "x", overwrite=False, kind="run") == (other, False)
    # a resume continues in its own directory
    assert outputs.resolve_output(str(d), "x", overwrite=False, kind="run", continuing=d) == (d, False)


def test_without_out_a_fresh_numbered_directory(tmp_path):
    base = tmp_path / "runs" / "copy-tiny-pre"
    assert outputs.resolve_output(None, str(base), overwrite=False, kind="run") == (base, False)
    _run_in(base, "report.json")
    _run_in(tmp_path / "runs" / "copy-tiny-pre-2", "checkpoint.pt")
    d, clear = outputs.resolve_output(None, str(base), overwrite=False, kind="run")
    assert d == tmp_path / "runs" / "copy-tiny-pre-3" and not clear


def test_overwrite_clears_old_outputs_so_tb_holds_one_run(tmp_path):
    d = _run_in(tmp_path / "run", "report.json", "report.md", "checkpoint.pt", "figures/loss.png",
                "tb/events.out.tfevents.1.host", "keep.txt")
    with outputs.claim_output(str(d), "x", overwrite=True, kind="run"):
        assert sorted(p.name for p in d.rglob("*") if p.is_file()) == [outputs.LOCK, "keep.txt"]
    assert not (d / outputs.LOCK).exists()


def test_triage_overwrite_never_removes_a_checkpoint_or_tb(tmp_path):
    d = _run_in(tmp_path / "run", "report.json", "checkpoint.pt", "tb/events.out.tfevents.1.host")
    with outputs.claim_output(str(d), "x", overwrite=True, kind="triage"):
        pass
    assert (d / "checkpoint.pt").exists() and (d / "tb/events.out.tfevents.1.host").exists()
    assert not (d / "report.json").exists()


def test_a_live_lock_is_refused_and_a_stale_one_taken_over(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (d / outputs.LOCK).write_text(f"pid={sleeper.pid}\nhost={os.uname().nodename}\n")
        with pytest.raises(UsageError, match=f"in use by another tndebug \\(pid {sleeper.pid}\\)"):
            with outputs.claim_output(str(d), "x", overwrite=False, kind="run"):
                pass
    finally:
        sleeper.kill()
        sleeper.wait()
    # the process is gone: its lock is stale
    with outputs.claim_output(str(d), "x", overwrite=False, kind="run") as out:
        assert (out / outputs.LOCK).read_text().startswith(f"pid={os.getpid()}\n")
    assert not (d / outputs.LOCK).exists()


def test_a_locked_default_is_skipped_by_numbering(tmp_path):
    base = tmp_path / "triage-x"
    with outputs.claim_output(None, str(base), overwrite=False, kind="triage") as first:
        (first / "keep").write_text("x")
        d, _ = outputs.resolve_output(None, str(base), overwrite=False, kind="triage")
        assert first == base and d == tmp_path / "triage-x-2"


def test_a_refused_or_empty_claim_leaves_nothing(tmp_path):
    d = tmp_path / "new"
    with outputs.claim_output(str(d), "x", overwrite=False, kind="triage"):
        assert d.is_dir()
    assert not d.exists()


def test_triage_default_names_the_parent_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    assert outputs.triage_default("model.pt") == "triage-model"
    assert outputs.triage_default("a/checkpoint.pt") == "triage-a-checkpoint"
    assert outputs.triage_default(tmp_path / "runs" / "copy-small-pre" / "checkpoint.pt") \
        == "triage-copy-small-pre-checkpoint"
    assert outputs.triage_default("a") == "triage-a"                      # a directory
