"""`arch=` of tndebug.check and tndebug.watch: a one-input model of the user's own is called as
a GPT and as a BERT alike (forward(model, ids, pad_id)), so the user says which; without it the
class name is a hint (MiniBert: encoder) and run.arch_from says how the shape was read."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import tndebug
from tndebug.errors import UsageError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "foreign"))
import minibert  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _net():
    torch.manual_seed(0)
    return minibert.build_net()                     # the BERT-style model, named Net


def test_a_bidirectional_model_told_encoder_is_checked_as_one():
    report = tndebug.check(_net(), arch="encoder")
    assert report.run["arch"] == "encoder" and report.run["arch_from"] == "arch='encoder'"
    assert report.probes["mask-broadcast"]["status"] == "pass"
    assert not [f for f in report.findings if f.severity in ("warning", "error")]
    own = tndebug.check(_net(), forward=lambda model, ids, pad_id: model(ids), arch="encoder")
    assert own.run["arch"] == "encoder" and own.probes["mask-broadcast"]["status"] == "pass"


def test_without_arch_the_name_decides_and_the_report_says_so():
    guessed = tndebug.check(_net())
    assert guessed.run["arch"] == "decoder" and "arch='encoder'" in guessed.run["arch_from"]
    (leak,) = [f for f in guessed.findings if f.code == "mask-broadcast/causal-leak"]
    # the judge's rule (judge/arch.py), in check as in triage: the fix says how to read an
    # encoder-only model as one (it ended at the causal mask's fix in check and watch before)
    assert leak.severity == "error" and leak.fix.endswith(
        "rerun with --arch encoder (arch='encoder' in tndebug.check and tndebug.watch).")
    told = tndebug.check(_net(), arch="decoder")
    (leak,) = [f for f in told.findings if f.code == "mask-broadcast/causal-leak"]
    assert "--arch encoder" not in leak.fix                        # told: no second guess
    torch.manual_seed(0)
    named = tndebug.check(minibert.build())
    assert named.run["arch"] == "encoder" and "class name MiniBert" in named.run["arch_from"]


@pytest.mark.parametrize("kw, words", [
    (dict(arch="bidi"), "arch='bidi'; expected one of seq2seq, decoder, encoder"),
    (dict(arch="seq2seq"), "arch='seq2seq', but Net takes one input"),
    (dict(forward=lambda model, src, tgt, pad_id: model(src), arch="encoder"),
     "arch='encoder' does not fit forward=<lambda>"),
])
def test_an_arch_that_does_not_fit_is_one_line(kw, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace("[", r"\[")) as e:
        tndebug.check(_net(), **kw)
    assert "\n" not in str(e.value)


def test_watch_takes_arch():
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tndebug.watch(model, opt, arch="encoder", quiet=True, probes="mask-broadcast") as dbg:
        for _ in range(2):
            ids = torch.randint(3, 11, (4, 8))
            loss = model(ids).logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert dbg.report.run["arch"] == "encoder" and dbg.report.run["arch_from"] == "arch='encoder'"
