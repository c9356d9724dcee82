"""tndebug/outputs.py: the output-place rule, numbering, clearing and the lock (issue 12)."""
import os
import subprocess
import sys

import pytest

from tndebug import manifest, outputs
from tndebug.errors import UsageError


def _files(d, *names):
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).parent.mkdir(parents=True, exist_ok=True)
        (d / n).write_text("x")
    return d


def _run_in(d, *names):
    """`d` with `names` written by tndebug (its manifest lists those tndebug writes)."""
    _files(d, *names)
    manifest.write(d, {n for n in names if manifest.tndebug_name(n)})
    return d


def _tree(d):
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())


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
        assert _tree(d) == [outputs.LOCK, "figures/loss.png", "keep.txt"]   # loss.png: no tndebug name
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


# -- issue 47: tndebug deletes only what it wrote ------------------------------------------------
USERS = ("report.md", "data.csv", "figures/mine.png")


def test_a_users_own_report_md_is_not_tndebug_output_and_survives_overwrite(tmp_path):
    d = _files(tmp_path / "mine", *USERS)
    for overwrite in (False, True):
        with pytest.raises(UsageError, match=r"holds report.md, which tndebug did not write "
                                             r"and would write over \(nothing is removed\)"):
            outputs.resolve_output(str(d), "x", overwrite=overwrite, kind="run")
        with pytest.raises(UsageError):
            with outputs.claim_output(str(d), "x", overwrite=overwrite, kind="run"):
                pass
    assert _tree(d) == sorted(USERS)


def test_overwrite_removes_exactly_what_the_manifest_lists(tmp_path):
    d = _files(tmp_path / "run", "data.csv", "figures/mine.png")
    with outputs.claim_output(str(d), "x", overwrite=False, kind="run") as out:     # a run's files
        for n in ("report.json", "report.md", "checkpoint.pt", "figures/curves.png"):
            (out / n).write_text("x")
    assert manifest.read(d) == {"report.json", "report.md", "checkpoint.pt", "figures/curves.png"}
    with pytest.raises(UsageError, match=r"already holds tndebug output \(report.json, report.md, "
                                         r"checkpoint.pt\)"):
        outputs.resolve_output(str(d), "x", overwrite=False, kind="run")
    with outputs.claim_output(str(d), "x", overwrite=True, kind="run"):
        assert _tree(d) == [outputs.LOCK, "data.csv", "figures/mine.png"]
    assert _tree(d) == ["data.csv", "figures/mine.png"]


def test_a_manifest_cannot_make_tndebug_delete_a_users_file(tmp_path):
    d = _files(tmp_path / "run", "data.csv", "report.json")
    (d / manifest.MANIFEST).write_text('{"written": ["data.csv", "../x", "report.json"]}')
    (tmp_path / "x").write_text("x")
    with outputs.claim_output(str(d), "x", overwrite=True, kind="run"):
        pass
    assert _tree(d) == ["data.csv"] and (tmp_path / "x").exists()


def test_a_directory_from_before_the_manifest_is_recognised_by_its_files(tmp_path):
    d = _files(tmp_path / "old", "data.csv", "figures/mine.png", "figures/curves.png")
    (d / "report.json").write_text('{"schema": "tndebug.report/2", "run": {"figures": '
                                   '[{"file": "figures/curves.png"}]}}')
    (d / "report.md").write_text("# tndebug report: CLEAN\n")
    _files(d, "tb/events.out.tfevents.1.host")
    assert outputs.tndebug_outputs(d) == ["report.json", "report.md", "tb/"]
    assert manifest.ours(d) == {"report.json", "report.md", "figures/curves.png",
                                "tb/events.out.tfevents.1.host"}
    with outputs.claim_output(str(d), "x", overwrite=True, kind="run"):
        pass
    assert _tree(d) == ["data.csv", "figures/mine.png"]


def test_a_report_json_of_someone_else_is_not_tndebug_output(tmp_path):
    d = tmp_path / "other"
    d.mkdir()
    (d / "report.json").write_text('{"schema": "mytool/1"}')
    with pytest.raises(UsageError, match="holds report.json, which tndebug did not write"):
        outputs.resolve_output(str(d), "x", overwrite=True, kind="run")


def test_tensorboard_events_of_the_user_are_left_alone(tmp_path):
    d = tmp_path / "tbrun"
    (d / "tb").mkdir(parents=True)
    (d / "tb" / "events.out.tfevents.1.host").write_bytes(b"x" * 1000)     # holds data
    with pytest.raises(UsageError, match="holds tb/events.out.tfevents.1.host, which tndebug did not"):
        outputs.resolve_output(str(d), "x", overwrite=True, kind="run")
    # triage writes no tb/ over them (reporters/oneshot.py keeps them): no refusal
    assert outputs.resolve_output(str(d), "x", overwrite=False, kind="triage") == (d, False)


@pytest.mark.parametrize("out", ["", " ", "\t"])
def test_an_empty_out_is_refused(out, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="an empty path; pass a directory path"):
        outputs.resolve_output(out, "x", overwrite=False, kind="run")
    with pytest.raises(UsageError, match=r"^out='': an empty path"):
        outputs.resolve_output("", "x", overwrite=False, kind="run", names=outputs.LIBRARY)


def test_a_command_that_fails_before_its_first_step_removes_what_it_made(tmp_path):
    d = _files(tmp_path / "run", "data.csv")
    with pytest.raises(RuntimeError):
        with outputs.claim_output(str(d), "x", overwrite=False, kind="run") as out:
            (out / "tb").mkdir()
            (out / "tb" / "events.out.tfevents.2.host").write_bytes(b"x" * 500)
            manifest.record(out / "tb" / "events.out.tfevents.2.host")
            assert manifest.read(out) == {"tb/events.out.tfevents.2.host"}
            raise RuntimeError("allocation failed")
    assert _tree(d) == ["data.csv"] and not (d / "tb").exists()
    new = tmp_path / "new"
    with pytest.raises(RuntimeError):
        with outputs.claim_output(str(new), "x", overwrite=False, kind="run") as out:
            (out / "figures").mkdir()
            (out / "figures" / "depth.png").write_text("x")
            raise RuntimeError("boom")
    assert not new.exists()
    # a run that wrote its checkpoint keeps everything, listed
    with pytest.raises(RuntimeError):
        with outputs.claim_output(str(new), "x", overwrite=False, kind="run") as out:
            (out / "checkpoint.pt").write_text("x")
            (out / "report.md").write_text("x")
            raise RuntimeError("later")
    assert manifest.read(new) == {"checkpoint.pt", "report.md"}


TINY_RUN = ["run", "--preset", "tiny", "--probe", "none", "--batch-size", "8", "--steps", "1"]


def test_a_run_that_fails_at_its_start_leaves_no_tb_and_the_next_run_goes_in(tmp_path, monkeypatch,
                                                                             capsys):
    import tndebug.train
    from tndebug.cli import main
    d = _files(tmp_path / "mine", "data.csv", "figures/mine.png")
    real = tndebug.train.run_training

    def fails(*args, **kwargs):
        raise RuntimeError("could not allocate 8e12 bytes")
    monkeypatch.setattr(tndebug.train, "run_training", fails)
    assert main(TINY_RUN + ["--out", str(d)]) == 3
    assert _tree(d) == ["data.csv", "figures/mine.png"]
    monkeypatch.setattr(tndebug.train, "run_training", real)
    assert main(TINY_RUN + ["--out", str(d)]) == 0
    assert main(TINY_RUN + ["--out", str(d), "--overwrite"]) == 0
    assert "data.csv" in _tree(d) and "figures/mine.png" in _tree(d)
    assert len(list((d / "tb").glob("events.out.tfevents.*"))) == 1
    capsys.readouterr()


def test_the_cli_refuses_an_empty_out_and_a_users_report_md(tmp_path, monkeypatch, capsys):
    from tndebug.cli import main
    monkeypatch.chdir(tmp_path)
    for out in ("", " "):
        assert main(TINY_RUN + ["--out", out]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and "an empty path" in err and len(err.splitlines()) == 1, err
    assert not any(tmp_path.iterdir())                       # nothing written into the cwd
    d = _files(tmp_path / "mine", *USERS)
    for extra in ([], ["--overwrite"]):
        assert main(TINY_RUN + ["--out", "mine", *extra]) == 2
        assert "which tndebug did not write" in capsys.readouterr().err
    assert _tree(d) == sorted(USERS)
