"""The decoder-only corpus: nanoGPT-style models (tests/foreign/nanogpt.py) trained briefly on
copy as a language model (`data.as_lm`: BOS source EOS target EOS, loss on the continuation),
saved as nanoGPT saves them ({"model": state_dict, "model_args", "iter_num", ...}, plain data)
and triaged as a user would:

    tndebug triage CKPT --model tests/foreign/nanogpt.py:build                 # adapter `gpt`
    tndebug triage CKPT --model tests/foreign/nanogpt.py:build --adapter tests/foreign/nanogpt.py:forward

Shared by tests/foreign/test_nanogpt.py and bench/foreign.py.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tndebug.capture.adapters import import_file
from tndebug.data import as_lm, data_generator, get_task
from tndebug.triage import TriageOptions, triage

HERE = Path(__file__).resolve().parent
FILE = HERE / "nanogpt.py"

# The probe that owns each bug's failure mode; None: benign (must triage clean).
EXPECTED_PROBE = {
    "no_causal": "mask-broadcast",
    "triu": "mask-broadcast",
    "pad_mask": "mask-broadcast",
    "softmax_dim": "mask-broadcast",   # each row's weights depend on later queries: a leak
    "no_scale": "missing-scale",
    "qkv_order": None,                 # k, q, v = split(...): the same model, relabelled chunks
    "labels_twice": "label-shift",     # the training loop's bug (LOOP_BUGS), not the model's
}
# Bugs of the training loop, not the model: the labels the loss compares with, as an offset from
# the input (1 is right). The model code is the healthy one. labels_unshifted is not in BUG_CASES:
# nanoGPT ties lm_head to wte, which repeats its input at initialisation, so triage gives that
# test no verdict rather than a finding (tests/foreign/test_nanogpt.py says so).
LOOP_BUGS = {"labels_twice": 2, "labels_unshifted": 0}
# (variant, bug) pairs the corpus holds: softmax_dim needs the explicit softmax
BUG_CASES = [("manual", b) for b in EXPECTED_PROBE] + [
    ("sdpa", b) for b in ("no_causal", "triu", "pad_mask", "no_scale", "qkv_order", "labels_twice")]


def lm_labels(lm, shift: int = 1) -> torch.Tensor:
    """The labels a training loop compares with the logits of `lm` (data.as_lm): the token at t + 1
    (shift 1, PAD where no loss falls), the input itself (0: not shifted) or the token after next
    (2: shifted twice). # [B, T]"""
    if shift == 0:                                         # loss(logits, idx): not shifted
        return lm.tgt_in.masked_fill(lm.tgt_out == 0, 0)
    if shift == 2:                                         # shifted once more
        return torch.cat([lm.tgt_out[:, 1:], torch.zeros_like(lm.tgt_out[:, :1])], 1)
    return lm.tgt_out


def train_lm(model, loss_of, *, steps: int, batch: int = 32, lr: float = 3e-3, seed: int = 0,
             shift: int = 1) -> float:
    """AdamW on copy as next-token prediction; `loss_of(model, ids, labels)` is the user's loss
    (labels PAD where no loss falls, lm_labels' `shift`). Returns the last loss."""
    torch.manual_seed(seed)
    task, g = get_task("copy"), data_generator(seed, "train")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        lm = as_lm(task.batch(g, batch))
        loss = loss_of(model, lm.tgt_in, lm_labels(lm, shift))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return float(loss.detach())


def train(model, *, steps: int = 300, batch: int = 32, lr: float = 3e-3, seed: int = 0,
          shift: int = 1):
    """nanoGPT's way: model(idx, targets) -> (logits, loss) with targets -1 where no loss falls."""
    return train_lm(model, lambda m, ids, labels: m(ids, labels.masked_fill(labels == 0, -1))[1],
                    steps=steps, batch=batch, lr=lr, seed=seed, shift=shift)


def trained_model(file: Path, variant: str, bug: str | None, seed: int, steps: int, train_fn):
    """The model `file`'s build(variant, bug) makes, trained by `train_fn` (a loop bug of
    LOOP_BUGS trains the healthy model with its labels). Returns (model, model_args, last loss)."""
    torch.manual_seed(seed)
    model_args = {"variant": variant, "bug": None if bug in LOOP_BUGS else bug}
    model = import_file(file).build(**model_args)
    return model, model_args, train_fn(model, steps=steps, seed=seed, shift=LOOP_BUGS.get(bug, 1))


def make_checkpoint(variant: str, bug: str | None, seed: int, folder: Path, steps: int = 300) -> Path:
    model, model_args, loss = trained_model(FILE, variant, bug, seed, steps, train)
    path = Path(folder) / f"nanogpt-{variant}-{bug or 'healthy'}-{seed}.pt"
    torch.save({"model": model.state_dict(), "model_args": model_args, "iter_num": steps,
                "best_val_loss": loss}, path)
    return path


def run_triage(path: Path, adapter: str | None = None, **kw):
    return triage(TriageOptions(str(path), model=f"{FILE}:build", adapter=adapter, **kw))


def flagged(report, severities=("warning", "error")) -> list:
    return [f for f in report.findings if f.severity in severities]


def describe(findings) -> str:
    return "\n".join(f"  {f.severity:7s} {f.probe:20s} {f.code or ''} {f.where or '(run)'}: "
                     f"{f.message}" for f in findings) or "  (none)"
