"""Regenerate sample_runs/: real `tndebug run` outputs, healthy and faulty.

    python sample_runs/regenerate.py            # all samples (a few minutes on 2 CPU cores)
    python sample_runs/regenerate.py no_scale   # one sample

Each sample directory keeps report.md (with its PNGs), report.json and the TensorBoard event
files; the checkpoint is dropped to keep the repository small. tests/test_sample_runs.py checks
the JSON against the current schema and re-runs one quick sample to compare its findings.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMON = ["--preset", "tiny", "--task", "copy", "--steps", "120", "--seed", "0",
          "--probe", "all", "--fail-on", "never"]

# name -> extra arguments.  Two healthy runs, then one fault for each probe of the design card.
SAMPLES: dict[str, list[str]] = {
    "healthy_pre": ["--norm", "pre"],
    "healthy_post": ["--norm", "post"],
    "no_scale": ["--norm", "pre", "--fault", "no_scale"],                              # missing-scale
    "no_causal_mask": ["--norm", "pre", "--fault", "no_causal_mask"],                  # mask-broadcast
    "pad_mask_query_axis": ["--norm", "post", "--fault", "pad_mask_query_axis"],       # mask-broadcast
    "neg_inf_fill_all_masked": ["--norm", "pre", "--fault", "neg_inf_fill_all_masked"],  # nan-scores
    "shared_qkv": ["--norm", "pre", "--fault", "shared_qkv"],                          # head-collapse
    "no_residual": ["--norm", "post", "--fault", "no_residual"],                       # variance-drift
    "pre_ln_no_final_norm": ["--norm", "pre", "--fault", "pre_ln_no_final_norm"],      # ln-placement
    "kl_raw_logits": ["--norm", "pre", "--fault", "kl_raw_logits"],                    # loss-health
}


def argv_for(name: str, out: Path) -> list[str]:
    return ["run", *COMMON, *SAMPLES[name], "--out", str(out), "--format", "json"]


def regenerate(name: str, root: Path = HERE) -> Path:
    from contextlib import redirect_stdout
    import io

    import torch

    from tndebug.cli import main

    torch.set_num_threads(1)                  # tiny models: one thread is fastest and reproducible

    out = root / name
    if out.exists():
        shutil.rmtree(out)
    with redirect_stdout(io.StringIO()):      # the JSON also lands in report.json
        code = main(argv_for(name, out))
    if code not in (0, 1):
        raise SystemExit(f"sample {name!r}: tndebug run exited {code}")
    (out / "checkpoint.pt").unlink(missing_ok=True)
    return out


if __name__ == "__main__":
    names = sys.argv[1:] or list(SAMPLES)
    for n in names:
        if n not in SAMPLES:
            raise SystemExit(f"unknown sample {n!r}; known: {', '.join(SAMPLES)}")
    for n in names:
        print(f"regenerating {n} ...", file=sys.stderr)
        regenerate(n)
