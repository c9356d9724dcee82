"""The x-transformers decoder-only corpus: TransformerWrapper(Decoder) (tests/foreign/xgpt.py)
trained on copy as a language model (`data.as_lm`: BOS source EOS target EOS, loss on the
continuation), the way its README trains (AutoregressiveWrapper-style: logits[:, t] against the
token at t + 1), saved as a plain state dict with its build arguments, and triaged as a user
would:

    tndebug triage CKPT --model tests/foreign/xgpt.py:build --adapter tests/foreign/xgpt.py:forward

Shared by tests/foreign/test_xgpt.py and bench/foreign.py. Nothing here was used to set a
threshold: it is held out for every probe (the thresholds were set on tndebug's own models, the
encoder-decoder corpus and nanoGPT).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tndebug.capture.adapters import import_file
from tndebug.data import as_lm, data_generator, get_task
from tndebug.triage import TriageOptions, triage

HERE = Path(__file__).resolve().parent
FILE = HERE / "xgpt.py"

# The probe that owns each bug's failure mode.
EXPECTED_PROBE = {
    "no_causal": "mask-broadcast",
    "no_scale": "missing-scale",
    "shared_qkv": "head-collapse",
    "labels_twice": "label-shift",      # the training loop's bug (LOOP_BUGS), not the model's
    "labels_unshifted": "label-shift",
}
# the labels' offset from the input in the training loop (1 is right); the model is healthy
LOOP_BUGS = {"labels_twice": 2, "labels_unshifted": 0}
BUG_CASES = [("abs", b) for b in EXPECTED_PROBE] + [
    ("rotary", b) for b in ("no_causal", "no_scale", "labels_unshifted")] + [
    ("flash", b) for b in ("no_causal", "no_scale")]
VARIANTS = ("abs", "rotary", "flash")


def train(model, *, steps: int = 400, batch: int = 32, lr: float = 3e-3, seed: int = 0,
          shift: int = 1) -> float:
    """AdamW on copy as next-token prediction; cross-entropy ignoring PAD. `shift`: the labels'
    offset from the input (LOOP_BUGS). Returns the last loss."""
    torch.manual_seed(seed)
    task, g = get_task("copy"), data_generator(seed, "train")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        lm = as_lm(task.batch(g, batch))
        labels = lm.tgt_out
        if shift == 0:
            labels = lm.tgt_in.masked_fill(lm.tgt_out == 0, 0)
        elif shift == 2:
            labels = torch.cat([lm.tgt_out[:, 1:], torch.zeros_like(lm.tgt_out[:, :1])], 1)
        logits = model(lm.tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return float(loss.detach())


def make_checkpoint(variant: str, bug: str | None, seed: int, folder: Path, steps: int = 400) -> Path:
    module = import_file(FILE)
    torch.manual_seed(seed)
    model_args = {"variant": variant, "bug": None if bug in LOOP_BUGS else bug}
    model = module.build(**model_args)
    loss = train(model, steps=steps, seed=seed, shift=LOOP_BUGS.get(bug, 1))
    path = Path(folder) / f"xgpt-{variant}-{bug or 'healthy'}-{seed}.pt"
    torch.save({"model": model.state_dict(), "model_args": model_args, "steps": steps,
                "loss": loss}, path)
    return path


def run_triage(path: Path, **kw):
    return triage(TriageOptions(str(path), model=f"{FILE}:build", adapter=f"{FILE}:forward", **kw))
