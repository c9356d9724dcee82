"""Distributed training: shards of one global batch, findings gathered with their rank,
checkpoints without `module.`, and real 2-process gloo runs (marked `multiprocess`).

The 2-process runs go through tests/train/ddp_worker.py under torchrun on 127.0.0.1 with a
free port; one torch thread per process. What they check:

* the reduced statistics equal the one-process run on the same global batch (float
  tolerance, every probed step) where the probe's statistic is a sum or a ratio of sums
  (loss, gradient norms, fitted attention scale); per-rank means of nonlinear quantities
  (entropy, pad mass, head similarity) are only close, by design;
* rank 0 alone wrote report.json, TensorBoard and the checkpoint;
* `no_scale` is caught as in one process; an exception or a NaN on rank 1 ends the job
  with the report written by rank 0 and the first error named.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from tndebug import judge
from tndebug.data import Batch, data_generator, get_task
from tndebug.findings import Finding
from tndebug.inject import make_model
from tndebug.train import TrainConfig, distributed, model_config, run_training
from tndebug.train.checkpoint import unwrap_state_dict
from tndebug.train.distributed import Dist, merge_findings

WORKER = Path(__file__).with_name("ddp_worker.py")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(WORKER.parent))
sys.path.insert(0, str(ROOT / "tests"))
from ddp_launch import torchrun  # noqa: E402
from ddp_worker import FAIL_STEP, MetricLog  # noqa: E402

# metric families whose statistic adds across ranks: equal to the one-process run
EXACT = ("train/loss", "loss/train", "grad/", "scale/", "lr/", "relu/dead_fraction")


# -- one process ---------------------------------------------------------------------------------
def test_shards_cover_the_global_batch_and_weights_restore_its_token_mean():
    task = get_task("copy")
    batch = task.batch(data_generator(0), 16)
    parts = [Dist(rank=r, world=2).shard(batch) for r in range(2)]
    for a, b in zip(batch, zip(*parts)):
        assert torch.equal(a, torch.cat(b))
    w = [Dist(rank=r, world=2).loss_weight(batch, p) for r, p in enumerate(parts)]
    assert sum(w) == pytest.approx(2.0)         # the mean of the weighted token means is the global one
    assert Dist().loss_weight(batch, batch) == 1.0 and Dist().shard(batch) is batch


def test_batch_must_split_over_the_processes():
    from tndebug.errors import UsageError
    with pytest.raises(UsageError, match="multiple of 4"):
        Dist(rank=0, world=4).check_batch(10)


def test_findings_merge_keeps_rank_and_drops_repeats():
    f = Finding("missing-scale", "error", "scale", where="encoder.layers.0.self_attn", step=0)
    only1 = Finding("nan-scores", "error", "NaN", where="decoder.layers.1", step=3)
    merged = merge_findings([[Finding(**{**f.to_dict(), "rank": 0})],
                             [Finding(**{**f.to_dict(), "rank": 1}), Finding(**{**only1.to_dict(), "rank": 1})]])
    assert [(x.probe, x.rank) for x in merged] == [("missing-scale", 0), ("nan-scores", 1)]
    assert judge.first_sign(merged).step == 0


def test_ddp_checkpoint_keys_load_in_one_process():
    model = make_model(model_config("copy", "tiny"))
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    other = make_model(model_config("copy", "tiny"))
    other.load_state_dict(unwrap_state_dict(wrapped))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert unwrap_state_dict(model.state_dict()) is not None


def test_one_process_is_unchanged_by_the_hooks():
    local = distributed.LOCAL
    assert not local.active and local.is_main and local.reducer is None
    log = distributed.LossLog(local)
    log.add(0, torch.tensor(2.5))
    log.add(1, torch.tensor(float("nan")))
    out = log.flush()
    assert out[0] == (0, 2.5) and out[1][0] == 1 and out[1][1] != out[1][1]
    assert log.flush() == []


# -- two processes -------------------------------------------------------------------------------
def _torchrun(tmp: Path, mode: str, faults: str, timeout: float = 240.0):
    """(torchrun's CompletedProcess, rank 0's exit code or None, the run directory)."""
    out, exit_file = tmp / "run", tmp / "exit_code"

    def clear():
        shutil.rmtree(out, ignore_errors=True)
        exit_file.unlink(missing_ok=True)
    proc = torchrun(WORKER, [str(out), mode, faults], env={distributed.EXIT_FILE_ENV: str(exit_file)},
                    timeout=timeout, before_retry=clear)
    code = int(exit_file.read_text()) if exit_file.is_file() else None
    return proc, code, out


class _Silent:
    """A session that only carries a metric sink (the one-process reference run)."""

    def __init__(self) -> None:
        self.out_dir, self.log = None, MetricLog()
        self.sinks = [self.log]

    def progress(self, total, description=""):
        import contextlib

        class Bar:
            def update(self, *a, **k):
                pass
        return contextlib.nullcontext(Bar())

    def log_scalars(self, step, scalars):
        pass


def _one_process(faults: str):
    """The reference run, on one thread as the workers: Adam's first update is about
    lr * sign(g), so a thread count's rounding noise in a near-zero gradient moves a weight."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_one_process(faults)
    finally:
        torch.set_num_threads(threads)


def _train_one_process(faults: str):
    session = _Silent()
    cfg = model_config("copy", "tiny", faults=tuple(f for f in faults.split(",") if f))
    result = run_training(cfg, TrainConfig(steps=4, batch_size=16, eval_size=32, log_every=1, device="cpu"),
                          probes="all", session=session)
    session.log.values["train/loss"] = dict(zip(result.report.history["step"], result.report.history["loss"]))
    return result, session.log.values


@pytest.mark.multiprocess
def test_two_processes_reduce_to_the_one_process_statistics(tmp_path):
    faults = "no_dropout,no_scale"
    proc, code, out = _torchrun(tmp_path, "run", faults)
    assert proc.returncode == 0 and code == 1, proc.stderr[-2000:]      # 1: findings
    report = json.loads((out / "report.json").read_text())
    # rank 0 alone wrote: one report, one TensorBoard file, one checkpoint, no error files
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "metrics.json", "report.json",
                                                     "report.md", "tb"]
    assert len(list((out / "tb").iterdir())) == 1
    assert report["run"]["world_size"] == 2 and report["run"]["status"] == "completed"

    single, values = _one_process(faults)
    # the fault is caught the same way as in one process, each finding with its rank
    key = lambda f: (f["probe"], f["severity"], f["where"], f["step"])  # noqa: E731
    assert {key(f) for f in report["findings"]} == {key(f.to_dict()) for f in single.report.findings}
    assert any(f["probe"] == "missing-scale" and f["severity"] == "error" and f["rank"] == 0
               for f in report["findings"])
    # statuses follow every rank's findings; coverage is the same as in one process
    assert report["probes"] == json.loads(json.dumps(single.report.probes))
    # the reduced statistics
    ddp = json.loads((out / "metrics.json").read_text())
    compared = 0
    for tag, by_step in values.items():
        assert tag in ddp, tag
        if not tag.startswith(EXACT):
            continue
        for step, v in by_step.items():
            assert ddp[tag][str(step)] == pytest.approx(v, rel=1e-4, abs=1e-6), (tag, step)
            compared += 1
    assert compared > 50


@pytest.mark.multiprocess
def test_an_exception_on_one_rank_ends_the_job_with_the_report_written(tmp_path):
    t0 = time.monotonic()
    proc, code, out = _torchrun(tmp_path, "crash", "no_dropout")
    assert proc.returncode != 0 and code == 3
    assert time.monotonic() - t0 < 200           # ended, not hung until a timeout
    error = f"rank 1 at step {FAIL_STEP}: ValueError: injected failure on rank 1"
    assert error in proc.stderr
    run = json.loads((out / "report.json").read_text())["run"]
    assert run["status"] == "failed" and run["stopped_at_step"] == FAIL_STEP
    assert run["error"] == error
    assert not list(out.glob(".tndebug-rank*"))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    proc, code, out = _torchrun(tmp_path, "nan", "no_dropout")
    if proc.returncode != 0 and "SIGABRT" in proc.stderr:
        # Seen once in ~5 runs, only on a heavily loaded machine: a gloo rank aborted in
        # teardown. One retry in a fresh directory; a real regression fails both times.
        (tmp_path / "retry").mkdir()
        proc, code, out = _torchrun(tmp_path / "retry", "nan", "no_dropout")
    assert proc.returncode == 0 and code == 1, proc.stderr[-2000:]      # findings, not a crash
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["status"] == "diverged" and report["run"]["stopped_at_step"] == FAIL_STEP
    assert any(f["probe"] == "nan-scores" and f["step"] == FAIL_STEP for f in report["findings"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_probe_budget_thins_the_same_steps_on_every_rank(tmp_path):
    """Under DDP the budget applies (it did not: every scheduled look ran), and the ranks thin
    the same looks although rank 1's probed steps cost 60 ms more than rank 0's (a budget
    kept per rank would let rank 0 probe steps that rank 1 skips, and their collectives would
    no longer pair up: a hang or 'ranks disagree')."""
    proc, code, out = _torchrun(tmp_path, "budget", "no_dropout")
    assert proc.returncode == 0 and code == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["status"] == "completed" and report["run"]["world_size"] == 2
    ranks = [json.loads((out / f"budget-rank{r}.json").read_text()) for r in (0, 1)]
    budget = report["run"]["probe_budget"]
    assert budget is not None and budget["thinned"], budget
    assert budget["ranks_agreed"]["exchanges"] == 4            # 40 steps, every 10
    assert ranks[0]["budget"]["thinned"] == ranks[1]["budget"]["thinned"] == budget["thinned"]
    assert ranks[0]["observed"] == ranks[1]["observed"]
    # the agreed step cost is the slower rank's: rank 1's 60 ms extra shows in the maximum
    assert budget["ranks_agreed"]["spent_s"] >= ranks[1]["budget"]["spent_s"] - 0.1


def test_nproc_relaunch_keeps_every_flag_but_nproc():
    from tndebug.cli import build_parser
    from tndebug.commands.run import relaunch_argv
    args = build_parser().parse_args(["run", "--preset", "tiny", "--fault", "no_scale", "--fault",
                                      "shared_qkv", "--steps", "3", "--nproc", "2", "--out", "x"])
    argv = relaunch_argv(args)
    assert "--nproc" not in argv
    again = build_parser().parse_args(argv)
    for key in ("preset", "fault", "steps", "out", "probe", "device", "amp", "fail_on", "format"):
        assert getattr(again, key) == getattr(args, key), key
    assert again.nproc == 1


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cli_nproc_trains_under_torchrun(tmp_path, monkeypatch):
    from tndebug.cli import main
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    monkeypatch.setenv("PYTHONPATH", path)
    code = main(["run", "--preset", "tiny", "--steps", "2", "--batch-size", "8", "--nproc", "2",
                 "--fault", "no_scale", "--device", "cpu", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 1 and report["run"]["world_size"] == 2
    assert any(f["probe"] == "missing-scale" and f["rank"] == 0 for f in report["findings"])
