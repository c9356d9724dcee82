"""GPU training: autocast, probes under it, no host sync on unprobed steps, CUDA fallbacks.

Tests marked `gpu` need CUDA and are skipped without it. The others check on the CPU what can
be checked there: `--device cuda` without CUDA is a one-line usage error; autocast (bf16 on the
CPU) reaches the probes as the compute dtype; an unprobed step calls no operator that would
make the host wait for a GPU (a dispatch-mode audit); the GPU check script's CPU fallback.
"""
from __future__ import annotations

import contextlib
import json
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tndebug.cli import main
from tndebug.probes import PROBE_NAMES, probe_class
from tndebug.probes.schedule import at
from tndebug.train import TrainConfig, distributed, model_config, run_training

ROOT = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
aten = torch.ops.aten

# operators whose CUDA kernels make the host wait for the device
_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
             aten.is_nonzero.default, aten.equal.default, aten._unique2.default,
             aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
_INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}


class SyncAudit(TorchDispatchMode):
    """Records every host-syncing operator, with the step it ran in and where it was called.

    On the CPU every tensor is a host tensor, so two kinds of call are left out because they
    touch host tensors on a GPU run too: the batch as drawn (tndebug/data.py, before the
    copy) and the optimizer's step counters (kept on the host by torch.optim on CUDA, or on
    the device with no read-back when fused)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = -1
        self.hits: list[tuple[int, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bad = func in _SYNC_OPS or (func in _INDEX_OPS and any(
            i is not None and i.dtype == torch.bool for i in args[1]))
        if bad:
            stack = traceback.extract_stack()
            frames = [f for f in stack if "tndebug" in f.filename]
            where = f"{frames[-1].filename.split('tndebug/')[-1]}:{frames[-1].lineno}" if frames else "?"
            host = where.startswith("data.py") or any("torch/optim/" in f.filename for f in stack)
            if not host:
                self.hits.append((self.step, func.__name__, where))
        return func(*args, **(kwargs or {}))


class StepMarks:
    """A silent session whose progress updates tell the audit which step runs next."""

    def __init__(self, audit: SyncAudit) -> None:
        self.out_dir, self.sinks, self.audit = None, [], audit

    @contextlib.contextmanager
    def progress(self, total, description=""):
        audit = self.audit

        class Bar:
            def update(self, done, **metrics):
                audit.step = done          # the step about to run

        yield Bar()

    def log_scalars(self, step, scalars):
        pass


# -- on the CPU --------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_device_cuda_without_cuda_is_a_usage_error(tmp_path, capsys):
    code = main(["run", "--preset", "tiny", "--steps", "1", "--device", "cuda", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "CUDA is not available" in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_amp_fp16_without_cuda_is_a_usage_error(tmp_path, capsys):
    code = main(["run", "--preset", "tiny", "--steps", "1", "--amp", "fp16", "--device", "cpu",
                 "--out", str(tmp_path)])
    assert code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_bf16_autocast_reaches_every_probe_as_the_compute_dtype():
    result = run_training(model_config("copy", "tiny"),
                          TrainConfig(steps=3, batch_size=16, device="cpu", amp="bf16", eval_size=16),
                          probes="all")
    assert result.engine.run.compute_dtype == torch.bfloat16
    assert result.report.run["dtype"] == "bfloat16"
    assert result.report.run["status"] == "completed"
    assert set(result.report.probes) == set(PROBE_NAMES), sorted(result.report.probes)
    assert not _crashed(result.report), _crashed(result.report)


def _crashed(report) -> dict:
    """Probes that raised: status "internal error", or a reason saying it raised."""
    return {n: s.get("reason") for n, s in report.probes.items()
            if s.get("status") == "internal error" or "raised" in str(s.get("reason", ""))}


@pytest.mark.parametrize("probes", ["none", "at0"])
def test_unprobed_steps_call_no_host_syncing_operator(monkeypatch, probes):
    """What a GPU run does between log steps: no .item(), no bool-mask indexing, no nonzero."""
    monkeypatch.setattr(distributed, "reads_loss_every_step", lambda device, dist=None: False)
    spec = "none" if probes == "none" else [probe_class(n)(schedule=at(0)) for n in PROBE_NAMES]
    audit = SyncAudit()
    steps = 5
    with audit:
        run_training(model_config("copy", "tiny"),
                     TrainConfig(steps=steps, batch_size=8, device="cpu", log_every=100),
                     probes=spec, session=StepMarks(audit), evaluate_at_end=False)
    quiet = range(1, steps - 1)            # step 0 logs (and probes), the last step logs
    assert [h for h in audit.hits if h[0] in quiet] == []


@pytest.mark.slow
def test_gpu_check_falls_back_to_a_labelled_cpu_run(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "bench"))
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--steps", "4", "--fault-steps", "2", "--faults", "no_scale,fill_1e9_fp16",
                           "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["label"].startswith("CPU FALLBACK") and got["device"] == "cpu"
    assert set(got["timing"]["median_step_ms"]) == {"none", "default", "every_step"}
    assert got["faults"]["no_scale"]["caught"] is True
    assert got["faults"]["fill_1e9_fp16"]["caught"] is None      # fp16 autocast needs CUDA


def test_gpu_check_script_is_prepared():
    script = ROOT / "bench" / "gpu_check.sh"
    assert script.is_file() and "gpu_check.py" in script.read_text()


# -- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_cuda_autocast_run_with_every_probe(amp):
    result = run_training(model_config("copy", "tiny"),
                          TrainConfig(steps=6, batch_size=32, device="cuda", amp=amp, eval_size=64),
                          probes="all")
    run = result.report.run
    assert run["status"] == "completed" and run["device"].startswith("cuda")
    assert run["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[amp]
    assert run["peak_gpu_mem_bytes"] > 0 and run["tokens_per_s"] > 0
    assert result.engine.run.compute_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    assert set(result.report.probes) == set(PROBE_NAMES), sorted(result.report.probes)
    assert not _crashed(result.report), _crashed(result.report)


@pytest.mark.gpu
@cuda
def test_fill_1e9_is_caught_under_fp16():
    result = run_training(model_config("copy", "tiny", faults=("fill_1e9_fp16",)),
                          TrainConfig(steps=4, batch_size=32, device="cuda", amp="fp16", eval_size=32),
                          probes="nan-scores")
    got = {(f.code, f.severity) for f in result.report.findings}
    assert ("nan-scores/fill-overflow-fp16", "error") in got, result.report.findings
    assert result.report.verdict == "errors" and result.report.exit_code() == 1


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_unprobed_cuda_steps_do_not_synchronise(amp):
    """torch's sync debug mode raises on any synchronising call while an unprobed step runs."""
    class Marks(StepMarks):
        @contextlib.contextmanager
        def progress(self, total, description=""):
            class Bar:
                def update(self, done, **metrics):
                    quiet = 1 <= done < total - 1
                    torch.cuda.set_sync_debug_mode("error" if quiet else "default")
            try:
                yield Bar()
            finally:
                torch.cuda.set_sync_debug_mode("default")

    spec = [probe_class(n)(schedule=at(0)) for n in PROBE_NAMES]
    result = run_training(model_config("copy", "tiny"),
                          TrainConfig(steps=6, batch_size=32, device="cuda", amp=amp, log_every=100),
                          probes=spec, session=Marks(None), evaluate_at_end=False)
    # a synchronising call on a quiet step raises inside run_training; it got to the end
    assert result.report.run["status"] == "completed" and result.report.run["stopped_at_step"] == 6
