"""Issue 44: the exact tests' tolerances follow the compute dtype (probes/_tolerance.py). A
healthy float16 or bfloat16 model gets the verdict it gets in float32 (before: "rows sum to
1.000..1.000, not 1: masked after softmax" on the docs' own model in half precision, and a
head-split error in bfloat16), and the mask bugs are still named in 16 bits."""
from __future__ import annotations

import pytest
import torch

import models as M
import tndebug
from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.probes._tolerance import EPS_MARGIN, computing_in, tol

DTYPES = (torch.float16, torch.bfloat16)


def _errors(report):
    return sorted({f.code for f in report.findings if f.severity == "error"})


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_a_healthy_16_bit_model_is_as_clean_as_in_float32(dtype):
    torch.manual_seed(0)
    model = M.TorchTransformer()
    fp32 = tndebug.check(model, M.torch_forward)
    low = tndebug.check(model.to(dtype), M.torch_forward)
    assert fp32.verdict == "clean", _errors(fp32)
    assert low.verdict == "clean" and _errors(low) == [], (dtype, _errors(low), low.probes)
    assert low.run["compute_dtype"] == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("fault,code", [("mask_after_softmax", "mask-broadcast/mask-after-softmax"),
                                        ("no_causal_mask", "mask-broadcast/causal-leak"),
                                        ("view_without_transpose", "mask-broadcast/head-split")])
def test_mask_bugs_are_still_named_in_16_bits(dtype, fault, code):
    torch.manual_seed(0)
    report = tndebug.check(make_model(ModelConfig.tiny().with_faults(fault)).to(dtype))
    assert code in _errors(report), (fault, _errors(report))


def test_the_tolerance_is_float32s_in_float32_and_grows_with_eps():
    assert tol(1e-5) == 1e-5                                  # float32: unchanged
    with computing_in(torch.bfloat16):
        assert tol(1e-5) == EPS_MARGIN * torch.finfo(torch.bfloat16).eps
    with computing_in(torch.float16):
        assert tol(1e-5) == EPS_MARGIN * torch.finfo(torch.float16).eps
        assert tol(1e-5, torch.zeros(1, dtype=torch.bfloat16)) > tol(1e-5)   # the coarser counts
    assert tol(1e-5, torch.zeros(1, dtype=torch.float16)) > 1e-5   # half probs, float32 weights
