"""The user's code exiting (issue 47): SystemExit from a --model factory, an adapter or the import
of the user's file is one line naming the file, exit 2; never a silent exit 0 with nothing said."""
from __future__ import annotations

import pytest
import torch

from tndebug.cli import main
from tndebug.config import ModelConfig
from tndebug.inject import make_model

GOOD = ("from tndebug.config import ModelConfig\nfrom tndebug.inject import make_model as mk\n"
        "def make_model(**kw):\n    return mk(ModelConfig.tiny())\n")
CASES = {
    "factory": ("import sys\ndef make_model(**kw):\n    sys.exit(0)\n",
                "mine.py called sys.exit(0) (line 3, in make_model())"),
    "import": ("import sys\nsys.exit(3)\ndef make_model(**kw):\n    pass\n",
               "mine.py called sys.exit(3) (line 2, at import)"),
    "message": ("def make_model(**kw):\n    raise SystemExit('bye')\n",
                "mine.py called sys.exit('bye') (line 2, in make_model())"),
}


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"model": make_model(ModelConfig.tiny()).state_dict()}, "model.pt")
    return "model.pt"


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_factory_or_import_that_exits_is_a_usage_error_naming_the_file(case, ckpt, tmp_path,
                                                                          capsys):
    code, words = CASES[case]
    (tmp_path / "mine.py").write_text(code)
    assert main(["triage", ckpt, "--model", "mine.py:make_model", "--out", "t"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"tndebug: error: {words}; tndebug runs that code"), err
    assert not (tmp_path / "t").exists()


def test_an_adapter_that_exits_is_a_usage_error_naming_the_file(ckpt, tmp_path, capsys):
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "adapt.py").write_text("def forward(model, src, tgt, pad_id):\n    exit(5)\n")
    assert main(["triage", ckpt, "--model", "good.py:make_model", "--adapter", "adapt.py:forward",
                 "--probe", "none", "--out", "t"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("tndebug: error: adapt.py called sys.exit(5) (line 2, in forward())"), err
    assert not (tmp_path / "t").exists()


def test_help_still_exits_zero(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0
