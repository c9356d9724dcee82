"""What TensorBoard shows of the run beyond its metrics (reporters/tensorboard.py writes it): the
run dict as the HParams dashboard takes it, hyperparameters apart from final results, and the
order of the custom-scalars charts. No TensorBoard import here.
"""
from __future__ import annotations

import re

# run keys that are results (HParams metrics); every other run key is a hyperparameter
RESULT_KEYS = ("exact_match", "token_accuracy", "peak_gpu_mem_bytes", "stopped_at_step", "stopped_at")
RESULT_PREFIXES = ("final_", "best_")
RESULT_SUFFIXES = ("_s", "_s_by_probe")        # timings (wall_s, tokens_per_s, ...) and per-probe dicts
NOT_HPARAMS = ("figures",)         # run keys that are neither: the figures' files and captions


def hparams_and_metrics(run: dict, extra_metrics: dict) -> tuple[dict, dict]:
    """(hyperparameters, {"hparams/<name>": final metric}) of report.json's `run`: results and
    timings are metrics, the rest hyperparameters (flattened, as HParams takes them)."""
    metrics = {f"hparams/{k}": float(v) for k, v in run.items()
               if is_result(k) and isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update({f"hparams/{k}": float(v) for k, v in extra_metrics.items()})
    hp = flat_hparams({k: v for k, v in run.items() if not is_result(k) and k not in NOT_HPARAMS})
    return hp, metrics


def chart_order(title: str):
    """enc_self, dec_self, cross; then by layer number."""
    kind = title.split(" ")[0].rstrip(":")
    m = re.search(r"layer (\d+)", title)
    rank = {"enc_self": 0, "dec_self": 1, "cross": 2, "encoder": 0, "decoder": 1}.get(kind, 3)
    return rank, int(m.group(1)) if m else -1, title


def is_result(key: str) -> bool:
    return key in RESULT_KEYS or key.startswith(RESULT_PREFIXES) or key.endswith(RESULT_SUFFIXES)


def flat_hparams(run: dict, prefix: str = "") -> dict:
    """HParams take numbers and strings: lists are joined, dicts flattened one level, None skipped."""
    out = {}
    for k, v in run.items():
        key = f"{prefix}{k}"
        if v is None:
            continue
        if isinstance(v, (bool, int, float, str)):
            out[key] = v
        elif isinstance(v, (list, tuple)):
            out[key] = ",".join(map(str, v)) or "none"
        elif isinstance(v, dict) and not prefix:
            out.update(flat_hparams(v, f"{key}."))
        else:
            out[key] = str(v)
    return out
