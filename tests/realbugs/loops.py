"""The user's training loop for the corpus, with the loop-level bugs as its options, and the
label-smoothing criteria the threads report. `run_watch` runs it under `tndebug.watch`;
`train` runs it bare (to train a model briefly before `tndebug.check`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tndebug
from model import copy_batch, forward

BASE_LR, WARMUP = 3e-3, 20


def warmup(step: int) -> float:
    """The lr factor of a linear warmup over WARMUP steps, then constant."""
    return min(1.0, (step + 1) / WARMUP)


# -- criteria (logits [N, V], target [N]) ------------------------------------------------------------
class SmoothedLoss(nn.Module):
    """Label smoothing written by hand: q = (1 - eps) on the target, eps spread over the rest.

    `keep_pad_off`: no smoothing mass on <pad> (the column OpenNMT zeroes);
    `ignore_pad`: pad-target rows out of the loss; `uniform_over_all_rows`: the uniform term
    averaged over every row, pad targets included (the CrossEntropyLoss bug of pytorch#73205).
    """

    def __init__(self, vocab: int, pad_id: int = 0, eps: float = 0.1, *, keep_pad_off: bool = True,
                 ignore_pad: bool = True, uniform_over_all_rows: bool = False) -> None:
        super().__init__()
        self.vocab, self.pad_id, self.eps = vocab, pad_id, eps
        self.keep_pad_off, self.ignore_pad, self.uniform_all = keep_pad_off, ignore_pad, uniform_over_all_rows

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits, dim=-1)                                     # [N, V]
        others = self.vocab - (2 if self.keep_pad_off else 1)
        q = torch.full_like(logp, self.eps / others)
        if self.keep_pad_off:
            q[:, self.pad_id] = 0.0
        q.scatter_(1, target[:, None], 1.0 - self.eps)
        keep = (target != self.pad_id).to(logp.dtype) if self.ignore_pad else torch.ones_like(target, dtype=logp.dtype)
        if self.uniform_all:                      # nll over kept rows, uniform part over all rows
            nll = -(logp.gather(1, target[:, None]).squeeze(1) * keep).sum() / keep.sum()
            smooth = -logp.mean(dim=-1).mean()
            return (1.0 - self.eps) * nll + self.eps * smooth
        per_row = -(q * logp).sum(dim=-1)
        return (per_row * keep).sum() / keep.sum()


def criterion(kind: str | None, vocab: int, pad_id: int = 0):
    if kind is None:
        return nn.CrossEntropyLoss(ignore_index=pad_id)
    return {"smooth_ok": lambda: SmoothedLoss(vocab, pad_id),
            "smooth_no_ignore": lambda: SmoothedLoss(vocab, pad_id, ignore_pad=False),
            "smooth_uniform_all_rows": lambda: SmoothedLoss(vocab, pad_id, keep_pad_off=False,
                                                            uniform_over_all_rows=True),
            "smooth_onto_pad": lambda: SmoothedLoss(vocab, pad_id, keep_pad_off=False)}[kind]()


# -- the loop -------------------------------------------------------------------------------------------
def train(model, opt, steps: int, g: torch.Generator, *, loss_fn=None, zero_grad: bool = True,
          eval_at: int | None = None, scheduler=None) -> list[float]:
    """The user's loop: copy-task batches, an evaluation at `eval_at` (model.eval() and no
    model.train() after it: the loop calls model.train() once, before the loop)."""
    V = model.cfg.vocab
    loss_fn = loss_fn or nn.CrossEntropyLoss(ignore_index=model.pad_id)
    losses = []
    model.train()
    for step in range(steps):
        if eval_at is not None and step == eval_at:
            model.eval()
            with torch.no_grad():
                src, tgt_in, _ = copy_batch(g, V)
                model(src, tgt_in)
        src, tgt_in, tgt_out = copy_batch(g, V)
        loss = loss_fn(model(src, tgt_in).reshape(-1, V), tgt_out.reshape(-1))
        if not torch.isfinite(loss):              # a user stops here too
            break
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if zero_grad:
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def run_watch(model, steps: int = 12, seed: int = 0, *, zero_grad: bool = True, eval_at: int | None = None,
              criterion_kind: str | None = None, resume: str | None = None):
    """The loop under tndebug.watch (every probe); the report of the watched run.

    `resume`: train WARMUP steps first (unwatched, with a warmup LambdaLR), save, build the
    optimizer again and resume under watch(start_step=WARMUP); "restart_warmup" forgets the
    scheduler's state (the bug), "keep" restores it.
    """
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.vocab
    loss_fn = criterion(criterion_kind, V, model.pad_id)
    declared = lambda s: BASE_LR * warmup(s)      # noqa: E731 - the schedule as the user wrote it
    start = 0
    opt = torch.optim.Adam(model.parameters(), lr=BASE_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    if resume is not None:
        train(model, opt, WARMUP, g, loss_fn=loss_fn, scheduler=sched)
        state = {"opt": opt.state_dict(), "sched": sched.state_dict()}
        opt = torch.optim.Adam(model.parameters(), lr=BASE_LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        opt.load_state_dict(state["opt"])
        if resume == "keep":
            sched.load_state_dict(state["sched"])
        else:                                     # the scheduler starts again at step 0
            for group in opt.param_groups:
                group["lr"] = BASE_LR * warmup(0)
        start = WARMUP
    with tndebug.watch(model, opt, forward=forward, pad_id=model.pad_id, bos_id=1, quiet=True,
                       criterion=loss_fn, lr_schedule=declared, start_step=start,
                       total_steps=start + steps, tensorboard=False) as dbg:
        train(model, opt, steps, g, loss_fn=loss_fn, zero_grad=zero_grad, eval_at=eval_at, scheduler=sched)
    return dbg.report
