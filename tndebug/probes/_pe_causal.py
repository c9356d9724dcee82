"""positional-encoding's exact test for a decoder-only (causal) model: does the first attention
that mixes tokens see where a token is?

Swap two earlier tokens i < j of a row and compare that attention module's output at the later
positions t > j. Without any positional information a causal attention at t reads the *set* of
tokens 0..t (each key and value is a function of its own token alone), and the swap leaves that
set unchanged: its output at t is the same up to float rounding (summation order, ~1e-7
relative in float32). An absolute position (learned or sinusoidal, added to the embeddings), a
rotary rotation of q and k, an ALiBi or relative bias all make the keys' weights or values
depend on where the tokens sit, and the output moves.

Only the first mixing attention is exact: later ones read hidden states that the swap changed
at positions i..j-1 even without positions. It is found by behaviour: the earliest attention
(by layer, else by the order the forward ran them) whose output at t moves when the token at i
is replaced by another one (the control). An attention whose output does not depend on earlier
tokens at all (a zero output projection at initialisation) is passed over: the next one is then
the first that mixes.

A weak but real signal (near-uniform attention at initialisation under rotary: q.k ~ 0) is
told from rounding as positional-encoding's order test does: the swap again in float64, where
rounding shrinks 1e9x and a real effect keeps its size (`_pe_order.rel_in_float64`'s rule).

What the model declares is read beside it, names as hints only: position tables (an
nn.Embedding that the token ids do not index, or a parameter/buffer named for positions) and
rotary or ALiBi buffers. A blind first attention with a declared mechanism is a mechanism never
applied (an error); with none, a model without positions by design (NoPE: info).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from tndebug.probes._float64 import in_float64
from tndebug.probes._misc_stats import rel_diff
from tndebug.subject import Subject

# names of parameters/buffers that declare a position mechanism (hints; behaviour decides);
# `positions` too: GPT-J's sin/cos table is the buffer `embed_positions` (issue 45's user-style
# corpus, rotary never applied: read as NoPE, info, before)
DECLARED = re.compile(r"(^|[._])(w?pe|pos|positions?|positional|posemb|pos_emb|wpe|rotary|rope|"
                      r"inv_freq|freqs?(_cis)?|cos_cached|sin_cached|cos|sin|alibi|slopes|"
                      r"rel_pos|relative_attention_bias)([._\d]|$)", re.I)


def swap_rows(ids: torch.Tensor, i: int, j: int) -> torch.Tensor:
    out = ids.clone()
    out[:, [i, j]] = ids[:, [j, i]]
    return out


def _outputs(subject: Subject, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """site -> the self-attention module's output  # [B, T, d] (batch first, by shape)"""
    src = ids.new_zeros((ids.shape[0], 0))
    trace = subject.trace(src, ids, reads=("attn.out", "attn.probs"))   # probs: finds the sites
    out = {}
    order = [r for r in trace.records() if r.out is not None and r.kind in ("dec_self", "enc_self")]
    order.sort(key=lambda r: (r.layer if r.layer is not None else 1 << 30))    # stable: run order
    for rec in order:
        o = rec.out
        if o.dim() == 3 and o.shape[:2] == ids.shape:
            out[rec.site] = o
        elif o.dim() == 3 and o.shape[:2] == ids.shape[::-1]:                  # sequence first
            out[rec.site] = o.transpose(0, 1)
    return out


def first_mixing_swap(subject: Subject, tol: float, generator: torch.Generator) -> dict | None:
    """{"site", "swap", "control", "positions", "i", "j"} for the first attention whose output at
    the later positions depends on earlier tokens; None when none does (or nothing captured)."""
    T = subject.fit(12)
    if T < 6:
        return None
    lo, V = subject.first_content, subject.tgt_vocab
    ids = torch.randint(lo, V, (4, T), generator=generator)
    ids[:, 0] = subject.bos_id
    i, j = 1, T // 2
    same = ids[:, i] == ids[:, j]                                    # a swap must change the row
    ids[same, j] = lo + (ids[same, i] - lo + 1) % (V - lo)
    other = ids.clone()
    other[:, i] = lo + (ids[:, i] - lo + 2) % (V - lo)              # control: a different token at i
    clash = other[:, i] == ids[:, j]
    other[clash, i] = lo + (ids[clash, i] - lo + 3) % (V - lo)
    ids, other = ids.to(subject.device), other.to(subject.device)
    with subject.evaluating():
        base, swapped, ctrl = (_outputs(subject, x) for x in (ids, swap_rows(ids, i, j), other))
    for site, ref in base.items():
        if site not in swapped or site not in ctrl:
            continue
        late = slice(j + 1, T)
        control = rel_diff(ctrl[site][:, late], ref[:, late])
        if control < tol:
            continue                            # reads no earlier token: not yet the mixing one
        return {"site": site, "swap": rel_diff(swapped[site][:, late], ref[:, late]),
                "control": control, "positions": f"{j + 1}..{T - 1}", "i": i, "j": j,
                "ids": ids}
    return None


def swap_in_float64(subject: Subject, found: dict) -> float | None:
    """The same swap with the model in float64 (None when it cannot run there)."""
    ids = found["ids"]
    try:
        with in_float64(subject.model), subject.evaluating():
            a = _outputs(subject, ids).get(found["site"])
            b = _outputs(subject, swap_rows(ids, found["i"], found["j"])).get(found["site"])
    except Exception:  # noqa: BLE001 - the fp32 result stands
        return None
    if a is None or b is None or a.dtype != torch.float64:
        return None
    late = slice(found["j"] + 1, ids.shape[1])
    return rel_diff(b[:, late], a[:, late])


def declared(model: nn.Module, token_tables: set[int]) -> list[str]:
    """Position mechanisms the model declares: tables (nn.Embedding the ids do not index) and
    parameters/buffers named for positions, rotary or ALiBi. Names only: hints."""
    found = []
    for path, mod in model.named_modules():
        if isinstance(mod, nn.Embedding) and id(mod) not in token_tables \
                and id(mod.weight) not in token_tables:
            found.append(path)
    for path, t in list(model.named_parameters()) + list(model.named_buffers()):
        owner = path.rsplit(".", 1)[0] if "." in path else ""
        if DECLARED.search(path) and owner not in found and path not in found:
            found.append(path)
    return found


def token_tables(subject: Subject) -> set[int]:
    """ids of the nn.Embedding modules (and their weights) that the token ids index: the
    embeddings called with the input ids during one forward."""
    seen: set[int] = set()
    ids = torch.full((1, 4), subject.first_content, dtype=torch.long, device=subject.device)

    def hook(mod, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].shape == ids.shape \
                and bool((args[0] == ids).all()):
            seen.update({id(mod), id(mod.weight)})

    handles = [m.register_forward_pre_hook(hook) for m in subject.model.modules()
               if isinstance(m, nn.Embedding)]
    try:
        with subject.evaluating():              # an encoder-only model reads src, the rest tgt
            subject.logits(ids if subject.kind == "encoder" else ids.new_zeros((1, 0)), ids)
    except Exception:  # noqa: BLE001 - then no table is known to be the token one
        pass
    finally:
        for h in handles:
            h.remove()
    return seen


def applied_where(subject: Subject) -> str:
    """"added to the embeddings" when one token at every position embeds differently by
    position (an absolute table), else "in attention" (rotary, ALiBi, a relative bias)."""
    if subject.capture is None:
        return "in attention or the embeddings"
    T = subject.fit(8)
    ids = torch.full((1, T), subject.first_content, dtype=torch.long, device=subject.device)
    try:
        with subject.evaluating():
            src = ids if subject.kind == "encoder" else ids.new_zeros((1, 0))   # its one sequence
            trace = subject.trace(src, ids, reads=("embed",), until_stacks=True)
    except Exception:  # noqa: BLE001
        return "in attention or the embeddings"
    for parts in trace.embed.values():
        out = parts.get("out")
        if out is not None and out.dim() == 3 and out.shape[1] == T and \
                rel_diff(out[:, 1:], out[:, :1].expand_as(out[:, 1:])) > 1e-6:
            return "added to the embeddings (absolute)"
    return "in attention (relative: rotary, ALiBi or a bias)"


def queries_positioned(subject: Subject, site: str, tol: float) -> bool | None:
    """On one token repeated, do the scores of `site` vary down a column (the query's position),
    while the swap test found the keys' positions unseen? Then positions reach the queries only:
    a rotation applied to q and not k (lm-decoding's rotary tests name it), not positions never
    applied. None when the scores are not captured."""
    T = subject.fit(8)
    ids = torch.full((1, T), subject.first_content, dtype=torch.long, device=subject.device)
    with subject.evaluating():
        trace = subject.trace(ids.new_zeros((1, 0)), ids, reads=("attn.scores", "attn.probs"))
    rec = trace.attention.get(site)
    S = None if rec is None else rec.scores
    if S is None or S.dim() != 4 or S.shape[-2:] != (T, T):
        return None
    S = S.double()[0]                                                     # [h, T, T]
    below = torch.ones(T, T, dtype=torch.bool, device=S.device).tril()
    col = S.masked_fill(~below, float("nan"))
    spread = (col.nan_to_num(float("-inf")).amax(-2) - col.nan_to_num(float("inf")).amin(-2))
    scale = float(S[:, below].abs().max().clamp_min(1e-30))
    return float(spread.max()) > tol * scale
