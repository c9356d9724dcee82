"""A cost budget for the probes on a training loop (`tndebug.watch` on the user's, and
`tndebug run`'s own: TrainConfig.probe_budget, --probe-budget): the probed steps may
cost at most `fraction` of the user's own step time, the way a sampling profiler bounds its
overhead, whatever the model's size and the probes' schedules.

Measured, not estimated: the front-end times each step of the user's model from its forward
to the update (forward, loss, backward and, on a probed step, the probes' recording and their
work; not the data loading or an evaluation between steps, so the budget errs on the strict
side) and hands it to `record()`, with the time spent in tndebug's own hooks (every step pays
it, and it is spent from the budget too). The steps no probe captured give the user's own step time
(their median: a garbage collection in one step does not move it); a probed step's time beyond
that median is what the probes cost. Before a probed step, `allows()` says whether its expected
cost (the median of the last probed steps' costs) still fits in `fraction` of the user's time
so far.

What is never thinned: a probe's first observation (each probe judges at least once, so the
budget never turns a verdict into "no verdict"), probes that capture nothing (loss-health,
lr-schedule, label-smoothing, ...: the loss and the lr, a sync at most, so divergence is seen
when it happens), the last step's snapshot for the figures (paid for ahead: `final_reserve` holds back the
costliest of the last WINDOW probed steps), and the setup's exact tests (they run before the first step,
outside any budget).
"""
from __future__ import annotations

import statistics

DEFAULT_FRACTION = 0.03     # issue 20's target for watch: <= 1.03x the user's own loop
# Steps no probe captured, before the budget judges: the first steps of a loop are slow
# (allocator, autotuning, lazy init) and mostly probed (log-spaced schedules), so the user's
# step time is not known before a few plain steps; until then nothing is thinned.
MIN_PLAIN = 5
WINDOW = 50                 # the last plain intervals / probed costs the medians are taken over


class Budget:
    def __init__(self, fraction: float = DEFAULT_FRACTION) -> None:
        self.fraction = fraction
        self._plain: list[float] = []
        self._costs: list[float] = []
        self.steps = 0               # intervals measured
        self.spent_s = 0.0           # the probed steps' cost beyond the user's own step time
        self.thinned: dict[str, int] = {}
        # a capture is held back for the run's closing snapshot (the figures' last step, never
        # thinned), as the costliest of the last WINDOW probed steps: bench/results/watch_overhead.json at
        # a044675 spent 3.5-3.7% by the budget's own account on the ~25 ms model, the snapshot
        # at the end being over. Set by the engine when a snapshot will come.
        self.final_reserve = False

    def record(self, seconds: float, probed: bool, own: float = 0.0) -> None:
        """One step of the user's model took `seconds`, `own` of them in tndebug's hooks (which
        every step pays, probed or not); `probed`: the probes captured on it."""
        self.steps += 1
        if probed:
            cost = max(seconds - self.step_s, own) if self._plain else own
            self._costs = [*self._costs[-(WINDOW - 1):], cost]
            self.spent_s += cost
        else:
            self._plain = [*self._plain[-(WINDOW - 1):], max(seconds - own, 0.0)]
            self.spent_s += own

    @property
    def step_s(self) -> float:
        """The user's own step time: the median plain interval (0 before any)."""
        return statistics.median(self._plain) if self._plain else 0.0

    def allows(self) -> bool:
        """Whether one more probed step fits: spent + its expected cost <= fraction of the
        user's time over the steps so far and this one."""
        if len(self._plain) < MIN_PLAIN or not self._costs:
            return True
        expected = statistics.median(self._costs[-WINDOW:])
        reserve = max(self._costs) if self.final_reserve else 0.0
        return self.spent_s + expected + reserve <= self.fraction * self.step_s * (self.steps + 1)

    def thin(self, name: str) -> None:
        self.thinned[name] = self.thinned.get(name, 0) + 1

    def summary(self) -> dict:
        """What the report says about the budget (run.probe_budget): what it spent, and the
        scheduled looks it deferred (`thinned`, probe -> steps skipped), in words (`note`)."""
        user = self.step_s * self.steps
        out = {"fraction": self.fraction, "user_step_s": round(self.step_s, 6),
               "steps_measured": self.steps, "spent_s": round(self.spent_s, 4),
               "spent_fraction": round(self.spent_s / user, 4) if user > 0 else None,
               "thinned": dict(self.thinned)}
        if self.thinned:
            each = ", ".join(f"{name} {n}" for name, n in sorted(self.thinned.items()))
            out["note"] = (f"scheduled looks deferred to keep the probes within {self.fraction * 100:g}% "
                           f"of the step time: {each} steps skipped; each probe still looked at "
                           "least once, and the exempt probes every time they were due")
        return out
