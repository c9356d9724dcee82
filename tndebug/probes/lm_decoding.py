"""lm-decoding: does a decoder-only model give, when it generates, the logits it was trained with?

Generation differs from training in two ways a loss never sees: prompts of different lengths are
left-padded into one batch, and tokens are decoded one at a time through a KV cache. Both are
exact invariances, tested at setup (eval, fp32 as the model runs, Subject calls only):

* `left-pad`: k pads put before a row must not change the logits of its real tokens (uniform k,
  and a ragged batch with k = 0.. per row). A control appends the pads on the right instead; that
  is mask-broadcast's target pad-length test, so a right-pad leak is left to it (no finding
  here, and the left-pad test then has no verdict: pads leak whatever their side).
* `kv-cache`: where the subject offers its cache (`subject.incremental`), the logits of positions
  split.. decoded through it must equal the full forward's. Checked only where the full forward
  is causal (its logits at t the same on ids[:, :t+1]): a forward that reads the future cannot be
  matched by any cache, and mask-broadcast names that leak.
* `rotary-shift`, `rotary-values` (_rotary.py): positions inside attention must be relative. On a
  periodic input the first attention's scores must repeat along the diagonal and its values
  repeat, where the embedding adds nothing positional (else absolute by design: not applicable);
  where the adapter moves positions (HF position_ids + c), the logits must not change.

When a test fails, what the model's behaviour tells about the cause is said: which attention puts
mass on the left pads, or the positional encoding that moved (from a trace); which earlier tokens
a cached step still sees (by resampling them).

The probe's class, codes, cause and the rotary verdict are here; the left-pad test is in
lm_decoding_left_pad.py and the cache test in lm_decoding_cache.py (mixins, each with its
messages), the rows both feed and the rule they compare by in lm_decoding_rows.py.
"""
from __future__ import annotations

import dataclasses

from tndebug.probes import _rotary
from tndebug.probes._mask_tests import compare
from tndebug.probes.base import Probe, RunContext, not_decoder_only
from tndebug.probes.lm_decoding_cache import CacheTests
from tndebug.probes.lm_decoding_left_pad import LEFT_PAD_FIX, LeftPadTests
from tndebug.probes.lm_decoding_rows import THRESHOLD, content_rows
from tndebug.probes.schedule import every
from tndebug.subject import NO_PAD, Subject


class LMDecoding(LeftPadTests, CacheTests, Probe):
    """Generation gives other logits than training: left padding or the KV cache.

    Failure: positions counted from column 0 (a left-padded prompt gets other positions than the
    prompt alone), a padding mask built for right padding; a KV cache whose causal mask is
    aligned top-left (SDPA `is_causal=True` with a one-token query: it sees only the first key),
    whose new token gets a position one off, or that is not read or not updated.
    Symptom: none in training or in the loss; batched or cached generation differs from the
    model evaluated on the whole sequence (worse, or different, outputs).
    Fix: positions from the mask (cumsum(mask) - 1), keep = ids != pad_id; with a cache, align
    the causal mask bottom-right and continue the positions from the real tokens before.
    """

    name = "lm-decoding"
    cause = (
        "A decoder-only model gives other logits when it generates than when it is trained: "
        "positions counted from column 0 under left padding, or a KV cache whose causal mask is "
        "aligned top-left (is_causal=True with a one-token query), whose positions are one off, "
        "or that is not updated (not in the notes)."
    )
    summary = "decoder-only: left padding and the KV cache leave the logits of real tokens exact"
    codes = {
        "left-pad": "pads put before a row change the logits of its real tokens",
        "kv-cache": "the logits decoded through the KV cache differ from the full forward's",
        "no-pad-mask": "the model masks no pad key: left-padded batches change its logits "
                       "(info: only matters where the user left-pads)",
        "rotary-shift": "positions inside attention are not relative: the same tokens later in "
                        "the sequence (or every position + c) change the scores or the logits",
        "rotary-values": "the first attention's values depend on position (rotary applied to v)",
    }
    reads = ("attn.probs", "embed")
    fix = LEFT_PAD_FIX
    # the tests run at setup; the steps only look for left-padded rows in the user's own batches
    default_schedule = staticmethod(lambda: every(50))

    def __init__(self, schedule=None) -> None:
        super().__init__(schedule)
        self.left_finding = None        # the left-pad error, kept an error only where left pads are used
        self._left_rows = 0              # rows of the user's batches that begin with a pad
        self._data_pad = NO_PAD

    def observe(self, trace, info) -> dict:
        ids = info.tgt_in
        if self.left_finding is None or self._data_pad == NO_PAD or ids is None or ids.dim() != 2 \
                or ids.shape[1] < 2:
            return {}
        real = ids != self._data_pad                                           # [B, T]
        return {"left_rows": (~real[:, 0] & real[:, 1:].any(1)).sum()}

    def update(self, stats, info) -> None:
        if stats:
            self._left_rows += int(stats["left_rows"])

    def finish(self, run: RunContext) -> None:
        """The left-pad error stays an error where this run's data, generation or config left-pad;
        elsewhere a warning that says when it would bite (docs/severity.md)."""
        f = self.left_finding
        if f is None or f not in self.findings:
            return
        side = _padding_side(run)
        if self._left_rows or side == "left":
            use = (f"{self._left_rows} row(s) of your batches begin with pads" if self._left_rows
                   else "padding_side='left' in its saved tokenizer or config")
            new = dataclasses.replace(f, message=f.message + f" ({use}: this run left-pads)",
                                      evidence={**f.evidence, "left_padding_used": use})
        else:
            new = dataclasses.replace(
                f, severity="warning",
                message=f.message + " (no left-padded row in this run's batches and no "
                                    "padding_side='left' in its config: it bites when prompts are "
                                    "left-padded for batched generation, or a tokenizer pads left)",
                evidence={**f.evidence, "left_padding_used": False,
                          "left_padded_rows_seen": self._left_rows})
        self.findings[self.findings.index(f)] = new
        self.left_finding = new

    def setup(self, run: RunContext) -> None:
        s = run.subject
        self._data_pad = s.data_pad_id
        if s.kind != "decoder":
            # its decoder is driven with the whole target, never left-padded or cached by
            # tndebug; its masks are mask-broadcast's (an encoder-only model has no decoder)
            self.cover("", "not applicable", not_decoder_only(s.kind))
            return
        with s.evaluating():
            ids = content_rows(s, 4, s.fit(9), seed=11)
            try:
                a, b = s.logits(ids[:, :0], ids), s.logits(ids[:, :0], ids)
            except Exception as e:  # noqa: BLE001 - mask-broadcast names what the model raised on
                self.skip(f"the model raised {type(e).__name__} on a plain batch (mask-broadcast "
                          f"names it)", where="")
                return
            if compare(a, b).failed:
                self.skip("the model's eval outputs are not repeatable (mask-broadcast/"
                          "not-repeatable), so no comparison can decide", where="")
                return
            rotary_bug = self._rotary(s)
            if rotary_bug:
                # positions that are not relative move a left-padded row however its pads are
                # masked: that finding is the rotary one, not a padding one
                self.cover("", "no verdict", "left padding not judged: " + rotary_bug)
            else:
                self.left_pad(s)
            self.kv_cache(s)

    # -- rotary / relative positions ----------------------------------------------------
    def _rotary(self, s: Subject) -> str:
        """The rotary tests (_rotary.py); returns the finding's code, "" when none."""
        v = _rotary.periodic(s, self.reads + ("attn.scores", "attn.v", "stream")) \
            if s.capture is not None else _rotary.Verdict("no verdict", "the model's internals "
                                                          "cannot be traced")
        shifted = s.position_shift                        # the adapter's, where it has one
        moved = None
        if shifted is not None and v.status != "not applicable" and not v.code:
            try:
                moved = _rotary.shift(s, shifted)
            except Exception as e:  # noqa: BLE001 - the periodic test decides without it
                v.evidence["shift_raised"] = f"{type(e).__name__}: {str(e)[:120]}"
        if moved is not None:
            v.evidence["shift"] = {"offset": 5, **vars(moved)}
            if v.status == "no verdict" and not moved.failed:
                v.status, v.reason = "checked", ""
        place = v.where or _rotary.PLACE
        if v.code:
            self.report("error", v.message, where=v.where, step=0, code=v.code, fix=v.fix,
                        evidence={**v.evidence, "threshold": THRESHOLD})
            self.cover(place, "checked")
            return v.code
        if moved is not None and moved.failed and v.status == "no verdict":
            # the embedding was not seen: absolute positions there would move the logits too
            v.reason += f"; position_ids + 5 moves the logits by {moved.delta:.3g}, but whether " \
                        f"positions are added at the embedding (absolute by design) was not seen"
        if moved is not None and moved.failed and v.status == "checked":
            self.report("error", f"moving every position by 5 (position_ids + 5) changes the "
                        f"logits by {moved.delta:.3g} (tolerance {moved.tol:.2g}), though nothing "
                        f"positional is added at the embedding: a later layer's rotary is applied "
                        f"inconsistently (q only, v too, another pairing, per-chunk positions)",
                        where="", step=0, code="rotary-shift", fix=_rotary.ROPE_FIX,
                        evidence={**v.evidence, "threshold": THRESHOLD})
            self.cover(place, "checked")
            return "rotary-shift"
        self.cover(place, v.status, v.reason)
        return ""


def _padding_side(run: RunContext) -> str | None:
    """'left'/'right' where the run (run.extras['padding_side']), the subject (`padding_side`:
    triage of a Hugging Face directory sets its saved tokenizer's), the model's config or its
    generation config says how it pads, else None."""
    side = run.extras.get("padding_side") or getattr(run.subject, "padding_side", None)
    m = run.subject.model
    for cfg in (getattr(m, "config", None), getattr(m, "generation_config", None)):
        side = side or getattr(cfg, "padding_side", None)
    return side if isinstance(side, str) else None
