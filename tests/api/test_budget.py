"""The probes' cost budget on a user's own loop (probes/budget.py, `watch(budget=)`): probed
steps are thinned so that they cost at most the given share of the user's own step time; each
probe still looks at least once, and the probes that capture nothing are never thinned."""
from __future__ import annotations

import pytest
import torch

import models as M
import tndebug
from tndebug.errors import UsageError
from tndebug.probes.budget import MIN_PLAIN, Budget


def _clock(budget: Budget, pattern, step_s=0.010, cost_s=0.100):
    """Feed `budget` step times: pattern[i] True = step i was probed (costs cost_s more)."""
    for probed in pattern:
        budget.record(step_s + (cost_s if probed else 0.0), probed)


def test_the_budget_learns_the_step_time_and_refuses_what_does_not_fit():
    b = Budget(0.03)
    assert b.allows()                                  # nothing known yet: never thin
    _clock(b, [False] * MIN_PLAIN + [True])
    assert b.step_s == pytest.approx(0.010)
    assert b.spent_s == pytest.approx(0.100)
    # 0.100 s spent + 0.100 expected > 3% of 0.010 s x 7 steps: refused ...
    assert not b.allows()
    # ... until enough plain steps have passed: 0.2 <= 0.03 * 0.01 * (n + 1) from n = 666
    _clock(b, [False] * 700)
    assert b.allows()
    s = b.summary()
    assert s["fraction"] == 0.03 and s["spent_fraction"] == pytest.approx(0.100 / (0.010 * s["steps_measured"]), abs=1e-4)


def test_the_closing_snapshot_is_paid_for_ahead():
    """With a snapshot to come, the costliest capture seen is held back: the looks stop that much
    earlier, so the run ends within its fraction once the snapshot is spent."""
    plain, reserved = Budget(0.03), Budget(0.03)
    reserved.final_reserve = True
    for b in (plain, reserved):
        _clock(b, [False] * MIN_PLAIN + [True])       # 0.100 s spent, 0.100 expected
        _clock(b, [False] * 700)
    # 0.2 <= 0.03 * 0.01 * 707 for the plain one; the reserved one needs 0.3: 1000 steps
    assert plain.allows() and not reserved.allows()
    _clock(reserved, [False] * 300)
    assert reserved.allows()


def test_the_looks_never_deferred_are_counted_apart():
    """A probed step the engine marks fixed (a first look, the closing snapshot) is spent as any
    other, and also counted apart: the share no fraction can thin (summary's fixed_fraction)."""
    b = Budget(0.03)
    _clock(b, [False] * MIN_PLAIN)
    b.fixed_next = True
    _clock(b, [True, True])                            # the first fixed, the second not
    assert b.spent_s == pytest.approx(0.200) and b.fixed_s == pytest.approx(0.100)
    s = b.summary()
    assert s["fixed_fraction"] == pytest.approx(0.100 / (0.010 * 7), abs=1e-4)
    assert s["fixed_fraction"] < s["spent_fraction"]


def test_a_plain_steps_median_ignores_one_slow_step():
    b = Budget(0.03)
    for dt in [0.01] * 9 + [5.0] + [0.01] * 9:            # a checkpoint save in one step
        b.record(dt, False)
    assert b.step_s == pytest.approx(0.01)


def _watched(budget, steps=120):
    build, forward = M.MODELS["sdpa"]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tndebug.watch(model, opt, forward=forward, quiet=True, total_steps=steps,
                       budget=budget) as dbg:
        M.train("sdpa", model, opt, steps)
    return dbg.report


def test_a_probed_steps_moment_is_spent_once(monkeypatch):
    """The probes' moment (end_step, in the optimizer's step pre-hook) is the probed step's cost;
    its time was also charged as tndebug's own time to the next step, a plain one, so every
    look was spent twice (and each ranks' exchange: bench/ddp_overhead.py --arm fsdp2 spent
    4.7% by the budget's account). Here each probed step's moment sleeps 50 ms."""
    import time
    from tndebug.probes.engine import ProbeEngine
    end_step, record = ProbeEngine.end_step, Budget.record
    seen: list[tuple[bool, float]] = []

    def slow_end_step(self, info):
        if self._trace is not None and any(p.reads for p in self._due):
            time.sleep(0.05)
        return end_step(self, info)

    def logged(self, seconds, probed, own=0.0):
        seen.append((probed, own))
        return record(self, seconds, probed, own)
    monkeypatch.setattr(ProbeEngine, "end_step", slow_end_step)
    monkeypatch.setattr(Budget, "record", logged)
    _watched(0.99, steps=40)                         # nothing thinned: every scheduled look
    after = [own for (was, _), (now, own) in zip(seen, seen[1:]) if was and not now]
    assert len(after) >= 3, seen
    assert max(after) < 0.05, after                  # the plain step's own hooks only


def _two_ranks(agreeing: bool, steps: int = 300):
    """Two budgets fed in lockstep (a thread each, as two processes), rank 1's steps and
    probes slower; `agreeing`: their exchange is the elementwise maximum (Dist.agree_max).
    Returns each rank's allows() answers, step by step."""
    import threading
    barrier, slots = threading.Barrier(2), [None, None]

    def agree_for(rank):
        def agree(values):
            slots[rank] = values
            barrier.wait()
            out = [max(a, b) for a, b in zip(*slots)]
            barrier.wait()
            return out
        return agree
    budgets = [Budget(0.2, agree=agree_for(r) if agreeing else None) for r in (0, 1)]
    answers: list[list[bool]] = [[], []]

    def feed(rank):
        b = budgets[rank]
        for step in range(steps):
            probed = step % 2 == 0 and b.allows()      # a probe due every other step
            answers[rank].append(probed)
            b.record((0.010 if rank == 0 else 0.012) + ((0.020 if rank == 0 else 0.080) if probed else 0.0),
                     probed, own=0.0002)
    threads = [threading.Thread(target=feed, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return answers, budgets


def test_ranks_that_measure_differently_thin_the_same_steps():
    """Over several processes each rank decides from the ranks' agreed maxima: the same answer
    on every step, though rank 1 is slower; alone, each would have thinned other steps."""
    alone, _ = _two_ranks(agreeing=False)
    assert alone[0] != alone[1]
    (a0, a1), budgets = _two_ranks(agreeing=True)
    assert a0 == a1
    assert a0[:10:2] == [True] * 5                     # nothing agreed before the first exchange
    assert not all(a0[::2]) and any(a0[100:])          # thinned, and still looking
    # the agreed cost is rank 1's: its probes (80 ms over a 12 ms step) buy fewer looks than
    # rank 0's own measurements would (20 ms over 10 ms)
    assert sum(a0) < sum(alone[0])
    summary = budgets[0].summary()["ranks_agreed"]
    assert summary["exchanges"] == 30 and summary["user_step_s"] == pytest.approx(0.012 - 0.0002)


def test_a_tight_budget_thins_the_costly_looks_and_keeps_every_verdict():
    """A tiny model's step is a few ms and a captured step tens of ms: at 1% most of the
    scheduled captures are skipped. Every probe still has its verdict, loss-health (which
    captures nothing) looked at every one of its steps, and the report says what was done."""
    full, thin = _watched(None), _watched(0.01)
    assert "probe_budget" not in full.run
    budget = thin.run["probe_budget"]
    assert budget["fraction"] == 0.01 and budget["thinned"], budget
    assert any("thinned" in n for n in thin.run.get("notes", []))
    for name, entry in full.probes.items():
        assert thin.probes[name]["status"] == entry["status"], (name, thin.probes[name], entry)
    assert thin.verdict == full.verdict == "clean"
    assert thin.probes["loss-health"]["steps_observed"] == full.probes["loss-health"]["steps_observed"]
    assert "loss-health" not in budget["thinned"]
    assert 0 < budget["fixed_fraction"] <= budget["spent_fraction"], budget   # the first looks
    looks = lambda r: sum(e.get("steps_observed", 0) for e in r.probes.values())  # noqa: E731
    assert looks(thin) < looks(full)
    for name in budget["thinned"]:                    # each looked once at least
        assert thin.probes[name]["status"] != "no verdict"
        if "steps_observed" in thin.probes[name]:
            assert thin.probes[name]["steps_observed"] >= 1


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, "3%", True])
def test_a_budget_that_is_no_fraction_is_refused(bad):
    model = M.MODELS["sdpa"][0]()
    with pytest.raises(UsageError, match="budget="):
        tndebug.watch(model, torch.optim.Adam(model.parameters()), forward=M.MODELS["sdpa"][1],
                      budget=bad)
