"""The tutorial notes' claims that a model at initialisation can settle, measured: the figures
the README's "What the measurements showed" quotes for them.

    python bench/notes_claims.py                 # -> bench/results/notes_claims.json
    python bench/notes_claims.py --seeds 0 --presets tiny --out /tmp/n.json

At init, copy and reverse tasks, one batch of 64 from the training stream, every preset, seeds,
Pre-LN and Post-LN; tndebug's own model with its tap points (no probe, no training):

* entropy: the encoder self-attention's normalised entropy (H / ln(keys kept), real queries),
  healthy against `no_scale` (note 000: uniform without 1/sqrt(d_k); notes 001/002: one-hot).
* rho: RMS(token embedding) / RMS(PE) over real source positions, healthy against
  `no_emb_scale` (note 001 has the direction of the sqrt(d_model) scale backwards).
* loss_over_ln_v: the initial cross-entropy (pad ignored) over ln V of the target vocabulary
  (FAILURE_MODES: more than 10% from ln V is a warning).
* self_argmax / symmetry: with `shared_qkv` (one Linear for Q, K, V) against healthy, the share
  of real encoder queries whose highest score is their own key, and ||S - S^T|| / ||S|| of the
  encoder self-attention scores before the mask (FAILURE_MODES 4b: self-argmax > 0.9).

Claims that need training (heads and dropout, Post-LN at a high lr) are not measured here.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import Provenance  # noqa: E402
from tndebug.data import PAD, data_generator, get_task  # noqa: E402
from tndebug.inject import make_model  # noqa: E402
from tndebug.train import model_config  # noqa: E402

OUT = Path(__file__).parent / "results" / "notes_claims.json"
ARMS = {"entropy": ("healthy", "no_scale"), "rho": ("healthy", "no_emb_scale"),
        "loss_over_ln_v": ("healthy",), "self_argmax": ("healthy", "shared_qkv"),
        "symmetry": ("healthy", "shared_qkv")}


def measure(task: str, preset: str, norm: str, seed: int, fault: str | None, batch: int) -> dict:
    """Every quantity for one model at init on one batch."""
    cfg = model_config(task, preset, norm, faults=(fault,) if fault else ())
    torch.manual_seed(seed)
    model = make_model(cfg).eval()                       # eval: dropout off, init unchanged
    b = get_task(task).batch(data_generator(seed, "train"), batch, 0.5)
    points = model.hook_points
    attn = "encoder.layers.0.self_attn."
    seen: dict[str, torch.Tensor] = {}
    handles = [points[n].register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.detach()))
               for n in (attn + "hook_scores", attn + "hook_probs", "src_embed.hook_tok", "src_embed.hook_pe")]
    try:
        with torch.no_grad():
            logits = model(b.src, b.tgt_in)                                        # [B, T, V]
    finally:
        for h in handles:
            h.remove()
    real = b.src != PAD                                                            # [B, S]
    probs = seen[attn + "hook_probs"]                                              # [B, h, S, S]
    n_keys = real.sum(-1).clamp(min=2).float()                                     # [B]
    ent = -(probs.clamp_min(1e-30).log() * probs).sum(-1) / n_keys.log()[:, None, None]  # [B, h, S]
    q_real = real[:, None, :].expand_as(ent)
    scores = seen[attn + "hook_scores"]                                            # [B, h, S, S]
    own = scores.masked_fill(~real[:, None, None, :], -math.inf).argmax(-1)        # [B, h, S]
    idx = torch.arange(scores.shape[-1])[None, None, :]
    tok, pe = seen["src_embed.hook_tok"], seen["src_embed.hook_pe"].expand_as(seen["src_embed.hook_tok"])
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(), ignore_index=PAD)
    return {"entropy": ent[q_real].mean().item(),
            "rho": (tok[real].pow(2).mean().sqrt() / pe[real].pow(2).mean().sqrt()).item(),
            "loss_over_ln_v": ce.item() / math.log(cfg.tgt_vocab),
            "self_argmax": (own == idx)[q_real].float().mean().item(),
            "symmetry": ((scores - scores.transpose(-1, -2)).norm() / scores.norm()).item()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small", "base"])
    ap.add_argument("--tasks", nargs="+", default=["copy", "reverse"])
    ap.add_argument("--norms", nargs="+", default=["pre", "post"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prov = Provenance.start(__file__, argv)
    rows = []
    for fault in (None, "no_scale", "no_emb_scale", "shared_qkv"):
        for preset in args.presets:
            for task in args.tasks:
                for norm in args.norms:
                    for seed in args.seeds:
                        r = measure(task, preset, norm, seed, fault, args.batch)
                        rows.append({"arm": fault or "healthy", "preset": preset, "task": task,
                                     "norm": norm, "seed": seed, **{k: round(v, 4) for k, v in r.items()}})
    summary = {}
    for quantity, arms in ARMS.items():
        for arm in arms:
            vals = [r[quantity] for r in rows if r["arm"] == arm]
            by_preset = {p: [r[quantity] for r in rows if r["arm"] == arm and r["preset"] == p] for p in args.presets}
            summary[f"{quantity}/{arm}"] = {"min": min(vals), "max": max(vals), "n": len(vals),
                                            "by_preset": {p: [min(v), max(v)] for p, v in by_preset.items() if v}}
    result = {"bench": "notes_claims", "what": __doc__.split("\n\n")[2].strip(), "batch": args.batch,
              "summary": summary, "rows": rows, "provenance": prov.finish()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for k, v in summary.items():
        print(f"{k:28s} {v['min']:.3f} - {v['max']:.3f}  {v['by_preset']}", file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
