"""Loop bugs of a character-level nanoGPT-style loop under `tndebug.watch` (pad_id=None), on
text a 32-wide model cannot learn to ~0 in 600 steps (Python's own pydoc topics, V = 96: the loss
goes from 4.7 to ~2.2 healthy, ~2.8 with labels shifted twice), issue 44:

* labels shifted twice are named by label-shift although the loss has not halved (it said "loss
  has not halved (4.45 -> 2.46)" and gave no verdict);
* an lr 100x too high under gradient clipping at 1.0 is named by lr-schedule's update-to-weight
  ratio, and the message says that clipping hid it from the loss;
* the healthy loop gets neither.
Seed 2 here; the thresholds were set on seeds 0 and 1 (probes/label_shift.py, lr_schedule.py).
"""
from __future__ import annotations

import pytest
import torch

import tndebug

import chargpt

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]
SEED, STEPS, BLOCK, BATCH = 2, 600, 32, 16


def corpus() -> tuple[torch.Tensor, int]:
    from pydoc_data.topics import topics
    s = "".join(topics[k] for k in sorted(topics))
    s = "".join(c if 32 <= ord(c) < 127 or c == "\n" else "?" for c in s)
    chars = sorted(set(s))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in s], dtype=torch.long), len(chars)


def run(shift: int = 1, lr: float = 3e-3, clip: float | None = None, steps: int = STEPS):
    data, vocab = corpus()
    torch.manual_seed(SEED)
    model = chargpt.build(vocab_size=vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(SEED)
    with tndebug.watch(model, opt, forward=chargpt.forward, quiet=True, total_steps=steps,
                       pad_id=None) as dbg:
        model.train()
        for _ in range(steps):
            ix = torch.randint(len(data) - BLOCK - 2, (BATCH,), generator=g).tolist()
            x = torch.stack([data[i:i + BLOCK] for i in ix])
            y = torch.stack([data[i + shift:i + shift + BLOCK] for i in ix])   # shift 2: the bug
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    return dbg.report


def bad(report):
    return [(f.code, f.severity) for f in report.findings if f.severity in ("warning", "error")]


def test_a_healthy_loop_is_checked_and_clean():
    report = run(clip=1.0)
    assert report.probes["label-shift"]["status"] == "pass", report.probes["label-shift"]
    assert report.probes["lr-schedule"]["coverage"]["update"]["status"] == "checked"
    assert not bad(report), bad(report)


def test_labels_shifted_twice_are_named_before_the_loss_halves():
    report = run(shift=2)
    (f,) = [f for f in report.findings if f.code == "label-shift/shifted-twice"]
    assert f.severity == "error" and f.evidence["after_next_only"] > f.evidence["next_only"]
    assert f.evidence["loss_last"] > 0.5 * f.evidence["loss_first"]   # the old rule's no verdict
    assert [c for c, s in bad(report) if s == "error"] == ["label-shift/shifted-twice"]


def test_an_lr_100x_too_high_under_clipping_is_named_and_clipping_said():
    report = run(lr=3e-1, clip=1.0, steps=300)
    (f,) = [f for f in report.findings if f.code == "lr-schedule/lr-too-high"]
    assert f.severity == "warning" and f.evidence["update_ratio"] > 1.0
    assert "clipped" in f.message and f.evidence["clipped_steps"] >= 2
    assert not [c for c, s in bad(report) if s == "error"], bad(report)
