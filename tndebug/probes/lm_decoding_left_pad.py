"""lm-decoding's left-padding test (the probe's class is in lm_decoding.py; these are its
methods, with their messages):

* `left-pad`: k pads put before a row must not change the logits of its real tokens (uniform k,
  and a ragged batch with k = 0.. per row). A control appends the pads on the right instead; that
  is mask-broadcast's target pad-length test, so a right-pad leak is left to it (no finding
  here, and the left-pad test then has no verdict: pads leak whatever their side).
When it fails, the trace tells which attention puts mass on the left pads, or the positional
encoding that moved; a model that masks no pad key at all is info (no-pad-mask).
"""
from __future__ import annotations

import math

import torch

from tndebug.faults import FAULT_NOTES
from tndebug.probes._mask_tests import Check, compare
from tndebug.probes.raised import ModelRaised, call as _call
from tndebug.probes.lm_decoding_rows import THRESHOLD, content_rows, pad_columns
from tndebug.subject import Subject

MASS_TOL = 1e-6          # attention a real query may put on pad keys (exactly 0 when masked)
LEFT_PADS = 3            # pads put before every row (uniform test); ragged rows get 0..LEFT_PADS
LEFT_PAD_FIX = FAULT_NOTES["positions_ignore_left_pad"][2]
PAD_MASK_FIX = ("Build the padding mask from the ids (keep = ids != pad_id, [B, 1, 1, T]), not "
                "from the rows' lengths: a mask from lengths (arange(T) < length) assumes right "
                "padding and hides a left-padded row's last tokens while it shows the pads.")


def _hides_a_real_key(p: torch.Tensor, p_ref: torch.Tensor | None) -> bool:
    """Some real key of a left-padded row gets exactly 0 from every real query at or after it,
    in every head and every row of the batch (each padded alike, each with its own tokens),
    while the same key of the unpadded rows is seen: the padding hides it (a mask from lengths
    hides a left-padded row's last LEFT_PADS keys, the first of them from LEFT_PADS queries).
    Zeros alone are no evidence: a softmax of finite scores underflows to 0 once a score sits
    ~104 below its row's maximum, which unscaled trained scores reach (nanoGPT without
    1/sqrt(d_k), 1000 steps: 2 zeros among 550 real entries), and a near one-hot attention
    zeros whole columns of one row, but which ones follows that row's tokens. A column needs
    LEFT_PADS (head, query) entries, so a head-averaged record's last key, seen by one query,
    cannot decide alone.  p: [B, h, L, L] with LEFT_PADS pads first; p_ref: [B, h, L - LEFT_PADS, ..]"""
    def unseen(q: torch.Tensor, lead: int) -> torch.Tensor:              # [L] key columns
        L = q.shape[-1]
        real_past = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        real_past[:lead] = False
        real_past[:, :lead] = False                  # real query, real key at or before it
        seen = real_past.sum(0) * q.shape[1]         # (head, query) entries per key
        return ((q == 0) | ~real_past).flatten(0, 2).all(0) & (seen >= LEFT_PADS)

    hidden = unseen(p, LEFT_PADS)[LEFT_PADS:]
    if p_ref is not None and p_ref.shape[-1] == hidden.shape[-1]:
        hidden = hidden & ~unseen(p_ref, 0)
    return bool(hidden.any())


def _left(s: Subject, ids: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Row b = ks[b] pads, the row, then pads up to the batch's width.  # [B, T + max(ks)]"""
    B, T = ids.shape
    out = pad_columns(s, B, T + max(ks), ids)
    for b, k in enumerate(ks):
        out[b, k:k + T] = ids[b]
    return out


def _future_leak(s: Subject, ids: torch.Tensor) -> Check:
    """Whether the logit at t of unpadded rows `ids` [B, T] changes when the tokens after t are
    dropped (the forward on ids[:, :t+1]): a causal model's does not, to rounding."""
    full = _call("rows without padding", s.logits, ids[:, :0], ids)       # [B, T, V]
    leak = Check()
    for t in range(ids.shape[1] - 1):
        part = _call("a prefix of the rows", s.logits, ids[:, :0], ids[:, :t + 1])
        leak = leak.merge(compare(full[:, t:t + 1], part[:, t:t + 1]))
    return leak


def _sig3(d: dict) -> dict:
    """Floats to 3 significant digits (evidence is read by people: 1.95, not 1.9534118175506592)."""
    return {k: (float(f"{v:.3g}") if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in d.items()}


class LeftPadTests:
    """lm-decoding's left-padding test, mixed into LMDecoding: it keeps the left-pad error as the
    probe's `left_finding` (judged again at finish) and reports as the probe."""

    # -- left padding --------------------------------------------------------------------
    def left_pad(self, s: Subject) -> None:
        logits = lambda what, ids: _call(what, s.logits, ids[:, :0], ids)     # noqa: E731
        left, right = Check(), Check()
        try:
            for seed, length in ((1, 10), (2, 7)):
                T = s.fit(length + LEFT_PADS) - LEFT_PADS
                if T < 2:
                    self.skip(f"the model takes too few positions ({T + LEFT_PADS}) to pad a row",
                              where="")
                    return
                ids = content_rows(s, 5, T, seed)
                ref = logits("rows without padding", ids)                      # [B, T, V]
                more = torch.cat([ids, pad_columns(s, 5, LEFT_PADS, ids)], 1)
                right = right.merge(compare(ref, logits(
                    f"the rows with {LEFT_PADS} pads appended", more)[:, :T]))
                less = torch.cat([pad_columns(s, 5, LEFT_PADS, ids), ids], 1)
                left = left.merge(compare(ref, logits(
                    f"the rows with {LEFT_PADS} pads put before", less)[:, LEFT_PADS:]))
                ks = [0, 1, 2, LEFT_PADS, 1][:5]
                ragged = logits("a ragged left-padded batch (0 to 3 pads before each row)",
                                _left(s, ids, ks))
                got = torch.stack([ragged[b, k:k + T] for b, k in enumerate(ks)])
                left = left.merge(compare(ref, got))
        except ModelRaised as e:
            self.skip(f"the model raised {type(e.error).__name__} on {e.what}: "
                      f"{str(e.error).strip()[:200]}", where="")
            return
        if not (left.finite and right.finite):
            self.skip("non-finite logits on the padded rows: the comparison cannot decide", where="")
            return
        if right.failed:
            self.skip(f"pads appended on the right change the logits too (by {right.delta:.3g}; "
                      f"mask-broadcast/tgt-pad-leak): pads leak whatever their side, so whether "
                      f"positions follow the padding cannot be told", where="")
            return
        if left.failed:
            try:
                leak = _future_leak(s, ids)
            except ModelRaised:          # the prefixes are shorter rows of a batch it ran
                leak = Check()
            if leak.failed:
                # left padding is a question about generation, which a model that reads the
                # future cannot do right whatever its positions: the leak is the story
                self.skip(f"the full forward is not causal (its logit at t changes with later "
                          f"tokens by {leak.delta:.3g}; mask-broadcast names the leak): left "
                          f"padding is not judged on a model that cannot generate", where="")
                return
        self.cover("", "checked")
        if not left.failed:
            return
        where, cause, fix, unmasked = self._left_pad_cause(s)
        evidence = {"left_pad": _sig3(vars(left)), "right_pad": _sig3(vars(right)),
                    "pads_before": LEFT_PADS, "threshold": THRESHOLD}
        if unmasked:
            # No pad key is masked and no real one hidden: the model has no padding mask at all
            # (nanoGPT-style code, trained on unpadded text). Left padding is then unsupported,
            # not broken: a hazard of a use (batched generation) the model may never see.
            self.report("info", f"the model masks no pad key: {LEFT_PADS} pads put before a row "
                        f"change the logits of its real tokens by {left.delta:.3g} (real "
                        f"queries attend the pads as tokens; every real key stays visible). "
                        f"Only matters if you left-pad prompts for batched generation",
                        where=where, step=0, evidence=evidence, code="no-pad-mask",
                        fix="to generate in batches, mask the pad keys (keep = ids != pad_id) and "
                            "count positions from each row's first real token (cumsum(mask) - 1)")
            return
        self.report("error", f"putting {LEFT_PADS} pads before a row changes the logits of its "
                    f"real tokens by {left.delta:.3g} (tolerance {left.tol:.2g}), while pads "
                    f"appended after it change nothing: {cause}", where=where, step=0,
                    evidence=evidence, fix=fix, code="left-pad")
        self.left_finding = self.findings[-1]

    def _left_pad_cause(self, s: Subject) -> tuple[str, str, str, bool]:
        """(where, cause, fix, unmasked) from one trace of the rows with and without left pads:
        attention mass on the pad keys, else the positional encoding added to the real tokens.
        `unmasked`: pads are attended, no real key is hidden from a real query after it and the
        pad queries attend causally like any token, in every attention: no padding mask at all,
        rather than a wrong one."""
        generic = ("the positions of a left-padded row are not counted from its first real "
                   "token, or its pads are attended (a trace could not tell which)")
        if s.capture is None:
            return "", generic, LEFT_PAD_FIX + " " + PAD_MASK_FIX, False
        T = s.fit(10 + LEFT_PADS) - LEFT_PADS
        ids = content_rows(s, 5, T, 1)
        less = torch.cat([pad_columns(s, 5, LEFT_PADS, ids), ids], 1)
        try:
            ref = s.trace(ids[:, :0], ids, reads=self.reads)
            padded = s.trace(less[:, :0], less, reads=self.reads)
        except Exception:  # noqa: BLE001 - the behaviour test already decided; this only names
            return "", generic, LEFT_PAD_FIX + " " + PAD_MASK_FIX, False
        leaks, hidden = [], False
        L = less.shape[1]
        for rec in padded.records():
            if rec.probs is None or rec.probs.dim() != 4 or rec.probs.shape[-1] != less.shape[1]:
                continue
            p = rec.probs.float()
            mass = p[:, :, LEFT_PADS:, :LEFT_PADS].sum(-1).max()                  # real queries
            if float(mass) > MASS_TOL:
                leaks.append((rec.site, float(mass)))
            r = ref.attention.get(rec.site)
            hidden = hidden or _hides_a_real_key(p, None if r is None or r.probs is None
                                                 else r.probs.float())
            # a mask that treats the pad *queries* (rows, not keys) shows there: their rows are
            # emptied, and come out non-finite or spread over future keys
            pad_rows = p[:, :, :LEFT_PADS]
            future = torch.ones(LEFT_PADS, L, dtype=torch.bool, device=p.device).triu(1)
            hidden = hidden or not bool(pad_rows.isfinite().all()) or \
                float((pad_rows.nan_to_num() * future).sum(-1).max()) > MASS_TOL
        if leaks:
            site, mass = leaks[0]
            return (site, f"real queries put up to {mass:.3f} of their attention on the left "
                    f"pads (a padding mask that assumes right padding)", PAD_MASK_FIX, not hidden)
        for name, parts in padded.embed.items():
            pe, pe_ref = parts.get("pe"), ref.embed.get(name, {}).get("pe")
            if pe is None or pe_ref is None:
                continue
            pe = pe.expand(less.shape[0], *pe.shape[1:])[:, LEFT_PADS:]           # [B, T, d]
            pe_ref = pe_ref.expand(ids.shape[0], *pe_ref.shape[1:])
            if pe.shape == pe_ref.shape and compare(pe_ref, pe).failed:
                return (name, "the positional encoding added to a row's real tokens moves with "
                        "its left pads: positions are counted from column 0, not from the row's "
                        "first real token", LEFT_PAD_FIX, False)
        return "", generic, LEFT_PAD_FIX + " " + PAD_MASK_FIX, False
