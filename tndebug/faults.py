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


# fault name -> (what the bug does, as people usually write it; the seed note ids that describe
# it; the fix, in the words of the notes). If no note describes a fault, the source is
# "(FAILURE_MODES.md)" and the fix text names the closest note as "(closest: note NNN)". A probe
# quotes the fix of the fault it names (`FAULT_NOTES[name][2]`); tndebug/notes.py holds the
# notes' titles and claims.
FAULT_NOTES: dict[str, tuple[str, str, str]] = {
    "no_scale": (
        "Scores QK^T not divided by sqrt(d_k); logits std ~8 at d_k=64 and softmax saturates",
        "000,001,002",
        "Divide scores by math.sqrt(d_k) (d_k=d_model/h=64) before mask+softmax; "
        "not a hyperparameter but a mathematical necessity",
    ),
    "scale_by_d_model": (
        "Scores divided by sqrt(d_model)=22.6 instead of sqrt(d_k)=8; attention too flat",
        "(FAILURE_MODES.md)",
        "Scale by sqrt(d_k) with d_k=q.size(-1) after the head split (64, not 512) "
        "(closest: note 001, 'that 64 is d_k')",
    ),
    "mask_inverted": (
        "Fills where mask==1 instead of mask==0, so real tokens are hidden and pads/future kept",
        "001",
        "Mask is 1/True for tokens to keep; use masked_fill(mask == 0, fill) and print the "
        "mask to check it",
    ),
    "pad_mask_query_axis": (
        "Padding mask broadcast over the query axis; real queries still attend to pad keys",
        "000,002,003",
        "Build src_mask as (src != pad).unsqueeze(1).unsqueeze(2) -> (batch,1,1,src_len) so "
        "it masks the key (last) axis",
    ),
    "no_causal_mask": (
        "Decoder self-attention has no subsequent mask; position t sees tokens after t",
        "000,001,002,003",
        "AND the target pad mask with a lower-triangular subsequent_mask (torch.tril) in "
        "decoder self-attention",
    ),
    "causal_transposed": (
        "Causal mask built with triu (upper) instead of tril; each query sees only the future",
        "001,003",
        "Row i = query i must see keys 1..i: subsequent_mask(4) must print "
        "[[1,0,0,0],[1,1,0,0],[1,1,1,0],[1,1,1,1]]",
    ),
    "mask_after_softmax": (
        "Multiplies mask * attn_probs after softmax; pad scores stay in denominator, rows !=1",
        "000",
        "Apply masked_fill(mask == 0, fill) to the scores BEFORE softmax so masked "
        "weights are exactly 0",
    ),
    "no_memory_mask": (
        "Cross-attention gets no src_mask, so decoder queries attend to source padding",
        "002,001",
        "Pass the encoder padding mask (src_mask) to the encoder-decoder attention "
        "src_attn(x, memory, memory, src_mask)",
    ),
    "softmax_wrong_dim": (
        "Softmax over the query axis (dim=-2) instead of keys (dim=-1); rows don't sum to 1",
        "(FAILURE_MODES.md)",
        "Use softmax(scores, dim=-1) over seq_len_k; scores are (batch, head, seq_len_q, "
        "seq_len_k) (closest: note 000)",
    ),
    "view_without_transpose": (
        "view(B,T,h,d_k) with no transpose(1,2); notes say it errors, but it mixes positions",
        "000,001",
        "q.view(B,T,h,d_k).transpose(1,2) -> (B,h,T,d_k); merge back with "
        "transpose(1,2).contiguous().view(B,T,d_model)",
    ),
    "shared_qkv": (
        "One projection (W_q=W_k=W_v, or a single Linear reused) makes Q, K and V identical",
        "001",
        "Use three separate Linear layers for Q/K/V plus W_o; check id(linears[0]) != "
        "id(linears[1])",
    ),
    "identical_head_init": (
        "All heads start from identical weights, so they stay the same as one head",
        "(FAILURE_MODES.md)",
        "Give each head its own random xavier_uniform_ draw so heads learn different patterns "
        "(closest: note 001)",
    ),
    "no_pos_encoding": (
        "PE computed but never added to the embeddings; the model is blind to token order",
        "000,002,001",
        "Make sure pe is added: x = x + self.pe[:, :x.size(1)] (with pe as a registered "
        "buffer), then dropout",
    ),
    "no_emb_scale": (
        "Token embeddings not multiplied by sqrt(d_model) before PE, so PE/emb ratio is off",
        "001,003",
        "Embeddings: self.lut(x) * math.sqrt(self.d_model), then add the positional encoding",
    ),
    "pos_max_len_small": (
        "PE table max_len <= longest sequence; longer inputs overrun the table",
        "000,002",
        "Set max_len well above the longest sequence (note 000: >=2x, e.g. 256 for 128; "
        "default 5000) or compute PE on the fly",
    ),
    "no_residual": (
        "A sublayer drops the residual add (x = sublayer(x)); gradients stop flowing",
        "002,001",
        "Keep x + dropout(sublayer(x)) around every sublayer (2 per encoder layer, 3 per "
        "decoder layer) before/with LayerNorm",
    ),
    "no_attn_residual": (
        "The attention sublayer drops its residual (x = attn(norm(x))) while the FFN keeps x + ffn(x)",
        "(FAILURE_MODES.md)",
        "Keep x + dropout(sublayer(x)) around the attention sublayer as around the FFN "
        "(closest: note 002)",
    ),
    "pre_ln_no_final_norm": (
        "Pre-LN blocks x+sublayer(norm(x)) with no final LayerNorm; output stream unnormalised",
        "(FAILURE_MODES.md)",
        "With pre-norm SublayerConnection, add a final LayerNorm after the last "
        "encoder/decoder layer (annotated Encoder.norm) (closest: note 003)",
    ),
    "tiny_ln_eps": (
        "LayerNorm eps set tiny (1e-8/1e-12), which rounds to 0 in fp16; NaN on const rows",
        "000",
        "Use eps=1e-5 (note 000: change eps from 1e-8 to 1e-5); tiny eps is unsafe when LN "
        "runs in fp16",
    ),
    "neg_inf_fill_all_masked": (
        "masked_fill(..., float('-inf')): a fully masked row (all-pad) gives NaN in softmax",
        "000,001,002",
        "Fill with a large finite negative (note 002: -1e9; dtype-safe: "
        "torch.finfo(dtype).min) so all-masked rows give no NaN",
    ),
    "fill_1e9_fp16": (
        "Mask fill of -1e9 overflows fp16 (max 65504); becomes -inf or errors under autocast",
        "(FAILURE_MODES.md)",
        "Use torch.finfo(scores.dtype).min (or -1e4) instead of -1e9 when training in "
        "float16 mixed precision (closest: note 002)",
    ),
    "label_smoothing_on_pad": (
        "Smoothing spreads eps over all V-1 classes incl. <pad>; pad rows also give loss",
        "000,001,003",
        "Spread eps over size-2 classes, zero true_dist[:, pad_idx] and rows with "
        "target==pad, else model learns to predict pad",
    ),
    "kl_raw_logits": (
        "Label-smoothing KLDivLoss called on the generator's raw logits (note 001's usage "
        "example); the loss is unbounded below and training pushes the logits up forever",
        "001,003",
        "KLDivLoss expects log-probabilities: criterion(F.log_softmax(logits, dim=-1), "
        "true_dist) (note 003: 'input is log_softmax, not logits')",
    ),
    "warmup_restart_on_resume": (
        "Checkpoint omits step_num; after resume warmup restarts and lr jumps",
        "000",
        "Save {'model','optimizer', 'step_num': opt.step_num} in the checkpoint and restore "
        "them so the schedule continues",
    ),
    "no_warmup_high_lr": (
        "No warmup and a large peak lr; loss oscillates or goes to NaN/inf early",
        "000,002",
        "Use the Noam schedule with warmup (warmup_steps=4000, step_num from 1) and a modest "
        "peak lr; Post-LN needs warmup",
    ),
    "dead_relu_init": (
        "Bad FFN init (e.g. negative bias) leaves most ReLU units never active",
        "(FAILURE_MODES.md)",
        "Init FFN w_1 with xavier_uniform_ (it feeds the ReLU) and default bias; no "
        "large negative bias (closest: note 000)",
    ),
    "positions_ignore_left_pad": (
        "Decoder-only positions counted from column 0 (arange(T)), not from the row's first "
        "real token: a left-padded prompt gets other positions than the same prompt alone",
        "(FAILURE_MODES.md)",
        "Derive the positions from the padding mask, as generate() does: position_ids = "
        "mask.cumsum(-1) - 1 (pads set to any valid id), and pass them to the model with the "
        "mask (closest: note 002, padding masks)",
    ),
    "kv_cache_causal_top_left": (
        "KV-cache decoding with F.scaled_dot_product_attention(q, k, v, is_causal=True): for a "
        "one-token query and S cached keys the mask is tril(ones(1, S)), aligned top-left, so "
        "the new token sees only the first key",
        "(FAILURE_MODES.md)",
        "With a cache, align the causal mask bottom-right: query i of a block of n over S keys "
        "sees keys ..S - n + i (torch.ones(n, S).tril(S - n)); for a one-token query pass no "
        "causal mask (is_causal=False) and only the padding mask (closest: note 002)",
    ),
    "kv_cache_position_off_by_one": (
        "The token decoded through the KV cache gets position cache_len + 1 (or the count "
        "before the prefix), not cache_len: its positional encoding is one off",
        "(FAILURE_MODES.md)",
        "The new token's position is the number of real tokens before it in the row: "
        "cache length - left pads (position_ids = mask.cumsum(-1)[:, -1:] - 1) (closest: note "
        "002)",
    ),
    "no_dropout": (
        "Dropout set to 0 everywhere; note 000 says heads in a layer collapse to one pattern",
        "000,002",
        "Use dropout=0.1 on sublayer outputs (before residual add) and on emb+PE; "
        "note 000: dropout=0.1 restored head diversity",
    ),
}


def check_faults(names) -> None:
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}; `tndebug faults` lists the {len(FAULTS)} faults")


def note_for(name: str) -> str:
    """The seed note(s) that describe a fault, when known."""
    entry = FAULT_NOTES.get(name)
    return entry[1] if entry else ""
