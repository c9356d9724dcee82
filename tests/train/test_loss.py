import math

import pytest
import torch
import torch.nn.functional as F

from tndebug.harness import smoothed_loss
from tndebug.train.loss import LabelSmoothingLoss

V, PAD = 11, 0


def _grad(crit, logits, target):
    logits = logits.clone().requires_grad_(True)
    crit(logits, target).backward()
    return logits.grad


def test_true_distribution_pad_column_and_rows():
    target = torch.tensor([3, 5, PAD, 10])
    true = LabelSmoothingLoss(0.1, PAD).true_dist(target, V)
    assert (true[:, PAD] == 0).all()
    assert (true[2] == 0).all()                                   # a pad row has no mass
    assert torch.allclose(true[[0, 1, 3]].sum(1), torch.ones(3))
    assert true[0, 3] == pytest.approx(0.9) and true[0, 4] == pytest.approx(0.1 / (V - 2))


def test_matches_harness_and_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, V, generator=g)
    target = torch.randint(0, V, (40,), generator=g)
    assert LabelSmoothingLoss(0.1, PAD)(logits, target).item() == pytest.approx(
        smoothed_loss(logits, target).item(), rel=1e-6)
    ce = F.cross_entropy(logits, target, ignore_index=PAD)
    assert LabelSmoothingLoss(0.0, PAD)(logits, target).item() == pytest.approx(ce.item(), rel=1e-5)


def test_pad_rows_get_no_gradient():
    target = torch.tensor([4, PAD, 7, PAD])
    grad = _grad(LabelSmoothingLoss(0.1, PAD), torch.randn(4, V), target)
    assert (grad[target == PAD] == 0).all()
    assert (grad[target != PAD].abs().sum(1) > 0).all()


def test_smoothing_on_pad_fault_changes_the_pad_column_gradient():
    """At uniform logits the pad column's gradient is p (no target mass) when healthy, and
    equals every other wrong class's when smoothing is spread over pad too (FAILURE_MODES 7c)."""
    target = torch.tensor([3, 6, 9])
    logits = torch.zeros(3, V)
    healthy = _grad(LabelSmoothingLoss(0.1, PAD), logits, target)
    faulty = _grad(LabelSmoothingLoss(0.1, PAD, smooth_pad=True), logits, target)
    other = 5   # a class that is neither pad nor any row's target
    assert healthy[0, PAD] == pytest.approx(1 / V / 3)
    assert healthy[0, PAD] != pytest.approx(healthy[0, other].item())
    assert faulty[0, PAD] == pytest.approx(faulty[0, other].item())
    assert faulty[0, PAD] < healthy[0, PAD]
    assert LabelSmoothingLoss(0.1, PAD, smooth_pad=True).true_dist(target, V)[0, PAD] == pytest.approx(0.1 / (V - 1))


def test_loss_is_float32_under_half_logits():
    target = torch.tensor([3, 4])
    loss = LabelSmoothingLoss(0.1, PAD)(torch.zeros(2, V, dtype=torch.bfloat16), target)
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())


def test_kl_raw_logits_fault_skips_the_log_softmax():
    torch.manual_seed(0)
    logits, target = torch.randn(12, 11), torch.randint(1, 11, (12,))
    good = LabelSmoothingLoss(0.1, pad_id=0)
    bad = LabelSmoothingLoss(0.1, pad_id=0, raw_logits=True)
    assert good(logits, target) >= 0
    assert bad(logits.log_softmax(-1), target) == pytest.approx(float(good(logits, target)))
    assert bad(logits + 10.0, target) < 0            # unbounded below: larger logits, lower loss
