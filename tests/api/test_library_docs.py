"""docs/library.md: every example file in it runs as written, and does what the page says."""
from __future__ import annotations

import os
import re
import runpy
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "library.md"


def examples() -> dict[str, str]:
    """`# name.py` first line -> the code block."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    return {m.group(1): b for b in blocks if (m := re.match(r"# (\w+\.py)\n", b))}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name, code in examples().items():
        (tmp_path / name).write_text(code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("mymodel", None)


def test_the_page_has_an_example_per_entry_point():
    assert set(examples()) == {"mymodel.py", "train_plain.py", "train_hf.py", "train_lightning.py",
                               "check_model.py", "test_mymodel.py", "notebook.py", "train_fsdp.py"}


def test_plain_loop_and_check(workdir, capsys):
    runpy.run_path("train_plain.py", run_name="__main__")
    assert capsys.readouterr().out.strip().splitlines()[-1] == "clean 0"
    assert (workdir / "runs" / "mine" / "report.json").is_file()
    table = runpy.run_path("notebook.py", run_name="__main__")["table"]     # the run's numbers
    assert table.shape == (2, 4) and table.notna().all().all()               # layers x heads
    assert (workdir / "entropy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runpy.run_path("check_model.py", run_name="__main__")
    assert capsys.readouterr().out.strip().splitlines()[-1] == "clean []"


def test_hf_trainer_example(workdir, capsys):
    pytest.importorskip("accelerate")
    runpy.run_path("train_hf.py", run_name="__main__")
    assert capsys.readouterr().out.strip().splitlines()[-1] == "clean 0"
    assert (workdir / "runs" / "bart" / "tndebug" / "report.md").is_file()


def test_lightning_example(workdir, capsys):
    pytest.importorskip("pytorch_lightning")
    runpy.run_path("train_lightning.py", run_name="__main__")
    assert capsys.readouterr().out.strip().splitlines()[-1] == "clean 0"


def test_pytest_example(workdir, pytester):
    pytester.makepyfile(mymodel=examples()["mymodel.py"], test_mymodel=examples()["test_mymodel.py"])
    pytester.runpytest("-q", "-p", "no:cacheprovider").assert_outcomes(passed=2)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_example_on_two_processes(workdir):
    """train_fsdp.py under torchrun: rank 0 prints the verdict, writes the one report; rank 1
    says on stderr that it writes none."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ddp_launch import ROOT, torchrun
    path = [str(workdir), *filter(None, [os.environ.get("PYTHONPATH")]), str(ROOT)]   # mymodel
    proc = torchrun(workdir / "train_fsdp.py", [], env={"PYTHONPATH": os.pathsep.join(path)},
                    before_retry=lambda: __import__("shutil").rmtree(workdir / "runs", ignore_errors=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "clean fsdp2 2"
    assert (workdir / "runs" / "fsdp" / "report.json").is_file()
    assert proc.stderr.count("rank 1 of 2: no report here") == 1
