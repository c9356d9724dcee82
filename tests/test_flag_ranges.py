"""Every number of `tndebug run` is range-checked by argparse, before any work (issue 47: a batch
of 1e12 and a seed of 2**70 were internal errors, 100000 threads a segfault), and triage's
--pad-id / --bos-id are checked against the model's vocabulary before any probe feeds them."""
from __future__ import annotations

import os

import pytest
import torch

from tndebug.cli import main
from tndebug.config import ModelConfig
from tndebug.inject import make_model

TOO_BIG = [
    (["--batch-size", "1000000000000"], "argument --batch-size: 1000000000000: must be at most 65536 ("),
    (["--threads", "100000"], f"argument --threads: 100000: must be at most {os.cpu_count()} ("),
    (["--seed", str(2**70)], f"argument --seed: {2**70}: must be at most {2**64 - 1} ("),
    (["--lr-factor", "1e300"], "argument --lr-factor: 1e300: must be at most 1000 ("),
    (["--steps", "10000000000"], "argument --steps: 10000000000: must be at most 1000000000 ("),
    (["--warmup", "10000000000"], "argument --warmup: 10000000000: must be at most 1000000000 ("),
    (["--nproc", "100"], "argument --nproc: 100: must be at most 64 ("),
]


@pytest.mark.parametrize("flags,words", TOO_BIG, ids=[f[0] for f, _ in TOO_BIG])
def test_a_number_above_its_bound_is_one_line_with_the_reason(flags, words, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", *flags, "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tndebug: error: {words}") and len(err.splitlines()) == 1, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("flags", [["--seed", str(2**64 - 1)], ["--threads", str(os.cpu_count())]])
def test_the_bound_itself_is_taken(flags, tmp_path, capsys):
    assert main(["run", "--preset", "tiny", "--probe", "none", "--steps", "1", "--batch-size", "8",
                 "--out", str(tmp_path / "r"), *flags]) == 0
    capsys.readouterr()


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"model": make_model(ModelConfig.tiny()).state_dict()}, "model.pt")
    (tmp_path / "mine.py").write_text(
        "from tndebug.config import ModelConfig\nfrom tndebug.inject import make_model as mk\n"
        "def make_model(**kw):\n    return mk(ModelConfig.tiny())\n")
    return "model.pt"


@pytest.mark.parametrize("flags,words", [
    (["--model", "mine.py:make_model", "--pad-id", "999999"], "--pad-id 999999"),
    (["--model", "mine.py:make_model", "--bos-id", "11"], "--bos-id 11"),
    (["--heads", "4", "--pad-id", "999999"], "--pad-id 999999"),
    (["--heads", "4", "--bos-id", "999999"], "--bos-id 999999"),
])
def test_triage_ids_outside_the_vocabulary_are_refused(flags, words, ckpt, tmp_path, capsys):
    assert main(["triage", ckpt, *flags, "--out", "t"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (f"tndebug: error: {words} is outside the model's vocabulary (ids 0..10); "
                      f"pass the id your data use"), err
    assert not (tmp_path / "t").exists()
