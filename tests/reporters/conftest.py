import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from report_helpers import run_tiny  # noqa: E402

from tndebug.reporters.session import ReportSession  # noqa: E402


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One 9-step tiny run with stand-in probes through a full ReportSession (diverged)."""
    import torch
    out = tmp_path_factory.mktemp("run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # 2 threads on 2 busy shared cores spin: 40x slower
    try:
        session = ReportSession(out, fmt="text", tensorboard=True, tb_every=4)
        report = run_tiny(session, steps=9, status="diverged")
        code = session.finish(report, fail_on="error")
    finally:
        torch.set_num_threads(threads)
    return {"dir": out, "session": session, "report": report, "code": code}
