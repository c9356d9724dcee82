"""positional-encoding's order tests: does the model see where its tokens are? (the probe's
class is in positional_encoding.py; these are its methods, with their messages)

* encoder (or encoder-decoder): permute the real source tokens of each row; an encoder without
  position information is permutation-equivariant, enc(Px) = P enc(x), to rounding (rel < 1e-4,
  and < 1% of what other tokens at the same places change: a control for outputs that barely
  depend on the source); second looks in `_pe_order`;
* decoder-only: swap two earlier tokens and compare the first attention that mixes tokens at the
  later positions (`_pe_causal`).
An order used names where the positions enter (report.json's coverage reason); an order ignored
with a declared position mechanism is positions-not-applied, without one order-ignored (encoder)
or no-positions (NoPE, decoder).
"""
from __future__ import annotations

import torch

from tndebug.capture.source import made_line
from tndebug.probes import _pe_causal, _pe_lines, _pe_order
from tndebug.probes._misc_stats import first_reason, rel_diff
from tndebug.subject import Subject

# PERM_TOL: harness tiny/small; PERM_VS_CONTROL: foreign's hf-marian at init (held out: x-transformers).
PERM_TOL = 1e-4          # FAILURE_MODES 7a; healthy tiny/small encoders give rel 0.3-1.0
PERM_TOL_LOW_PRECISION = 1e-2   # when the encoder does not compute in float32
# An fp32 difference under PERM_TOL is rechecked in float64: an order-blind model is equivariant
# there to summation-order rounding (~1e-15 x depth), while a weak but real order signal keeps
# its size: a fresh RoFormer (rotary, 0.02-std init: near-uniform attention) gave 3e-5 in fp32
# and the same in float64 (bench/hf_unseen.py DEV). 1e-9 leaves 1e5x over fp64 rounding and
# sits 1e4x under the weakest real signal seen.
FP64_BLIND = 1e-9
# ...and a weak signal keeps its size there (RoFormer: 3e-5 in both), while rounding shrinks: a
# model that builds some tensors of its own in float32 stays above FP64_BLIND in float64 from
# those alone (x-transformers, absolute positions zeroed: 1.8e-7 in fp32, 3.9e-8 in float64,
# tests/foreign/test_xtransformers.py). Half its fp32 size: a real effect does not halve when the
# arithmetic gets 1e9x more precise.
FP64_KEEPS = 0.5
PERM_VS_CONTROL = 1e-2   # order-blind only if permuting changes the output < 1% as much as other
                         # tokens do: a model whose output barely depends on the source (a random
                         # init with small weights) has a small permutation difference too, but an
                         # order-blind one changes under permutation only by rounding
NOT_APPLIED_FIX = ("apply the positions: add the position table's rows to the token embeddings "
                   "(x = tok_emb(idx) + pos_emb(torch.arange(T))), or rotate q and k with the "
                   "rotary tables before q @ k^T; a model meant to have none (NoPE) may ignore this")


class OrderTests:
    """positional-encoding's order tests, mixed into PositionalEncodingProbe: they read and set
    its `token_order`, `mechanism`, `no_pe_sites` and `src_sites`, and report as it."""

    # -- 1. permutation equivariance -------------------------------------------------------
    def permutation_test(self, subject: Subject) -> None:
        g = torch.Generator().manual_seed(7)
        src, tgt = subject.random_batch(batch=4, src_len=12, tgt_len=6, generator=g)
        keep = src != subject.pad_id                                   # [B, S]
        src_p, gather = src.clone(), torch.arange(src.shape[1]).repeat(src.shape[0], 1)
        for b in range(src.shape[0]):
            idx = keep[b].nonzero().flatten().cpu()
            perm = torch.randperm(len(idx), generator=g)
            if torch.equal(perm, torch.arange(len(idx))):
                perm = perm.roll(1)
            gather[b, idx] = idx[perm]
            src_p[b, idx] = src[b, idx[perm]]
        gather = gather.to(src.device)
        other = src.clone()                 # control: other tokens at the same real positions
        other[keep] = torch.randint(subject.first_content, subject.src_vocab, (int(keep.sum()),),
                                    generator=g).to(src.device)
        try:
            with subject.evaluating():
                enc = subject.encode(src)
                if enc is not None:                 # equivariance: enc(Px) == P enc(x)
                    what = "encoder output"
                    out = subject.encode(src_p)[keep]
                    ref = enc.gather(1, gather[..., None].expand_as(enc))[keep]
                    ctrl = subject.encode(other)[keep]
                    base = enc[keep]
                else:                               # invariance: memory is a set to cross-attention
                    what = "decoder logits"
                    out, ref = subject.logits(src_p, tgt), subject.logits(src, tgt)
                    ctrl, base = subject.logits(other, tgt), ref
        except Exception as e:  # noqa: BLE001 - a model that cannot run this is not our finding
            self.skip_also(f"permutation test could not run: {first_reason(e)}")
            return
        rel, rel_ctrl = rel_diff(out, ref), rel_diff(ctrl, base)
        tol = PERM_TOL if out.dtype == torch.float32 else PERM_TOL_LOW_PRECISION
        self.metric(0, "pe/encoder/permutation_rel_diff", rel)
        if rel_ctrl < tol:
            self.cover("", "no verdict", f"the {what} hardly depend on the source tokens (other "
                       f"tokens change them by {rel_ctrl:.1e} < {tol:g}): order cannot be tested")
            return
        self.cover("", "checked")              # token order: the encoder (or the logits) as a whole
        self.token_order = "uses positions"
        if not (rel < tol and rel < PERM_VS_CONTROL * rel_ctrl):
            self._encoder_mechanism(subject, what, rel)
            return
        if rel < tol and rel < PERM_VS_CONTROL * rel_ctrl:
            rel64 = _pe_order.rel_in_float64(subject, src, src_p, gather, keep, tgt, what)
            if rel64 is not None and rel64 >= FP64_BLIND and rel64 >= FP64_KEEPS * rel:
                # a weak order signal, not rounding
                self.metric(0, "pe/encoder/permutation_rel_diff_float64", rel64)
                self._encoder_mechanism(subject, what, rel64, weak=True)
                return
            blind = (_pe_order.attention_blind(subject, src, tgt)
                     or _pe_order.tokens_unmixed(subject, src, keep, tol, g))
            if blind:
                self.token_order = None
                self.cover("", "no verdict", blind)
                return
            self.token_order = "ignores order"
            if subject.kind == "encoder" and self._declared_not_applied(subject, what, rel, rel_ctrl, tol):
                return
            src_no_pe = [s for s in self.no_pe_sites if s in self.src_sites]
            where = src_no_pe[0] if src_no_pe else "encoder"
            no_pe = f"; no PE is added at {', '.join(self.no_pe_sites)}" if self.no_pe_sites else ""
            self.report("error", f"encoder ignores token order: permuting the source permutes its "
                        f"{what} (rel diff {rel:.1e} < {tol:g}; other tokens: {rel_ctrl:.1e})"
                        f"{no_pe}", where=where, step=0,
                        evidence={"rel_diff": rel, "threshold": tol, "compared": what,
                                  "control_rel_diff": rel_ctrl, "vs_control": PERM_VS_CONTROL,
                                  "sites_without_pe": list(self.no_pe_sites)}, code="order-ignored",
                        source=_embedding_line(subject, where))

    def _encoder_mechanism(self, subject: Subject, what: str, rel: float, weak: bool = False) -> None:
        """Encoder-only, order used: where the positions enter (report.json's coverage reason), as
        for a decoder: added to the embeddings, or in attention (rotary, a relative bias)."""
        if subject.kind != "encoder":
            return
        self.mechanism = _pe_causal.applied_where(subject) + (", weak at this init" if weak else "")
        self.cover("", "checked", f"encoder positions: {self.mechanism} (permuting the tokens moves "
                   f"the {what} by {rel:.1e})")

    def _declared_not_applied(self, subject: Subject, what: str, rel: float, rel_ctrl: float,
                              tol: float) -> bool:
        """Encoder-only, order ignored: a position mechanism the model declares (a table the ids
        do not index, a parameter or buffer named for positions, rotary or a relative bias:
        hints, as for a decoder) is one never applied, the decoder's error; True when reported.
        Without one the encoder has no positions at all: order-ignored (a bidirectional stack
        cannot learn them from a mask, unlike a causal one)."""
        try:
            tables = _pe_causal.declared(subject.model, _pe_causal.token_tables(subject))
        except Exception:  # noqa: BLE001 - then order-ignored, without the declaration
            return False
        if not tables:
            return False
        self.report("error", f"positions never applied: the model declares "
                    f"{', '.join(tables[:3])}{' (+more)' if len(tables) > 3 else ''}, but "
                    f"permuting the tokens permutes its {what} (rel diff {rel:.1e} < {tol:g}; other "
                    f"tokens: {rel_ctrl:.1e}): a bidirectional stack without positions is "
                    f"permutation-equivariant", where=tables[0], step=0, fix=NOT_APPLIED_FIX,
                    evidence={"rel_diff": rel, "threshold": tol, "compared": what,
                              "control_rel_diff": rel_ctrl, "vs_control": PERM_VS_CONTROL,
                              "declared": tables}, code="positions-not-applied",
                    source=_pe_lines.not_applied_line(subject, tables[0]))
        return True

    # -- 1b. decoder-only: positions applied? (_pe_causal) ---------------------------------------
    def causal_swap_test(self, subject: Subject) -> None:
        if subject.capture is None:
            self.cover("", "no verdict", "the positions test reads the attention outputs, and none "
                       "were found in this model's forward")
            return
        g = torch.Generator().manual_seed(11)
        try:
            with torch.no_grad():
                found = _pe_causal.first_mixing_swap(subject, PERM_TOL, g)
        except Exception as e:  # noqa: BLE001 - a model that cannot run this is not our finding
            self.cover("", "no verdict", f"positions test could not run: {first_reason(e)}")
            return
        if found is None:
            self.cover("", "no verdict", "no attention output was captured that depends on earlier "
                       "tokens (control: another token at an earlier position): positions cannot "
                       "be tested")
            return
        low = next((p.dtype for p in subject.model.parameters() if p.is_floating_point()),
                   torch.float32) != torch.float32
        tol = PERM_TOL_LOW_PRECISION if low else PERM_TOL
        swap, control, site = found["swap"], found["control"], found["site"]
        self.metric(0, "pe/decoder/swap_rel_diff", swap)
        evidence = {"swap_rel_diff": swap, "control_rel_diff": control, "threshold": tol,
                    "vs_control": PERM_VS_CONTROL, "module": site,
                    "swapped": f"positions {found['i']} and {found['j']}",
                    "compared": f"positions {found['positions']}"}
        if not (swap < tol and swap < PERM_VS_CONTROL * control):
            self._mechanism(_pe_causal.applied_where(subject), swap)
            return
        rel64 = _pe_causal.swap_in_float64(subject, found)
        if rel64 is not None and rel64 >= FP64_BLIND and rel64 >= FP64_KEEPS * swap:
            self._mechanism(_pe_causal.applied_where(subject) + ", weak at this init", rel64)
            return                                # a weak order signal, not rounding
        evidence["swap_rel_diff_float64"] = rel64
        try:
            partial = _pe_causal.queries_positioned(subject, site, tol)
        except Exception:  # noqa: BLE001 - only a refinement of the result above
            partial = None
        if partial:                               # keys blind, queries not: a partial rotation
            self._mechanism("in attention, on the queries only (the keys carry no position: "
                            "see lm-decoding's rotary tests)", swap)
            return
        tables = _pe_causal.declared(subject.model, _pe_causal.token_tables(subject))
        evidence["declared"] = tables
        what = (f"swapping the tokens at positions {found['i']} and {found['j']} leaves the "
                f"first attention that mixes tokens ({site}) unchanged at the later positions "
                f"(rel diff {swap:.1e}; another token there: {control:.1e})")
        self._mechanism("none reaches the attention" if tables else "none (NoPE)", swap)
        if tables:
            self.report("error", f"positions never applied: the model declares "
                        f"{', '.join(tables[:3])}{' (+more)' if len(tables) > 3 else ''}, but "
                        f"{what}", where=tables[0], step=0, evidence=evidence,
                        fix=NOT_APPLIED_FIX, code="positions-not-applied",
                        source=_pe_lines.not_applied_line(subject, tables[0]))
        else:
            self.report("info", f"no position mechanism (NoPE): {what}; a causal stack can learn "
                        f"positions from its mask, a published design (Kazemnejad et al. 2023), "
                        f"but not the usual one", where="", step=0, evidence=evidence,
                        fix=NOT_APPLIED_FIX, code="no-positions")

    def _mechanism(self, where: str, swap: float) -> None:
        """The positions found (report.json's coverage reason): where they enter, or none."""
        self.mechanism = where
        self.cover("", "checked", f"decoder positions: {where} (token swap moves the first "
                   f"mixing attention by {swap:.1e})")


def _embedding_line(subject: Subject, where: str) -> dict | None:
    """The user's line of the embedding addition whose result enters the encoder (a recorded
    pass's, capture/origins.py), for a finding on the encoder as a whole; None: the engine
    places a finding on a module itself."""
    if where != "encoder":
        return None
    return made_line(getattr(subject, "model", None), "encoder:embedding")
