"""The fault catalogue: every failure mode of the notes, written the way people get it wrong.

Faults are switched on through config (`ModelConfig.with_faults`) or, for the training-loop
faults, through `TrainConfig`. tndebug/inject.py puts the model faults into the healthy model
from outside it (tndebug/model/ reads none), the trainer reads the training faults; probes
never read either.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    name: str
    probe: str          # the probe that must catch it ("" for a claim to measure)
    where: str          # "attention" | "mask" | "embedding" | "block" | "training" | "config"
    summary: str        # what the buggy code does, in one line
    norms: tuple[str, ...] = ("pre", "post")   # placements where the fault applies
    needs: str = ""      # a condition for the fault to show (e.g. "fp16", "resume"; "rotary":
    #                      a model with pos="rotary", which the config then requires)
    arch: str = ""       # "decoder": only a decoder-only model has it; "seq2seq": only an
    #                      encoder-decoder; "": both


_F = Fault
FAULTS: dict[str, Fault] = {f.name: f for f in (
    _F("no_scale", "missing-scale", "attention", "scores = q @ k^T with no 1/sqrt(d_k)"),
    _F("scale_by_d_model", "missing-scale", "attention", "scores divided by sqrt(d_model) instead of sqrt(d_k)"),
    _F("mask_inverted", "mask-broadcast", "mask", "masked_fill on the keep-mask: real tokens are hidden, pads are seen"),
    _F("pad_mask_query_axis", "mask-broadcast", "mask",
       "encoder padding mask shaped [B,1,S,1]: it broadcasts over queries, so real queries attend to pads"),
    _F("no_causal_mask", "mask-broadcast", "mask", "decoder self-attention gets the padding mask only: it sees the future"),
    _F("causal_transposed", "mask-broadcast", "mask", "causal mask built with triu instead of tril: each position sees the future"),
    _F("mask_after_softmax", "mask-broadcast", "attention",
       "masked positions zeroed after softmax: pads stay in the denominator, rows do not sum to 1"),
    _F("no_memory_mask", "mask-broadcast", "mask", "cross-attention called without the source padding mask",
       arch="seq2seq"),
    _F("softmax_wrong_dim", "mask-broadcast", "attention", "softmax over the query axis (dim=-2) instead of the keys"),
    _F("view_without_transpose", "mask-broadcast", "attention",
       "heads split with .view(B, h, T, d_k) and no transpose: positions and features mix"),
    _F("shared_qkv", "head-collapse", "attention", "one Linear used for Q, K and V: scores are symmetric"),
    _F("identical_head_init", "head-collapse", "attention",
       "every head initialised from one copy (deepcopy of a head): heads stay identical"),
    _F("no_pos_encoding", "positional-encoding", "embedding", "positional encoding computed but never added"),
    _F("no_emb_scale", "positional-encoding", "embedding", "embeddings not multiplied by sqrt(d_model): PE drowns the tokens"),
    _F("pos_max_len_small", "positional-encoding", "embedding",
       "PE table too short; positions past max_len are clamped onto its last row"),
    _F("no_residual", "variance-drift", "block", "sublayer output replaces the stream: x = f(x) with no residual"),
    _F("no_attn_residual", "ln-placement", "block",
       "self-attention's output replaces the stream: x = attn(x) with no residual, the FFN keeps its own"),
    _F("pre_ln_no_final_norm", "ln-placement", "block", "Pre-LN stacks without the final LayerNorm", norms=("pre",)),
    _F("tiny_ln_eps", "nan-scores", "block", "LayerNorm eps=1e-12, which rounds to 0 in float16", needs="fp16"),
    _F("neg_inf_fill_all_masked", "nan-scores", "mask",
       "2-D padding mask (pad queries too) filled with -inf: fully-masked rows give NaN"),
    _F("fill_1e9_fp16", "nan-scores", "attention", "mask filled with the literal -1e9, which overflows float16",
       needs="fp16"),
    _F("label_smoothing_on_pad", "label-smoothing", "training",
       "label smoothing spreads eps over all V classes, pad included"),
    _F("kl_raw_logits", "loss-health", "training",
       "KLDivLoss (label smoothing) fed raw logits instead of log_softmax, as note 001's example does"),
    _F("warmup_restart_on_resume", "lr-schedule", "training",
       "on resume the scheduler step and Adam state start from zero: warmup restarts", needs="resume"),
    _F("no_warmup_high_lr", "ln-placement", "training",
       "constant lr 5x the run's own Noam peak from step 0, no warmup (--lr-factor scales it)",
       norms=("post",)),
    _F("dead_relu_init", "gradient-flow", "block", "FFN first bias initialised to -3: most ReLUs never fire"),
    _F("positions_ignore_left_pad", "lm-decoding", "embedding",
       "decoder-only: positions counted from column 0, not from the row's first real token, so "
       "a left-padded row (batched generation) gets other positions and other logits",
       arch="decoder"),
    _F("kv_cache_causal_top_left", "lm-decoding", "attention",
       "decoder-only KV cache: the causal mask of the query block aligned top-left (SDPA "
       "is_causal=True with a one-token query and a cache): each generated token sees only the "
       "first key", arch="decoder"),
    _F("kv_cache_position_off_by_one", "lm-decoding", "embedding",
       "decoder-only KV cache: the token decoded through the cache gets position t + 1, not t",
       arch="decoder"),
    _F("lm_labels_unshifted", "label-shift", "training",
       "decoder-only: loss(logits, ids) with labels not shifted: the model learns to repeat its input",
       arch="decoder"),
    _F("lm_labels_shifted_twice", "label-shift", "training",
       "decoder-only: labels shifted in the data and again in the loss: it learns the token after next",
       arch="decoder"),
    _F("rotary_q_only", "lm-decoding", "attention",
       "decoder-only RoPE: q rotated by its position, k left unrotated: the scores depend on the "
       "query's absolute position, not on the distance to the key", needs="rotary", arch="decoder"),
    _F("rotary_on_v", "lm-decoding", "attention",
       "decoder-only RoPE: v rotated too (apply_rotary(q, k, v)): each value carries its key's "
       "absolute position into the output", needs="rotary", arch="decoder"),
    _F("rotary_halves", "lm-decoding", "attention",
       "decoder-only RoPE: q pairs feature i with i + d_k/2 (rotate_half), k pairs 2i with 2i+1 "
       "(interleaved): q and k are rotated in different planes", needs="rotary", arch="decoder"),
    _F("no_dropout", "", "config", "dropout 0 everywhere (the notes claim heads then collapse; measured, not assumed)"),
)}

TRAINING_FAULTS = frozenset(n for n, f in FAULTS.items() if f.where == "training")
# faults of the sinusoidal table added at the embedding: a pos="rotary" model adds none
TABLE_FAULTS = frozenset({"no_pos_encoding", "pos_max_len_small"})


def check_faults(names) -> None:
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}; `tndebug faults` lists the {len(FAULTS)} faults")


def note_for(name: str) -> str:
    """The seed note(s) that describe a fault, when known."""
    try:
        from tndebug.notes import FAULT_NOTES
    except ImportError:  # pragma: no cover - notes.py is data shipped with the package
        return ""
    entry = FAULT_NOTES.get(name)
    return entry[1] if entry else ""
