"""A torchrun worker for tests/api/test_fsdp.py (not a test module): the nanoGPT-style decoder
of fsdp_watch_worker.py trained by PyTorch Lightning with FSDP2 (`ModelParallelStrategy`,
`fully_shard` on each block and the root in `configure_model`), 2 gloo processes on the CPU,
tndebug's Lightning callback watching.

    python -m torch.distributed.run --nproc-per-node=2 ... lightning_fsdp_worker.py OUT BUG STEPS

Rank 0's callback writes OUT (report.json); every rank writes OUT.ranks/rank<r>.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import pytorch_lightning as pl
from pytorch_lightning.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "foreign"))
import fsdp_watch_worker as W  # noqa: E402
import nanogpt  # noqa: E402
from tndebug.integrations.lightning import TndebugCallback  # noqa: E402


class Lit(pl.LightningModule):
    def __init__(self, bug: str):
        super().__init__()
        self.bug = bug
        torch.manual_seed(0)
        self.model = nanogpt.build("manual", None if bug in ("healthy", "no_zero_grad") else bug,
                                   vocab_size=W.V, block_size=W.T, n_layer=2, n_head=2, n_embd=32)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, ids, _):
        logits = W.forward(self.model, ids[:, :-1], None)                          # [B, T-1, V]
        tgt = ids[:, 1:].clone()
        tgt[:, : W.T // 2 - 1] = -1
        return F.cross_entropy(logits.reshape(-1, W.V), tgt.reshape(-1), ignore_index=-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if self.bug != "no_zero_grad":           # the bug: Lightning's zero_grad overridden away
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)


class Rows(torch.utils.data.IterableDataset):
    """The same global batches on every rank, each rank its own half of the rows."""
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        n = W.BATCH // self.world
        while True:
            yield W.batch(g)[self.rank * n:(self.rank + 1) * n]


def main(out: str, bug: str, steps: int) -> int:
    torch.set_num_threads(1)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                     process_group_backend="gloo")
    cb = TndebugCallback(W.forward, out=out, pad_id=None, quiet=True)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps,
                         callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=f"{out}.pl")
    rank = trainer.global_rank
    loader = torch.utils.data.DataLoader(Rows(rank, 2), batch_size=None)
    trainer.fit(Lit(bug), loader)
    ranks = Path(f"{out}.ranks")
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / f"rank{rank}.json").write_text(json.dumps(
        {"exit_code": cb.exit_code, "world": cb.report.run.get("world_size"),
         "verdict": cb.report.verdict}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
