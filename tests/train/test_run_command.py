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
    assert run["device"] == "cpu" or torch.cuda.is_available()
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["global_step"] == 5


def test_zero_steps_is_unchecked_not_clean(tmp_path, capsys, monkeypatch):
    """Issue 12: `--steps 0` checks the model at setup, but the probes that need training
    observe nothing: the verdict is UNCHECKED (exit 0), and the console says which."""
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "run"
    probes = "mask-broadcast,gradient-flow,loss-health,lr-schedule"
    assert main(["run", "--preset", "tiny", "--probe", probes, "--steps", "0", "--out", str(out)]) == 0
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


@pytest.mark.parametrize("flags, message", [
    (["--fault", "no_such_fault"], "unknown fault 'no_such_fault'"),
    (["--fault", "no_scale,bogus"], "unknown fault 'bogus'"),
    (["--probe", "nan-scores,bogus"], "unknown probe 'bogus'"),
    (["--task", "parse"], "invalid choice"),
    (["--steps", "-1"], "--steps -1"),
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
