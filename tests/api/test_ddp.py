"""tndebug.watch under DDP (torchrun, 2 gloo processes): statistics reduced across ranks, rank 0
writes the report with every rank's findings."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ddp_watch_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, mode: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "--monitor-interval=0.2",
           str(WORKER), str(out), mode]
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
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
