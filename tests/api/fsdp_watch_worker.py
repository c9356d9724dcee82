"""A torchrun worker for tests/api/test_fsdp.py (not a test module): a nanoGPT-style decoder
(tests/foreign/nanogpt.py) in the user's own loop, sharded with FSDP2 (`fully_shard` on each
block and on the root) or wrapped in DDP, AdamW, `tndebug.watch` around it on every rank.

    python -m torch.distributed.run --nproc-per-node=2 ... fsdp_watch_worker.py OUT SHARD BUG [STEPS]
    python fsdp_watch_worker.py OUT none BUG [STEPS]          # the same run in one process

SHARD: fsdp | ddp | none (TNDEBUG_TEST_DEVICE=cuda: one GPU per rank, NCCL). BUG: healthy | no_scale | no_causal | no_zero_grad (the loop never
calls opt.zero_grad(): gradients add up). Every rank draws the same global batch and trains on
its own half of the rows. Rank 0's watch writes the report into OUT; every rank writes
OUT.ranks/rank<r>.json (its exit code, world size, verdict, findings, last loss, its budget's
summary and each probe's observed steps). TNDEBUG_TEST_BUDGET: "none" (every scheduled look)
or a share (watch's budget=); TNDEBUG_TEST_SLOW_RANK=R: rank R's probed steps cost 60 ms more.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "foreign"))
import nanogpt  # noqa: E402
import tndebug  # noqa: E402

V, T, BATCH = 12, 16, 16


def batch(g: torch.Generator) -> torch.Tensor:
    """A copy task without padding: 7 random ids >= 2, a separator 1, the same 7 ids, one more."""
    half = torch.randint(2, V, (BATCH, T // 2 - 1), generator=g)
    sep = torch.ones(BATCH, 1, dtype=torch.long)
    return torch.cat([half, sep, half, half[:, :1]], dim=1)[:, :T]                 # [B, T]


def forward(model, ids, pad_id):
    logits, _ = model(ids, ids.contiguous())
    return logits                                                                  # [B, T, V]


def shard(model, how: str):
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        return model
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model)
    return model


def slow_probed_steps() -> None:
    """This rank's probed steps cost 60 ms more (budgets kept per rank would then disagree)."""
    import time
    from tndebug.probes.engine import ProbeEngine
    end_step = ProbeEngine.end_step

    def slow(self, info):
        if self._trace is not None and self._due:
            time.sleep(0.06)
        return end_step(self, info)
    ProbeEngine.end_step = slow


def main(out: str, how: str, bug: str, steps: int = 80) -> int:
    torch.set_num_threads(1)
    multi = how != "none"
    device = torch.device(os.environ.get("TNDEBUG_TEST_DEVICE", "cpu"))   # cuda: bench/gpu_check.sh
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if multi:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if multi else (0, 1)
    torch.manual_seed(0)                                   # the same initial weights on every rank
    model = nanogpt.build("manual", None if bug in ("healthy", "no_zero_grad") else bug,
                          vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=32).to(device)
    model = shard(model, how)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)                   # the same global batches on every rank
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    probes = os.environ.get("TNDEBUG_TEST_PROBES", "all")     # a subset, when reproducing one probe
    share = os.environ.get("TNDEBUG_TEST_BUDGET")
    budget = {} if share is None else {"budget": None if share == "none" else float(share)}
    if os.environ.get("TNDEBUG_TEST_SLOW_RANK") == str(rank):
        slow_probed_steps()
    with tndebug.watch(model, opt, forward=forward, pad_id=None, out=out, total_steps=steps,
                       probes=probes, quiet=True, **budget) as dbg:
        for _ in range(steps):
            ids = batch(g)[rows].to(device)
            logits = forward(model, ids[:, :-1], None)                              # [B, T-1, V]
            tgt = ids[:, 1:].clone()
            tgt[:, : T // 2 - 1] = -1                      # only the copied half is learnt
            loss = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), ignore_index=-1)
            if bug != "no_zero_grad":
                opt.zero_grad()
            loss.backward()
            opt.step()
        engine = dbg._engine                               # released when the watch closes
    ranks = Path(f"{out}.ranks")                           # beside OUT: OUT is tndebug's alone
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / f"rank{rank}.json").write_text(json.dumps(
        {"exit_code": dbg.exit_code, "world": dbg.report.run.get("world_size"),
         "verdict": dbg.report.verdict, "loss": float(loss.detach()),
         "findings": [[f.code, f.severity, f.message] for f in dbg.report.findings],
         "budget": engine.budget.summary() if engine.budget is not None else None,
         "observed": {p.name: p.observed_steps for p in engine.probes}}))
    if multi:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:5])))
