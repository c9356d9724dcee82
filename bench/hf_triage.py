"""How long `tndebug triage DIR` takes on real-size Hugging Face models, and its peak memory:

* marian      (issue 11) d_model 512, 6+6 layers, 8 heads, d_ff 2048, vocabulary 58101
              (MarianConfig's defaults, opus-mt size);
* gpt2-small  (issue 21) GPT-2 small: 12 layers, d_model 768, 12 heads, vocabulary 50257;
* bart-base   (issue 21) BART-base: 6+6 layers, d_model 768, 12 heads, vocabulary 50265 (139M).

Random init, saved with `save_pretrained`. Targets: <= 30 s for the whole CLI command on 2 CPU
cores; peak resident memory (the child's ru_maxrss) <= 3x the fp32 weights (issue 21).

Timed as a user runs it: `tndebug triage DIR --out ...` in a subprocess (Python, torch and
transformers start-up included), with OMP_NUM_THREADS=2. The import cost is measured apart, in
fresh interpreters: `import torch`, then `import transformers` + the Auto classes triage uses,
and + MarianMTModel (transformers imports a model's module lazily, when from_config builds it).

    python bench/hf_triage.py                      # -> bench/results/hf_triage.json (marian)
    python bench/hf_triage.py --size gpt2-small    # -> bench/results/hf_triage_gpt2-small.json
    python bench/hf_triage.py --reps 1 --attn eager --out /tmp/hf.json

Random weights: no --text, so the temperature sweep is skipped (it needs real data). The machine
may be shared: `cli_cpu_over_threads_s` (the child's CPU time / 2) is what two idle cores take,
the provenance block's `load_before` / `load_after` say how busy it was.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import Provenance  # noqa: E402

OUT = Path(__file__).parent / "results" / "hf_triage.json"
TARGET_S = 30.0
MEMORY_X = 3.0          # peak resident memory / fp32 weights
THREADS = "2"


def save_marian(folder: Path) -> dict:
    import torch
    from transformers import MarianConfig, MarianMTModel
    torch.manual_seed(0)
    config = MarianConfig(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                          decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                          vocab_size=58101, decoder_vocab_size=58101, pad_token_id=58100,
                          decoder_start_token_id=58100, eos_token_id=0, scale_embedding=True)
    model = MarianMTModel(config)
    model.save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "files": {p.name: p.stat().st_size for p in folder.iterdir()}}


def save_gpt2_small(folder: Path) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())          # the defaults are GPT-2 small's
    model.save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "files": {p.name: p.stat().st_size for p in folder.iterdir()}}


def save_bart_base(folder: Path) -> dict:
    import torch
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(0)
    config = BartConfig(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                        decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
                        vocab_size=50265)
    model = BartForConditionalGeneration(config)
    model.save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "files": {p.name: p.stat().st_size for p in folder.iterdir()}}


SIZES = {"marian": (save_marian, "Marian-size (512/8/6+6, d_ff 2048, vocab 58101)", "MarianMTModel",
                    "AutoModelForSeq2SeqLM"),
         "gpt2-small": (save_gpt2_small, "GPT-2-small-size (768/12/12 layers, vocab 50257)",
                        "GPT2LMHeadModel", "AutoModelForCausalLM"),
         "bart-base": (save_bart_base, "BART-base-size (768/12/6+6, d_ff 3072, vocab 50265)",
                       "BartForConditionalGeneration", "AutoModelForSeq2SeqLM")}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": THREADS, "MKL_NUM_THREADS": THREADS, "NO_COLOR": "1",
            "HF_HUB_OFFLINE": "1"}


def import_seconds(code: str) -> float:
    """Seconds spent in `code` (imports) in a fresh interpreter, timed inside it."""
    prog = f"import time; t = time.perf_counter(); {code}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", prog], env=_env(), capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def cli_seconds(folder: Path, out: Path, attn: str | None) -> tuple[float, float, int, dict]:
    argv = [sys.executable, "-m", "tndebug", "triage", str(folder), "--out", str(out), "--fail-on", "never"]
    if attn:
        argv += ["--attn", attn]
    # the child's own peak RSS, read by a wrapper (RUSAGE_CHILDREN's maxrss is the largest child
    # so far, save_pretrained's builder included)
    wrapped = [sys.executable, "-c", "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(p.returncode)", *argv]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(wrapped, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"triage failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    peak_kib = int(proc.stderr.strip().splitlines()[-1])
    report = json.loads((out / "report.json").read_text())
    report["_peak_rss_bytes"] = peak_kib * 1024
    return wall, cpu, proc.returncode, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--attn", choices=("eager", "sdpa"), default=None)
    ap.add_argument("--size", choices=tuple(SIZES), default="marian")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.out is None:
        args.out = OUT if args.size == "marian" else OUT.with_name(f"hf_triage_{args.size}.json")
    save, what, model_class, auto = SIZES[args.size]
    prov = Provenance.start(__file__, None)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.size
        t = time.perf_counter()
        saved = save(folder)
        save_s = time.perf_counter() - t
        imports = {
            "torch_s": statistics.median(import_seconds("import torch") for _ in range(args.reps)),
            "torch_transformers_s": statistics.median(import_seconds(
                f"import torch, transformers; from transformers import AutoConfig, "
                f"{auto}") for _ in range(args.reps)),
            # transformers imports each model's module lazily, at from_config: Marian's (with the
            # generation utilities it pulls in) is part of the import cost too
            "torch_transformers_model_s": statistics.median(import_seconds(
                f"import torch, transformers; from transformers import AutoConfig, "
                f"{auto}, {model_class}") for _ in range(args.reps)),
            "tndebug_cli_s": statistics.median(import_seconds("import tndebug.cli") for _ in range(args.reps)),
        }
        imports["transformers_only_s"] = round(imports["torch_transformers_model_s"] - imports["torch_s"], 3)
        runs = []
        for i in range(args.reps):
            wall, cpu, code, report = cli_seconds(folder, Path(tmp) / f"out{i}", args.attn)
            runs.append({"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "exit": code,
                         "verdict": report.get("verdict"), "triage_wall_s": report["run"]["wall_s"],
                         "probes_see_logits_of_ids": report["run"].get("probes_see_logits_of_ids"),
                         "timings_s": report["run"]["timings_s"],
                         "probe_seconds": report["run"]["probe_seconds"],
                         "attn_implementation": report["run"]["attn_implementation"],
                         "peak_rss_bytes": report["_peak_rss_bytes"],
                         "flagged": sorted({(f["probe"], f["severity"]) for f in report["findings"]
                                            if f["severity"] in ("warning", "error")})})
    wall = statistics.median(r["wall_s"] for r in runs)
    weights = 4 * saved["parameters"]                         # fp32 bytes
    peak = max(r["peak_rss_bytes"] for r in runs)
    result = {
        "what": f"tndebug triage DIR, {what}, random init, save_pretrained; the whole CLI "
                f"command in a subprocess",
        "size": args.size,
        "threads": int(THREADS), "target_s": TARGET_S, "cli_wall_s": round(wall, 3),
        "within_target": wall <= TARGET_S,
        "fp32_weights_bytes": weights, "peak_rss_bytes": peak,
        "peak_over_weights": round(peak / weights, 2), "memory_target_x": MEMORY_X,
        "memory_within_target": peak <= MEMORY_X * weights,
        # the machine is shared: CPU time over the threads is what 2 idle cores would take
        "cli_cpu_s": statistics.median(r["cpu_s"] for r in runs),
        "cli_cpu_over_threads_s": round(statistics.median(r["cpu_s"] for r in runs) / int(THREADS), 3),
        "cli_wall_minus_transformers_import_s": round(wall - imports["transformers_only_s"], 3),
        "imports": {k: round(v, 3) for k, v in imports.items()},
        "runs": runs, "save_s": round(save_s, 3), "model": saved,
    }
    import torch
    import transformers
    result.update(torch=torch.__version__, transformers=transformers.__version__, provenance=prov.finish())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("cli_wall_s", "within_target", "peak_over_weights",
                                             "memory_within_target", "cli_cpu_s",
                                             "cli_cpu_over_threads_s", "imports",
                                             "provenance")}, indent=2))


if __name__ == "__main__":
    main()
