"""Scale out: one probed run over several processes (DistributedDataParallel under torchrun),
and the device helpers a GPU run needs so that unprobed steps never wait for the host.

    torchrun --standalone --nproc-per-node=2 -m tndebug run --preset tiny   # or: tndebug run --nproc 2
    dist = init_from_env("auto")        # LOCAL (one process, every method a no-op) outside torchrun

How a run over N processes stays comparable with the one-process run:

* data: every rank draws the same global batch from the same stream and trains on its own
  contiguous rows (`shard`); the loss is weighted (`loss_weight`) so that DDP's gradient
  average is exactly the one-process gradient of the global batch, and the ranks' mean loss
  is exactly the one-process loss.
* probes: they attach to the inner model (`ddp.module`, the module the trainer built); setup
  runs identically on every rank, with no collective. At probed steps the engine's packed
  statistics are averaged over ranks (`reducer`): a ratio of sums stays exact, a per-rank mean
  becomes the mean over ranks, a per-rank maximum the mean of the maxima, and any NaN or
  non-zero count on one rank survives. The schedules are step functions, so every rank probes
  the same steps and calls the same collectives in the same order. A probe budget thins the
  same steps on every rank: the ranks agree on its measurements every few steps (`agree_max`).
* losses: read on the host only at sync points (`LossLog`), averaged over ranks there, so a
  NaN on one rank stops every rank at the same step.
* output: only rank 0 writes TensorBoard, the report and the checkpoint (the inner module's
  state dict: no `module.` prefix); findings are gathered to rank 0 with their rank.
* failure: a rank that raises writes a one-line error file into the run directory and exits;
  the others' collectives fail (gloo: the peer's socket closes; NCCL: torchrun stops them, or
  the process-group timeout, TNDEBUG_DIST_TIMEOUT_S, default 180 s), rank 0 writes the report
  with status "failed" and the first error. SIGTERM from torchrun becomes an exception only
  inside `terminable()`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from tndebug.data import Batch
from tndebug.errors import UsageError
from tndebug.findings import Finding

DEFAULT_TIMEOUT_S = float(os.environ.get("TNDEBUG_DIST_TIMEOUT_S", "180"))
EXIT_FILE_ENV = "TNDEBUG_EXIT_FILE"     # set by `launch`: rank 0 writes its exit code there


class RankFailed(RuntimeError):
    """This rank raised (or a collective failed) during a distributed run."""


class Terminated(RuntimeError):
    """torchrun sent SIGTERM (another rank failed)."""


@dataclass
class Dist:
    """Where this process stands in the run. `LOCAL` is the one-process run (all no-ops)."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None          # "gloo" | "nccl" | None
    control: Any = None                 # gloo group for host-side control (None: the default group)
    error_dir: Path | None = None       # where a failing rank leaves its error (the run directory)
    run_id: str = "local"
    broken: bool = False                # a failure was caught: no more collectives

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def info(self) -> dict:
        """What the report records about the process group."""
        return {"world_size": self.world, "backend": self.backend}

    # -- model and data -----------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP around `model` (which probes keep using); `model` itself in one process."""
        if not self.active:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP
        p = next(model.parameters())
        ids = [p.device.index if p.device.index is not None else torch.cuda.current_device()] \
            if p.device.type == "cuda" else None
        # buffers (the PE table) are constants: synced once at init, not on every forward
        params = inspect.signature(DDP.__init__).parameters
        sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params \
            else {"broadcast_buffers": False}   # torch < 2.13
        return DDP(model, device_ids=ids, **sync)

    def check_batch(self, batch_size: int) -> None:
        if self.active and batch_size % self.world:
            raise UsageError(f"--batch-size {batch_size} does not split over {self.world} processes; "
                             f"use a multiple of {self.world}")

    def shard(self, batch: Batch) -> Batch:
        """This rank's contiguous rows of the global batch.  [B, L] -> [B / world, L]"""
        if not self.active:
            return batch
        b = batch.src.shape[0] // self.world
        rows = slice(self.rank * b, (self.rank + 1) * b)
        return Batch(*(t[rows] for t in batch))

    def loss_weight(self, global_batch: Batch, part: Batch) -> float:
        """Scale for this rank's token-mean loss so that DDP's average of the ranks' gradients
        (and the ranks' mean loss) equals the token mean over the global batch."""
        if not self.active:
            return 1.0
        return part.ntokens * self.world / max(global_batch.ntokens, 1)

    # -- collectives ----------------------------------------------------------------------------
    @property
    def reducer(self):
        """The engine's `reducer` under DDP (None in one process)."""
        return self._reduce if self.active else None

    def _reduce(self, packed: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of the packed probe statistics, on their device (one all-reduce)."""
        n = packed.numel()
        sizes = torch.tensor([n, -n], dtype=torch.int64)
        tdist.all_reduce(sizes, op=tdist.ReduceOp.MAX, group=self.control)   # host ints, gloo
        hi, lo = int(sizes[0]), -int(sizes[1])
        if hi != lo:
            raise RankFailed(f"ranks disagree on the probe statistics ({lo} to {hi} values): a probe "
                             f"observed something on one rank only")
        tdist.all_reduce(packed)
        return packed.div_(self.world)

    def agree_max(self, values: list[float]) -> list[float]:
        """The elementwise maximum over ranks of host numbers (one all-reduce on the control
        group: no device sync); the probe budget's exchange (probes/budget.py)."""
        if not self.active or self.broken:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=self.control)
        return t.tolist()

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        if self.active and not self.broken:
            tdist.all_reduce(values)
            values = values.div_(self.world)
        return values

    def gather_findings(self, findings: list[Finding]) -> list[Finding]:
        """Every rank's findings on rank 0, each with its rank, duplicates once (lowest rank)."""
        if not self.active:
            return list(findings)
        mine = [dataclasses.replace(f, rank=self.rank) for f in findings]
        if self.broken:
            return mine
        out = [None] * self.world if self.is_main else None
        tdist.gather_object(mine, out, dst=0, group=self.control)
        return merge_findings(out) if self.is_main else mine

    def settle(self) -> None:
        """Wait until every rank gets here (after rank 0 has written its report). A rank that
        left early and tore down its process group could abort (seen with gloo under load:
        "terminate called without an active exception"), and torchrun then kills rank 0
        before its report is on disk."""
        if self.active and not self.broken and tdist.is_initialized():
            tdist.barrier(group=self.control)

    def close(self) -> None:
        if self.active and not self.broken and tdist.is_initialized():
            self.settle()
            tdist.destroy_process_group()

    # -- failure --------------------------------------------------------------------------------
    def _error_path(self, rank: int) -> Path | None:
        if self.error_dir is None:
            return None
        return Path(self.error_dir) / f".tndebug-rank{rank}-{self.run_id}.error"

    def failed(self, exc: BaseException, step: int | None) -> str:
        """Note a failure on this rank; no collective after this. Non-main ranks leave their
        error for rank 0 and raise RankFailed; rank 0 returns the first error of the run."""
        self.broken = True
        own = {"rank": self.rank, "step": step, "time": time.time(),
               "error": f"{type(exc).__name__}: {_first_line(exc)}",
               "collateral": _collateral(exc)}
        if not self.is_main:
            path = self._error_path(self.rank)
            if path is not None:
                with contextlib.suppress(OSError):
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(own))
            raise RankFailed(_describe(own)) from exc
        return _describe(self._first_error(own))

    def _first_error(self, own: dict, wait_s: float = 3.0) -> dict:
        """The root cause: the earliest non-collateral error of any rank (peers' files)."""
        deadline = time.monotonic() + (wait_s if own["collateral"] else 0.0)
        while True:
            peers = []
            for r in range(1, self.world):
                path = self._error_path(r)
                if path is not None and path.is_file():
                    with contextlib.suppress(OSError, ValueError):
                        peers.append(json.loads(path.read_text()))
                        path.unlink()
            if peers or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        errors = [own] + peers
        errors.sort(key=lambda e: (bool(e.get("collateral")), e.get("time", 0.0)))
        return errors[0]

    @contextlib.contextmanager
    def terminable(self):
        """Inside: torchrun's SIGTERM raises Terminated (once, unless a failure is already being
        handled), so rank 0 can still write its report. Outside: SIGTERM is ignored until the
        process ends (torchrun escalates to SIGKILL after its grace period)."""
        if not self.active or not _main_thread():
            yield
            return

        def on_term(signum, frame):
            if not self.broken:
                self.broken = True
                raise Terminated("stopped by torchrun (another rank failed)")

        signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN if self.is_main else signal.SIG_DFL)


LOCAL = Dist()


# -- setup -------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def init_from_env(device: str = "auto", *, error_dir: str | Path | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> Dist:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR);
    `LOCAL` when not launched by torchrun. gloo on CPU, NCCL on CUDA (one GPU per process)."""
    if not under_torchrun():
        return LOCAL
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available here (use --device cpu or auto)")
    timeout = timedelta(seconds=timeout_s)
    control = None
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                             f"use --nproc <= {torch.cuda.device_count()}")
        torch.cuda.set_device(local_rank)
        tdist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
        control = tdist.new_group(backend="gloo", timeout=timeout)   # host ints and objects
    else:
        tdist.init_process_group("gloo", timeout=timeout)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "") + "-" + os.environ.get("MASTER_PORT", "")
    return Dist(rank=rank, world=world, local_rank=local_rank, backend=tdist.get_backend(),
                control=control, error_dir=Path(error_dir) if error_dir else None,
                run_id=run_id.strip("-") or "run")


def launch(argv: list[str], nproc: int, *, device: str = "auto") -> int:
    """`tndebug run --nproc N`: the same command under torchrun, N processes on this machine.

    Returns rank 0's exit code (0 clean, 1 findings, 3 a rank failed); 3 when torchrun failed
    before rank 0 could say."""
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: need at least 1 process")
    if device == "cuda" and torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {nproc} with --device cuda: only {torch.cuda.device_count()} GPU(s)")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    with tempfile.TemporaryDirectory(prefix="tndebug-launch-") as tmp:
        exit_file = Path(tmp) / "exit_code"
        env[EXIT_FILE_ENV] = str(exit_file)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "tndebug", *argv]
        proc = subprocess.run(cmd, env=env)
        if exit_file.is_file():
            with contextlib.suppress(ValueError):
                return int(exit_file.read_text().strip())
    if proc.returncode == 0:
        return 0
    print(f"tndebug: error: the {nproc}-process run failed (torchrun exit {proc.returncode}) "
          f"before rank 0 wrote a report; see the rank errors above", file=sys.stderr)
    return 3


def report_exit(code: int) -> int:
    """Rank 0 under `launch`: leave the exit code for the launcher, exit 0 unless it failed
    (torchrun treats any non-zero exit as a crash and prints its own traceback)."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path:
        return code
    with contextlib.suppress(OSError):
        Path(path).write_text(str(code))
    return code if code >= 3 else 0


# -- device helpers ----------------------------------------------------------------------------
def to_device(batch: Batch, device: torch.device) -> Batch:
    """Copy a host batch to `device`. On CUDA through pinned memory, so the copy is queued
    without waiting for the GPU (a copy from pageable memory synchronises the stream)."""
    if device.type != "cuda":
        return batch.to(device)
    return Batch(*(t.pin_memory().to(device, non_blocking=True) for t in batch))


class LossLog:
    """Losses stay on the device until a sync point; then one stack, one all-reduce (mean over
    ranks) and one copy to the host for all of them.

        log.add(step, loss)               # every step: no host sync
        for step, value in log.flush():   # at log / probed / last steps, the same on every rank
    """

    def __init__(self, dist: Dist = LOCAL) -> None:
        self.dist = dist
        self._steps: list[int] = []
        self._losses: list[torch.Tensor] = []

    def add(self, step: int, loss: torch.Tensor) -> None:
        self._steps.append(step)
        self._losses.append(loss.detach().float().reshape(()))

    def flush(self) -> list[tuple[int, float]]:
        if not self._losses:
            return []
        values = self.dist.mean(torch.stack(self._losses)).tolist()       # [n] -> host
        out = list(zip(self._steps, values))
        self._steps, self._losses = [], []
        return out


def reads_loss_every_step(device: torch.device, dist: Dist = LOCAL) -> bool:
    """One CPU process reads the loss every step: it costs nothing there, and a NaN then
    stops the run before the optimizer takes it. On a GPU or across processes the loss is
    read at log steps only, so the steps in between queue without waiting."""
    return device.type == "cpu" and not dist.active


# -- checkpoints and findings ------------------------------------------------------------------
def merge_findings(per_rank: list[list[Finding]]) -> list[Finding]:
    """Rank 0's findings, then any other rank's that no lower rank reported (same probe,
    severity, place and step)."""
    seen: set[tuple] = set()
    out: list[Finding] = []
    for findings in per_rank:
        new = [f for f in findings or [] if _key(f) not in seen]
        seen.update(_key(f) for f in new)
        out.extend(new)
    return out


def _key(f: Finding) -> tuple:
    return f.probe, f.severity, f.where, f.step, f.layer, f.head


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _collateral(exc: BaseException) -> bool:
    """A failed collective or torchrun's stop: a consequence of another rank's failure."""
    if isinstance(exc, (Terminated, tdist.DistError)):
        return True
    text = str(exc).lower()
    return any(w in text for w in ("gloo", "nccl", "connection closed", "connection reset",
                                   "broken pipe", "timed out"))


def _describe(err: dict) -> str:
    at = f" at step {err['step']}" if err.get("step") is not None else ""
    return f"rank {err['rank']}{at}: {err['error']}"


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
