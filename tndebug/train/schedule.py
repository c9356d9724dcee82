"""Learning-rate schedules: plain `step -> lr` callables with a readable `__doc__`.

The Noam schedule of the paper (§5.3), with the step counted from 0 as the trainer counts it:

    lr(step) = factor * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5),   s = step + 1
"""
from __future__ import annotations

from typing import Callable

Schedule = Callable[[int], float]


def noam(d_model: int, warmup: int, factor: float = 1.0) -> Schedule:
    """Linear warmup for `warmup` steps, then decay as 1/sqrt(step) (Vaswani et al. §5.3)."""
    if warmup < 1:
        raise ValueError(f"warmup={warmup} must be >= 1")
    scale = factor * d_model ** -0.5

    def lr(step: int) -> float:
        s = step + 1
        return scale * min(s ** -0.5, s * warmup ** -1.5)

    lr.__doc__ = f"noam(d_model={d_model}, warmup={warmup}, factor={factor})"
    return lr


def constant(value: float) -> Schedule:
    """The same lr at every step."""
    def lr(step: int) -> float:
        return value

    lr.__doc__ = f"constant({value})"
    return lr


def peak(schedule: Schedule, steps: int) -> tuple[int, float]:
    """(step, lr) of the largest lr within the first `steps` steps."""
    best = max(range(steps), key=schedule)
    return best, schedule(best)
