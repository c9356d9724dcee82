"""tndebug.watch on 2 gloo processes (torchrun), the model sharded with FSDP2 (`fully_shard` on
each block and the root: parameters and gradients are DTensors) or wrapped in DDP: one report,
written by rank 0, that states the world size and the sharding; a healthy run as clean as the
same model in one process; three bugs named as in one process. The worker is
tests/api/fsdp_watch_worker.py (a nanoGPT-style decoder, AdamW, 60 steps)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fsdp_watch_worker.py")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_launch import ROOT, torchrun  # noqa: E402

STEPS = "60"
NOT_WRITING = "no report here; rank 0 writes the run's one report"


def _run(out: Path, shard: str, bug: str, env: dict | None = None):
    def clear():
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(f"{out}.ranks", ignore_errors=True)
    proc = torchrun(WORKER, [str(out), shard, bug, STEPS], env=env, before_retry=clear)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text()), proc.stderr


def _serious(report) -> set[tuple[str, str]]:
    return {(f["code"], f["severity"]) for f in report["findings"] if f["severity"] != "info"}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same model, data and loop in one process, healthy."""
    out = tmp_path_factory.mktemp("one") / "healthy"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    proc = subprocess.run([sys.executable, str(WORKER), str(out), "none", "healthy", STEPS],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("shard", ["fsdp", "ddp"])
def test_healthy_sharded_run_is_one_report_as_clean_as_one_process(tmp_path, shard, one_process):
    report, stderr = _run(tmp_path / "run", shard, "healthy")
    assert one_process["verdict"] == "clean", one_process["findings"]
    assert report["verdict"] == "clean", report["findings"]
    assert _serious(report) == _serious(one_process) == set()
    run = report["run"]
    assert run["world_size"] == 2 and run["sharding"] == {"fsdp": "fsdp2", "ddp": "ddp"}[shard]
    assert run["steps"] == int(STEPS) and run["backend"] == "gloo"
    # each rank trains on its own rows: their losses differ, and the report says so per rank
    assert len(run["per_rank"]["final_loss"]) == 2, run.get("per_rank")
    # every probe that ran in one process ran here too: none switched off, none without a verdict
    for name, status in one_process["probes"].items():
        assert report["probes"][name]["status"] == status["status"], (name, report["probes"][name])
    assert not [f for f in report["findings"] if f["code"].endswith("/probe-failed")]
    assert stderr.count(NOT_WRITING) == 1 and "rank 1 of 2" in stderr   # rank 1 says so, once
    ranks = [json.loads((tmp_path / "run.ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("shard", ["fsdp", "ddp"])
@pytest.mark.parametrize("bug,code", [("no_scale", "missing-scale/absent"),
                                      ("no_causal", "mask-broadcast/causal-leak"),
                                      ("no_zero_grad", "zero-grad/grads-accumulate")])
def test_a_bug_under_sharding_is_named_as_in_one_process(tmp_path, shard, bug, code):
    report, _ = _run(tmp_path / "run", shard, bug)
    errors = {c for c, sev in _serious(report) if sev == "error"}
    assert errors == {code}, report["findings"]
    assert all(f["rank"] == 0 for f in report["findings"] if f["code"] == code)   # merged once
    assert not [f for f in report["findings"] if f["code"].endswith("/probe-failed")]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("shard", ["fsdp", "ddp"])
def test_the_budget_thins_the_same_looks_on_every_rank(tmp_path, shard, one_process):
    """watch's budget applies under FSDP2 and DDP (it did not: every scheduled look ran), the
    ranks skipping the same looks though rank 1's probed steps cost 60 ms more; each probe
    still looks, so the healthy run stays as clean as in one process."""
    report, _ = _run(tmp_path / "run", shard, "healthy",
                     env={"TNDEBUG_TEST_BUDGET": "0.05", "TNDEBUG_TEST_SLOW_RANK": "1"})
    budget = report["run"]["probe_budget"]
    assert budget["thinned"] and budget["ranks_agreed"]["exchanges"] == int(STEPS) // 10, budget
    ranks = [json.loads((tmp_path / "run.ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["budget"]["thinned"] == ranks[1]["budget"]["thinned"] == budget["thinned"]
    assert ranks[0]["observed"] == ranks[1]["observed"]
    assert report["verdict"] == "clean", report["findings"]
    for name, status in one_process["probes"].items():
        assert report["probes"][name]["status"] == status["status"], (name, report["probes"][name])


LIGHTNING = Path(__file__).with_name("lightning_fsdp_worker.py")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("bug,errors", [("healthy", set()), ("no_scale", {"missing-scale/absent"}),
                                        ("no_zero_grad", {"zero-grad/grads-accumulate"})])
def test_lightning_callback_under_fsdp2(tmp_path, bug, errors):
    """Lightning's ModelParallelStrategy (FSDP2: fully_shard in configure_model), gloo, CPU:
    the callback's one report, as clean as the loop above or naming the missing scale, or the
    gradients that add up when `optimizer_zero_grad` does nothing (zero-grad hooks the optimizer
    Lightning steps)."""
    pytest.importorskip("pytorch_lightning")
    out = tmp_path / "run"
    proc = torchrun(LIGHTNING, [str(out), bug, STEPS],
                    before_retry=lambda: [shutil.rmtree(p, ignore_errors=True)
                                          for p in (out, f"{out}.ranks", f"{out}.pl")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # rank 1 writes nothing and says so, once (the callback gave it no out=: it was silent)
    assert proc.stderr.count(NOT_WRITING) == 1 and "rank 1 of 2" in proc.stderr, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["world_size"] == 2 and report["run"]["sharding"] == "fsdp2"
    assert {c for c, sev in _serious(report) if sev == "error"} == errors, report["findings"]
    assert not [f for f in report["findings"] if f["code"].endswith("/probe-failed")]
    if not errors:
        assert report["verdict"] == "clean", report["findings"]
    ranks = [json.loads((tmp_path / "run.ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
