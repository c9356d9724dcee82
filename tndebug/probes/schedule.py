"""Schedules: `step -> bool` callables that say when a probe runs."""
from __future__ import annotations


class Schedule:
    def __init__(self, fn, doc: str) -> None:
        self._fn, self.__doc__ = fn, doc

    def __call__(self, step: int) -> bool:
        return bool(self._fn(step))

    def __or__(self, other: "Schedule") -> "Schedule":
        return Schedule(lambda s: self(s) or other(s), f"{self.__doc__} or {other.__doc__}")

    def __repr__(self) -> str:
        return f"<schedule: {self.__doc__}>"


def every(n: int, start: int = 0) -> Schedule:
    return Schedule(lambda s: s >= start and (s - start) % n == 0, f"every {n} steps")


def at(*steps: int) -> Schedule:
    wanted = frozenset(steps)
    return Schedule(lambda s: s in wanted, "at steps " + ",".join(map(str, sorted(wanted))))


def once() -> Schedule:
    return at(0)


def log_spaced(then_every: int = 250) -> Schedule:
    """Steps 0, 1, 2, 4, 8, ... and every `then_every` after."""
    return Schedule(lambda s: s == 0 or (s & (s - 1)) == 0 or s % then_every == 0,
                    f"log-spaced, then every {then_every}")


def never() -> Schedule:
    return Schedule(lambda s: False, "never")


def own_hooks() -> Schedule:
    """Never due to the engine (no trace is captured for it): the probe sees every optimizer
    step through hooks of its own (zero-grad, train-mode)."""
    return Schedule(lambda s: False, "at every optimizer step, through its own optimizer hooks")
