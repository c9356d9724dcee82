"""mask-broadcast: exact step-0 tests of the masks, and which attention breaks them."""
from __future__ import annotations

import functools

from tndebug.faults import FAULT_NOTES
from tndebug.findings import Finding
from tndebug.probes._tolerance import tol
from tndebug.probes._mask_tests import (FIT_TOL, INPUTS, KINDS, MASS_TOL, NOTE, REL_TOL, SUM_TOL,
                                        Check, Module, likely_cause, behaviour, compare, probs_check)
from tndebug.probes.raised import ModelRaised, call as _call, raised_in as _raised_in
from tndebug.probes._attn_stats import head_split_fits, probe_batch
from tndebug.capture.source import pick, same_line, with_also
from tndebug.capture.trace import KIND_WORDS
from tndebug.capture.op_lines import random_op_line
from tndebug.probes import _bidirectional
from tndebug.probes._embed_moves import embedding_moves
from tndebug.probes.base import Probe, RunContext
from tndebug.probes.schedule import never
from tndebug.subject import Subject

# behaviour tests whose difference a PE indexed by the padded shape makes at the embedding
# output (`_embed_moves`): mask-broadcast then defers to positional-encoding
AT_EMBEDDING = {"tgt_pad_length": "tgt_pad_length", "enc_pad_length": "src_pad_length",
                "src_pad_length": "src_pad_length", "batch": "batch", "enc_batch": "batch"}

OUTSIDE_FIX = ("The masks are right; something else moves information between positions. Look "
               "for a head split or merge without the transpose (q.view(B, T, h, d_k)"
               ".transpose(1, 2), and back with z.transpose(1, 2).reshape(B, T, d_model)), a "
               "positional encoding indexed by the padded batch's shape instead of each "
               "position, or a norm or pooling over the time axis.")


# the op whose line a finding points at: the softmax for what the softmax did; else the mask (a
# masked_fill or an added mask), the SDPA call that takes it, or the softmax it should precede
AT_SOFTMAX = ("softmax-axis", "row-sums")


# the codes that say what a mask lets through: the mask as built is the likelier bug (a mask
# helper, the model's forward, a buffer's `__init__` line) than the generic line applying it,
# which the finding carries second (capture/origins.py follows the mask back)
MASK_CONTENT = ("mask-inverted", "causal-transposed", "causal-leak", "memory-leak", "pad-leak",
                "tgt-pad-leak", "encoder-causal", "encoder-one-sided")


def mask_line(sources: dict, code: str, sides: dict | None = None) -> dict | None:
    """The user's line for a mask-broadcast finding of kind `code` on a module (with the other
    relevant lines as `also`: capture/source.with_also)."""
    if code in AT_SOFTMAX:
        return pick(sources, "softmax", "sdpa")
    if code == "head-split":            # q as split into heads, or the heads' output merged
        merge = bool(sides) and sides.get("merge", 0.0) > sides.get("split", 0.0)
        first = ("merged", "q_made") if merge else ("q_made", "merged")
        return with_also(pick(sources, *first, "scores", "sdpa"),
                         (sources.get("scores") or sources.get("sdpa"), "the scores are computed here"))
    applied = next((sources[r] for r in ("mask", "mask_add", "sdpa") if sources.get(r)), None)
    attention = sources.get("sdpa") or sources.get("softmax")
    if code in MASK_CONTENT:
        if sources.get("mask_none") and not (sources.get("mask") or sources.get("mask_add")):
            return with_also(sources["mask_none"], (attention, "the attention that gets no mask"))
        if applied is None and sources.get("softmax_in") \
                and not same_line(sources["softmax_in"], sources.get("scores")):
            return with_also(sources["softmax_in"], (attention, "the softmax of these scores"))
        if sources.get("mask_built") and applied is not None:
            return with_also(sources["mask_built"], (applied, "the mask is applied here"))
    return pick(sources, "mask", "mask_add", "add", "sdpa", "softmax")


# the behaviour tests of padding (pad_id=None: the data hold none, so they are not run)
NO_PAD_TESTS = ("tgt_pad_length", "tgt_pad_content", "enc_pad_length", "src_pad_length")


class MaskBroadcast(Probe):
    """Masks on the wrong axis, inverted, missing or applied at the wrong time.

    Failure: a padding mask shaped [B,1,S,1] (query axis), `masked_fill(mask == 1, ...)`
    (inverted), no causal mask or a triu one, no memory mask in cross-attention, masking after
    the softmax, softmax over dim=-2, heads split with `.view(B, h, T, d_k)` and no transpose.
    Symptom: none in the loss on easy tasks (a copy task trains); the decoder reads the future,
    pads change real outputs, an example's output depends on its batch companions.
    Fix: boolean keep-masks [B,1,1,S] for padding and [B,1,T,T] (pad & tril) for the decoder,
    masked_fill(~keep, finfo.min) before softmax(dim=-1) (notes 000-003).

    Exact tests at setup (eval, fp32, Subject calls only): causality (resample targets after t,
    2 batches x 4 values of t), pad length and target pad content, batch independence; then a
    trace: per attention module, the probability real queries put on pad/future keys and the
    row sums; and, only when a behaviour test failed and no probability explains it, whether q
    is an affine function of its own input row (the head split: ~140 sequences on a 512-wide
    model, so it is not paid on healthy ones).
    On an encoder-only model (no target side) the causal test is turned round: the outputs must
    change with the tokens on either side (`_bidirectional`: encoder-causal, encoder-one-sided).
    The failing attention is named: encoder self (encoder output changes), decoder self
    (causality), cross (logits change while the encoder output does not). The Subject marks
    pads by id, so the source's pad *content* cannot vary: its length does.
    """

    name = "mask-broadcast"
    cause = (
        "The mask has the wrong shape or is broadcast wrongly in some module, so attention "
        "is blocked or pads take part and loss won't drop [note 002]. src mask (B,1,S) and "
        "tgt mask (B,T,T) need unsqueeze(1) for the heads, and mask==0 must not be "
        "inverted [notes 003, 001]."
    )
    summary = "exact step-0 tests of causal and padding masks; names the attention that leaks"
    codes = {
        "not-repeatable": "eval outputs differ between identical calls (randomness on in eval)",
        "model-raised": "the model raised on a probe input it should take",
        "batch-mixing": "an example's outputs depend on its batch companions",
        "src-pad-leak": "appending source pads changes the logits (encoder not separable)",
        "softmax-axis": "the softmax taken over another axis than the keys",
        "mask-after-softmax": "masked after the softmax: rows do not sum to 1",
        "row-sums": "attention rows that do not sum to 1",
        "mask-inverted": "the mask is inverted: real queries see only masked keys",
        "causal-transposed": "the causal mask is transposed (triu for tril)",
        "causal-leak": "the decoder sees the future (no causal mask)",
        "memory-leak": "cross-attention sees source pads (no memory mask)",
        "pad-leak": "real queries attend to pad keys (padding mask missing or on the query axis)",
        "tgt-pad-leak": "target pads change the logits at real positions",
        "head-split": "heads split or merged without the transpose",
        "positions-mixed": "a behaviour test fails while every mask holds: positions mix outside the softmax",
        "at-embedding": "a behaviour test fails already at the embedding output: positional-encoding's (info)",
        "encoder-causal": "encoder-only: the outputs at <= t ignore the tokens after t (causal mask)",
        "encoder-one-sided": "encoder-only: the outputs at >= t ignore the tokens before t (triu mask)",
        # check and triage say so when tndebug's adapter built the masks (tndebug_masks_note)
        "tndebug-masks": "the built-in adapter built the masks, not your code",
    }
    reads = ("attn.q", "attn.k", "attn.scores", "attn.masked_scores", "attn.probs", "stream")
    fix = FAULT_NOTES["pad_mask_query_axis"][2]
    default_schedule = staticmethod(never)

    def setup(self, run: RunContext) -> None:
        s = run.subject
        if not s.padded:
            self.cover("padding", "not applicable", "no padding in this data (pad_id=None): "
                       "the pad tests do not apply; causality, batch independence and the "
                       "attention rows are checked")
        with s.evaluating():
            try:
                if not self._deterministic(s):
                    return
                checks = behaviour(s)
                if not s.padded:            # pad_id=None: what pads do cannot bite this data
                    for k in NO_PAD_TESTS:
                        checks.pop(k, None)
                modules = self._modules(s) if s.capture is not None else []
                if not s.has_target:        # encoder-only: attention must see both sides
                    sides = _bidirectional.measure(s)
            except ModelRaised as e:
                self._raised(e)
                return
            odd = [k for k, c in checks.items() if not c.finite]
            if len(odd) < len(checks):      # the behaviour tests: the model as a whole
                self.cover("", "checked")
            if odd:
                self.skip(f"non-finite outputs made these tests inconclusive: {', '.join(odd)}",
                          where="" if len(odd) == len(checks) else None)
            self._moved = functools.cache(lambda: self._embedding_moved(s))   # 3 traces, once
            self._verdict(checks, modules, lambda: self._fit_heads(s, modules))
            if not s.has_target:
                _bidirectional.report(self, sides)

    def _deterministic(self, s: Subject) -> bool:
        """Two identical calls in eval mode must give the same logits: every test below compares
        outputs, so randomness left on in eval (dropout written as F.dropout(x, p) without
        training=self.training, or a Dropout built in forward) would read as a leak."""
        src, tgt = probe_batch(s, 4, s.fit(10), s.fit(9), seed=4)
        a = _call(INPUTS["base"], s.logits, src, tgt)
        b = _call(INPUTS["base"], s.logits, src, tgt)
        c = compare(a, b)
        if not c.failed:
            return True
        line = random_op_line(lambda: s.logits(src, tgt))          # the op drawing at random
        self.report("error", f"the model's outputs change by {c.delta:.3g} between two identical "
                    f"calls in eval mode: something random (dropout) is active in eval",
                    where="", step=0, evidence={"repeat": vars(c), "threshold":
                                               f"max|change| > {REL_TOL:g}*(1+max|logit|)"},
                    fix="Use nn.Dropout modules (model.eval() switches them off) or "
                        "F.dropout(x, p, training=self.training); never a bare F.dropout(x, p) "
                        "or a Dropout made inside forward", code="not-repeatable", source=line)
        self.skip("the model's eval outputs are not repeatable, so no comparison can decide",
                  where="")
        return False

    def _raised(self, e: ModelRaised) -> None:
        """The model raised on an input it should take (lengths within its limit, ids within its
        vocabulary, pads only at the end of a row): the error, on that input."""
        text = str(e.error).strip().splitlines()[0][:300] if str(e.error).strip() else ""
        cause = likely_cause(e)
        self.report("error", f"the model raised {type(e.error).__name__} on {e.what}: {text}"
                    + (f" ({cause[0]})" if cause else ""), where="", step=0,
                    evidence={"input": e.what, "error": f"{type(e.error).__name__}: {text}",
                              "raised_in": _raised_in(e.error)},
                    fix=cause[1] if cause else
                    "Run your model on such a batch yourself: right-padded rows of different "
                    "lengths, one example alone, more pad columns than the longest row needs. A "
                    "model that takes training batches should take these; if it may not, pass "
                    "max_len / --max-len or your own data so that the tests fit it.", code="model-raised")
        self.skip(f"the model raised on {e.what}", where="")

    def _modules(self, s: Subject) -> list[Module]:
        """One small trace: the probabilities of every attention module."""
        S, T = s.fit(12), s.fit(11)
        src, tgt = probe_batch(s, 8, S, T, seed=3)
        trace = s.trace(src, tgt, reads=self.reads)    # inputs the behaviour tests ran: a raise is ours
        out = []
        for rec in trace.records():
            m = Module(rec.site, rec.kind, sources=rec.sources)
            why = ("attention probabilities not captured (the model-level behaviour tests "
                   "still cover it)") if rec.probs is None else probs_check(m, rec.probs, src, tgt,
                                                                           s.data_pad_id)
            self.cover(rec.site, "no verdict" if why else "checked", why)
            out.append(m)
        return out

    def _fit_heads(self, s: Subject, modules: list[Module]) -> None:
        """Head-split fit of every module (q as an affine map of its input row).

        Needs 3x more rows than features: on a 512-wide model that is ~140 sequences, most of
        this probe's cost, so it runs only when a behaviour test failed and the probabilities
        did not say why."""
        if s.capture is None or getattr(self, "_heads_fitted", False):
            return
        self._heads_fitted = True
        S, T = s.fit(12), s.fit(11)
        reads = ("attn.q", "attn.k", "attn.v", "attn.z", "attn.out", "stream")
        src, tgt = probe_batch(s, 8, S, T, seed=3)
        trace = s.trace(src, tgt, reads=reads)
        d = max((p.x.shape[-1] for p in trace.streams), default=0)
        if trace.streams and 8 * T < 3 * (d + 1):         # enough rows for the head-split fit
            src, tgt = probe_batch(s, -(-3 * (d + 1) // T), S, T, seed=3)
            trace = s.trace(src, tgt, reads=reads)
        sides: dict = {}
        fits = head_split_fits(trace, sides)
        for m in modules:
            m.fit = fits.get(m.site)
            m.fit_sides = sides.get(m.site, {})

    @staticmethod
    def _embedding_moved(s: Subject) -> dict:
        """`_embed_moves.embedding_moves`, {} if it raises."""
        try:
            return embedding_moves(s)
        except Exception:  # noqa: BLE001 - the behaviour tests above ran on these inputs
            return {}

    def _at_embedding(self, where: str, tests: list[str], checks) -> list[str]:
        """The failing tests whose difference is already in the embedding output at real
        positions (before any attention: a PE indexed by the padded shape, positional-encoding's
        finding), reported here as one info; returns the tests it does not explain."""
        moved = getattr(self, "_moved", lambda: {})() if any(t in AT_EMBEDDING for t in tests) else {}
        explained = [t for t in tests if AT_EMBEDDING.get(t) in moved]
        rest = [t for t in tests if t not in explained]
        if explained and not rest:
            m = moved[AT_EMBEDDING[explained[0]]]
            self.report("info", f"{where}: {', '.join(explained)} fails, but the difference is already "
                        f"in the embedding output ({m['site']} moves by {m['delta']:.3g} at real "
                        f"positions, before any attention): the embedding (a positional encoding "
                        f"indexed by the padded shape or the batch) is positional-encoding's "
                        f"finding, not a mask", where=where,
                        step=0, evidence={"behaviour": {t: vars(checks[t]) for t in explained},
                                          "embedding": moved, "deferred_to": "positional-encoding"},
                        code="at-embedding")
        return rest

    def _verdict(self, checks: dict[str, Check], modules: list[Module], fit_heads=lambda: None) -> None:
        failed = {k for k, c in checks.items() if c.failed}
        enc_ok = "enc_pad_length" in checks and not checks["enc_pad_length"].failed \
            and checks["enc_pad_length"].finite
        tests = {"enc_self": [t for t in ("enc_pad_length", "enc_batch") if t in failed],
                 "dec_self": [t for t in ("causality", "tgt_pad_length", "tgt_pad_content") if t in failed],
                 "cross": ["src_pad_length"] if "src_pad_length" in failed and enc_ok else []}
        for kind in KINDS:
            mods = [m for m in modules if m.kind == kind and m.problem]
            if not mods and failed:
                fit_heads()
                fit_tol = tol(FIT_TOL)
                mods = [m for m in modules if m.kind == kind and m.fit is not None and m.fit > fit_tol]
                for m in mods:
                    sides = m.fit_sides
                    merge = sides.get("merge", 0.0) > fit_tol
                    split = sides.get("split", 0.0) > fit_tol or not merge
                    words = []
                    if split:
                        words.append(f"q or v is not a per-position function of the input "
                                     f"(fit residual {sides.get('split', m.fit):.2f}): heads split "
                                     f"with view/reshape and no transpose")
                    if merge:
                        words.append(f"the output is not a per-position function of the heads' "
                                     f"outputs (fit residual {sides['merge']:.2f}): heads merged "
                                     f"with view/reshape and no transpose back")
                    m.problem = "; ".join(words)
                    m.fix, m.code = NOTE["view_without_transpose"], "head-split"
            if not mods and not tests[kind]:
                continue
            seen = [m for m in modules if m.kind == kind]
            masks_ok = bool(seen) and all(m.stats and not m.problem for m in seen)
            self._report_kind(kind, mods, tests[kind], checks, masks_ok, seen)
        if "batch" in failed and not any(tests.values()) and not self.findings \
                and self._at_embedding("batch axis", ["batch"], checks):
            c = checks["batch"]
            self.report("error", f"an example's logits change by {c.delta:.3g} with its batch "
                        f"companions (something mixes the batch axis)", where="batch axis", step=0,
                        evidence={"batch": vars(c), "threshold": f"max|change| > {REL_TOL:g}*(1+max|logit|)"},
                        fix="Find what reads across examples: a positional encoding or mask indexed "
                            "by x.size(0) (the batch) where x.size(1) (the positions) was meant, a "
                            "BatchNorm, a reshape or a transpose that moves the batch axis, a "
                            "mask of shape [B, B]. Each example's logits must not depend on the "
                            "others in its batch.", code="batch-mixing")
        if "src_pad_length" in failed and "enc_pad_length" not in checks and not self.findings:
            c = checks["src_pad_length"]
            self.report("error", f"logits at real positions change by {c.delta:.3g} when pad columns "
                        f"are appended to the source", where="encoder or decoder (cross-attention)",
                        step=0, evidence={"src_pad_length": vars(c)}, code="src-pad-leak")

    def _report_kind(self, kind: str, mods: list[Module], tests: list[str], checks,
                     masks_ok: bool = False, seen: list[Module] = ()) -> None:
        """One error for the attention kind: the module whose probabilities show the defect, else
        the behaviour test that failed. When every module of the kind had its probabilities
        tested and they respect the masks, the masks are right: positions mix outside the
        softmax (a head split or merge without transpose, a PE that depends on the padded
        length), and the message and fix say that, not "add a mask"."""
        beh = {t: vars(checks[t]) for t in tests}
        ev = {"behaviour": beh, "modules": {m.site: {**m.stats, **({"fit_residual": m.fit} if m.fit is not None else {})}
                                            for m in mods},
              "thresholds": {"behaviour": f"max|change| > {REL_TOL:g}*(1+max|ref|)",
                             "forbidden_mass": MASS_TOL, "row_sum": SUM_TOL, "head_split_fit": FIT_TOL}}
        if not mods:
            tests = self._at_embedding(KIND_WORDS[kind], tests, checks)
            if not tests:
                return
        if mods:
            first = mods[0]
            tail = f" (+{len(mods) - 1} more {KIND_WORDS[kind]} modules)" if len(mods) > 1 else ""
            self.report("error", f"{first.site}: {first.problem}{tail}", where=first.site, step=0,
                        evidence=ev, fix=first.fix, code=first.code,
                        source=mask_line(first.sources, first.code, getattr(first, "fit_sides", None)))
            return
        t = tests[0]
        c = checks[t]
        what = {"causality": ("logits at positions <= t change by {d} when later target tokens are "
                              "resampled (the decoder sees the future)", NOTE["no_causal_mask"]),
                "tgt_pad_length": ("logits at real positions change by {d} when pads are appended to "
                                   "the target", NOTE["no_causal_mask"]),
                "tgt_pad_content": ("logits at real positions change by {d} when target pads become "
                                    "tokens", NOTE["no_causal_mask"]),
                "enc_pad_length": ("encoder output at real positions changes by {d} when pad columns "
                                   "are appended (real queries attend to pads)", NOTE["pad_mask_query_axis"]),
                "enc_batch": ("encoder output changes by {d} with the batch companions", self.fix),
                "src_pad_length": ("logits at real positions change by {d} when source pads are "
                                   "appended, the encoder output does not (cross-attention sees pads)",
                                   NOTE["no_memory_mask"])}[t]
        text, fix = what[0].format(d=f"{c.delta:.3g}"), what[1]
        code = {"causality": "causal-leak", "tgt_pad_length": "tgt-pad-leak",
                "tgt_pad_content": "tgt-pad-leak", "enc_pad_length": "pad-leak",
                "enc_batch": "batch-mixing", "src_pad_length": "memory-leak"}[t]
        if masks_ok:
            code = "positions-mixed"
            text = (text.split(" (")[0] + f", yet the attention probabilities of every "
                    f"{KIND_WORDS[kind]} module respect the masks: positions are mixed outside "
                    f"the softmax")
            fix = OUTSIDE_FIX
            ev["probabilities_respect_masks"] = True
        first = seen[0] if seen else None      # the kind's first module: its mask's line
        self.report("error", f"{KIND_WORDS[kind]}: " + text, where=KIND_WORDS[kind], step=0,
                    evidence=ev, fix=fix, code=code,
                    source=None if first is None or code == "positions-mixed"
                    else mask_line(first.sources, code))


def tndebug_masks_note(adapter_note: str, adapter: str, own_forward: str) -> Finding:
    """The info that tndebug's built-in adapter, not the user's code, built the masks the tests
    judged (check's forward=, triage's --adapter); `own_forward` says how to pass a forward that
    calls the user's own mask code."""
    return Finding("mask-broadcast", "info", f"{adapter_note}; the mask tests judged tndebug's "
                   f"masks, not yours: pass {own_forward} that calls your own mask code", where="",
                   step=0, evidence={"adapter": adapter}, code="mask-broadcast/tndebug-masks")
