"""The encoder-only corpus: BERT-style user code (tests/foreign/minibert.py) trained briefly as a
masked LM on copy's pairs as one row each (BOS source EOS target EOS, `data.as_lm`; 15% of
the content tokens replaced by [MASK] and predicted, each recoverable from its copy on the other
side, so the model must learn to attend both ways; on source rows alone, random tokens, there
would be nothing to learn but the unigram prior, and an input-independent model), saved
as a tutorial saves it ({"model": state_dict, "config": kwargs}) and triaged as a user would:

    tndebug triage CKPT --model tests/foreign/minibert.py:build                    # MiniBert
    tndebug triage CKPT --model tests/foreign/minibert.py:build_net --arch encoder

Shared by tests/foreign/test_minibert.py.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tndebug.capture.adapters import import_file
from tndebug.data import as_lm, data_generator, get_task
from tndebug.triage import TriageOptions, triage

HERE = Path(__file__).resolve().parent
FILE = HERE / "minibert.py"

# The probe that owns each bug's failure mode.
EXPECTED_PROBE = {"causal": "mask-broadcast", "triu": "mask-broadcast",
                  "pad_leak": "mask-broadcast", "no_scale": "missing-scale"}
# every bug on the explicit path; on SDPA the two whose mask reaches it another way
BUG_CASES = [("manual", b) for b in EXPECTED_PROBE] + [("sdpa", "triu"), ("sdpa", "pad_leak")]
EXPECTED_CODE = {"causal": "mask-broadcast/encoder-causal", "triu": "mask-broadcast/encoder-one-sided",
                 "pad_leak": "mask-broadcast/pad-leak", "no_scale": "missing-scale/absent"}


def train(model, module, *, steps: int = 200, batch: int = 32, lr: float = 3e-3, seed: int = 0) -> float:
    """AdamW on the masked-LM objective over copy's pairs as one row. Returns the last loss."""
    torch.manual_seed(seed)
    task, g = get_task("copy"), data_generator(seed, "train")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        ids = as_lm(task.batch(g, batch)).tgt_in
        pick = (torch.rand(ids.shape) < 0.15) & (ids > 2)               # real content tokens
        inputs = ids.masked_fill(pick, module.MASK_ID)
        labels = ids.masked_fill(~pick, -100)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def make_checkpoint(variant: str, bug: str | None, seed: int, folder: Path, steps: int = 200) -> Path:
    module = import_file(FILE)
    torch.manual_seed(seed)
    config = {"variant": variant, "bug": bug}
    model = module.build(**config)
    loss = train(model, module, steps=steps, seed=seed)
    path = Path(folder) / f"minibert-{variant}-{bug or 'healthy'}-{seed}.pt"
    torch.save({"model": model.state_dict(), "config": config, "step": steps, "loss": loss}, path)
    return path


def run_triage(path: Path, factory: str = "build", **kw):
    return triage(TriageOptions(str(path), model=f"{FILE}:{factory}", **kw))
