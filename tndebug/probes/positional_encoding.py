"""positional-encoding: does the encoder see token order, at a sane strength, at every length?

Tests at setup, all in eval mode and from behaviour only:

* order (positional_encoding_order.py): permute the real source tokens of each row; an encoder
  without position information is permutation-equivariant, enc(Px) = P enc(x), to rounding; a
  decoder-only model: swap two earlier tokens before its first mixing attention;
* scale (here): rho = RMS(token part) / RMS(PE actually added), the PE being `out - tok` of the
  embedding taps (a bug may compute the PE and never add it), judged again from the training
  loss at the end of a run;
* table (positional_encoding_table.py): the PE rows by the padded shape, past the table's
  length (one constant-token sequence as long as the model accepts: two positions with
  identical rows share a PE row) and their rank.
The probe's class, its codes, cause and fix are here; the two sibling files hold its tests as
mixins, each with its thresholds and messages.
Sharded parameters (FSDP2): the token table the embedding scale is fitted against is gathered
whole (`tndebug.sharded.full`, every rank at the same moment); the float64 second looks are not
taken on a sharded model (FSDP2 keeps its own views of each shard), the float32 result stands.
"""
from __future__ import annotations

import torch

from tndebug.faults import FAULT_NOTES
from tndebug import tags
from tndebug.probes._misc_stats import first_reason, rms
from tndebug.probes.base import Probe, RunContext, StepInfo
from tndebug.probes.positional_encoding_order import OrderTests
from tndebug.probes.positional_encoding_table import TableTests
from tndebug.probes.schedule import every
from tndebug.sharded import full
from tndebug.subject import Subject
from tndebug.capture.trace import Trace

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
# UNIT, ZERO_PE: exact in kind (s fitted exactly; no PE adds 0); no run.
UNIT = 0.05              # |s - 1| below this: the embedding row is used as it is
ZERO_PE = 1e-6           # RMS(PE added) / RMS(token part) below this: no PE added


def _fix(fault: str) -> str:
    _, notes, fix = FAULT_NOTES[fault]
    return f"{fix} [notes {notes}]" if notes[0].isdigit() else fix


class PositionalEncodingProbe(OrderTests, TableTests, Probe):
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
        # triage reads the weights (positional_encoding_weights.py)
        "stored-pe": "a stored PE table that is not the paper's sinusoids",
        "emb-ratio": "the embedding/PE ratio from the weights out of range",
    }
    reads = ("embed",)
    fix = _fix("no_pos_encoding")
    default_schedule = staticmethod(lambda: every(100))

    def setup(self, run: RunContext) -> None:
        subject = run.subject
        self.no_pe_sites: list[str] = []       # embedding taps whose output equals their token part
        self.src_sites: set[str] = set()       # taps that embed the source
        self._scale_off: list[dict] = []       # scale deviations, judged from behaviour below
        self.token_order: str | None = None    # "uses positions" | "ignores order" | None (untested)
        self._losses: list[tuple[int, float]] = []   # training loss at the probed steps
        self._training = run.mode == "train"
        self.mechanism: str | None = None      # one-stack models: where positions enter (_pe_causal)
        self._rho_last: dict[str, tuple[int, float]] = {}   # site -> (step, rho) last probed
        if subject.capture is None:
            self.skip_also("no embedding taps: scale and overflow tests skipped")
        else:
            self._scale_test(subject)
        if subject.has_source:
            self.permutation_test(subject)
        else:   # decoder-only: does the first attention that mixes tokens see where they are?
            self.causal_swap_test(subject)
        if subject.capture is not None:
            self.padded_shape_test(subject)
            self.overflow_test(subject)
        if self.token_order == "ignores order":     # the harm is shown now: the positions are lost
            self._report_scale("warning")

    def skip_also(self, reason: str) -> None:
        self.skip(f"{self.skipped}; {reason}" if self.skipped else reason)

    # -- 2. embedding / PE scale ---------------------------------------------------------------
    def _scale_test(self, subject: Subject) -> None:
        g = torch.Generator().manual_seed(8)
        src, tgt = subject.random_batch(batch=8, src_len=12, tgt_len=10, generator=g)
        try:
            with subject.evaluating():
                trace = subject.trace(src, tgt, reads=("embed",))
        except Exception as e:  # noqa: BLE001
            self.skip_also(f"scale test could not capture the embeddings: {first_reason(e)}")
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
                self.src_sites.add(site)
            keep = (tokens != subject.pad_id if tokens is not None          # [B, T]
                    else torch.ones(tok.shape[:2], dtype=torch.bool, device=tok.device))
            pe = (out - tok).expand_as(tok)                           # [B, T, d]
            tok_rms, pe_rms = rms(tok[keep]).item(), rms(pe[keep]).item()
            self.cover(site, "checked")
            if pe_rms <= ZERO_PE * tok_rms:
                self.no_pe_sites.append(site)
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
            self.skip_also("no embedding taps (tok/out) in the trace; scale test skipped")
        elif with_pe and self.no_pe_sites:       # one side adds PE, the other does not
            for site in self.no_pe_sites:
                self.report("warning", f"{site} adds no positional encoding (out == tok) while "
                            f"{', '.join(with_pe)} does", where=site, step=0,
                            evidence={"rms_pe_over_rms_tok": 0.0, "threshold": ZERO_PE,
                                      "sites_with_pe": with_pe}, code="no-pe-one-side")



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
                   if self.token_order == "ignores order" else f"the loss does not fall ({trend})")
        else:
            seen = {"uses positions": "the encoder uses positions (order test)",
                    None: "the order test could not decide"}[self.token_order]
            why = f"{seen}; no training observed: a deviation from the paper, no harm shown"
        for item in pending:
            ev = {**item["evidence"], "order_test": self.token_order or "no verdict",
                  "loss_trend": [(s, round(v, 4)) for s, v in losses[-4:]]}
            text = item["what"] if severity == "warning" and not still_low else item["deviation"]
            self.report(severity, f"{text}; {why}", where=item["site"], step=0,
                        evidence=ev, fix=_fix("no_emb_scale"), code="emb-scale")



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
