"""Probe inputs that fit the model (issue 18): a user model whose learned position table is
short gets every exact test at a size it takes; data longer than the model takes is one clear
line (exit 2), not an internal IndexError; --max-len states the limit."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_bad_input, run_triage_cli, zoo, zoo_spec

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def short_table_ckpt(tmp_path):
    torch.manual_seed(0)
    model = zoo("sdpa_model").build(max_len=12)          # a position table of 12 rows
    path = tmp_path / "short.pt"
    torch.save({"model": model.state_dict(), "config": {"max_len": 12}}, path)
    return path


def triage_args(path):
    return [path, "--model", zoo_spec("sdpa_model", "build"),
            "--adapter", zoo_spec("sdpa_model", "forward")]


def test_every_exact_test_runs_on_a_table_that_just_fits(short_table_ckpt, tmp_path, capsys):
    code, _, err = run_triage_cli([*triage_args(short_table_ckpt), "--out", tmp_path / "o"], capsys)
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    for name in ("nan-scores", "missing-scale", "mask-broadcast"):
        assert report["probes"][name]["status"] == "pass", (name, report["probes"][name])
    assert report["verdict"] in ("clean", "incomplete") and code in (0, 4), err


def test_data_longer_than_the_table_is_one_line(short_table_ckpt, tmp_path, capsys):
    src = torch.randint(2, 11, (4, 20))
    tgt = torch.cat([torch.ones(4, 1, dtype=torch.long), src], 1)
    torch.save({"src": src, "tgt": tgt}, tmp_path / "long.pt")
    assert_bad_input([*triage_args(short_table_ckpt), "--data", tmp_path / "long.pt"], capsys,
                     tmp_path, "rows are 20 positions long and the model raises IndexError")


def test_max_len_states_the_limit(short_table_ckpt, tmp_path, capsys):
    src = torch.randint(2, 11, (4, 10))
    tgt = torch.cat([torch.ones(4, 1, dtype=torch.long), src], 1)
    torch.save({"src": src, "tgt": tgt}, tmp_path / "d.pt")
    assert_bad_input([*triage_args(short_table_ckpt), "--data", tmp_path / "d.pt", "--max-len", "8"],
                     capsys, tmp_path, "the model takes at most 8 (max_len 8")
