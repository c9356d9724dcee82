"""Issue 45: the two real tracker bugs the held-out set still missed, now named: a Pre-LN
residual overwritten with the normalised input in code with no sublayer modules (ln-placement's
residual-normalised, read off the adds by tensor identity), and a sinusoidal PE whose exponent
was truncated to 0 by integer division (positional-encoding's pe-one-frequency)."""
from __future__ import annotations

import pytest
import torch

import tndebug
from bugs import BUGS, build
from inline_preln import Seq2Seq, forward as inline_forward
from model import forward

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _alarms(report):
    return {(f.code, f.severity) for f in report.findings if f.severity in ("warning", "error")}


@pytest.mark.parametrize("bug", [False, True])
def test_an_inline_pre_ln_residual_of_the_normalised_input_is_named(bug):
    torch.manual_seed(0)
    report = tndebug.check(Seq2Seq(bug=bug), inline_forward)
    if bug:
        assert _alarms(report) == {("ln-placement/residual-normalised", "error")}, report.findings
        f = next(f for f in report.findings if f.code == "ln-placement/residual-normalised")
        assert f.where == "enc.0.attn" and "norm1" in f.evidence["norms"][0]
    else:
        assert _alarms(report) == set() and report.verdict == "clean", report.findings
        assert report.probes["ln-placement"]["coverage"]["enc.0.attn"]["status"] == "checked"


def test_an_integer_division_in_the_pe_exponent_is_named():
    report = tndebug.check(build(BUGS["pe_integer_division"], 0), forward, pad_id=0, bos_id=1)
    assert _alarms(report) == {("positional-encoding/pe-one-frequency", "warning")}, report.findings
    f = next(f for f in report.findings if f.code == "positional-encoding/pe-one-frequency")
    assert f.evidence["rank"] == 2 and f.evidence["d_model"] == 32


def test_a_healthy_sinusoidal_table_spans_every_dimension():
    report = tndebug.check(build(None, 0), forward, pad_id=0, bos_id=1)
    assert not [f for f in report.findings if f.code == "positional-encoding/pe-one-frequency"]
