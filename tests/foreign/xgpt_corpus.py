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

from tndebug.triage import TriageOptions, triage

from nanogpt_corpus import LOOP_BUGS, train_lm, trained_model  # noqa: F401 - LOOP_BUGS: bench/foreign

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
# LOOP_BUGS (nanogpt_corpus): the labels' offset from the input in the training loop; the model
# is the healthy one
BUG_CASES = [("abs", b) for b in EXPECTED_PROBE] + [
    ("rotary", b) for b in ("no_causal", "no_scale", "labels_unshifted")] + [
    ("flash", b) for b in ("no_causal", "no_scale")]
VARIANTS = ("abs", "rotary", "flash")


def train(model, *, steps: int = 400, seed: int = 0, shift: int = 1) -> float:
    """AdamW on copy as next-token prediction (nanogpt_corpus.train_lm), the loss as
    x-transformers' README computes it: cross-entropy of model(ids), ignoring PAD."""
    return train_lm(model, lambda m, ids, labels: F.cross_entropy(
        m(ids).flatten(0, 1), labels.flatten(), ignore_index=0), steps=steps, seed=seed, shift=shift)


def make_checkpoint(variant: str, bug: str | None, seed: int, folder: Path, steps: int = 400) -> Path:
    model, model_args, loss = trained_model(FILE, variant, bug, seed, steps, train)
    path = Path(folder) / f"xgpt-{variant}-{bug or 'healthy'}-{seed}.pt"
    torch.save({"model": model.state_dict(), "model_args": model_args, "steps": steps,
                "loss": loss}, path)
    return path


def run_triage(path: Path, **kw):
    return triage(TriageOptions(str(path), model=f"{FILE}:build", adapter=f"{FILE}:forward", **kw))
