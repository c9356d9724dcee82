"""Checkpoint hygiene: what the file itself says, before and besides the probes.

Each check returns `Finding`s (probe "checkpoint", or the probe whose failure mode it is):

* non-finite weights: which tensors, how many entries                      -> checkpoint, error
* no optimizer state or no step counter: a resume restarts the warmup      -> lr-schedule, warning
* the checkpoint's config and its weights disagree                         -> checkpoint, error
* attention heads duplicated in the weights, or W_Q = W_K                  -> head-collapse, error
* trained without the 1/sqrt(d_k) scale: the temperature sweep (FAILURE_MODES 2.2)
                                                                           -> missing-scale, error
* a stored PE table that is not the paper's sinusoids                      -> positional-encoding, warning
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from tndebug.findings import Finding
from tndebug.triage.loading import Checkpoint

# FAILURE_MODES 2.2 / 2b: scale the scores by alpha = 2^(k/2), k = -6..6; argmin outside
# [1/sqrt 2, sqrt 2] -> error.
SWEEP_K = range(-6, 7)
ALPHA_LOW, ALPHA_HIGH = 2 ** -0.5, 2 ** 0.5
SOLVED = 0.5            # the sweep is judged only if the best loss < SOLVED * ln V
DUP_COS = 0.99          # FAILURE_MODES 4b: per-head slice cosine

FIX_RESUME = ("save {'model': model.state_dict(), 'optimizer': opt.state_dict(), 'step': step} "
              "and restore all three, so the warmup and Adam's moments continue [note 000]")
FIX_SCALE = ("the checkpoint was trained by code without the 1/sqrt(d_k) scale (or with another "
             "one): evaluate it with the code it was trained with, or fix the code and retrain / "
             "fine-tune; do not load it into correctly scaled code")


def _f(probe, severity, message, where="", evidence=None, fix="") -> Finding:
    return Finding(probe, severity, message, where=where, step=0, evidence=evidence or {}, fix=fix)


# -- the file ------------------------------------------------------------------------------------
def non_finite(sd: dict[str, torch.Tensor]) -> list[Finding]:
    out = []
    for key, t in sd.items():
        if not t.is_floating_point():
            continue
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            nan = int(torch.isnan(t).sum())
            out.append(_f("checkpoint", "error",
                          f"{key} holds {bad} non-finite values ({nan} NaN, {bad - nan} inf) of {t.numel()}",
                          where=key, evidence={"non_finite": bad, "nan": nan, "numel": t.numel()},
                          fix="the run diverged before this save: resume from an earlier checkpoint "
                              "and find the first NaN with `tndebug run` (nan-scores)"))
    return out


def resume_state(ckpt: Checkpoint) -> list[Finding]:
    missing = []
    if not ckpt.has_optimizer_state:
        missing.append("optimizer state" if ckpt.optimizer is None else "optimizer moments (empty state)")
    if ckpt.step is None and not ckpt.has_scheduler:
        missing.append("step counter")
    if not missing:
        return []
    return [_f("lr-schedule", "warning",
               f"checkpoint has no {' and no '.join(missing)}: resuming from it restarts the "
               f"warmup (the lr jumps) and Adam from empty moments",
               evidence={"container": ckpt.container, "top_level_keys": ckpt.top_keys[:12],
                         "step_key": ckpt.step_key or None}, fix=FIX_RESUME)]


def config_vs_weights(config: dict, inferred: dict, key: str) -> list[Finding]:
    """`config`: the checkpoint's own (normalised); `inferred`: what the shapes say."""
    out = []
    for name in ("d_model", "n_layers", "d_ff", "src_vocab", "tgt_vocab"):
        if name in config and name in inferred and int(config[name]) != int(inferred[name]):
            out.append(_f("checkpoint", "error",
                          f"the checkpoint's config says {name}={config[name]} but its weights "
                          f"have {name}={inferred[name]}",
                          where=f"{key}.{name}" if key else name,
                          evidence={"config": config[name], "weights": inferred[name]},
                          fix="the config saved with the weights is stale: save the config of the "
                              "model that was trained (triage used the shapes)"))
    return out


def stored_pe(pe: torch.Tensor | None, key: str, d_model: int) -> list[Finding]:
    if pe is None:
        return []
    from tndebug.model.embedding import sinusoid_table
    table = pe.reshape(-1, d_model).float()                                   # [max_len, d]
    ref = sinusoid_table(table.shape[0], d_model)
    err = float((table - ref).abs().max())
    if err <= 1e-4:
        return []
    zero = float(table.abs().max()) == 0.0
    return [_f("positional-encoding", "warning",
               f"{key} is {'all zero' if zero else 'not the sinusoidal table'} "
               f"(max |diff| {err:.2g}): the model was trained with a different PE than the "
               f"paper's", where=key.rpartition(".")[0] or key,
               evidence={"max_abs_diff": err, "all_zero": zero},
               fix="check how the PE table is built (sin on even, cos on odd features)")]


def embedding_scale(lut: torch.Tensor, scale: float, where: str, rho_low: float = 0.05,
                    rho_high: float = 20.0) -> list[Finding]:
    """rho = RMS(embedding rows x scale) / RMS(sinusoidal PE) (FAILURE_MODES 7b: < 0.05 or > 20
    -> warning). The PE's RMS is 1/sqrt(2) at every width."""
    rho = float(lut.float().pow(2).mean().sqrt()) * scale / math.sqrt(0.5)
    if rho_low <= rho <= rho_high:
        return []
    drowned = "the PE drowns the token embeddings" if rho < rho_low else "the embeddings drown the PE"
    return [_f("positional-encoding", "warning",
               f"{where}: rho = RMS(embedding x {scale:.3g}) / RMS(PE) = {rho:.3g}: {drowned}",
               where=where, evidence={"rho": rho, "scale": scale, "threshold_low": rho_low,
                                      "threshold_high": rho_high},
               fix="multiply the embeddings by sqrt(d_model) and initialise them N(0, 1/d_model) "
                   "(or Xavier), so that token and position parts are comparable")]


# -- weights ------------------------------------------------------------------------------------
def duplicate_heads(sites: Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int]]) -> list[Finding]:
    """sites: (module path, W_Q, W_K, W_V [d, d] each, heads). Shared W_Q = W_K, or two heads
    whose Q/K/V slices have cosine > 0.99."""
    out = []
    for where, wq, wk, wv, h in sites:
        if wq.shape == wk.shape and torch.equal(wq, wk):
            same_v = wv.shape == wq.shape and torch.equal(wq, wv)
            out.append(_f("head-collapse", "error",
                          f"{where}: W_Q and W_K{' and W_V' if same_v else ''} are the same weights: "
                          f"every head's scores are symmetric", where=where,
                          evidence={"shared": "qkv" if same_v else "qk"},
                          fix="give Q, K and V their own projections (nn.Linear each)"))
            continue
        if h < 2 or wq.shape[0] % h:
            continue
        per_head = torch.cat([w.reshape(h, -1) for w in (wq, wk, wv)], dim=1).double()  # [h, 3 d_k d]
        unit = per_head / per_head.norm(dim=1, keepdim=True).clamp_min(1e-30)
        cos = unit @ unit.T                                                             # [h, h]
        cos.fill_diagonal_(-1.0)
        worst = float(cos.max())
        if worst > DUP_COS:
            i, j = divmod(int(cos.argmax()), h)
            n_dup = int((cos > DUP_COS).any(1).sum())
            out.append(_f("head-collapse", "error",
                          f"{where}: {n_dup} of {h} heads are copies of each other in the weights "
                          f"(heads {i} and {j}: cosine {worst:.4f})", where=where,
                          evidence={"max_cosine": worst, "heads": [i, j], "duplicated": n_dup,
                                    "threshold": DUP_COS},
                          fix="initialise each head independently (no deepcopy of one head)"))
    return out


# -- behaviour: the temperature sweep ------------------------------------------------------------
ScaleCtx = Callable[[float], "contextmanager"]


def held_out_loss(forward: Callable, src, tgt_in, tgt_out, pad_id: int) -> float:
    """Mean cross-entropy over non-pad targets; accepts logits or log-probs."""
    logits = forward(src, tgt_in)                                          # [B, T, V]
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt_out.reshape(-1),
                                 ignore_index=pad_id))


def temperature_sweep(forward: Callable, scaled: ScaleCtx, batch, pad_id: int, vocab: int,
                      where: str = "") -> tuple[list[Finding], dict]:
    """Scale every attention's scores by alpha and find the alpha that minimises held-out loss.

    A checkpoint that matches its code gives alpha ~ 1; one trained without 1/sqrt(d_k) and
    loaded into scaled code gives alpha ~ sqrt(d_k). Returns (findings, evidence).
    """
    src, tgt_in, tgt_out = batch
    losses = {}
    with torch.no_grad():
        for k in SWEEP_K:
            alpha = 2 ** (k / 2)
            with scaled(alpha):
                losses[alpha] = held_out_loss(forward, src, tgt_in, tgt_out, pad_id)
    finite = {a: l for a, l in losses.items() if math.isfinite(l)}
    ln_v = math.log(vocab)
    evidence = {"losses": {f"{a:.3g}": round(l, 4) for a, l in losses.items()}, "ln_V": ln_v}
    if not finite:
        return [], {**evidence, "verdict": "non-finite"}
    best = min(finite, key=finite.get)
    evidence.update(best_alpha=best, best_loss=finite[best], loss_at_1=losses[1.0],
                    interval=[ALPHA_LOW, ALPHA_HIGH])
    if finite[best] >= SOLVED * ln_v:
        evidence["verdict"] = "inconclusive"
        return [_f("missing-scale", "info",
                   f"temperature sweep inconclusive: the checkpoint does not solve the held-out "
                   f"task (best loss {finite[best]:.2f} >= {SOLVED} ln V = {SOLVED * ln_v:.2f}); "
                   f"pass the --task it was trained on", where=where, evidence=evidence)], evidence
    if ALPHA_LOW - 1e-9 <= best <= ALPHA_HIGH + 1e-9:
        evidence["verdict"] = "matched"
        return [], evidence
    evidence["verdict"] = "mismatch"
    what = "without the 1/sqrt(d_k) scale" if best > 1 else "with a larger scale than this code's"
    return [_f("missing-scale", "error",
               f"the checkpoint was trained {what}: held-out loss is lowest with the scores "
               f"scaled by alpha={best:.3g} ({finite[best]:.3f} vs {losses[1.0]:.3f} at alpha=1; "
               f"healthy: alpha in [0.71, 1.41])", where=where, evidence=evidence, fix=FIX_SCALE)], evidence


@contextmanager
def hook_scores_scaled(model, alpha: float):
    """tndebug's model: multiply every `hook_scores` tap by alpha (the explicit path runs)."""
    handles = [p.register_forward_hook(lambda m, i, o: o * alpha)
               for name, p in model.named_modules() if name.endswith("hook_scores")]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
