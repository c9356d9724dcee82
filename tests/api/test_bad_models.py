"""`tndebug.check` and `tndebug.watch` on models and forwards that are no place to start
(issue 47): one UsageError line, or a finding that blames the right part."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tndebug
from tndebug.config import ModelConfig
from tndebug.errors import UsageError
from tndebug.inject import make_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _tiny():
    torch.manual_seed(0)
    return make_model(ModelConfig.tiny())


def test_a_meta_device_model_is_said_to_have_no_weights():
    with torch.device("meta"):
        model = make_model(ModelConfig.tiny())
    with pytest.raises(UsageError, match=r"has no weights \(meta device: .*load or materialise"):
        tndebug.check(model)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(11, 16), nn.Linear(16, 16), nn.Linear(16, 11)

    def forward(self, src, tgt):
        return self.head(torch.relu(self.body(self.emb(tgt))))


class Lstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(11, 16), nn.LSTM(16, 16, batch_first=True), nn.Linear(16, 11)

    def forward(self, src, tgt):
        return self.head(self.rnn(self.emb(tgt))[0])


@pytest.mark.parametrize("cls", [Mlp, Lstm])
def test_a_model_without_attention_says_what_tndebug_covers(cls):
    with pytest.raises(UsageError) as e:
        tndebug.check(cls(), lambda m, s, t, p: m(s, t))
    msg = str(e.value)
    assert "found no attention in" in msg and "\n" not in msg
    assert "encoder-decoder, decoder-only and encoder-only" in msg
    assert "probes are for encoder-decoder Transformers" not in msg


def test_integer_logits_are_refused_by_check():
    with pytest.raises(UsageError, match='int64 "logits".*must return floating logits'):
        tndebug.check(_tiny(), lambda m, s, t, p: m(s, t).argmax(-1, keepdim=True).expand(-1, -1, 11))


def test_nan_logits_are_blamed_on_the_forward_not_the_loss():
    report = tndebug.check(_tiny(), lambda m, s, t, p: m(s, t) * float("nan"))
    codes = {f.code for f in report.findings if f.severity == "error"}
    assert "nan-scores/nonfinite-forward" in codes and "nan-scores/nonfinite-loss" not in codes
    f = next(f for f in report.findings if f.code == "nan-scores/nonfinite-forward")
    assert "the forward produced the NaN" in f.message and "not the loss computation" in f.message


def test_watch_refuses_the_optimizer_of_another_model():
    model, other = _tiny(), _tiny()
    opt = torch.optim.Adam(other.parameters())
    with pytest.raises(UsageError, match="the optimizer holds no parameter of the model"):
        tndebug.watch(model, opt)
    tndebug.watch(model, torch.optim.Adam(list(model.parameters())[:3]))   # a subset: fine-tuning


def test_ignore_of_no_codes_and_load_report_of_no_report_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="expected finding codes or probe names"):
        tndebug.check(_tiny(), ignore=3)
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "list.json").write_text("[1]")
    for name, words in (("data.csv", "is not a tndebug report.json"), ("missing.json", "no such file"),
                        ("list.json", "JSON but no tndebug report")):
        with pytest.raises(UsageError, match=words):
            tndebug.load_report(tmp_path / name)
