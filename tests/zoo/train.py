"""Train a zoo model briefly on a tndebug task and save it the way users do."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tndebug.data import data_generator, get_task


def train(model, forward, *, task: str = "copy", steps: int = 300, lr: float = 3e-3,
          batch: int = 64, seed: int = 0, pad_id: int = 0):
    """Adam with a short linear warmup, cross-entropy; returns (model, optimizer, final loss)."""
    torch.manual_seed(seed)
    t = get_task(task)
    g = data_generator(seed, "train")
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        src, tgt_in, tgt_out = t.batch(g, batch)
        logits = forward(model, src, tgt_in, pad_id)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1),
                               ignore_index=pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return model, opt, float(loss.detach())


def save(path: Path, model, opt=None, step: int | None = None, config: dict | None = None,
         *, bare: bool = False) -> Path:
    """{'model', 'optimizer', 'step', 'config'} (or a bare state_dict)."""
    path = Path(path)
    if bare:
        torch.save(model.state_dict(), path)
    else:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict() if opt else None,
                    "step": step, "config": config or {}}, path)
    return path
