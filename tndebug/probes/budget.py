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

Over several processes (DDP, FSDP2) every rank must probe the same steps, or their
collectives no longer pair up. Each rank measures its own steps as above, and every
SYNC_EVERY steps (a count every rank reaches together) the ranks exchange what they measured
in one all-reduce of a few numbers (`agree`: the elementwise maximum over ranks: the slowest
rank's step time and the costliest rank's probes, since each step of a synchronous run waits
for both). Between exchanges `allows()` reads only the agreed numbers and the step count,
extrapolating what was spent since (each probed step at the agreed expected cost, each plain
one at the agreed own-hook cost), so every rank reaches the same answer with no collective
before a step; the next exchange replaces the estimate by what was measured.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

DEFAULT_FRACTION = 0.03     # issue 20's target for watch: <= 1.03x the user's own loop
# Steps no probe captured, before the budget judges: the first steps of a loop are slow
# (allocator, autotuning, lazy init) and mostly probed (log-spaced schedules), so the user's
# step time is not known before a few plain steps; until then nothing is thinned.
MIN_PLAIN = 5
WINDOW = 50                 # the last plain intervals / probed costs the medians are taken over
# Over several processes the ranks agree every SYNC_EVERY steps: one all-reduce of 8 host
# numbers (~0.1-1 ms on gloo) every 10 steps is under 0.1% of any step that takes 10 ms, and
# a stale view lasts at most 10 steps, during which the spending is extrapolated from the
# agreed medians rather than ignored.
SYNC_EVERY = 10
_AGREED = ("plain", "costs", "step_s", "expected", "worst", "spent_s", "own_s", "reserve")


class Budget:
    def __init__(self, fraction: float = DEFAULT_FRACTION,
                 agree: Callable[[list[float]], list[float]] | None = None) -> None:
        """`agree`: over several processes, the elementwise maximum over ranks of a list of
        numbers (one collective; `Dist.agree_max`); None in one process."""
        self.fraction = fraction
        self.agree = agree
        self._plain: list[float] = []
        self._costs: list[float] = []
        self._own: list[float] = []          # tndebug's own time on the last plain steps
        self._agreed: dict[str, float] | None = None   # the ranks' view at the last exchange
        self._since = [0, 0]                 # probed, plain steps since that exchange
        self.syncs = 0
        self.steps = 0               # intervals measured
        self.spent_s = 0.0           # the probed steps' cost beyond the user's own step time
        self.thinned: dict[str, int] = {}
        # a capture is held back for the run's closing snapshot (the figures' last step, never
        # thinned), as the costliest of the last WINDOW probed steps: bench/results/watch_overhead.json at
        # a044675 spent 3.5-3.7% by the budget's own account on the ~25 ms model, the snapshot
        # at the end being over. Set by the engine when a snapshot will come.
        self.final_reserve = False
        # the cost of probed steps that held a look never deferred (a probe's first, the closing
        # snapshot): fixed whatever the fraction, so a short run may spend more than it
        self.fixed_s = 0.0
        self.fixed_next = False              # set by the engine for the step begun

    def record(self, seconds: float, probed: bool, own: float = 0.0) -> None:
        """One step of the user's model took `seconds`, `own` of them in tndebug's hooks (which
        every step pays, probed or not); `probed`: the probes captured on it."""
        self.steps += 1
        if probed:
            cost = max(seconds - self.step_s, own) if self._plain else own
            self._costs = [*self._costs[-(WINDOW - 1):], cost]
            self.spent_s += cost
            self.fixed_s += cost if self.fixed_next else 0.0
        else:
            self._plain = [*self._plain[-(WINDOW - 1):], max(seconds - own, 0.0)]
            self._own = [*self._own[-(WINDOW - 1):], own]
            self.spent_s += own
        self.fixed_next = False
        if self.agree is not None:
            self._since[0 if probed else 1] += 1
            if self.steps % SYNC_EVERY == 0:      # the same steps on every rank
                self._exchange()

    def _exchange(self) -> None:
        """One collective: every rank's view replaced by the maximum over ranks."""
        t0 = time.perf_counter()
        mine = [len(self._plain), len(self._costs), self.step_s, self._expected(),
                max(self._costs, default=0.0), self.spent_s,
                statistics.median(self._own) if self._own else 0.0, float(self.final_reserve)]
        self._agreed = dict(zip(_AGREED, (float(v) for v in self.agree(mine))))
        self._since = [0, 0]
        self.syncs += 1
        self.spent_s += time.perf_counter() - t0     # the exchange is the budget's own cost

    def _expected(self) -> float:
        return statistics.median(self._costs[-WINDOW:]) if self._costs else 0.0

    @property
    def reserves_final(self) -> bool:
        """Whether the closing snapshot is paid for ahead (over ranks: whether any rank takes
        it; rank 0 alone writes the figures, and every rank must decide as it does)."""
        if self.agree is None:
            return self.final_reserve
        return bool(self._agreed and self._agreed["reserve"])

    @property
    def step_s(self) -> float:
        """The user's own step time: the median plain interval (0 before any)."""
        return statistics.median(self._plain) if self._plain else 0.0

    def allows(self) -> bool:
        """Whether one more probed step fits: spent + its expected cost <= fraction of the
        user's time over the steps so far and this one. Over several processes: from the
        ranks' agreed view only (the same answer on every rank)."""
        if self.agree is not None:
            return self._allows_agreed()
        if len(self._plain) < MIN_PLAIN or not self._costs:
            return True
        expected = self._expected()
        reserve = max(self._costs) if self.final_reserve else 0.0
        return self.spent_s + expected + reserve <= self.fraction * self.step_s * (self.steps + 1)

    def _allows_agreed(self) -> bool:
        a = self._agreed
        if a is None or a["plain"] < MIN_PLAIN or not a["costs"]:
            return True
        spent = a["spent_s"] + self._since[0] * a["expected"] + self._since[1] * a["own_s"]
        reserve = a["worst"] if a["reserve"] else 0.0
        return spent + a["expected"] + reserve <= self.fraction * a["step_s"] * (self.steps + 1)

    def thin(self, name: str) -> None:
        self.thinned[name] = self.thinned.get(name, 0) + 1

    def summary(self) -> dict:
        """What the report says about the budget (run.probe_budget): what it spent, and the
        scheduled looks it deferred (`thinned`, probe -> steps skipped), in words (`note`)."""
        user = self.step_s * self.steps
        out = {"fraction": self.fraction, "user_step_s": round(self.step_s, 6),
               "steps_measured": self.steps, "spent_s": round(self.spent_s, 4),
               "spent_fraction": round(self.spent_s / user, 4) if user > 0 else None,
               "fixed_fraction": round(self.fixed_s / user, 4) if user > 0 else None,
               "thinned": dict(self.thinned)}
        if self.agree is not None:      # the ranks' maxima at the last exchange decided
            a = self._agreed or {}
            out["ranks_agreed"] = {"every_steps": SYNC_EVERY, "exchanges": self.syncs,
                                   "user_step_s": round(a.get("step_s", 0.0), 6),
                                   "spent_s": round(a.get("spent_s", 0.0), 4)}
        if self.thinned:
            each = ", ".join(f"{name} {n}" for name, n in sorted(self.thinned.items()))
            out["note"] = (f"scheduled looks deferred to keep the probes within {self.fraction * 100:g}% "
                           f"of the step time: {each} steps skipped; each probe still looked at "
                           "least once, and the exempt probes every time they were due")
        return out
