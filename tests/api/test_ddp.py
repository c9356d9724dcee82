"""tndebug.watch under DDP (torchrun, 2 gloo processes): statistics reduced across ranks, rank 0
writes the report with every rank's findings."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ddp_watch_worker.py")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_launch import torchrun  # noqa: E402


def _torchrun(out: Path, mode: str):
    proc = torchrun(WORKER, [str(out), mode], before_retry=lambda: shutil.rmtree(out, ignore_errors=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_watch_under_ddp_healthy_and_no_scale(tmp_path):
    healthy = _torchrun(tmp_path / "healthy", "healthy")
    assert healthy["run"]["world_size"] == 2 and healthy["verdict"] == "clean", healthy["findings"]
    assert healthy["probes"]["loss-health"]["status"] == "pass"
    assert healthy["probes"]["gradient-flow"]["steps_observed"] == 3
    ranks = [json.loads((tmp_path / "healthy" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["verdict"] == "clean"
    bug = _torchrun(tmp_path / "bug", "no_scale")
    errors = [f for f in bug["findings"] if f["severity"] == "error"]
    assert {f["probe"] for f in errors} == {"missing-scale"}, bug["findings"]
    assert all(f["rank"] == 0 for f in errors)                 # the same on rank 1: merged once
