"""Checkpoint hygiene: what the file itself says, before and besides the probes.

Each check returns `Finding`s (probe "checkpoint", or the probe whose failure mode it is):

* non-finite weights: which tensors, how many entries                      -> checkpoint, error
* no optimizer state or no step counter: a resume restarts the warmup      -> lr-schedule, info
* the checkpoint's config and its weights disagree                         -> checkpoint, error
* attention heads duplicated in the weights, or W_Q = W_K                  -> head-collapse, error
* trained without the 1/sqrt(d_k) scale: the temperature sweep (FAILURE_MODES 2.2), with a
  paired significance test, measured here -> its evidence; missing-scale's findings from it
  (probes/missing_scale_sweep.py sweep_findings: error; on the user's own code info or none)
* a stored PE table that is not the paper's sinusoids                      -> positional-encoding, warning
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F

from tndebug.findings import Finding
from tndebug.model.embedding import sinusoid_table
from tndebug.probes.lr_schedule import no_resume_state
from tndebug.probes.positional_encoding_weights import emb_ratio_finding, stored_pe_finding
# the paired comparison of held-out losses, shared with the kv-order test (probes/paired.py)
from tndebug.probes.paired import (MAJORITY, MIN_GAIN_NATS, MIN_GAIN_REL, MIN_SEQS,  # noqa: F401
                                   SOLVED, Z_SE, paired_gain, sequence_losses)
from tndebug.triage.loading import Checkpoint

# FAILURE_MODES 2.2 / 2b: scale the scores by alpha = 2^(k/2), k = -6..6; argmin outside
# [1/sqrt 2, sqrt 2] -> error.
SWEEP_K = range(-6, 7)
ALPHA_LOW, ALPHA_HIGH = 2 ** -0.5, 2 ** 0.5


def _f(probe, severity, message, where="", evidence=None, fix="", *, code: str) -> Finding:
    return Finding(probe, severity, message, where=where, step=0, evidence=evidence or {}, fix=fix,
                   code=code)


# -- the file ------------------------------------------------------------------------------------
FINITE_BLOCK = 1 << 20      # elements per isfinite call (all_finite)


def all_finite(t: torch.Tensor) -> bool:
    """Every value of `t` finite, looked at FINITE_BLOCK elements at a time: isfinite on a whole
    50k x 768 embedding allocates its temporaries at once (0.3 GB on GPT-2 small's, the triage's
    peak), a block's are 1/37 of that. Same answer."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + FINITE_BLOCK]).all())
               for i in range(0, flat.numel(), FINITE_BLOCK))


def weights_finite(state_dict) -> bool:
    """Every floating-point tensor of the file finite (one bool reduction each): the judge
    withdraws what the probes measured through non-finite weights (Context.weights_finite)."""
    return all(all_finite(t) for t in state_dict.values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def non_finite(sd: dict[str, torch.Tensor]) -> list[Finding]:
    """One error for the file's non-finite tensors: the first named, the others counted (a
    checkpoint NaN from a -inf fill at step 0 has NaN in every matrix: one line, not forty)."""
    bad_keys: list[tuple[str, int, int, int]] = []          # (key, non-finite, nan, numel)
    for key, t in sd.items():
        if not t.is_floating_point():
            continue
        if all_finite(t):                       # bool reductions: no int64 copy of the tensor
            continue
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            bad_keys.append((key, bad, int(torch.isnan(t).sum()), t.numel()))
    if not bad_keys:
        return []
    key, bad, nan, numel = bad_keys[0]
    more = f" (+{len(bad_keys) - 1} more tensors)" if len(bad_keys) > 1 else ""
    return [_f("checkpoint", "error",
               f"{key} holds {bad} non-finite values ({nan} NaN, {bad - nan} inf) of {numel}{more}",
               where=key, evidence={"non_finite": bad, "nan": nan, "numel": numel,
                                    "tensors": {k: {"non_finite": b, "nan": n, "numel": m}
                                                for k, b, n, m in bad_keys}},
               fix="the run diverged before this save: resume from an earlier checkpoint and "
                   "find the first NaN with `tndebug run` (nan-scores); a checkpoint NaN from "
                   "its first steps points at the code (with --model its exact tests also run "
                   "on a fresh initialisation)",
               code="checkpoint/nonfinite-weights")]


# Finite values no training produces: a float32 weight or Adam's first moment beyond 1e30 (the
# largest weights of trained models are ~1e2-1e4; an exponent bit flipped gives ~1e37), or a
# negative second moment (exp_avg_sq is a running mean of squares). They are a damaged file,
# named before the probes read the weights as a model bug (QK^T overflowing to inf).
IMPLAUSIBLE = 1e30
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum")


def _finite_abs_max(t: torch.Tensor) -> float:
    """max |t| over its finite entries (non_finite names the others), a block at a time."""
    flat, top = t.reshape(-1), 0.0
    for i in range(0, flat.numel(), FINITE_BLOCK):
        m = flat[i:i + FINITE_BLOCK].abs().amax()
        if not bool(torch.isfinite(m)):
            m = torch.nan_to_num(flat[i:i + FINITE_BLOCK].abs(), nan=0.0, posinf=0.0).amax()
        top = max(top, float(m))
    return top


def implausible(sd: dict[str, torch.Tensor], optimizer: dict | None = None) -> list[Finding]:
    """One error naming the first tensor whose finite values no training produces (see
    IMPLAUSIBLE), the others counted: weights, and the optimizer's moments when saved."""
    bad: list[tuple[str, str]] = []                       # (tensor, what is wrong)
    for key, t in sd.items():
        if t.is_floating_point() and t.numel():
            top = _finite_abs_max(t)
            if top > IMPLAUSIBLE:
                bad.append((key, f"|value| up to {top:.3g}"))
    state = (optimizer or {}).get("state") or {}
    for idx, moments in state.items() if isinstance(state, dict) else ():
        for name, t in (moments.items() if isinstance(moments, dict) else ()):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
                continue
            key = f"optimizer state[{idx}].{name}"
            if name in SECOND_MOMENTS and bool((t < 0).any()):
                bad.append((key, f"{int((t < 0).sum())} negative values (min {float(t.min()):.3g}) "
                                 f"in a second moment, a mean of squares"))
            elif _finite_abs_max(t) > IMPLAUSIBLE:
                bad.append((key, f"|value| up to {_finite_abs_max(t):.3g}"))
    if not bad:
        return []
    key, what = bad[0]
    more = f" (+{len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    return [_f("checkpoint", "error",
               f"{key} holds values no training produces: {what}{more}; the file is damaged "
               f"(bits changed after the save), so what the probes find in it may follow from that",
               where=key, evidence={"tensors": dict(bad), "bound": IMPLAUSIBLE},
               fix="use another copy of the file or an earlier checkpoint (a disk, copy or "
                   "transfer changed it); then triage again",
               code="checkpoint/implausible-values")]


def resume_state(ckpt: Checkpoint) -> list[Finding]:
    missing = []
    if not ckpt.has_optimizer_state:
        missing.append("optimizer state" if ckpt.optimizer is None else "optimizer moments (empty state)")
    if ckpt.step is None and not ckpt.has_scheduler:
        missing.append("step counter")
    if not missing:
        return []
    # an advisory (docs/severity.md): lr_schedule.no_resume_state
    return [no_resume_state(missing, ckpt.container, ckpt.top_keys[:12], ckpt.step_key or None)]


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
                              "model that was trained (triage used the shapes)", code="checkpoint/config-mismatch"))
    return out


def stored_pe(pe: torch.Tensor | None, key: str, d_model: int) -> list[Finding]:
    if pe is None:
        return []
    table = pe.reshape(-1, d_model).float()                                   # [max_len, d]
    ref = sinusoid_table(table.shape[0], d_model)
    err = float((table - ref).abs().max())
    if err <= 1e-4:
        return []
    zero = float(table.abs().max()) == 0.0
    return [stored_pe_finding(key, err, zero)]


def embedding_scale(lut: torch.Tensor, scale: float, where: str, rho_low: float = 0.05,
                    rho_high: float = 20.0) -> list[Finding]:
    """rho = RMS(embedding rows x scale) / RMS(sinusoidal PE) (FAILURE_MODES 7b: < 0.05 or > 20
    -> warning). The PE's RMS is 1/sqrt(2) at every width."""
    rho = float(lut.float().pow(2).mean().sqrt()) * scale / math.sqrt(0.5)
    if rho_low <= rho <= rho_high:
        return []
    return [emb_ratio_finding(where, rho, scale, rho_low, rho_high)]


# -- weights ------------------------------------------------------------------------------------
# -- behaviour: the temperature sweep ------------------------------------------------------------
ScaleCtx = Callable[[float], "contextmanager"]

NOT_APPLICABLE = ("the checkpoint was triaged with its own code (--model), which it was trained "
                  "with, so it sits at alpha ~ 1 by construction: the sweep cannot reveal a "
                  "missing scale here (missing-scale measures the scale the code applies)")


def held_out_loss(forward: Callable, src, tgt_in, tgt_out, pad_id: int) -> float:
    """Mean cross-entropy over non-pad targets; accepts logits or log-probs."""
    logits = forward(src, tgt_in)                                          # [B, T, V]
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt_out.reshape(-1),
                                 ignore_index=pad_id))


def temperature_sweep(forward: Callable, scaled: ScaleCtx, batch, pad_id: int, vocab: int, *,
                      own_code: bool = False, data: str = "--task") -> dict:
    """Scale every attention's scores by alpha and find the alpha that minimises held-out loss.

    A checkpoint that matches its code gives alpha ~ 1; one trained without 1/sqrt(d_k) and
    loaded into scaled code gives alpha ~ sqrt(d_k). `own_code`: the checkpoint runs with the
    code it was trained with (--model), where a mismatch cannot show (at most an info).
    `data`: where the held-out batch came from ("--task", or "--data" for the user's own).
    Returns the evidence, run["temperature_sweep"]: the losses, the best alpha, the paired test
    and the verdict ("matched", "not significant", "mismatch", "not applicable", or
    "inconclusive" with its "reason" when the checkpoint does not solve the data, "non-finite").
    The judge adds missing-scale's findings from it (probes/missing_scale_sweep.py `sweep_findings`: an error
    on "mismatch") and a verdict that decided nothing into a part not run (Context.sweep).
    """
    src, tgt_in, tgt_out = batch
    losses, per_seq = {}, {}
    with torch.no_grad():
        for k in SWEEP_K:
            alpha = 2 ** (k / 2)
            with scaled(alpha):
                losses[alpha], per_seq[alpha] = sequence_losses(forward, src, tgt_in, tgt_out, pad_id)
    finite = {a: l for a, l in losses.items() if math.isfinite(l)}
    ln_v = math.log(vocab)
    evidence = {"losses": {f"{a:.3g}": round(l, 4) for a, l in losses.items()}, "ln_V": ln_v,
                "data": data}
    if own_code:
        evidence["reason"] = NOT_APPLICABLE
    if not finite:
        return {**evidence, "verdict": "not applicable" if own_code else "non-finite"}
    best = min(finite, key=finite.get)
    test = paired_gain(per_seq[1.0], per_seq[best]) if best != 1.0 else {"n": int(src.shape[0])}
    gain = losses[1.0] - finite[best] if math.isfinite(losses[1.0]) else math.inf
    significant = (best != 1.0 and test["n"] >= MIN_SEQS and test["share_better"] >= MAJORITY
                   and test["z"] > Z_SE and gain >= MIN_GAIN_NATS
                   and gain >= MIN_GAIN_REL * losses[1.0])
    evidence.update(best_alpha=best, best_loss=finite[best], loss_at_1=losses[1.0],
                    interval=[ALPHA_LOW, ALPHA_HIGH], gain_nats=gain, paired=test,
                    significant=significant,
                    threshold=(f"gain >= {MIN_GAIN_NATS} nats and >= {MIN_GAIN_REL:.0%} of the loss "
                               f"at alpha=1, positive on >= {MAJORITY:.0%} of >= {MIN_SEQS} "
                               f"sequences, mean > {Z_SE:g} standard errors"))
    outside = not (ALPHA_LOW - 1e-9 <= best <= ALPHA_HIGH + 1e-9)
    solved = finite[best] < SOLVED * ln_v
    if own_code:
        evidence["verdict"] = "not applicable"
    elif not solved:
        hint = ("an under-trained checkpoint (or one given other data than its own) is flat in "
                "alpha, so the sweep cannot judge it" if data == "--data" else
                "pass --data with your own held-out batches, or the --task it was trained on")
        evidence.update(verdict="inconclusive", reason=(
            f"the checkpoint does not solve the held-out data ({data}; best loss "
            f"{finite[best]:.2f} >= {SOLVED} ln V = {SOLVED * ln_v:.2f}): {hint}"))
    else:
        evidence["verdict"] = ("matched" if not outside else "not significant" if not significant
                               else "mismatch")
    return evidence


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
