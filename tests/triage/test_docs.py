"""The adapter examples in docs/triage.md run as written."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tndebug.cli import main
from tndebug.probes.base import DECODER_ONLY

from conftest import ZOO

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
DOC = Path(__file__).resolve().parents[2] / "docs" / "triage.md"


def doc_files() -> dict[str, str]:
    """`<!-- file: NAME -->` followed by a ```python block."""
    text = DOC.read_text()
    return dict(re.findall(r"<!-- file: (\S+) -->\s*```python\n(.*?)```", text, re.S))


def triage_cli(tmp_path, capsys, *argv):
    code = main(["triage", *map(str, argv), "--out", str(tmp_path / "out"), "--format", "json",
                 "--overwrite"])      # called twice per test: the second replaces the first
    err = capsys.readouterr().err
    return code, err, json.loads((tmp_path / "out" / "report.json").read_text())


def test_translator_example(tmp_path, capsys, monkeypatch):
    (tmp_path / "translator.py").write_text(doc_files()["translator.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    import translator
    torch.manual_seed(0)
    model = translator.make_model(d_model=32, nhead=4, dropout=0.0)
    torch.save({"model": model.state_dict(), "optimizer": torch.optim.Adam(model.parameters()).state_dict(),
                "step": 0, "config": {"d_model": 32, "nhead": 4, "dropout": 0.0}}, tmp_path / "translator.pt")
    code, err, report = triage_cli(tmp_path, capsys, tmp_path / "translator.pt",
                                   "--model", f"{tmp_path}/translator.py:make_model",
                                   "--adapter", f"{tmp_path}/translator.py:forward", "--fail-on", "never")
    assert code == 0, err
    assert report["run"]["adapter"].endswith("translator.py:forward")
    assert "transformer.decoder.layers.0.multihead_attn" in report["run"]["attention_modules"]
    assert all(p["status"] not in ("skipped", "no verdict") or p.get("reason") == DECODER_ONLY
               for p in report["probes"].values()), report["probes"]    # every probe that applies ran


def test_tutorial_adapter_example(tmp_path, capsys):
    (tmp_path / "seq2seq_adapter.py").write_text(doc_files()["seq2seq_adapter.py"])
    shutil.copy(ZOO / "torch_seq2seq.py", tmp_path / "seq2seq.py")     # the tutorial's model
    import importlib.util
    spec = importlib.util.spec_from_file_location("seq2seq_doc", tmp_path / "seq2seq.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    cfg = {"num_encoder_layers": 2, "num_decoder_layers": 2, "emb_size": 32, "nhead": 4,
           "src_vocab_size": 11, "tgt_vocab_size": 11, "dim_feedforward": 64, "dropout": 0.0}
    torch.save(mod.Seq2SeqTransformer(**cfg).state_dict(), tmp_path / "tutorial.pt")
    code, err, report = triage_cli(tmp_path, capsys, tmp_path / "tutorial.pt",
                                   "--model", f"{tmp_path}/seq2seq_adapter.py:build",
                                   "--adapter", f"{tmp_path}/seq2seq_adapter.py:forward",
                                   "--config", json.dumps(cfg), "--fail-on", "error")
    assert code == 0, err
    flagged = {(f["probe"], f["severity"]) for f in report["findings"] if f["severity"] != "info"}
    assert flagged == set(), flagged                         # a healthy model, saved as a bare state_dict
    assert any(f["probe"] == "lr-schedule" and f["severity"] == "info"   # no resume state: advisory
               for f in report["findings"])
    # the same weights without the code, as the doc says
    code, err, report = triage_cli(tmp_path, capsys, tmp_path / "tutorial.pt", "--heads", "4",
                                   "--norm", "post", "--fail-on", "error")
    # loaded into tndebug's code, the untrained weights do not solve --task: the temperature
    # sweep cannot judge them, a part not run: INCOMPLETE (exit 4), nothing flagged
    assert code == 4, err
    assert {p for p, st in report["probes"].items() if st.get("not_run")} == {"missing-scale"}
    assert report["run"]["temperature_sweep"]["verdict"] == "inconclusive"
    assert report["run"]["layout"] == "torch" and report["run"]["emb_scale"] is True
