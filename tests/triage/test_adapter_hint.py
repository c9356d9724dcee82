"""Issue 45: when the adapter tndebug chose raises inside the user's code, the one error line
shows the `--adapter FILE.py:forward` line to write; with that adapter the model is triaged."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_bad_input, run_triage_cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
HERE = Path(__file__).parent


def _checkpoint(tmp_path):
    shutil.copy(HERE / "annotated_names_pkg.py", tmp_path / "pkg.py")
    import importlib.util
    spec = importlib.util.spec_from_file_location("pkg_hint", tmp_path / "pkg.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    torch.save(mod.build().state_dict(), tmp_path / "ck.pt")
    return tmp_path / "ck.pt", tmp_path / "pkg.py"


def test_a_guessed_adapter_that_raises_names_the_adapter_line_to_write(tmp_path, capsys):
    ck, pkg = _checkpoint(tmp_path)
    assert_bad_input([ck, "--model", f"{pkg}:build"], capsys, tmp_path,
                     "pass --adapter FILE.py:forward, e.g. `def forward(model, src, tgt, pad_id): "
                     "return model(src, tgt)`")


def test_with_that_adapter_the_model_is_triaged(tmp_path, capsys):
    ck, pkg = _checkpoint(tmp_path)
    (tmp_path / "fwd.py").write_text("def forward(model, src, tgt, pad_id):\n"
                                     "    return model(src, tgt)\n")
    code, out, err = run_triage_cli([ck, "--model", f"{pkg}:build", "--adapter",
                                     f"{tmp_path / 'fwd.py'}:forward", "--out", tmp_path / "o"], capsys)
    assert code in (0, 1, 4) and "tndebug: error" not in err, err
    assert (tmp_path / "o" / "report.json").exists()
