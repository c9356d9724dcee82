"""The GPU check behind bench/gpu_check.sh: probed training of the `base` preset on one GPU.

    python bench/gpu_check.py                       # CUDA: base preset, bf16; else a tiny CPU run
    python bench/gpu_check.py --steps 60 --budget-s 120

Three parts, each written to bench/results/gpu_check.json as soon as it is done:

1. timing: the same run with probes off and with the default schedules (150 steps), and with
   every probe on every step (40 steps: it is slow, and the figure is per step), interleaved
   (none, default, every, none, ...); steady-state step time (probe setup and the first 2
   steps excluded), tokens/s, peak GPU memory, and the overhead ratios default/none and
   every_step/none. A run that fails is recorded with its error and the check goes on.
2. faults: the detection suite's GPU-relevant faults, each trained briefly with every probe
   at its default schedule: `fill_1e9_fp16` under fp16 autocast, the others under the run's
   autocast dtype; "caught" means the fault's probe reported a warning or an error.
3. environment: torch, CUDA, GPU name, the budget used.

Without CUDA it runs a tiny CPU version (tiny preset, a few steps, no autocast) so the script
is tested in CI; the JSON then says `"label": "CPU FALLBACK ..."` and the figures are not GPU
figures. Exit 0 unless the script itself breaks; faults missed are data, not a failure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import Provenance  # noqa: E402
from _timing import StepTimer  # noqa: E402

from tndebug.faults import FAULTS  # noqa: E402
from tndebug.probes import PROBE_NAMES, probe_class  # noqa: E402
from tndebug.probes.schedule import every  # noqa: E402
from tndebug.train import TrainConfig, model_config, run_training  # noqa: E402

RESULT = Path(__file__).parent / "results" / "gpu_check.json"
FAULT_SET = ("fill_1e9_fp16", "no_scale", "mask_inverted", "no_causal_mask",
             "neg_inf_fill_all_masked", "shared_qkv", "no_residual", "pre_ln_no_final_norm")
FP16_FAULTS = ("fill_1e9_fp16",)


def arms(steps: int, every_steps: int) -> dict:
    """name -> (probes, steps): probes off, default schedules, every probe on every step (fewer
    steps: the figure is the steady per-step time, and every probe every step is slow)."""
    return {"none": (lambda: "none", steps), "default": (lambda: "all", steps),
            "every_step": (lambda: [probe_class(n)(schedule=every(1)) for n in PROBE_NAMES],
                           min(steps, every_steps))}


def guarded(fn, *args) -> dict:
    """A run that fails is recorded, not fatal: the check goes on to the next part."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}


def timed_run(preset: str, train_cfg: TrainConfig, probes) -> dict:
    timer = StepTimer(skip=2)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    result = run_training(model_config("copy", preset), train_cfg, probes=probes, session=timer,
                          evaluate_at_end=False)
    run = result.report.run
    step_s = timer.step_seconds()
    tokens_per_step = (run["tokens_per_s"] or 0) * run["train_s"] / max(train_cfg.steps, 1)
    return {"step_ms": None if step_s is None else round(step_s * 1e3, 3),
            "tokens_per_s": None if not step_s else round(tokens_per_step / step_s, 1),
            "tokens_per_s_whole_run": run["tokens_per_s"], "train_s": run["train_s"],
            "probe_s": run["probe_s"], "peak_gpu_mem_bytes": run.get("peak_gpu_mem_bytes"),
            "device": run["device"], "dtype": run["dtype"], "status": run["status"],
            "findings": len(result.report.findings)}


def timing(preset: str, cfg: TrainConfig, reps: int, every_steps: int, deadline: float) -> dict:
    plan = arms(cfg.steps, every_steps)
    runs: dict[str, list[dict]] = {name: [] for name in plan}
    for rep in range(reps):
        for name, (probes, steps) in plan.items():
            if rep and time.monotonic() > deadline:
                break
            runs[name].append(guarded(timed_run, preset, cfg.replace(steps=steps), probes()))
            print(f"timing {name} rep {rep}: {runs[name][-1]}", file=sys.stderr)
    ok = {n: [r for r in rs if r.get("step_ms")] for n, rs in runs.items()}
    med = {n: statistics.median(r["step_ms"] for r in rs) for n, rs in ok.items() if rs}
    out = {"runs": runs, "steps": {n: s for n, (_, s) in plan.items()}, "median_step_ms": med,
           "tokens_per_s": {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in ok.items() if rs},
           "peak_gpu_mem_bytes": {n: max((r["peak_gpu_mem_bytes"] or 0) for r in rs) or None
                                  for n, rs in ok.items() if rs}}
    if med.get("none"):
        out["overhead"] = {n: round(med[n] / med["none"], 4) for n in med if n != "none"}
    return out


def fault_check(preset: str, cfg: TrainConfig, name: str, cuda: bool) -> dict:
    fault = FAULTS[name]
    amp = "fp16" if name in FP16_FAULTS else cfg.amp
    if amp == "fp16" and not cuda:
        return {"expected_probe": fault.probe, "amp": amp, "caught": None,
                "skipped": "fp16 autocast needs CUDA"}
    t0 = time.perf_counter()
    result = run_training(model_config("copy", preset, faults=(name,)), cfg.replace(amp=amp),
                          probes="all", session=None, evaluate_at_end=False)
    fs = result.report.findings
    hit = [f for f in fs if f.probe == fault.probe and f.severity in ("warning", "error")]
    return {"expected_probe": fault.probe, "amp": amp, "caught": bool(hit),
            "status": result.report.run["status"], "wall_s": round(time.perf_counter() - t0, 2),
            "findings": [{"probe": f.probe, "severity": f.severity, "where": f.where, "step": f.step,
                          "message": f.message[:200]} for f in fs if f.severity != "info"]}


def environment(cuda: bool) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_mem_bytes=p.total_memory, capability=f"{p.major}.{p.minor}",
                   bf16_supported=torch.cuda.is_bf16_supported())
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="timing steps per run (GPU 150, CPU 8)")
    ap.add_argument("--fault-steps", type=int, default=None, help="steps per fault run (GPU 30, CPU 4)")
    ap.add_argument("--every-steps", type=int, default=40, help="steps of the every-probe-every-step arm")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions of the three arms")
    ap.add_argument("--batch-size", type=int, default=None, help="GPU 128, CPU 16")
    ap.add_argument("--amp", default=None, choices=("none", "bf16", "fp16"), help="GPU bf16, CPU none")
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop starting new runs after this")
    ap.add_argument("--faults", default=",".join(FAULT_SET), help="comma-separated subset")
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    prov = Provenance.start(__file__, argv)
    cuda = torch.cuda.is_available()
    if cuda:
        preset, label = "base", "GPU"
        steps, fsteps, batch = args.steps or 150, args.fault_steps or 30, args.batch_size or 128
        amp = args.amp or ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        preset = "tiny"
        label = "CPU FALLBACK (no CUDA): tiny preset, a few steps; these are not GPU figures"
        steps, fsteps, batch = args.steps or 8, args.fault_steps or 4, args.batch_size or 16
        amp = args.amp or "none"
        torch.set_num_threads(1)
        args.reps = min(args.reps, 1)
    device = "cuda" if cuda else "cpu"
    cfg = TrainConfig(steps=steps, batch_size=batch, device=device, amp=amp, eval_size=0, log_every=50)
    out = {"label": label, "device": device, "preset": preset, "amp": amp, "steps": steps,
           "fault_steps": fsteps, "batch_size": batch, "environment": environment(cuda)}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out["wall_s"] = round(time.monotonic() - t_start, 1)
        out["provenance"] = prov.finish()          # written again at each save: the latest state
        args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")

    print(f"gpu_check: {label}; {preset} preset, amp {amp}", file=sys.stderr)
    deadline = t_start + args.budget_s
    out["timing"] = timing(preset, cfg, args.reps, args.every_steps, t_start + 0.5 * args.budget_s)
    save()
    fcfg = cfg.replace(steps=fsteps)
    out["faults"] = {}
    for name in [f for f in args.faults.split(",") if f]:
        if time.monotonic() > deadline:
            out["faults"][name] = {"expected_probe": FAULTS[name].probe, "caught": None,
                                   "skipped": "time budget spent"}
            continue
        out["faults"][name] = guarded(fault_check, preset, fcfg, name, cuda)
        print(f"fault {name}: caught={out['faults'][name].get('caught')}", file=sys.stderr)
        save()
    checked = [v["caught"] for v in out["faults"].values() if v.get("caught") is not None]
    out["faults_caught"] = f"{sum(checked)}/{len(checked)}"
    save()
    t = out["timing"]
    print(f"gpu_check: {label}\n  step ms {t['median_step_ms']}  overhead {t.get('overhead')}\n"
          f"  tokens/s {t['tokens_per_s']}\n  faults caught {out['faults_caught']}\n"
          f"  -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
