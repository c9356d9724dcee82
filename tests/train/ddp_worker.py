"""A torchrun worker for tests/train/test_distributed.py (not a test module itself).

    python -m torch.distributed.run --nproc-per-node=2 ... tests/train/ddp_worker.py OUT MODE

MODE: "run" (a clean probed run), "crash" (rank 1 raises at step 2), "nan" (rank 1's loss is
NaN at step 2), "budget" (40 steps under a 20% probe budget, rank 1's probed steps 60 ms
slower than rank 0's, so that budgets kept per rank would thin different steps; each rank
writes OUT/budget-rank{r}.json: its budget's summary and each probe's observed steps). Rank 0 writes OUT/report.json through a ReportSession and OUT/metrics.json
(every probe metric and training scalar, `tag -> {step: value}`); exit code as `tndebug run`.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from tndebug.reporters.session import ReportSession
from tndebug.train import TrainConfig, model_config, run_training
from tndebug.train import distributed

FAIL_STEP = 2


class MetricLog:
    """A sink: every metric the probes emit, and the training scalars."""

    def __init__(self) -> None:
        self.values: dict[str, dict[int, float]] = {}

    def on_metric(self, step: int, tag: str, value: float) -> None:
        self.values.setdefault(tag, {})[step] = value


def sabotage(mode: str, rank: int) -> None:
    """Rank 1 fails at FAIL_STEP, between its forward and backward: an exception, or a NaN loss
    (through the loss weight, which only the training loop asks for)."""
    if rank != 1 or mode == "run":
        return
    if mode == "budget":
        from tndebug.probes.engine import ProbeEngine
        end_step = ProbeEngine.end_step

        def slow_end_step(self, info):
            if self._trace is not None and self._due:     # a probed step: probes cost more here
                time.sleep(0.06)
            return end_step(self, info)
        ProbeEngine.end_step = slow_end_step
        return
    weight = distributed.Dist.loss_weight
    calls = {"n": 0}

    def bad_weight(self, global_batch, part):
        calls["n"] += 1
        if calls["n"] == FAIL_STEP + 1:
            if mode == "crash":
                raise ValueError("injected failure on rank 1")
            return float("nan")
        return weight(self, global_batch, part)

    distributed.Dist.loss_weight = bad_weight


def main(out: str, mode: str, faults: str = "no_dropout", steps: int = 4) -> int:
    torch.set_num_threads(1)
    dist = distributed.init_from_env("cpu", error_dir=out, timeout_s=60)
    sabotage(mode, dist.rank)
    session = log = None
    if dist.is_main:
        session = ReportSession(out, fmt="json", tensorboard=True, figures=False)
        log = MetricLog()
        session.sinks.append(log)
    cfg = model_config("copy", "tiny", faults=tuple(f for f in faults.split(",") if f))
    budget = {"steps": 40, "probe_budget": 0.2} if mode == "budget" else {"steps": steps}
    train_cfg = TrainConfig(batch_size=16, eval_size=32, log_every=1, device="cpu", **budget)
    try:
        result = run_training(cfg, train_cfg, probes="all", session=session, dist=dist)
    except distributed.RankFailed as e:
        print(f"tndebug: error: {e}", file=sys.stderr)
        return 3
    if dist.is_main and result.report.run["status"] == "failed":
        print(f"tndebug: error: {result.report.run['error']}", file=sys.stderr)
    if mode == "budget":
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"budget-rank{dist.rank}.json").write_text(json.dumps({
            "budget": result.engine.budget.summary(),
            "observed": {p.name: p.observed_steps for p in result.engine.probes}}))
    if not dist.is_main:
        dist.close()
        return 0
    log.values["train/loss"] = dict(zip(result.report.history["step"], result.report.history["loss"]))
    Path(out, "metrics.json").write_text(json.dumps(log.values))
    code = session.finish(result.report)
    dist.close()
    return distributed.report_exit(3 if result.report.run["status"] == "failed" else code)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3], *sys.argv[3:4]))
