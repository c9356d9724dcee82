"""ln-placement's "Post-LN without warmup" symptom: its calibration runs and its evaluation runs.

    OMP_NUM_THREADS=1 python bench/ln_warmup_symptom.py      # -> bench/results/ln_warmup_symptom.json
    python bench/ln_warmup_symptom.py --only eval           # the evaluation runs only

Every run is Post-LN at a constant lr from step 0 (no warmup), except the healthy trainer run,
which warms up (the probe then raises no hazard; its curve still calibrates the margins). Each
run records its loss and parameter-gradient norm at every step, the margins of the symptom's
four tests at the probe's own schedule (steps 0, 1, 2, 4, 8, 16, then every SYMPTOM_EVERY), and
the verdict the probe itself gives (the LnPlacement probe attached to the run).

* calibration (the thresholds in tndebug/probes/ln_placement_warmup.py were set on these): the
  fault `no_warmup_high_lr` on tiny, seeds 1 and 2; tiny Post-LN with warmup (seed 1); user loops at
  seed 1 on the copy task of tests/api: HF BART at 1e-3 and 3e-4, tndebug's tiny Post-LN and an
  nn.Transformer Post-LN at 1e-3, 300 steps each.
* evaluation (the thresholds were not set on these): the fault at seed 0 (the command
  `tndebug run --preset tiny --norm post --fault no_warmup_high_lr --steps 300`), and the same
  user loops at seed 0 for 150 steps.
"""
from __future__ import annotations

import argparse
import json
import statistics as st
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "api"))
import models as M  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from _provenance import Provenance  # noqa: E402

import tndebug  # noqa: E402
from tndebug.config import ModelConfig  # noqa: E402
from tndebug.inject import make_model  # noqa: E402
from tndebug.probes import ln_placement as lp  # noqa: E402
from tndebug.probes import ln_placement_warmup as lw  # noqa: E402
from tndebug.probes.base import Probe  # noqa: E402
from tndebug.probes.schedule import every  # noqa: E402
from tndebug.train.config import TrainConfig, model_config  # noqa: E402
from tndebug.train.loop import run_training  # noqa: E402

CALIBRATION = [("trainer", "no_warmup_high_lr", 1, 300), ("trainer", "no_warmup_high_lr", 2, 300),
               ("trainer", "-", 1, 300), ("bart", 1e-3, 1, 300), ("bart", 3e-4, 1, 300),
               ("tinypost", 1e-3, 1, 300), ("torchpost", 1e-3, 1, 300)]
EVALUATION = [("trainer", "no_warmup_high_lr", 0, 300), ("bart", 1e-3, 0, 150),
              ("tinypost", 1e-3, 0, 150), ("torchpost", 1e-3, 0, 150)]


class Curves(Probe):
    """Loss and parameter-gradient norm at every step (a recorder, not a check)."""
    name, reads = "curves", ()
    default_schedule = staticmethod(lambda: every(1))

    def __init__(self):
        super().__init__()
        self.loss, self.grad = [], []

    def setup(self, run):
        self.model = run.subject.model

    def observe(self, trace, info):
        g = [p.grad.float().norm() for p in self.model.parameters() if p.grad is not None]
        return {"loss": info.loss.detach().float().reshape(1), "grad": torch.stack(g).norm().reshape(1)}

    def update(self, stats, info):
        self.loss.append(float(stats["loss"][0]))
        self.grad.append(float(stats["grad"][0]))


class _Wrapped(torch.nn.Module):
    """tndebug's model called as the tests/api loop calls a model: model(src, tgt, pad)."""
    def __init__(self, inner):
        super().__init__()
        self.m = inner

    def forward(self, src, tgt, pad):
        return self.m(src, tgt)


def user_model(kind: str):
    if kind == "tinypost":
        return _Wrapped(make_model(ModelConfig.tiny(norm="post", src_vocab=M.V, tgt_vocab=M.V))), "torch"
    if kind == "torchpost":
        model = M.TorchTransformer()
        model.transformer = torch.nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True,
                                                 norm_first=False)
        return model, "torch"
    return M.bart(), "bart"


def run_one(kind, what, seed, steps) -> dict:
    probe = lp.LnPlacement()
    if kind == "trainer":
        curves = Curves()
        faults = [] if what == "-" else [what]
        run_training(model_config("copy", "tiny", "post", faults),
                     TrainConfig(steps=steps, seed=seed, device="cpu"), probes=[probe, curves],
                     evaluate_at_end=False)
        loss, grad = curves.loss, curves.grad
    else:
        torch.manual_seed(seed)
        model, loop = user_model(kind)
        opt = torch.optim.Adam(model.parameters(), lr=what)
        grad = []

        def on_step(i, m):
            grad.append(float(torch.stack([p.grad.norm() for p in m.parameters()
                                           if p.grad is not None]).norm()))
        forward = None if loop == "bart" else (lambda m, s, t, pad: m(s, t, pad))
        with tndebug.watch(model, opt, forward=forward, quiet=True, probes=[probe],
                           total_steps=steps):
            loss = M.train(loop, model, opt, steps, seed=seed, on_step=on_step)
    hazard = [f for f in probe.findings if "warmup" in f.message]
    return {"run": [kind, what, seed, steps], "margins": margins(loss, grad),
            "loss_first": loss[0], "loss_last10": sum(loss[-10:]) / 10,
            "verdict": [(f.severity, f.step, f.evidence.get("symptom", {}).get("kind"))
                        for f in hazard]}


def margins(loss, grad) -> dict:
    """The symptom's tests at the probe's schedule: how close each run comes to each threshold."""
    seen = [s for s in range(len(loss)) if s in lp.EARLY_STEPS or
            (s > lw.DECIDE_AT and s % lw.SYMPTOM_EVERY == 0)]
    stall = []
    for t in seen:
        if t < lw.STALL_FROM:
            continue
        late = [loss[s] for s in seen if 0.75 * t <= s <= t]
        early = [loss[s] for s in seen if 0.375 * t <= s <= 0.5 * t]
        grads = [grad[s] for s in seen if 0.75 * t <= s <= t]
        stall.append((t, 1 - st.median(late) / st.median(early), st.median(grads) / grad[0]))
    spikes = [grad[t] / st.median([grad[s] for s in seen if s < t])
              for t in seen if len([s for s in seen if s < t]) >= 3]
    return {"max_rise": max(loss[s] for s in seen if s > 0) / loss[0],
            "max_spike": max(spikes), "min_stall_fall": min(f for _, f, _ in stall),
            "min_stall_grad": min(g for _, _, g in stall),
            "first_stall": next(([t, round(f, 4), round(g, 4)] for t, f, g in stall
                                 if f < lw.STALL_FALL and g < lw.STALL_GRAD), None)}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("calibration", "eval"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ln_warmup_symptom.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prov = Provenance.start(__file__, argv)
    sets = {"calibration": CALIBRATION, "eval": EVALUATION}
    out = {"thresholds": {"RISE": lw.RISE, "SPIKE": lw.SPIKE, "STALL_FROM": lw.STALL_FROM,
                          "STALL_FALL": lw.STALL_FALL, "STALL_GRAD": lw.STALL_GRAD,
                          "SYMPTOM_EVERY": lw.SYMPTOM_EVERY}}
    for name, runs in sets.items():
        if args.only and args.only != name:
            continue
        out[name] = []
        for spec in runs:
            t0 = time.perf_counter()
            row = run_one(*spec)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            out[name].append(row)
            m = row["margins"]
            print(f"{name:11s} {str(spec):42s} verdict {row['verdict']}  rise {m['max_rise']:.3f} "
                  f"spike {m['max_spike']:.2f} fall {m['min_stall_fall']:.4f} grad "
                  f"{m['min_stall_grad']:.3f}", flush=True)
    out["provenance"] = prov.finish()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
