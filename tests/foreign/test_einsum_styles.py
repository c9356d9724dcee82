"""Issue 45: attention written with einsum in another axis order (sequence first, heads after
the positions) is traced: missing-scale and mask-broadcast reach a verdict, and each bug is
named by its own probe (before: missing-scale had no verdict, mask-broadcast read no module
and named the query-axis softmax only through a NaN)."""
from __future__ import annotations

import pytest
import torch

import tndebug
from einsum_gpt import STYLES, EinsumLM, forward

EXPECTED = {"no_scale": "missing-scale/absent", "no_causal": "mask-broadcast/causal-leak",
            "softmax_dim": "mask-broadcast/softmax-axis"}


def _check(style, bug=None):
    torch.manual_seed(0)
    return tndebug.check(EinsumLM(style, bug), forward, arch="decoder")


@pytest.mark.parametrize("style", STYLES)
def test_a_healthy_einsum_model_is_clean_and_fully_checked(style):
    report = _check(style)
    assert report.verdict == "clean", (report.findings, report.incomplete())
    for name in ("missing-scale", "mask-broadcast"):
        cov = report.probes[name].get("coverage", {})
        assert cov and all(c["status"] == "checked" for w, c in cov.items() if w), (name, cov)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("bug", list(EXPECTED))
def test_each_bug_is_named_by_its_probe(style, bug):
    report = _check(style, bug)
    errors = {f.code for f in report.findings if f.severity == "error"}
    assert EXPECTED[bug] in errors, (bug, errors)
    others = {c for c in errors if c.split("/")[0] != EXPECTED[bug].split("/")[0]}
    assert not others, (bug, others)                    # no collateral error from another probe
