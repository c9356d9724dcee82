"""Fault-injection detection benchmark (FAILURE_MODES §3): every fault of `tndebug.faults.FAULTS`
x seeds x {pre, post}, against healthy runs on two tasks and benign controls, all with
`--probe all`, tiny preset, CPU.

    nice python bench/detection.py                       # the full plan; appends to detection.jsonl
    nice python bench/detection.py --dry-run             # print the plan and stop
    python bench/detection.py --faults no_scale --healthy-tasks copy --eval-fault-seeds 10 \
        --eval-healthy-seeds 10 --calib-seeds --benign --steps 20 --out /tmp/d.jsonl

One JSON line per run is appended to `--out` as soon as the run ends, so a partial run is
useful and a rerun skips the runs already there (keyed by split, kind, fault, variant, task,
norm, seed, steps). `bench/detection_report.py` turns the JSONL into detection.json / .md.

Runs:
* fault:   each fault x its norms (`Fault.norms`) x the evaluation fault seeds, on `--fault-task`.
           `needs="resume"` faults train `--resume-at` steps, write a checkpoint, and continue for
           the remaining steps from it; the fault acts in the resumed leg (findings of both legs
           are recorded, tagged by leg). `needs="fp16"` faults run fp32 (CPU): latent only.
           `needs="rotary"` faults run the decoder-only model with rotary positions (variant
           "rotary": `tndebug run --arch decoder --pos rotary`).
* healthy: no fault, each healthy task x {pre, post} x the evaluation healthy seeds; and, when the
           plan has a rotary fault and `--archs` the decoder, the same runs with rotary positions
           (variant "rotary"), the reference those faults are compared with.
* benign:  dropout 0.0, dropout 0.3, tied embeddings, and a healthy resume (same two legs as the
           resume fault), on `--fault-task` x {pre, post}.
* calibration: the same healthy/benign/fault configurations on separate seeds (`--calib-seeds`),
           for reading thresholds only (probe code is not changed by this benchmark).

Jobs are ordered round-robin by seed index (evaluation first, calibration last) so that a run
stopped early still covers every configuration. Two worker processes at most, one torch thread
each, OMP_WAIT_POLICY=PASSIVE (a shared, loaded machine). The workers import a copy of tndebug/
taken at the start (its git HEAD and content hash go into the JSONL's meta line), so edits made
to the tree during a long benchmark do not mix code versions (`--workers 1` runs in process,
on the tree as imported).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import Provenance  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEFAULT_OUT = RESULTS / "detection.jsonl"
BENIGN = ("dropout0", "dropout0.3", "tied", "resume")
KEY_FIELDS = ("split", "kind", "fault", "variant", "task", "norm", "seed", "steps", "arch")


def job_key(job: dict) -> str:
    return "|".join(str(job.get(k, "")) for k in KEY_FIELDS)


# -- the plan ----------------------------------------------------------------------------------
def make_plan(args) -> list[dict]:
    from tndebug.faults import FAULTS
    faults = args.faults or list(FAULTS)
    common = dict(steps=args.steps, preset=args.preset, eval_size=args.eval_size,
                  resume_at=args.resume_at)

    def fault_jobs(split, seed):
        for name in faults:
            arch = {"arch": "decoder"} if FAULTS[name].arch == "decoder" else {}
            variant = "rotary" if FAULTS[name].needs == "rotary" else ""
            for norm in FAULTS[name].norms:
                yield dict(common, split=split, kind="fault", fault=name, variant=variant,
                           task=args.fault_task, norm=norm, seed=seed, **arch)

    rotary = "decoder" in args.archs and any(FAULTS[n].needs == "rotary" for n in faults)

    def healthy_jobs(split, seed):
        for task in args.healthy_tasks:
            for norm in args.norms:
                for arch in args.archs:
                    yield dict(common, split=split, kind="healthy", fault="", variant="",
                               task=task, norm=norm, seed=seed,
                               **({"arch": arch} if arch != "seq2seq" else {}))
                if rotary:            # the rotary faults' reference: the same model, healthy
                    yield dict(common, split=split, kind="healthy", fault="", variant="rotary",
                               task=task, norm=norm, seed=seed, arch="decoder")

    def benign_jobs(split, seed):
        for variant in args.benign:
            for norm in args.norms:
                yield dict(common, split=split, kind="benign", fault="", variant=variant,
                           task=args.fault_task, norm=norm, seed=seed)

    kinds = set(args.kinds)
    if "fault" not in kinds:
        fault_jobs = lambda split, seed: ()          # noqa: E731
    if "healthy" not in kinds:
        healthy_jobs = lambda split, seed: ()        # noqa: E731
    if "benign" not in kinds:
        benign_jobs = lambda split, seed: ()         # noqa: E731
    jobs: list[dict] = []
    for split, fseeds, hseeds, bseeds in (
            ("eval", args.eval_fault_seeds, args.eval_healthy_seeds, args.eval_benign_seeds),
            ("calibration", args.calib_fault_seeds, args.calib_seeds, args.calib_benign_seeds)):
        rounds = max(len(fseeds), len(hseeds), len(bseeds))
        for i in range(rounds):
            if i < len(hseeds):
                jobs += healthy_jobs(split, hseeds[i])
            if i < len(bseeds):
                jobs += benign_jobs(split, bseeds[i])
            if i < len(fseeds):
                jobs += fault_jobs(split, fseeds[i])
    return jobs


# -- one run (in a worker) ---------------------------------------------------------------------
def _finding(f, leg: str) -> dict:
    ev = json.dumps(f.evidence, default=str)
    return {"probe": f.probe, "severity": f.severity, "where": f.where, "step": f.step,
            "layer": f.layer, "head": f.head, "message": f.message[:400], "leg": leg,
            "evidence": ev[:600]}


def run_job(job: dict) -> dict:
    import torch
    torch.set_num_threads(1)
    from tndebug.faults import FAULTS
    from tndebug.probes.budget import DEFAULT_FRACTION
    from tndebug.train import TrainConfig, model_config, run_training

    t0, c0 = time.perf_counter(), time.process_time()
    load0 = os.getloadavg()
    import tndebug
    rec = dict(job, key=job_key(job), code_path=str(Path(tndebug.__file__).parent.parent))
    try:
        kw = {}
        if job["variant"] == "dropout0":
            kw["dropout"] = 0.0
        elif job["variant"] == "dropout0.3":
            kw["dropout"] = 0.3
        elif job["variant"] == "tied":
            kw["tie_embeddings"] = True
        elif job["variant"] == "rotary":
            kw["pos"] = "rotary"
        faults = (job["fault"],) if job["fault"] else ()
        decoder = job.get("arch") == "decoder"
        if decoder:     # `tndebug run --arch decoder`'s own defaults
            from tndebug.train.config import DECODER_DROPOUT, DECODER_RUN
            kw = {"dropout": DECODER_DROPOUT, **kw, "arch": "decoder"}
        mcfg = model_config(job["task"], job["preset"], job["norm"], faults, **kw)
        two_legs = job["variant"] == "resume" or (job["fault"] and FAULTS[job["fault"]].needs == "resume")
        tcfg = TrainConfig(task=job["task"], steps=job["steps"], seed=job["seed"], device="cpu",
                           eval_size=job["eval_size"], probe_budget=DEFAULT_FRACTION,   # tndebug run's
                           **({k: DECODER_RUN[k] for k in ("warmup", "lr_factor")} if decoder else {}))
        findings, statuses, leg1 = [], {}, None
        if two_legs:
            n1 = job["resume_at"]
            with tempfile.TemporaryDirectory(prefix="tndebug-det-") as d:
                r1 = run_training(mcfg, tcfg.replace(steps=n1), probes="all", out_dir=d,
                                  evaluate_at_end=False)
                findings += [_finding(f, "first") for f in r1.report.findings]
                leg1 = {k: r1.report.run.get(k) for k in ("status", "stopped_at_step", "final_loss",
                                                          "final_lr", "probe_s", "train_s")}
                res = run_training(mcfg, tcfg.replace(steps=job["steps"] - n1), probes="all",
                                   resume=r1.checkpoint)
            rec["fault_active_from"] = n1 if job["fault"] else None
        else:
            res = run_training(mcfg, tcfg, probes="all")
            rec["fault_active_from"] = 0 if job["fault"] else None
        findings += [_finding(f, "resumed" if two_legs else "only") for f in res.report.findings]
        statuses = {n: s["status"] for n, s in res.report.probes.items()}
        run = res.report.run
        rec.update(
            ok=True, findings=findings, probe_status=statuses, leg1=leg1,
            exact_match=run["exact_match"], token_accuracy=run["token_accuracy"],
            final_loss=run["final_loss"], run_status=run["status"],
            stopped_at_step=run["stopped_at_step"], train_s=run["train_s"], probe_s=run["probe_s"],
            dropout=mcfg.dropout, tie_embeddings=mcfg.tie_embeddings, dtype=run["dtype"],
            # what tndebug run's budget deferred (the last leg's): a finding kept with looks
            # deferred is the evidence that the budget loses none
            budget_thinned=(run.get("probe_budget") or {}).get("thinned"))
    except Exception as e:  # noqa: BLE001 - one broken configuration must not stop the benchmark
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
    rec.update(wall_s=round(time.perf_counter() - t0, 2), cpu_s=round(time.process_time() - c0, 2),
               load_before=[round(x, 2) for x in load0],
               load_after=[round(x, 2) for x in os.getloadavg()], pid=os.getpid(),
               finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
    return rec


# -- driver ------------------------------------------------------------------------------------
def snapshot_code(root: Path) -> tuple[Path, dict]:
    """Copy tndebug/ to a temporary directory, so that every worker runs the same code while
    others edit the tree; returns (directory to put first on PYTHONPATH, its identity)."""
    import hashlib
    import shutil

    from _provenance import tree_state
    dest = Path(tempfile.mkdtemp(prefix="tndebug-bench-code-"))
    shutil.copytree(root / "tndebug", dest / "tndebug",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    h = hashlib.sha256()
    for f in sorted((dest / "tndebug").rglob("*.py")):
        h.update(str(f.relative_to(dest)).encode())
        h.update(f.read_bytes())
    state = tree_state(root)
    ident = {"git_head": state["commit"],
             "tndebug_dirty": any(p.startswith("tndebug/") for p in state["dirty"]),
             "tndebug_sha256": h.hexdigest()[:16]}
    return dest, ident

def done_keys(path: Path) -> set[str]:
    keys = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("ok"):
                keys.add(r["key"])
    return keys


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (both legs together)")
    ap.add_argument("--resume-at", type=int, default=100, help="first-leg steps of resume runs")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--eval-size", type=int, default=500, help="held-out sequences for exact match")
    ap.add_argument("--fault-task", default="copy", help="task of the fault and benign runs")
    ap.add_argument("--healthy-tasks", nargs="+", default=["copy", "reverse"])
    ap.add_argument("--norms", nargs="+", default=["pre", "post"])
    ap.add_argument("--archs", nargs="+", default=["seq2seq", "decoder"], choices=("seq2seq", "decoder"),
                    help="architectures of the healthy runs (a fault runs on the one it exists in)")
    ap.add_argument("--faults", nargs="*", default=None, help="default: every fault")
    ap.add_argument("--benign", nargs="*", default=list(BENIGN), choices=BENIGN)
    ap.add_argument("--eval-fault-seeds", type=int, nargs="*", default=[10, 11, 12])
    ap.add_argument("--eval-healthy-seeds", type=int, nargs="*", default=[10, 11, 12, 13, 14])
    ap.add_argument("--eval-benign-seeds", type=int, nargs="*", default=[10, 11, 12])
    ap.add_argument("--calib-seeds", type=int, nargs="*", default=[0, 1, 2], help="healthy calibration seeds")
    ap.add_argument("--calib-benign-seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--calib-fault-seeds", type=int, nargs="*", default=[0],
                    help="fault calibration seeds (run last; drop them on a busy machine)")
    ap.add_argument("--kinds", nargs="+", default=["fault", "healthy", "benign"],
                    choices=["fault", "healthy", "benign"])
    ap.add_argument("--workers", type=int, default=2, choices=(1, 2))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--fresh", action="store_true",
                    help="start --out afresh (drop the runs already there): every run at this commit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.fresh and not args.dry_run:
        out.unlink(missing_ok=True)
    prov = Provenance.start(__file__, argv)
    jobs = make_plan(args)
    done = done_keys(out)
    todo = [j for j in jobs if job_key(j) not in done]
    print(f"{len(jobs)} runs planned, {len(jobs) - len(todo)} already in {out}, {len(todo)} to do",
          flush=True)
    if args.dry_run:
        for j in todo:
            print(job_key(j))
        return 0
    code_dir, code = snapshot_code(Path(__file__).resolve().parent.parent)
    old_pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(code_dir)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
    sys.path.insert(0, str(code_dir))
    meta = {"meta": True, "argv": sys.argv if argv is None else ["bench/detection.py", *argv], "code": code, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "load": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "planned": len(jobs), "todo": len(todo), "workers": args.workers}
    with out.open("a") as fh:
        fh.write(json.dumps(meta) + "\n")
    t0 = time.perf_counter()
    if args.workers == 1:
        results = map(run_job, todo)
        pool = None
    else:
        import multiprocessing as mp
        pool = mp.get_context("spawn").Pool(args.workers, maxtasksperchild=100)
        results = pool.imap(run_job, todo)      # in plan order: a stop leaves whole rounds
    signal.signal(signal.SIGTERM, _interrupt)
    stopped = False
    try:
        for i, rec in enumerate(results, 1):
            with out.open("a") as fh:
                fh.write(json.dumps(rec, default=str) + "\n")
            alarms = sorted({f["probe"] for f in rec.get("findings", []) if f["severity"] != "info"})
            print(f"[{i}/{len(todo)} {time.perf_counter() - t0:6.0f}s] {rec['key']} "
                  f"ok={rec['ok']} wall={rec['wall_s']}s em={rec.get('exact_match')} alarms={alarms}"
                  + (f" ERR {rec.get('error')}" if not rec["ok"] else ""), flush=True)
    except KeyboardInterrupt:
        stopped = True
        print("stopped; the runs written so far are kept", flush=True)
    finally:
        if pool is not None:
            if stopped:
                pool.terminate()
            else:
                pool.close()
            pool.join()
        import shutil
        shutil.rmtree(code_dir, ignore_errors=True)
        sys.path.remove(str(code_dir))
        if old_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pythonpath
        with out.open("a") as fh:            # the invocation's provenance, when it ends
            fh.write(json.dumps({"meta": True, "end": True, "stopped": stopped,
                                 "provenance": prov.finish()}) + "\n")
    return 130 if stopped else 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
