"""`triage --data`: the user's own held-out batches, as a .pt file or FILE.py:FUNCTION; every bad
input is one line, exit 2, nothing written."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from tndebug.cli import main
from tndebug.data import eval_set, get_task
from tndebug.errors import UsageError
from tndebug.triage import TriageOptions, triage
from tndebug.triage.userdata import load_data, to_batch

from conftest import assert_bad_input, run_triage_cli, zoo_spec

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def as_file_dict(batch) -> dict:
    """An eval_set batch in --data's format: tgt = BOS + target + EOS, right-padded."""
    return {"src": batch.src, "tgt": torch.cat([batch.tgt_in[:, :1], batch.tgt_out], 1)}


@pytest.fixture
def held_out(tmp_path):
    def make(name="held_out.pt", n=12, **override):
        data = {**as_file_dict(eval_set(get_task("copy"), n=n, seed=3)), **override}
        torch.save(data, tmp_path / name)
        return tmp_path / name
    return make


run, bad = run_triage_cli, assert_bad_input


def test_the_convention_matches_the_built_in_batches():
    """tgt_in = tgt[:, :-1] (pad where tgt_out is pad), tgt_out = tgt[:, 1:]: an eval_set batch
    written in --data's format loads back exactly."""
    for task in ("copy", "translate"):
        b = eval_set(get_task(task), n=40, seed=0)
        got = to_batch(as_file_dict(b), pad_id=0, bos_id=1, spec="x.pt")
        for mine, theirs in zip(got, b):
            assert torch.equal(mine, theirs)
        assert (b.tgt_out[:, -1] == 0).any(), "some rows are short, so the pad rule is exercised"


def test_pt_file_is_used_for_every_comparison(annotated_ckpt, held_out, tmp_path):
    path, _ = annotated_ckpt()
    data = held_out(n=20)
    report = triage(TriageOptions(str(path), data=str(data)))            # the layout path
    assert report.run["data"] == f"--data {data}" and report.run["task"] is None
    assert report.run["held_out_sequences"] == 20
    assert report.run["temperature_sweep"]["data"] == "--data"


def test_function_spec(annotated_ckpt, tmp_path):
    path, _ = annotated_ckpt()
    (tmp_path / "mydata.py").write_text(
        "import torch\n"
        "def held_out():\n"
        "    src = torch.randint(3, 11, (10, 7))\n"
        "    tgt = torch.cat([torch.ones(10, 1, dtype=torch.long), src, torch.full((10, 1), 2)], 1)\n"
        "    return {'src': src, 'tgt': tgt}\n")
    spec = f"{tmp_path / 'mydata.py'}:held_out"
    report = triage(TriageOptions(str(path), model=zoo_spec("annotated", "make_model"),
                                  adapter="annotated", data=spec))
    assert report.run["data"] == f"--data {spec}"
    sweep = report.run["temperature_sweep"]
    assert sweep["verdict"] == "not applicable" and "by construction" in sweep["reason"]
    assert not [f for f in report.findings if f.probe == "missing-scale" and f.severity != "info"]


def test_without_data_the_report_says_the_task_is_not_the_models(annotated_ckpt):
    path, _ = annotated_ckpt()
    report = triage(TriageOptions(str(path)))
    assert report.run["data"] == "task copy (built-in; not the model's own data)"
    assert report.run["task"] == "copy"


def test_cli_flag(annotated_ckpt, held_out, tmp_path, capsys):
    path, _ = annotated_ckpt()
    code, out, err = run([path, "--data", held_out(), "--out", tmp_path / "o", "--format", "json",
                          "--fail-on", "never"], capsys)
    assert code == 0, err
    assert json.loads(out)["run"]["data"].startswith("--data ")
    with pytest.raises(SystemExit):
        main(["triage", "--help"])
    assert "--data FILE.pt|FILE.py:FUNCTION" in capsys.readouterr().out


# -- bad input ---------------------------------------------------------------------------------
def test_missing_file(annotated_ckpt, tmp_path, capsys):
    path, _ = annotated_ckpt()
    bad([path, "--data", tmp_path / "nope.pt"], capsys, tmp_path, "--data: no such file")


@pytest.mark.parametrize("data, words", [
    ({"source": torch.zeros(2, 3, dtype=torch.long)}, "no 'src' and no 'tgt' key (keys: source)"),
    ({"src": torch.zeros(2, 3, dtype=torch.long)}, "no 'tgt' key"),
    ([1, 2], "expected {'src'"),
    ({"src": torch.rand(4, 5), "tgt": torch.ones(4, 6, dtype=torch.long)}, "'src' holds float32"),
    ({"src": torch.ones(4, 5, dtype=torch.long), "tgt": torch.ones(4, 6, dtype=torch.bool)}, "'tgt' holds bool"),
    ({"src": torch.ones(4, 5, dtype=torch.long), "tgt": torch.ones(3, 6, dtype=torch.long)},
     "src has 4 sequences but tgt has 3"),
    ({"src": torch.ones(4, 5, 2, dtype=torch.long), "tgt": torch.ones(4, 6, dtype=torch.long)}, "expected [N, length]"),
    ({"src": [[3, 4]], "tgt": torch.ones(1, 6, dtype=torch.long)}, "'src' is a list, not a tensor"),
    ({"src": torch.full((4, 5), 3), "tgt": torch.full((4, 6), 3)}, "tgt must start with BOS (--bos-id 1)"),
    ({"src": torch.full((4, 5), -1), "tgt": torch.ones(4, 6, dtype=torch.long)}, "negative token id -1"),
    ({"src": torch.full((1, 5), 3), "tgt": torch.ones(1, 6, dtype=torch.long)}, "at least 2 sequences"),
])
def test_bad_contents(annotated_ckpt, tmp_path, capsys, data, words):
    path, _ = annotated_ckpt()
    torch.save(data, tmp_path / "d.pt")
    bad([path, "--data", tmp_path / "d.pt"], capsys, tmp_path, words)


@pytest.mark.parametrize("with_model", [False, True])
def test_ids_outside_the_vocabulary(annotated_ckpt, held_out, tmp_path, capsys, with_model):
    path, _ = annotated_ckpt()                            # vocabularies of 11
    src = torch.full((4, 5), 3)
    src[2, 1] = 40
    data = held_out(src=src, tgt=torch.cat([torch.ones(4, 1, dtype=torch.long), src], 1))
    model = ["--model", zoo_spec("annotated", "make_model"), "--adapter", "annotated"] if with_model else []
    bad([path, "--data", data, *model], capsys, tmp_path, "token id 40, outside the model's")


def test_unsafe_pickle(annotated_ckpt, tmp_path, capsys):
    path, _ = annotated_ckpt()
    torch.save({"src": torch.ones(2, 3, dtype=torch.long), "tgt": torch.ones(2, 3, dtype=torch.long),
                "meta": argparse.Namespace(a=1)}, tmp_path / "d.pt")
    bad([path, "--data", tmp_path / "d.pt"], capsys, tmp_path, "holds pickled objects other than tensors")


def test_not_a_torch_file(annotated_ckpt, tmp_path, capsys):
    path, _ = annotated_ckpt()
    (tmp_path / "d.pt").write_text("src,tgt\n1,2\n")
    bad([path, "--data", tmp_path / "d.pt"], capsys, tmp_path, "not a torch.save file")


@pytest.mark.parametrize("body, spec_fn, words", [
    ("def held_out():\n    raise RuntimeError('no dataset here')\n", "held_out",
     "raised RuntimeError: no dataset here"),
    ("def held_out():\n    return None\n", "held_out", "expected {'src'"),
    ("def other():\n    return {}\n", "held_out", "defines no function 'held_out'"),
])
def test_bad_function(annotated_ckpt, tmp_path, capsys, body, spec_fn, words):
    path, _ = annotated_ckpt()
    (tmp_path / "mydata.py").write_text(body)
    bad([path, "--data", f"{tmp_path / 'mydata.py'}:{spec_fn}"], capsys, tmp_path, words)


def test_load_data_caps_the_sequences(tmp_path):
    b = eval_set(get_task("copy"), n=100, seed=0)
    torch.save(as_file_dict(b), tmp_path / "d.pt")
    got = load_data(str(tmp_path / "d.pt"), 0, 1)
    assert got.src.shape[0] == 64
    with pytest.raises(UsageError, match="no such file"):
        load_data(str(tmp_path / "missing.py:fn"), 0, 1)
