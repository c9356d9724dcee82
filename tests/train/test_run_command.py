"""`tndebug run` (tndebug/commands/run.py): files, exit codes, one-line errors, resume."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tndebug.cli import main

TINY = ["run", "--preset", "tiny", "--probe", "none", "--batch-size", "16"]


def test_tiny_run_writes_checkpoint_and_report(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(TINY + ["--steps", "5", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    run = report["run"]
    assert run["task"] == "copy" and run["preset"] == "tiny" and run["norm"] == "pre"
    assert run["steps"] == 5 and run["stopped_at_step"] == 5 and run["status"] == "completed"
    # --device auto: CUDA where there is one, else the CPU
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert run["device"].split(":")[0] == want, run["device"]
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["global_step"] == 5


def test_zero_steps_is_unchecked_not_clean(tmp_path, capsys, monkeypatch):
    """Issue 12: `--steps 0` checks the model at setup, but the probes that need training
    observe nothing: the verdict is UNCHECKED (exit 4: not everything that applies was
    checked), and the console says which."""
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "run"
    probes = "mask-broadcast,gradient-flow,loss-health,lr-schedule"
    assert main(["run", "--preset", "tiny", "--probe", probes, "--steps", "0", "--out", str(out)]) == 4
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "unchecked"
    assert report["probes"]["mask-broadcast"]["status"] == "pass"          # its setup tests ran
    for name in ("gradient-flow", "loss-health", "lr-schedule"):
        assert report["probes"][name]["status"] == "no verdict", name
        assert report["probes"][name]["steps_observed"] == 0
    text = "".join(capsys.readouterr())
    assert "verdict: UNCHECKED" in text and "CLEAN" not in text
    assert "probes passed (1): mask-broadcast" in text
    assert "NO VERDICT loss-health" in text and "never observed a training step" in text
    assert "> **Unchecked:**" in (out / "report.md").read_text()


def test_resume_through_the_cli(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(TINY + ["--steps", "3", "--out", str(out), "--task", "reverse"]) == 0
    assert main(["run", "--resume", str(out), "--steps", "2", "--probe", "none"]) == 0
    run = json.loads((out / "report.json").read_text())["run"]
    assert run["task"] == "reverse" and run["resumed_from_step"] == 3 and run["stopped_at_step"] == 5
    assert main(["run", "--resume", str(out), "--task", "copy", "--steps", "1"]) == 2
    assert "conflicts with the checkpoint" in capsys.readouterr().err


def test_a_healthy_resumed_run_trains_its_own_parameters_and_is_clean(tmp_path, capsys):
    """Issue 44: the CLI's check that the checkpoint fits (a load with assign=True on the meta
    device) had left its switch in the state dict, so the run's own load swapped new Parameters
    into the model, away from the optimizer's: nothing trained, .grad summed over the steps and
    zero-grad said "at step 1 ... zero_grad() is not called". The resumed run continues the
    uninterrupted one and has no finding."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    flags = ["run", "--preset", "tiny", "--batch-size", "16", "--probe", "zero-grad,lr-schedule"]
    assert main(flags + ["--steps", "8", "--out", str(whole)]) == 0
    assert main(flags + ["--steps", "4", "--out", str(out)]) == 0
    start = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    assert main(["run", "--resume", str(out), "--steps", "4", "--probe", "zero-grad,lr-schedule"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["findings"] == [] and report["verdict"] == "clean"
    assert report["probes"]["zero-grad"]["status"] == "pass"
    a = torch.load(whole / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    # the weights moved, as far as the uninterrupted run's (not to the bit: a step the report
    # snapshots takes the explicit attention path, whose dropout draws differ from SDPA's)
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < moved / 3


@pytest.mark.parametrize("flags, message", [
    (["--fault", "no_such_fault"], "unknown fault 'no_such_fault'"),
    (["--fault", "no_scale,bogus"], "unknown fault 'bogus'"),
    (["--probe", "nan-scores,bogus"], "unknown probe 'bogus'"),
    (["--task", "parse"], "invalid choice"),
    (["--steps", "-1"], "argument --steps: -1: must be an integer >= 0"),
    (["--steps", "many"], "invalid int value"),
    (["--amp", "fp8"], "invalid choice"),
])
def test_bad_flags_exit_2_with_one_line(flags, message, tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "x")] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("tndebug: error:")


def test_missing_resume_is_a_usage_error(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path / "nowhere")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_bad_flag_in_a_real_process_has_no_traceback(tmp_path):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.run([sys.executable, "-m", "tndebug", "run", "--fault", "nope"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    for flag in ("--task", "--preset", "--norm", "--fault", "--probe", "--seed", "--steps",
                 "--batch-size", "--device", "--amp", "--out", "--resume", "--fail-on", "--format"):
        assert flag in text


# -- issue 12: flags, output places, SIGTERM, periodic checkpoints, help -----------------------
@pytest.mark.parametrize("flags, message", [
    (["--lr-factor", "nan"], "argument --lr-factor: nan: must be a finite number"),
    (["--lr-factor", "inf"], "argument --lr-factor: inf: must be a finite number"),
    (["--lr-factor", "0"], "argument --lr-factor: 0: must be a finite number > 0"),
    (["--lr-factor", "-1"], "argument --lr-factor: -1: must be a finite number > 0"),
    (["--nproc", "0"], "argument --nproc: 0: must be an integer >= 1"),
    (["--warmup", "-5"], "argument --warmup: -5: must be an integer >= 1"),
    (["--warmup", "0"], "argument --warmup: 0: must be an integer >= 1"),
    (["--batch-size", "0"], "argument --batch-size: 0: must be an integer >= 1"),
    (["--save-every", "-1"], "argument --save-every: -1: must be an integer >= 0"),
    (["--seed", "-1"], "argument --seed: -1: must be an integer >= 0"),
])
def test_numbers_that_make_no_sense_exit_2_with_one_line(flags, message, tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "x")] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_output_places_are_checked_before_training(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    for out, words in ((tmp_path / "f", "is a file, not a directory"),
                       (tmp_path / "f" / "run", "is a file, so no directory can be made under it")):
        assert main(TINY + ["--steps", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1 and "tndebug run:" not in err, err


def test_a_second_run_into_one_out_is_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(TINY + ["--steps", "2", "--out", str(out)]) == 0
    assert main(TINY + ["--steps", "2", "--out", str(out)]) == 2
    assert "already holds tndebug output" in capsys.readouterr().err
    assert main(TINY + ["--steps", "3", "--out", str(out), "--overwrite"]) == 0
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1        # one run in tb/
    assert json.loads((out / "report.json").read_text())["run"]["steps"] == 3
    assert not (out / ".tndebug.lock").exists()


def test_without_out_a_rerun_gets_a_fresh_numbered_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert main(TINY + ["--steps", "1"]) == 0
    assert (tmp_path / "runs/copy-tiny-pre/report.json").is_file()
    assert (tmp_path / "runs/copy-tiny-pre-2/report.json").is_file()
    assert "-> runs/copy-tiny-pre-2" in capsys.readouterr().err


def test_a_directory_in_use_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".tndebug.lock").write_text(f"pid={os.getppid()}\nhost={os.uname().nodename}\n")
    assert main(TINY + ["--steps", "1", "--out", str(out)]) == 2
    assert f"in use by another tndebug (pid {os.getppid()})" in capsys.readouterr().err


def test_periodic_checkpoints_are_atomic(tmp_path, capsys, monkeypatch):
    from tndebug.train import checkpoint as ckpt
    saved = []
    real = ckpt.save_checkpoint

    def spy(path, state):
        saved.append((state["global_step"], state["status"]))
        return real(path, state)

    monkeypatch.setattr(ckpt, "save_checkpoint", spy)
    out = tmp_path / "run"
    assert main(TINY + ["--steps", "5", "--save-every", "2", "--out", str(out)]) == 0
    assert saved == [(2, "running"), (4, "running"), (5, "completed")]
    assert [p.name for p in out.glob("checkpoint.pt*")] == ["checkpoint.pt"]   # no .tmp left


def test_sigterm_writes_checkpoint_report_and_events_and_exits_143(tmp_path):
    import signal
    import time
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    p = subprocess.Popen([sys.executable, "-m", "tndebug", "run", "--preset", "tiny", "--probe",
                          "loss-health", "--batch-size", "8", "--steps", "100000", "--save-every",
                          "0", "--out", str(out)], stderr=subprocess.PIPE, text=True, env=env)
    import threading
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stderr.readline, "")), daemon=True)
    reader.start()                  # the first progress line says the first step is done: the
    try:                            # loop owns SIGTERM from then (a fixed sleep was flaky under load)
        deadline = time.time() + 120
        while not any(ln.startswith("training: step") for ln in lines) and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)                           # some training steps
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
        reader.join(timeout=30)
        err = "".join(lines)
    finally:
        p.kill()
    assert p.returncode == 143, err
    assert "tndebug: terminated (SIGTERM) at step" in err and "Traceback" not in err
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["status"] == "interrupted"
    step = report["run"]["stopped_at_step"]
    assert step > 0 and torch.load(out / "checkpoint.pt", weights_only=True)["global_step"] == step
    assert (out / "report.md").is_file() and not (out / ".tndebug.lock").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (events,) = (out / "tb").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert acc.Scalars("train/loss"), "no flushed training events"


def test_resume_errors_say_what_is_wrong(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(TINY + ["--steps", "1", "--out", str(out)]) == 0
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    key = next(iter(state["model"]))
    state["model"][key] = torch.zeros(3, 3)
    (tmp_path / "bad").mkdir()
    torch.save(state, tmp_path / "bad" / "checkpoint.pt")
    torch.save({"format": "tndebug.checkpoint/1", "x": print}, tmp_path / "unsafe.pt")
    (tmp_path / "text.pt").write_text("just text\n")
    capsys.readouterr()
    for path, words in ((tmp_path / "bad", f"size mismatch for {key}: copying a param with shape"),
                        (tmp_path / "unsafe.pt", "holds pickled code (builtins.print)"),
                        (tmp_path / "text.pt", "neither a zip archive (torch.save) nor a pickle")):
        assert main(["run", "--resume", str(path), "--steps", "1", "--probe", "none"]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert words in line and "weights_only=False" not in line, line


def test_help_reads_right_at_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    texts = {}
    for argv in (["--help"], ["run", "--help"], ["triage", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        texts[argv[0]] = capsys.readouterr().out
    for name, text in texts.items():
        assert "3 internal error" in text, name
        long = [ln for ln in text.splitlines() if len(ln) > 80]
        assert not long, (name, long)
    assert "{error,warning,info,never}" in texts["run"] and "--overwrite" in texts["run"]
    assert "143 terminated" in texts["run"] and "--save-every" in texts["run"]
    lines = texts["triage"].splitlines()
    for flag in ("--pad-id", "--bos-id", "--format", "--fail-on"):   # each has a help text
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(flag))
        assert len(lines[i].split()) > 2 or lines[i + 1].startswith(" " * 20), (flag, lines[i])


def test_probes_listing_reads_right(capsys):
    assert main(["probes"]) == 0
    text = capsys.readouterr().out
    assert "runs never" not in text and "every 1 steps" not in text
    assert "(at setup only)" in text and "(runs every step)" in text


# -- issue 14: --threads -----------------------------------------------------------------------
def test_threads_apply_to_the_run_and_are_restored(tmp_path, capsys, monkeypatch):
    import tndebug.train
    seen, real = [], tndebug.train.run_training

    def spy(*args, **kw):
        seen.append(torch.get_num_threads())
        return real(*args, **kw)

    monkeypatch.setattr(tndebug.train, "run_training", spy)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)       # 3 threads are taken on any machine
    before = torch.get_num_threads()
    assert main(TINY + ["--steps", "1", "--threads", "3", "--out", str(tmp_path / "r")]) == 0
    assert seen == [3] and torch.get_num_threads() == before
    assert main(TINY + ["--steps", "1", "--out", str(tmp_path / "d")]) == 0
    assert seen[-1] == 1                                  # the default: one thread
    assert main(["run", "--threads", "0", "--out", str(tmp_path / "x")]) == 2
    assert "argument --threads: 0: must be an integer >= 1" in capsys.readouterr().err
