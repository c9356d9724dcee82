"""positional-encoding: does the encoder see token order, at a sane strength, at every length?

Three tests at setup, all in eval mode and from behaviour only:

* permutation: permute the real source tokens of each row; an encoder without position
  information is permutation-equivariant, enc(Px) = P enc(x), to rounding (rel < 1e-4, and
  < 1% of what other tokens at the same places change: a control for outputs that barely
  depend on the source);
* scale: rho = RMS(token part) / RMS(PE actually added), the PE being `out - tok` of the
  embedding taps (a bug may compute the PE and never add it);
* overflow: feed one constant-token sequence as long as the model accepts; the embedding rows
  then differ only by position, so two positions with identical rows share a PE row.
Sharded parameters (FSDP2): the token table the embedding scale is fitted against is gathered
whole (`tndebug.sharded.full`, every rank at the same moment); the float64 second looks are not
taken on a sharded model (FSDP2 keeps its own views of each shard), the float32 result stands.
"""
from __future__ import annotations

import torch

from tndebug.faults import FAULT_NOTES
from tndebug import tags
from tndebug.probes import _pe_causal, _pe_order
from tndebug.probes._misc_stats import first_reason, rel_diff, rms
from tndebug.probes.base import Probe, RunContext, StepInfo
from tndebug.probes.schedule import every
from tndebug.sharded import full
from tndebug.subject import Subject
from tndebug.capture.trace import Trace

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
# rho at init: ours is 1.33-1.41 (N(0,1/d) embeddings x sqrt(d) over a sin/cos table of RMS
# 0.707); without the sqrt(d) scale it is d^-0.5/0.707: 0.17 (tiny), 0.12 (small), 0.06 (base).
# FAILURE_MODES 2.7 gives 0.23 for the annotated Transformer (xavier, V=37k) *with* the scale,
# so a low rho is forgiven when the token part is a parameter row times s >= SCALED.
RHO_LOW, RHO_HIGH = 0.25, 20.0
SCALED = 2.0
# With no multiplier at all (token part = embedding row x 1), the paper's design without its
# sqrt(d) gives rho = 1.41/sqrt(d) <= 0.5 for every d >= 8, while healthy designs sit near 1 or
# above (1.41 with the scale; learned positions initialised like the tokens, as BART's, ~1): a
# token part under half the PE with nothing scaling it is the notes' missing sqrt(d_model).
RHO_UNSCALED = 0.5
# A scale deviation the order test did not show harmful is a warning in a training run only if
# the loss at the last probed step is not below 0.95x the first: within batch noise (the CE of a
# 32 x 10-token batch varies by ~2-3% between batches), the model has not learnt (healthy tiny
# runs and the no_emb_scale fault alike are far below that by step 100).
TRAINS = 0.95
# UNIT, ZERO_PE, DUP_TOL: exact in kind (s fitted exactly; no PE adds 0; sinusoid rows differ by O(1)); no run.
UNIT = 0.05              # |s - 1| below this: the embedding row is used as it is
ZERO_PE = 1e-6           # RMS(PE added) / RMS(token part) below this: no PE added
DUP_TOL = 1e-5           # two positions whose rows differ by less (relative) share a PE row
MAX_PROBE_LEN = 1024
# The position part of >= 16 rows of d >= 8 features: a healthy sinusoidal or learned table
# spans min(L, d) directions (singular values within 1e3 of the largest for sinusoids at d=32,
# L=64); one frequency in every pair spans exactly 2 (sin p, cos p). Rank counted above 1e-6 of
# the largest singular value: fp32 rounding of a rank-2 table leaves ~1e-7. Exact in kind.
PE_MIN_RANK = 2
PE_RANK_TOL = 1e-6
PE_RANK_FIX = ("compute the exponent in floating point: div_term = torch.exp(torch.arange(0, "
               "d_model, 2).float() * (-math.log(10000.0) / d_model)); an integer division "
               "(2i // d_model) makes it 0, so every pair of dimensions gets frequency 1")
NOT_APPLIED_FIX = ("apply the positions: add the position table's rows to the token embeddings "
                   "(x = tok_emb(idx) + pos_emb(torch.arange(T))), or rotate q and k with the "
                   "rotary tables before q @ k^T; a model meant to have none (NoPE) may ignore this")


def _fix(fault: str) -> str:
    _, notes, fix = FAULT_NOTES[fault]
    return f"{fix} [notes {notes}]" if notes[0].isdigit() else fix


class PositionalEncodingProbe(Probe):
    """Failure: the positional encoding is computed but never added (pytorch-lightning #19138); the
    token embeddings are not multiplied by sqrt(d_model), so the PE drowns them (or N(0, 1)
    embeddings times sqrt(d) drown the PE); the PE table is shorter than the sequences and later
    positions silently reuse its last row.
    Symptom: the loss plateaus (note 000's "stuck at about 3.5"), word order is ignored, long
    sentences degrade.
    Fix: add the PE (x = x + pe[:, :T]), scale the embeddings by sqrt(d_model) before adding it,
    and size the table well above the longest sequence (or raise on overflow).
    """

    name = "positional-encoding"
    cause = (
        "The PE was never added to the embeddings, so the encoder cannot see token order, or "
        "pads take part in attention [notes 000, 002]. Also check that the embeddings are "
        "scaled by sqrt(d_model) and that max_len exceeds the sequence length [notes 001, 000, "
        "002]."
    )
    summary = "PE added (encoder permutation test), embedding/PE scale ratio, PE rows past max_len"
    codes = {
        "order-ignored": "the encoder ignores token order (no positional encoding used)",
        "no-pe-one-side": "one side adds no positional encoding while the other does",
        "pe-rows-reused": "positions past the table reuse its rows",
        "emb-scale": "the token embedding scale off the paper's (no sqrt(d_model)): info when harmless",
        "padded-shape": "the embedding output at real positions depends on the padded length or the batch",
        "positions-not-applied": "decoder- or encoder-only: a declared position table, rotary or "
                                 "relative bias never reaches the attention (swapping earlier "
                                 "tokens, or permuting them, changes nothing)",
        "no-positions": "decoder-only: no position mechanism at all (NoPE, by design or not)",
        "pe-one-frequency": "the PE spans two dimensions: every pair has the same frequency",
    }
    reads = ("embed",)
    fix = _fix("no_pos_encoding")
    default_schedule = staticmethod(lambda: every(100))

    def setup(self, run: RunContext) -> None:
        subject = run.subject
        self._no_pe_sites: list[str] = []      # embedding taps whose output equals their token part
        self._src_sites: set[str] = set()      # taps that embed the source
        self._scale_off: list[dict] = []       # scale deviations, judged from behaviour below
        self._order: str | None = None         # "uses positions" | "ignores order" | None (untested)
        self._losses: list[tuple[int, float]] = []   # training loss at the probed steps
        self._training = run.mode == "train"
        self.mechanism: str | None = None      # one-stack models: where positions enter (_pe_causal)
        self._rho_last: dict[str, tuple[int, float]] = {}   # site -> (step, rho) last probed
        if subject.capture is None:
            self._skip("no embedding taps: scale and overflow tests skipped")
        else:
            self._scale_test(subject)
        if subject.has_source:
            self._permutation_test(subject)
        else:   # decoder-only: does the first attention that mixes tokens see where they are?
            self._causal_swap_test(subject)
        if subject.capture is not None:
            self._padded_shape_test(subject)
            self._overflow_test(subject)
        if self._order == "ignores order":     # the harm is shown now: the positions are lost
            self._report_scale("warning")

    def _skip(self, reason: str) -> None:
        self.skip(f"{self.skipped}; {reason}" if self.skipped else reason)

    # -- 1. permutation equivariance -------------------------------------------------------
    def _permutation_test(self, subject: Subject) -> None:
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
            self._skip(f"permutation test could not run: {first_reason(e)}")
            return
        rel, rel_ctrl = rel_diff(out, ref), rel_diff(ctrl, base)
        tol = PERM_TOL if out.dtype == torch.float32 else PERM_TOL_LOW_PRECISION
        self.metric(0, "pe/encoder/permutation_rel_diff", rel)
        if rel_ctrl < tol:
            self.cover("", "no verdict", f"the {what} hardly depend on the source tokens (other "
                       f"tokens change them by {rel_ctrl:.1e} < {tol:g}): order cannot be tested")
            return
        self.cover("", "checked")              # token order: the encoder (or the logits) as a whole
        self._order = "uses positions"
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
                self._order = None
                self.cover("", "no verdict", blind)
                return
            self._order = "ignores order"
            if subject.kind == "encoder" and self._declared_not_applied(subject, what, rel, rel_ctrl, tol):
                return
            src_no_pe = [s for s in self._no_pe_sites if s in self._src_sites]
            where = src_no_pe[0] if src_no_pe else "encoder"
            no_pe = f"; no PE is added at {', '.join(self._no_pe_sites)}" if self._no_pe_sites else ""
            self.report("error", f"encoder ignores token order: permuting the source permutes its "
                        f"{what} (rel diff {rel:.1e} < {tol:g}; other tokens: {rel_ctrl:.1e})"
                        f"{no_pe}", where=where, step=0,
                        evidence={"rel_diff": rel, "threshold": tol, "compared": what,
                                  "control_rel_diff": rel_ctrl, "vs_control": PERM_VS_CONTROL,
                                  "sites_without_pe": list(self._no_pe_sites)}, code="order-ignored",
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
                              "declared": tables}, code="positions-not-applied")
        return True

    # -- 1b. decoder-only: positions applied? (_pe_causal) ---------------------------------------
    def _causal_swap_test(self, subject: Subject) -> None:
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
                        fix=NOT_APPLIED_FIX, code="positions-not-applied")
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

    # -- 2. embedding / PE scale ---------------------------------------------------------------
    def _scale_test(self, subject: Subject) -> None:
        g = torch.Generator().manual_seed(8)
        src, tgt = subject.random_batch(batch=8, src_len=12, tgt_len=10, generator=g)
        try:
            with subject.evaluating():
                trace = subject.trace(src, tgt, reads=("embed",))
        except Exception as e:  # noqa: BLE001
            self._skip(f"scale test could not capture the embeddings: {first_reason(e)}")
            return
        ids = {src.shape[1]: src, tgt.shape[1]: tgt}
        with_pe = []
        for site, parts in trace.embed.items():
            if "tok" not in parts or "out" not in parts:
                self.skip("the token embeddings and their sum with the positions are not both "
                          "outputs of a module here, so their scales could not be compared",
                          where=site)
                continue
            tok, out = parts["tok"], parts["out"]
            tokens = ids.get(tok.shape[1])
            if tok.shape[1] == src.shape[1]:
                self._src_sites.add(site)
            keep = (tokens != subject.pad_id if tokens is not None          # [B, T]
                    else torch.ones(tok.shape[:2], dtype=torch.bool, device=tok.device))
            pe = (out - tok).expand_as(tok)                           # [B, T, d]
            tok_rms, pe_rms = rms(tok[keep]).item(), rms(pe[keep]).item()
            self.cover(site, "checked")
            if pe_rms <= ZERO_PE * tok_rms:
                self._no_pe_sites.append(site)
                continue
            with_pe.append(site)
            rho = tok_rms / pe_rms
            self.metric(0, tags.PE_RHO.build(site=site), rho)
            scale = _fitted_scale(subject, tok, tokens)
            evidence = {"rho": rho, "rms_token": tok_rms, "rms_pe": pe_rms,
                        "threshold_low": RHO_LOW, "threshold_high": RHO_HIGH,
                        "fitted_scale": scale}
            unscaled = scale is not None and abs(scale - 1) < UNIT
            if (rho < RHO_LOW and (scale is None or scale < SCALED)) or (rho < RHO_UNSCALED and unscaled):
                bound = RHO_UNSCALED if rho >= RHO_LOW else RHO_LOW
                evidence["threshold_unscaled"] = RHO_UNSCALED
                self._scale_off.append({
                    "site": site, "evidence": evidence,
                    "what": f"PE drowns the token embeddings at {site}: rho = RMS(tok)/RMS(PE) = "
                            f"{rho:.3f} < {bound}" + (f" (token part = embedding row x {scale:.3g}"
                                                      f"{': no sqrt(d_model)' if unscaled else ''})"
                                                      if scale else ""),
                    "deviation": f"the token part at {site} is {rho:.3f} of the PE's RMS "
                                 f"(< {bound}" + (", the embedding row used unscaled: no "
                                                  "sqrt(d_model)" if unscaled else "") + ")"})
            elif rho > RHO_HIGH:
                self._scale_off.append({
                    "site": site, "evidence": evidence,
                    "what": f"token embeddings drown the PE at {site}: rho = {rho:.1f} > {RHO_HIGH}",
                    "deviation": f"the token part at {site} is {rho:.1f}x the PE's RMS (> {RHO_HIGH})"})
        if not trace.embed:
            self._skip("no embedding taps (tok/out) in the trace; scale test skipped")
        elif with_pe and self._no_pe_sites:       # one side adds PE, the other does not
            for site in self._no_pe_sites:
                self.report("warning", f"{site} adds no positional encoding (out == tok) while "
                            f"{', '.join(with_pe)} does", where=site, step=0,
                            evidence={"rms_pe_over_rms_tok": 0.0, "threshold": ZERO_PE,
                                      "sites_with_pe": with_pe}, code="no-pe-one-side")

    # -- 2b. PE rows that depend on the padded shape ----------------------------------------------
    def _padded_shape_test(self, subject: Subject) -> None:
        """The embedding output at real positions must not change when pad columns are appended
        or when the example is alone (exact, `_embed_moves`). A PE indexed by the padded shape
        moves it; reported unless this probe already named an error at setup (the order test on
        `x + pe[:, T]`, which adds one row to every position), so the PE is named once."""
        from tndebug.probes._embed_moves import embedding_moves
        try:
            moved = embedding_moves(subject)
        except Exception as e:  # noqa: BLE001 - the behaviour tests name a model that raises
            self.cover("", "no verdict", f"padded-shape test could not run: {first_reason(e)}")
            return
        if not moved or any(f.severity == "error" for f in self.findings):
            return
        what = {"src_pad_length": "source pad columns are appended",
                "tgt_pad_length": "target pad columns are appended", "batch": "the example is run alone"}
        test, m = next(iter(moved.items()))
        self.report("error", f"{m['site']}: the embedding output at real positions changes by "
                    f"{m['delta']:.3g} when {what[test]} (before any attention): the positional "
                    f"encoding added (or something else in the embedding) depends on the padded "
                    f"{'batch' if test == 'batch' else 'length'}, not on each position",
                    where=m["site"], step=0,
                    fix="Index the PE by position: x + pe[:, :x.size(1)] for a [1, max_len, d] table "
                        "(x [B, T, d]), not pe[:, x.size(1)] (one row) nor pe[:x.size(0)] (the batch "
                        "axis); with sequence-first tensors, pe[:x.size(0)] of a [max_len, 1, d] table",
                    evidence={"moved": moved, "threshold": "max|change| > 1e-5*(1+max|embedding|)"},
                    code="padded-shape")

    # -- 3. positions past the table -------------------------------------------------------------
    def _overflow_test(self, subject: Subject) -> None:
        length = min(subject.max_len or MAX_PROBE_LEN, MAX_PROBE_LEN)
        tok = subject.first_content
        refused = None
        while length >= 16:
            seq = torch.full((1, length), tok, dtype=torch.long, device=subject.device)
            try:
                with subject.evaluating():
                    # within the length the model declares (max_len), only the embeddings
                    # are needed: the layers are not run. Without one, the whole forward runs,
                    # since a length the layers refuse must halve the probe (rows the model
                    # never sees at that length are not its defect)
                    trace = subject.trace(seq, seq, reads=("embed",),
                                          until_stacks=subject.max_len is not None)
                break
            except Exception as e:  # noqa: BLE001 - raising on a long input is healthy
                refused = refused or (length, first_reason(e))
                length //= 2
        else:
            self._skip(f"overflow test: the model refused every probe length"
                      f"{f' ({refused[1]})' if refused else ''}")
            return
        for site, parts in trace.embed.items():
            if "out" not in parts:
                continue
            rows = parts["out"][0].double()                             # [L, d]: same token everywhere
            spread = (rows - rows.mean(0)).pow(2).mean().sqrt()         # RMS of the position part
            self.cover(site, "checked")
            if spread <= 1e-12 * rows.pow(2).mean().sqrt().clamp_min(1e-300):
                continue                                                # no PE at all: test 1's case
            dist = torch.cdist(rows, rows) / (spread * rows.shape[1] ** 0.5)   # [L, L]
            same = torch.triu(dist < DUP_TOL, diagonal=1)               # pairs i < j
            dup_cols = same.any(0).nonzero().flatten()
            if len(dup_cols) == 0:
                self._rank_test(site, rows, length)
                continue
            j = int(dup_cols[0])
            i = int(same[:, j].nonzero()[0])
            self.report("error", f"{site}: {len(dup_cols)} positions from {j} on reuse the PE row of an "
                        f"earlier position ({j} gets the row of {i}); the PE table is too short",
                        where=site, step=0, fix=_fix("pos_max_len_small"),
                        evidence={"first_duplicate_position": j, "same_row_as": i,
                                  "duplicate_positions": len(dup_cols), "probe_length": length,
                                  "threshold_rel_distance": DUP_TOL,
                                  "refused_length": refused[0] if refused else None}, code="pe-rows-reused")

    def _rank_test(self, site: str, rows: torch.Tensor, length: int) -> None:
        """The position part of the embedding rows (one token at every position, centred over
        the positions) spans how many directions? A sinusoidal table spans min(L, d), a learned
        one as many; a table whose every pair of dimensions has the same frequency (the
        exponent 2i/d truncated to 0 by integer division: sin(p), cos(p) in every pair) spans 2,
        and its rows come back near each other every 2*pi positions (p and p + 44 differ by
        0.018 rad)."""
        P = (rows - rows.mean(0)).double().cpu()                          # [L, d]
        if P.shape[0] < 16 or P.shape[1] < 8 or not bool(P.isfinite().all()):
            return
        try:
            sv = torch.linalg.svdvals(P)
        except RuntimeError:           # LAPACK did not converge: the rank is not told
            return
        if not float(sv[0]) > 0:
            return
        rank = int((sv > PE_RANK_TOL * sv[0]).sum())
        if rank > PE_MIN_RANK:
            return
        self.report("warning", f"{site}: the positional encoding spans only {rank} of "
                    f"{P.shape[1]} dimensions over {P.shape[0]} positions: every dimension "
                    f"pair uses the same frequency, so positions about 2*pi*k apart get nearly "
                    f"the same row", where=site, step=0, fix=PE_RANK_FIX,
                    evidence={"rank": rank, "d_model": P.shape[1], "positions": P.shape[0],
                              "threshold_rank": PE_MIN_RANK, "singular_value_tol": PE_RANK_TOL,
                              "probe_length": length}, code="pe-one-frequency")

    # -- runtime: rho as embeddings grow ---------------------------------------------------------
    def observe(self, trace: Trace, info: StepInfo) -> dict[str, torch.Tensor]:
        stats = {}
        for site, parts in trace.embed.items():
            if "tok" in parts and "out" in parts:
                tok = parts["tok"]
                stats[site] = rms(tok) / rms((parts["out"] - tok).expand_as(tok)).clamp_min(1e-30)
        if info.loss is not None and self._scale_off:
            stats["__loss"] = info.loss.detach().float().reshape(())
        return stats

    def update(self, stats, info: StepInfo) -> None:
        for site, rho in stats.items():
            if site == "__loss":
                self._losses.append((info.step, float(rho)))
            else:
                self.metric(info.step, tags.PE_RHO.build(site=site), float(rho))
                self._rho_last[site] = (info.step, float(rho))

    def finish(self, run: RunContext) -> None:
        """A scale off the paper's that the order test did not show harmful: judged from the
        training loss where this run trains (a loss that does not fall is the harm), else info."""
        if not self._scale_off:
            return
        losses = [(s, v) for s, v in self._losses if v == v]
        if not self._training or (len(losses) < 2 and not self._rho_last):
            self._report_scale("info", losses)          # no training seen: no harm shown, none claimed
            return
        if len(losses) >= 2 and not losses[-1][1] < TRAINS * losses[0][1]:
            self._report_scale("warning", losses)
            return
        # a falling loss is no evidence: the same model with the scale may fall much further.
        # Harmless only where the harm is seen not to last: the token part regained its share
        # of the embedding (rho back inside [RHO_LOW, RHO_HIGH]) by the last probed step.
        recovered, kept = [], []
        for item in self._scale_off:
            last = self._rho_last.get(item["site"])
            (recovered if last is not None and RHO_LOW <= last[1] <= RHO_HIGH else kept).append(item)
            if last is not None:
                item["evidence"] = {**item["evidence"], "rho_last": last[1], "rho_last_step": last[0]}
        self._scale_off = recovered
        if recovered:
            self._report_scale("info", losses, recovered=True)
        self._scale_off = kept
        if kept:
            self._report_scale("warning", losses, still_low=True)

    def _report_scale(self, severity: str, losses: list[tuple[int, float]] = (), *,
                      recovered: bool = False, still_low: bool = False) -> None:
        """Report the collected scale deviations: a warning with the harm the behaviour shows,
        info (naming the deviation) when the model uses positions and trains."""
        pending, self._scale_off = self._scale_off, []
        trend = (f"loss {losses[0][1]:.3g} at step {losses[0][0]}, {losses[-1][1]:.3g} at step "
                 f"{losses[-1][0]}" if len(losses) >= 2 else "")
        if still_low:
            last = [i["evidence"].get("rho_last") for i in pending]
            rho = f"rho is still {min(v for v in last if v is not None):.3g}" if any(
                v is not None for v in last) else "rho was not observed again"
            why = (f"{rho} at the last probed step, outside [{RHO_LOW}, {RHO_HIGH}]: the loss "
                   f"falls ({trend}), but a falling loss does not show the deviation harmless "
                   f"(the scaled model may train further)")
        elif recovered:
            why = (f"the token part regained its share by the end (rho back in [{RHO_LOW}, "
                   f"{RHO_HIGH}]) and it trains ({trend}): a deviation from the paper whose harm "
                   f"did not last")
        elif severity == "warning":
            why = ("the encoder ignores token order (see the order error)"
                   if self._order == "ignores order" else f"the loss does not fall ({trend})")
        else:
            seen = {"uses positions": "the encoder uses positions (order test)",
                    None: "the order test could not decide"}[self._order]
            why = f"{seen}; no training observed: a deviation from the paper, no harm shown"
        for item in pending:
            ev = {**item["evidence"], "order_test": self._order or "no verdict",
                  "loss_trend": [(s, round(v, 4)) for s, v in losses[-4:]]}
            text = item["what"] if severity == "warning" and not still_low else item["deviation"]
            self.report(severity, f"{text}; {why}", where=item["site"], step=0,
                        evidence=ev, fix=_fix("no_emb_scale"), code="emb-scale")


def _embedding_line(subject: Subject, where: str) -> dict | None:
    """The user's line of the embedding addition whose result enters the encoder (a recorded
    pass's, capture/origins.py), for a finding on the encoder as a whole; None: the engine
    places a finding on a module itself."""
    if where != "encoder":
        return None
    from tndebug.capture.source import made_line
    return made_line(getattr(subject, "model", None), "encoder:embedding")


def _fitted_scale(subject: Subject, tok: torch.Tensor, tokens: torch.Tensor | None) -> float | None:
    """s when the token part is s * W[token] for some [V, d] parameter W, else None."""
    if tokens is None:
        return None
    d, top = tok.shape[-1], int(tokens.max())
    for p in subject.model.parameters():
        if p.dim() != 2 or p.shape[1] != d or p.shape[0] <= top:
            continue
        rows = full(p.detach())[tokens].to(tok.dtype)                   # [B, T, d] (FSDP2: gathered)
        denom = rows.pow(2).sum()
        if denom == 0:
            continue
        s = (tok * rows).sum() / denom
        if (tok - s * rows).norm() <= 1e-4 * tok.norm():
            return float(s)
    return None
