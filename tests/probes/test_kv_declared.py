"""Issue 45: a KV cache the adapter does not reach is not "not applicable". A model whose
forward takes a cache argument (or holds a cache module) but whose adapter offers no
incremental call gets the cache test as a part not run: the verdict is INCOMPLETE with the
reason, never CLEAN; a model with no cache at all keeps "not applicable"."""
from __future__ import annotations

import torch

import tndebug
from pe_gpts import PosGPT, forward


class CachedGPT(PosGPT):
    """A GPT whose forward can use a KV cache (kv_cache=) that the probes' adapter never passes."""

    def forward(self, idx, kv_cache=None):
        return super().forward(idx)


def _kv(report):
    return report.probes["lm-decoding"]["coverage"]["kv cache"]


def test_a_cache_the_adapter_does_not_reach_is_not_checked():
    torch.manual_seed(0)
    report = tndebug.check(CachedGPT("learned"), forward, arch="decoder")
    assert _kv(report)["status"] == "no verdict" and "kv_cache=" in _kv(report)["reason"]
    assert report.verdict == "incomplete" and report.exit_code() == 4
    assert "KV cache" in report.incomplete()["lm-decoding"]


def test_a_model_with_no_cache_keeps_not_applicable():
    torch.manual_seed(0)
    report = tndebug.check(PosGPT("learned"), forward, arch="decoder")
    assert _kv(report)["status"] == "not applicable"
    assert report.verdict == "clean", report.incomplete()
