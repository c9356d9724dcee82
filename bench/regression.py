"""Behaviour unchanged, and shown so (issue 20): one regression set of report findings, recorded
against the tndebug of a commit, and two such records compared case by case.

    OMP_NUM_THREADS=1 python bench/regression.py                 # tndebug of this tree
    OMP_NUM_THREADS=1 python bench/regression.py --at 8c9bc0d    # tndebug as at a commit
    python bench/regression.py --parts foreign,triage            # some parts (merged into the file)
    python bench/regression.py --compare 8c9bc0d 1a2b3c4         # -> bench/results/regression.md

The set (the case definitions and this script as they are now; only tndebug/ comes from --at):
* detection: every fault of tndebug.faults x its norms, one seed (10), `--probe all`, tiny preset,
  DETECTION_STEPS steps (resume faults: two legs), plus healthy seq2seq and decoder x pre/post;
* foreign: tests/foreign's corpus, seed 0 per healthy variant, every bug once (seed 0), 10 steps;
  the nanoGPT corpus likewise;
* samples: sample_runs/regenerate.py's samples, its own arguments, into a temporary folder;
* triage: tests/zoo checkpoints (20 steps) and tiny Hugging Face directories (BART, T5, GPT-2,
  Llama, BERT; save_pretrained from config) through `tndebug triage ... --no-figures`, and
  `tndebug.check` on two user models (tests/api/models.py) and on tndebug's own model with a fault.

Per case: the verdict and the sorted findings [probe, severity, where, code] (every severity),
or the exception. Writes bench/results/regression_<short commit>.json with provenance; a second
run of other parts (or shards) at the same commit is merged into the same file. Measured at
0c005b5, one thread, two runs side by side on 2 shared cores: triage 13 s, samples 121 s, foreign
125-132 s, detection 245-249 s (about 8.5 minutes in all); `--shard 0/2` and `--shard 1/2` keep
each detection run under 3 minutes.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
AT_ENV = "REGRESSION_BENCH_AT"          # set in the child of --at: the commit whose tndebug runs
if os.environ.get(AT_ENV) is None:      # the tndebug of this tree (a worktree too), not the
    sys.path.insert(0, str(ROOT))       # editable install's
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "foreign"))
from _provenance import Provenance, provenance_line  # noqa: E402

PARTS = ("detection", "foreign", "samples", "triage")
DETECTION_STEPS, DETECTION_RESUME_AT, DETECTION_SEED = 30, 15, 10
FOREIGN_STEPS, ZOO_STEPS = 10, 20


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(findings) -> list[list]:
    """Finding objects or report.json dicts -> sorted [probe, severity, where, code]."""
    out = []
    for f in findings:
        get = f.get if isinstance(f, dict) else (lambda k, f=f: getattr(f, k, None))
        out.append([get("probe"), get("severity"), get("where") or "", get("code") or ""])
    return sorted(out, key=lambda r: [str(x) for x in r])


def _of_report(report) -> dict:
    return {"verdict": report.verdict, "findings": _rows(report.findings)}


def _of_json(out_dir: Path) -> dict:
    d = json.loads((out_dir / "report.json").read_text())
    return {"verdict": d.get("verdict"), "findings": _rows(d.get("findings", []))}


def _cli(argv: list[str]) -> int:
    from tndebug.cli import main
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        return main(argv)


def make_model_fn():
    """tndebug's model with its faults. Since 12d890d the faults are put in from outside the model
    (tndebug.inject.make_model); before it tndebug.model.make_model read them from the config.
    An older commit lacks tndebug.inject: fall back explicitly to the name it had then."""
    try:
        from tndebug.inject import make_model
        return make_model, "tndebug.inject.make_model"
    except ImportError:
        from tndebug.model import make_model           # before 12d890d
        return make_model, "tndebug.model.make_model (fallback: no tndebug.inject at this commit)"


# -- the cases: name -> function(tmp folder) -> {"verdict", "findings"} -------------------------------
def detection_cases() -> dict:
    from tndebug.faults import FAULTS
    jobs = {}
    for name, fault in FAULTS.items():
        for norm in fault.norms:
            jobs[f"detection/{name}/{norm}"] = (name, norm, fault.arch == "decoder", fault.needs == "resume")
    for arch in ("seq2seq", "decoder"):
        for norm in ("pre", "post"):
            jobs[f"detection/healthy-{arch}/{norm}"] = ("", norm, arch == "decoder", False)
    return {k: (lambda tmp, j=j: _detection_run(tmp, *j)) for k, j in jobs.items()}


def _detection_run(tmp: Path, fault: str, norm: str, decoder: bool, resume: bool) -> dict:
    """bench/detection.py's run_job, shortened: `tndebug run --probe all` on copy, one seed."""
    from tndebug.faults import FAULTS
    from tndebug.train import TrainConfig, model_config, run_training
    kw = {}
    if decoder:                      # `tndebug run --arch decoder`'s own defaults, as detection.py
        from tndebug.train.config import DECODER_DROPOUT, DECODER_RUN
        kw = {"dropout": DECODER_DROPOUT, "arch": "decoder"}
    if fault and FAULTS[fault].needs == "rotary":   # a bug of rotary positions: a rotary model
        kw["pos"] = "rotary"
    mcfg = model_config("copy", "tiny", norm, (fault,) if fault else (), **kw)
    tcfg = TrainConfig(task="copy", steps=DETECTION_STEPS, seed=DETECTION_SEED, device="cpu", eval_size=20,
                       **({k: DECODER_RUN[k] for k in ("warmup", "lr_factor")} if decoder else {}))
    findings = []
    if resume:                       # the fault acts in the resumed leg; both legs' findings count
        r1 = run_training(mcfg, tcfg.replace(steps=DETECTION_RESUME_AT), probes="all", out_dir=tmp,
                          evaluate_at_end=False)
        findings += r1.report.findings
        res = run_training(mcfg, tcfg.replace(steps=DETECTION_STEPS - DETECTION_RESUME_AT), probes="all",
                           resume=r1.checkpoint)
    else:
        res = run_training(mcfg, tcfg, probes="all")
    return {"verdict": res.report.verdict, "findings": _rows(findings + list(res.report.findings))}


def foreign_cases() -> dict:
    import foreign_corpus as corpus
    import nanogpt_corpus as lm

    def one(style, variant, bug):
        def run(tmp):
            path = corpus.make_checkpoint(style, variant, bug, 0, tmp, steps=FOREIGN_STEPS)
            return _of_report(corpus.run_triage(style, path))
        return run

    def one_lm(variant, bug):
        return lambda tmp: _of_report(lm.run_triage(lm.make_checkpoint(variant, bug, 0, tmp)))

    cases = {f"foreign/{s}/{v}/healthy": one(s, v, None) for s, v, _ in corpus.healthy_cases([0])}
    cases.update({f"foreign/{s}/{v}/{b}": one(s, v, b) for s, v, b in corpus.bug_cases()})
    cases.update({f"foreign/nanogpt/{v}/healthy": one_lm(v, None) for v in ("manual", "sdpa")})
    cases.update({f"foreign/nanogpt/{v}/{b}": one_lm(v, b) for v, b in lm.BUG_CASES})
    return cases


def sample_cases() -> dict:
    regen = _import(ROOT / "sample_runs" / "regenerate.py", "sample_runs_regenerate")

    def one(name):
        def run(tmp):
            code = _cli(regen.argv_for(name, tmp / name))
            if code not in (0, 1):
                raise RuntimeError(f"tndebug run exited {code}")
            return _of_json(tmp / name)
        return run
    return {f"samples/{n}": one(n) for n in regen.SAMPLES}


ZOO = ROOT / "tests" / "zoo"
TINY = dict(N=2, d_model=32, d_ff=64, h=4, dropout=0.0)     # tests/triage/conftest.py's TINY
ZOO_CASES = {                         # tests/triage/test_zoo.py's models, healthy and a bug each
    "annotated/healthy": ("annotated", {}), "annotated/no-scale": ("annotated", {"scale": False}),
    "torch_seq2seq/healthy": ("torch_seq2seq", {}),
    "sdpa_model/healthy": ("sdpa_model", {}), "sdpa_model/no-causal": ("sdpa_model", {"causal": False}),
}


def _zoo(tmp: Path, name: str, bugs: dict) -> dict:
    """Train as tests/triage/test_zoo.py's checkpoint() does, save, `tndebug triage CKPT`."""
    import torch
    from tndebug.capture.adapters import import_file
    train, mod = import_file(ZOO / "train.py"), import_file(ZOO / f"{name}.py")
    torch.manual_seed(0)
    if name == "annotated":
        config = {"src_vocab": 11, "tgt_vocab": 11, **TINY, "fill": None, **bugs}
        model, forward, factory, adapter = mod.make_model(**config), mod.forward_logits, "make_model", "annotated"
    else:
        config = {"dropout": 0.0, **bugs} if name == "torch_seq2seq" else dict(bugs)
        model, forward, factory = mod.build(**config), mod.forward, "build"
        adapter = f"{ZOO / name}.py:forward"
    model, opt, _ = train.train(model, forward, steps=ZOO_STEPS, batch=32)
    path = train.save(tmp / f"{name}.pt", model, opt, ZOO_STEPS, config)
    code = _cli(["triage", str(path), "--model", f"{ZOO / name}.py:{factory}", "--adapter", adapter,
                 "--no-figures", "--format", "json", "--out", str(tmp / "out")])
    if code not in (0, 1, 4):           # 4: incomplete (a part not run) is a verdict, not a crash
        raise RuntimeError(f"tndebug triage exited {code}")
    return _of_json(tmp / "out")


def _hf_config(arch: str):
    """Tiny configs as tests/triage/test_hf.py, test_hf_decoder.py and test_hf_encoder.py."""
    import transformers as T
    if arch == "t5":
        return T.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                          num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
                          relative_attention_max_distance=16, feed_forward_proj="relu",
                          pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if arch == "bart":
        return T.BartConfig(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                            attention_dropout=0.0, activation_dropout=0.0)
    if arch == "gpt2":
        return T.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    if arch == "llama":
        return T.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=64, num_key_value_heads=2)
    return T.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=66)


def _hf(tmp: Path, arch: str) -> dict:
    import torch
    import transformers as T
    auto = {"bart": T.AutoModelForSeq2SeqLM, "t5": T.AutoModelForSeq2SeqLM, "gpt2": T.AutoModelForCausalLM,
            "llama": T.AutoModelForCausalLM, "bert": T.AutoModelForMaskedLM}[arch]
    torch.manual_seed(0)
    auto.from_config(_hf_config(arch)).save_pretrained(tmp / arch)
    code = _cli(["triage", str(tmp / arch), "--no-figures", "--format", "json", "--out", str(tmp / "out")])
    if code not in (0, 1, 4):           # 4: incomplete (a part not run) is a verdict, not a crash
        raise RuntimeError(f"tndebug triage exited {code}")
    return _of_json(tmp / "out")


def _check(tmp: Path, which: str) -> dict:
    import torch
    import tndebug
    torch.manual_seed(0)
    if which == "paper-no_scale":      # tndebug's own model, its fault put in by make_model
        from tndebug.train import model_config
        make_model, _ = make_model_fn()
        return _of_report(tndebug.check(make_model(model_config("copy", "tiny", "pre", ("no_scale",)))))
    M = _import(ROOT / "tests" / "api" / "models.py", "regression_api_models")
    if which == "annotated":
        return _of_report(tndebug.check(M.annotated(), M.annotated_forward))
    return _of_report(tndebug.check(M.FusedSDPA(scale=which != "fused-no-scale"), M.fused_forward))


def triage_cases() -> dict:
    cases = {f"triage/zoo/{k}": (lambda tmp, n=n, b=b: _zoo(tmp, n, b)) for k, (n, b) in ZOO_CASES.items()}
    cases.update({f"triage/hf/{a}": (lambda tmp, a=a: _hf(tmp, a)) for a in ("bart", "t5", "gpt2", "llama", "bert")})
    cases.update({f"triage/check/{w}": (lambda tmp, w=w: _check(tmp, w))
                  for w in ("annotated", "fused-sdpa", "fused-no-scale", "paper-no_scale")})
    return cases


CASES = {"detection": detection_cases, "foreign": foreign_cases, "samples": sample_cases, "triage": triage_cases}


# -- running --------------------------------------------------------------------------------------
def tndebug_commit() -> tuple[str, str]:
    """(full commit, how it was read) of the tndebug that runs."""
    import tndebug
    at = os.environ.get(AT_ENV)
    if at:
        return at, f"git archive {at[:12]} tndebug (from {Path(tndebug.__file__).resolve().parent})"
    pkg = Path(tndebug.__file__).resolve().parent
    if ROOT not in pkg.parents:
        raise SystemExit(f"bench/regression.py: tndebug imported from {pkg}, not from {ROOT}")
    return _git("rev-parse", "HEAD"), f"this tree ({pkg})"


def run_parts(parts: list[str], only: str | None, shard: tuple[int, int] | None = None) -> dict:
    import torch
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    records = {}
    for part in parts:
        cases = CASES[part]()
        for i, (name, fn) in enumerate(cases.items()):
            if (only and only not in name) or (shard and i % shard[1] != shard[0]):
                continue
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="tndebug-regression-") as tmp:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        rec = fn(Path(tmp))
                except Exception as e:  # noqa: BLE001 - a crash is a result too
                    msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                    rec = {"verdict": None, "findings": [], "crashed": f"{type(e).__name__}: {msg}"}
            rec["wall_s"] = round(time.perf_counter() - t0, 2)
            records[name] = rec
            print(f"[{part} {len(records)}] {name}: {rec.get('crashed') or rec['verdict']} "
                  f"({len(rec['findings'])} findings, {rec['wall_s']} s)", flush=True)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--at", metavar="COMMIT", help="tndebug/ as at COMMIT (git archive, first on PYTHONPATH)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--only", default=None, help="only the cases whose name holds this string")
    ap.add_argument("--shard", default=None, metavar="K/N",
                    help="only every N-th case of each part, from the K-th (0-based): a long part in short runs")
    ap.add_argument("--out", default=None, help="default bench/results/regression_<short commit>.json")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"),
                    help="compare regression_A.json with regression_B.json -> bench/results/regression.md")
    args = ap.parse_args(argv)
    if args.compare:
        from _regression_compare import compare
        return compare(*args.compare)
    if args.at and os.environ.get(AT_ENV) is None:
        return _rerun_at(args.at, sys.argv[1:] if argv is None else list(argv))
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(set(parts) - set(PARTS))}; have {', '.join(PARTS)}")
    prov = Provenance.start(__file__, argv)
    commit, source = tndebug_commit()
    _, make_model_name = make_model_fn()
    shard = tuple(int(x) for x in args.shard.split("/")) if args.shard else None
    if shard and not (len(shard) == 2 and 0 <= shard[0] < shard[1]):
        ap.error(f"--shard {args.shard}: K/N with 0 <= K < N")
    records = run_parts(parts, args.only, shard)
    out = Path(args.out) if args.out else RESULTS / f"regression_{commit[:7]}.json"
    old = json.loads(out.read_text()) if out.exists() else {}
    if old.get("tndebug_commit") != commit:
        old = {}                                   # another commit's file: start afresh
    whole = not (args.only or shard)           # a whole part replaces that part's old cases
    runs = [r for r in old.get("runs", []) if not (whole and set(r["parts"]) & set(parts))]
    runs.append({"parts": parts, "only": args.only, "shard": args.shard, "provenance": prov.finish()})
    kept = {k: v for k, v in old.get("cases", {}).items()
            if k not in records and not (whole and k.split("/")[0] in parts)}
    import transformers
    doc = {"bench": "regression", "tndebug_commit": commit, "tndebug_from": source,
           "make_model": make_model_name, "transformers": transformers.__version__,
           "settings": {"detection_steps": DETECTION_STEPS, "detection_resume_at": DETECTION_RESUME_AT,
                        "detection_seed": DETECTION_SEED, "foreign_steps": FOREIGN_STEPS, "zoo_steps": ZOO_STEPS},
           "runs": runs, "cases": dict(sorted({**kept, **records}.items()))}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} ({len(records)} cases, {sum(r['wall_s'] for r in records.values()):.0f} s)")
    return 0


def _rerun_at(commit: str, argv: list[str]) -> int:
    """Run this script again with tndebug/ from `commit` first on PYTHONPATH (bench/foreign.py's way)."""
    full = _git("rev-parse", "--verify", f"{commit}^{{commit}}")
    if not full:
        raise SystemExit(f"bench/regression.py: --at {commit}: no such commit")
    with tempfile.TemporaryDirectory(prefix="regression-at-") as tmp:
        archive = subprocess.run(["git", "archive", full, "tndebug"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")])),
               AT_ENV: full}
        return subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
