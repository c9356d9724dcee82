"""Training-step speed of tndebug's Transformer (no probes) against torch.nn.Transformer.

Both models run side by side in ONE process, with interleaved repetitions (the order flips
every repetition), so that load from other processes hits both alike; we report the ratio
ours/torch per repetition and its median. One step = zero_grad + forward + label loss +
backward (no optimizer update: it costs the same for both). Train mode, dropout as the preset.

The reference is `nn.Transformer` (batch_first, norm_first as the config) wrapped in the same
`Embeddings` and `Generator` modules that ours uses, so only the encoder/decoder stacks differ.
Our preset default is pre-LN, where nn.Transformer's always-built final norms match our stack.

    python bench/speed_vs_torch.py                    # small and base -> bench/results/speed_vs_torch.json
    python bench/speed_vs_torch.py --presets small --reps 5 --out /tmp/x.json

CPU, torch.set_num_threads(2) (the machine is shared; ratios, not absolute times, are the result).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import Provenance  # noqa: E402
from tndebug.config import ModelConfig  # noqa: E402
from tndebug.inject import make_model  # noqa: E402
from tndebug.model.embedding import Embeddings  # noqa: E402
from tndebug.model.transformer import Generator, count_parameters  # noqa: E402

THREADS = 2
# preset -> (batch, src_len = tgt_len, repetitions)
SIZES = {"small": (32, 32, 21), "base": (8, 32, 9)}
OUT = Path(__file__).parent / "results" / "speed_vs_torch.json"
TARGET = 1.0        # ours no slower than torch.nn.Transformer


class TorchReference(nn.Module):
    """nn.Transformer with our embeddings and generator; the same (src, tgt) -> logits API."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pad_id = cfg.pad_id
        self.src_embed = Embeddings(cfg.src_vocab, cfg)
        self.tgt_embed = Embeddings(cfg.tgt_vocab, cfg)
        with warnings.catch_warnings():   # "enable_nested_tensor is True, but ...": inference-only anyway
            warnings.simplefilter("ignore", UserWarning)
            self.transformer = nn.Transformer(
                cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.n_layers, cfg.d_ff, cfg.dropout,
                batch_first=True, norm_first=cfg.norm == "pre", layer_norm_eps=cfg.ln_eps)
        self.generator = Generator(cfg)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        T = tgt.shape[1]
        src_pad, tgt_pad = src == self.pad_id, tgt == self.pad_id   # True = ignore (torch's convention)
        future = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)   # [T, T]
        x = self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=future,
                             src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                             memory_key_padding_mask=src_pad, tgt_is_causal=True)
        return self.generator(x)   # [B, T, V]


def batch(cfg: ModelConfig, B: int, L: int, g: torch.Generator):
    """Copy-task batch with right padding on half the rows.  src, tgt_in, tgt_out: [B, L]"""
    src = torch.randint(2, cfg.src_vocab, (B, L), generator=g)
    for b in range(0, B, 2):
        src[b, int(torch.randint(L // 2, L, (), generator=g)):] = cfg.pad_id
    tgt = torch.cat([torch.ones(B, 1, dtype=torch.long), src], dim=1)
    return src, tgt[:, :-1], tgt[:, 1:]


def step(model: nn.Module, src, tgt_in, tgt_out, pad_id: int) -> float:
    """One timed training step: forward, loss, backward.  Returns seconds."""
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    logits = model(src, tgt_in)                                     # [B, T, V]
    loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=pad_id)
    loss.backward()
    return time.perf_counter() - t0


def measure(preset: str, B: int, L: int, reps: int, warmup: int = 2) -> dict:
    cfg = ModelConfig.preset(preset)
    torch.manual_seed(0)
    ours, ref = make_model(cfg).train(), TorchReference(cfg).train()
    g = torch.Generator().manual_seed(0)
    data = batch(cfg, B, L, g)
    times = {"ours": [], "torch": []}
    models = {"ours": ours, "torch": ref}
    for _ in range(warmup):
        for m in models.values():
            step(m, *data, cfg.pad_id)
    for r in range(reps):
        order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")
        for name in order:
            times[name].append(step(models[name], *data, cfg.pad_id))
    ratios = sorted(o / t for o, t in zip(times["ours"], times["torch"]))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {
        "preset": preset, "batch": B, "src_len": L, "tgt_len": L, "reps": reps,
        "d_model": cfg.d_model, "n_heads": cfg.n_heads, "n_layers": cfg.n_layers, "d_ff": cfg.d_ff,
        "dropout": cfg.dropout, "norm": cfg.norm,
        "params_ours": count_parameters(ours), "params_torch": count_parameters(ref),
        "median_s_ours": statistics.median(times["ours"]),
        "median_s_torch": statistics.median(times["torch"]),
        "ratio_median": statistics.median(ratios),
        "ratio_q1": q[0], "ratio_q3": q[2], "ratio_min": ratios[0], "ratio_max": ratios[-1],
        # met only when the interquartile range is under the target, not just the median
        "target": TARGET, "met": q[2] <= TARGET,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default: per preset)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    rows = []
    prov = Provenance.start(__file__, argv)
    for preset in args.presets:
        B, L, reps = SIZES[preset]
        row = measure(preset, B, L, args.reps or reps)
        rows.append(row)
        print(f"{preset:6s} B={B} L={L}: ours {row['median_s_ours'] * 1e3:8.1f} ms  "
              f"torch {row['median_s_torch'] * 1e3:8.1f} ms  ratio {row['ratio_median']:.3f} "
              f"[q1 {row['ratio_q1']:.3f}, q3 {row['ratio_q3']:.3f}]")
    result = {
        "what": "training step (zero_grad + forward + cross-entropy + backward) time, ours / torch.nn.Transformer",
        "device": "cpu", "threads": THREADS,
        "note": "one process, interleaved repetitions (order flips each rep); shared machine, so read the ratios",
        "results": rows, "provenance": prov.finish(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
