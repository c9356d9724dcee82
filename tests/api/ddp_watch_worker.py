"""A torchrun worker for tests/api/test_ddp.py (not a test module): the user's own DDP loop
(gloo, CPU) with tndebug.watch around it on every rank.

    python -m torch.distributed.run --nproc-per-node=2 ... ddp_watch_worker.py OUT MODE

MODE "healthy" or "no_scale" (SDPA called with scale=1.0). Each rank trains on its own half
of one global batch. Rank 0 writes OUT/report.json (and OUT/rank0.json: its exit code and
the world size the watch saw); every rank writes OUT/rank<r>.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import models as M  # noqa: E402
import tndebug  # noqa: E402


def main(out: str, mode: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                                 # the same initial weights on every rank
    model = M.FusedSDPA(scale=mode != "no_scale")
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)                 # the same global batches on every rank
    # budget=None: every scheduled look, which the test counts (test_fsdp.py thins them)
    with tndebug.watch(ddp, opt, forward=M.fused_forward, out=out, quiet=True, budget=None) as dbg:
        for _ in range(21):
            src, tgt = M.copy_batch(g, batch=16)
            rows = slice(rank * 8, (rank + 1) * 8)
            loss = M.train_step("sdpa", ddp, src[rows], tgt[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(
        {"exit_code": dbg.exit_code, "world": dbg.report.run["world_size"],
         "verdict": dbg.report.verdict, "findings": len(dbg.report.findings)}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
