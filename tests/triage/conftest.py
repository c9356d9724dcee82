"""Fixtures for triage tests: the zoo models (user-style code, loaded by file path as a user's
would be) and small checkpoints written to tmp."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tndebug.capture.adapters import import_file

ZOO = Path(__file__).resolve().parents[1] / "zoo"
TINY = dict(N=2, d_model=32, d_ff=64, h=4, dropout=0.0)


def zoo(name: str):
    """A zoo module (tests/zoo/<name>.py), imported from its path."""
    return import_file(ZOO / f"{name}.py")


def zoo_spec(name: str, fn: str) -> str:
    return f"{ZOO / name}.py:{fn}"


@pytest.fixture
def annotated_ckpt(tmp_path):
    """Factory: an untrained annotated-style model saved with its config, optimizer and step."""
    def make(name="annotated.pt", **bugs):
        torch.manual_seed(0)
        m = zoo("annotated").make_model(11, 11, **TINY, **bugs)
        opt = torch.optim.Adam(m.parameters())
        m(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
          None, None).sum().backward()
        opt.step()
        path = tmp_path / name
        torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "step": 1,
                    "config": {"src_vocab": 11, "tgt_vocab": 11, **TINY, **bugs}}, path)
        return path, m
    return make


def run_triage_cli(argv, capsys):
    """`tndebug triage ARGV` in-process -> (exit code, stdout, stderr)."""
    from tndebug.cli import main
    code = main(["triage", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_bad_input(argv, capsys, tmp_path, words):
    """Bad input: exit 2, exactly one `tndebug: error:` line containing `words`, no traceback,
    nothing written to --out (the user's own code may print its warnings besides)."""
    out_dir = tmp_path / "out"
    code, _, err = run_triage_cli([*argv, "--out", out_dir], capsys)
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("tndebug:")]
    assert len(lines) == 1 and lines[0].startswith("tndebug: error: "), err
    assert "Traceback" not in err and words in lines[0], lines[0]
    assert not out_dir.exists()


# The parts that need the user's data: without it (or on data the checkpoint does not solve)
# they do not run, and the verdict is incomplete, not clean (Report.incomplete, issue 19).
DATA_PARTS = {"temperature sweep", "the untied-head test"}


def clean_but_for_data(report) -> bool:
    """Nothing at warning or above, every probe decided, and the verdict short of clean only
    because a part that needs the user's data did not run (`not_run`), which it must then name."""
    if any(f.severity in ("warning", "error") for f in report.findings):
        return False
    if any(st.get("status") == "no verdict" for st in report.probes.values()):
        return False
    unrun = {part for st in report.probes.values() for part in st.get("not_run", {})}
    return unrun <= DATA_PARTS and report.verdict == ("incomplete" if unrun else "clean")
