"""A silent session for benchmarks: no output, and a clock stamped at two progress updates so
that per-step time excludes probe setup and the first steps (warm-up, allocator, autotuning)."""
from __future__ import annotations

import contextlib
import time

import torch


class StepTimer:
    """Pass as `session=` to `run_training`. `step_seconds()` is the mean time of the steps
    after the first `skip` (on CUDA the two stamps synchronise the device first)."""

    def __init__(self, skip: int = 2) -> None:
        self.out_dir = None            # no checkpoint
        self.sinks: list = []
        self.skip = skip
        self._stamps: list[tuple[int, float]] = []

    @contextlib.contextmanager
    def progress(self, total: int, description: str = "training"):
        timer = self

        class Bar:
            def update(self, done: int, **metrics) -> None:
                if done == timer.skip or done == total:
                    if torch.cuda.is_available() and torch.cuda.is_initialized():
                        torch.cuda.synchronize()
                    timer._stamps.append((done, time.perf_counter()))

        yield Bar()

    def log_scalars(self, step: int, scalars: dict) -> None:
        pass

    def step_seconds(self) -> float | None:
        if len(self._stamps) < 2:
            return None
        (d0, t0), (d1, t1) = self._stamps[0], self._stamps[-1]
        return (t1 - t0) / (d1 - d0) if d1 > d0 else None
