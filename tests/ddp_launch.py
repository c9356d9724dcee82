"""torchrun for the 2-process tests (tests/api/test_ddp.py, tests/train/test_distributed.py):
two gloo workers on 127.0.0.1, a free port, one torch thread each.

A gloo worker sometimes aborts as its process ends ("terminate called without an active
exception", SIGABRT; torchrun then sends the other rank SIGTERM): seen about once in 60 runs,
only on a loaded machine, with the process-group work done. The abort is in torch's C++
teardown, not in what these tests check, so such a run is run once more, with a warning that
carries its stderr. Any other failure, or the same abort twice, is returned as it is.
PYTHONFAULTHANDLER=1 makes an abort print the Python stack it happened in.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEARDOWN_ABORT = "terminate called without an active exception"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(worker: Path, args: list[str], env: dict | None = None,
             timeout: float = 240.0, before_retry=None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node=2 worker *args`; `before_retry()`
    clears what the first try left (its output folder) before a second try."""
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1",
            **(env or {})}
    for attempt in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--monitor-interval=0.2",
               str(worker), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full)
        if proc.returncode == 0 or TEARDOWN_ABORT not in proc.stderr or attempt == 2:
            return proc
        warnings.warn(f"a gloo worker aborted in torch's teardown; running once more. Its "
                      f"stderr: {proc.stderr[-2000:]}")
        if before_retry is not None:
            before_retry()
    return proc
