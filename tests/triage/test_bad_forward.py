"""What the user's code returns is checked at the front door (issue 47): a forward must return
floating logits of the model's vocabulary; a model on the meta device has no weights; --adapter
on one of tndebug's own layouts (no --model) is refused, not ignored."""
from __future__ import annotations

import pytest
import torch

from conftest import ZOO, assert_bad_input, zoo, zoo_spec

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _seq2seq(tmp_path, body: str):
    """The zoo's nn.Transformer model saved, and an adapter FILE.py:forward doing `body` to its
    logits `y`."""
    (tmp_path / "seq.py").write_text((ZOO / "torch_seq2seq.py").read_text())
    (tmp_path / "adapter.py").write_text(
        "from seq import forward as f\n"
        "def forward(model, src, tgt, pad_id):\n"
        f"    y = f(model, src, tgt, pad_id)\n    return {body}\n")
    torch.save({"model": zoo("torch_seq2seq").build().state_dict()}, tmp_path / "t.pt")
    return [tmp_path / "t.pt", "--model", zoo_spec("torch_seq2seq", "build"),
            "--adapter", f"{tmp_path}/adapter.py:forward"]


def test_an_adapter_returning_integer_logits_is_refused(capsys, tmp_path):
    assert_bad_input(_seq2seq(tmp_path, "y.long()"), capsys, tmp_path,
                     'returned int64 "logits"')


def test_an_adapter_returning_logits_over_fewer_ids_is_refused(capsys, tmp_path):
    assert_bad_input(_seq2seq(tmp_path, "y[..., :-3]"), capsys, tmp_path,
                     "returns logits over 8 ids, but the model's token embedding has 11 rows")


def test_a_factory_building_on_the_meta_device_is_refused(capsys, tmp_path):
    (tmp_path / "seq.py").write_text((ZOO / "torch_seq2seq.py").read_text())
    (tmp_path / "meta.py").write_text(
        "import torch\nimport seq\n"
        "def build(**kw):\n    with torch.device('meta'):\n        return seq.build(**kw)\n")
    torch.save({"model": zoo("torch_seq2seq").build().state_dict()}, tmp_path / "t.pt")
    assert_bad_input([tmp_path / "t.pt", "--model", f"{tmp_path}/meta.py:build",
                      "--adapter", zoo_spec("torch_seq2seq", "forward")], capsys, tmp_path,
                     "has no weights (meta device")


def test_an_adapter_without_model_on_a_tndebug_layout_is_refused(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    assert_bad_input([path, "--adapter", zoo_spec("torch_seq2seq", "forward")], capsys, tmp_path,
                     "applies with --model (your own code)")
