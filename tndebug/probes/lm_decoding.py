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
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import re

import torch

from tndebug.faults import FAULT_NOTES
from tndebug.probes import _rotary
from tndebug.probes._raised import ModelRaised, call as _call
from tndebug.probes.base import Probe, RunContext, not_decoder_only
from tndebug.probes._mask_tests import Check, compare
from tndebug.probes.schedule import every
from tndebug.subject import NO_PAD, Subject

# Both tests compare the same model on the same real tokens: healthy, only float rounding of
# other shapes (another kernel, another reduction order) separates them, ~1e-7 of the logit scale
# in fp32 (measured 0.95-1.3e-6 absolute on logits up to ~3.6, tndebug's tiny decoder-only). A pad that
# moves a position, or a cached step that misses a key, changes logits by 1e-2..1 of their scale.
# REL_TOL sits two orders of magnitude above rounding and far below either: max|change| >
# REL_TOL * (1 + max|reference logit|) (the same rule as mask-broadcast's).
REL_TOL = 1e-5
MASS_TOL = 1e-6          # attention a real query may put on pad keys (exactly 0 when masked)
LEFT_PADS = 3            # pads put before every row (uniform test); ragged rows get 0..LEFT_PADS
THRESHOLD = f"max|change| > {REL_TOL:g}*(1+max|logit|)"
# a forward argument or a submodule/buffer so named declares a KV cache (a hint that the cache
# test applies; whether the cache is right is decided by decoding through it)
CACHE_NAMES = re.compile(r"^(past_key_values?|past|layer_past|kv_cache|cache|caches|use_cache|"
                         r"incremental_state|cache_k|cache_v|k_cache|v_cache|key_cache|value_cache)$")


OFFER_CACHE = ("offer it as incremental(model, ids, pad_id, split) -> the logits of positions "
               "split.. decoded through the cache: in the --adapter FILE.py module (triage), or as "
               "forward.incremental (tndebug.check / watch); docs/decoder.md")


def declared_cache(model) -> str:
    """What in `model` declares a KV cache: a forward argument (past_key_values, use_cache,
    kv_cache, ...) or a submodule, parameter or buffer so named; "" when nothing does."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    for name in params:
        if CACHE_NAMES.match(name):
            return f"forward takes {name}="
    for path, _ in list(model.named_modules()) + list(model.named_buffers()):
        leaf = path.rsplit(".", 1)[-1]
        if leaf and CACHE_NAMES.match(leaf):
            return f"{path}"
    for path, mod in model.named_modules():
        for attr in ("kv_cache", "cache_k", "cache_v", "k_cache", "v_cache"):
            if isinstance(getattr(mod, attr, None), (torch.Tensor, list, dict)):
                return f"{path + '.' if path else ''}{attr}"
    return ""
CACHE = "kv cache"       # coverage place of the cache test (the model's generation path)

NOTE = {k: FAULT_NOTES[k][2] for k in ("positions_ignore_left_pad", "kv_cache_causal_top_left",
                                        "kv_cache_position_off_by_one")}
PAD_MASK_FIX = ("Build the padding mask from the ids (keep = ids != pad_id, [B, 1, 1, T]), not "
                "from the rows' lengths: a mask from lengths (arange(T) < length) assumes right "
                "padding and hides a left-padded row's last tokens while it shows the pads.")


def _rows(s: Subject, batch: int, length: int, seed: int) -> torch.Tensor:
    """BOS-led rows of content tokens, no pads.  # [B, T]"""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(s.first_content, s.tgt_vocab, (batch, length), generator=g)
    ids[:, 0] = s.bos_id
    return ids.to(s.device)


def _pads(s: Subject, batch: int, n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((batch, n), s.pad_id, dtype=like.dtype, device=like.device)


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
    out = _pads(s, B, T + max(ks), ids)
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


def _resampled(s: Subject, ids: torch.Tensor, cols, seed: int) -> torch.Tensor:
    """ids with other content tokens at columns `cols`."""
    g = torch.Generator().manual_seed(seed)
    out = ids.clone()
    lo, n = s.first_content, s.tgt_vocab - s.first_content
    r = torch.randint(1, max(n, 2), out[:, cols].shape, generator=g).to(ids.device)
    out[:, cols] = lo + (out[:, cols].clamp(min=lo) - lo + r) % n
    return out


class LMDecoding(Probe):
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
    fix = NOTE["positions_ignore_left_pad"]
    # the tests run at setup; the steps only look for left-padded rows in the user's own batches
    default_schedule = staticmethod(lambda: every(50))

    def __init__(self, schedule=None) -> None:
        super().__init__(schedule)
        self._left_finding = None        # the left-pad error, kept an error only where left pads are used
        self._left_rows = 0              # rows of the user's batches that begin with a pad
        self._data_pad = NO_PAD

    def observe(self, trace, info) -> dict:
        ids = info.tgt_in
        if self._left_finding is None or self._data_pad == NO_PAD or ids is None or ids.dim() != 2 \
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
        f = self._left_finding
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
        self._left_finding = new

    def setup(self, run: RunContext) -> None:
        s = run.subject
        self._data_pad = s.data_pad_id
        if s.kind != "decoder":
            # its decoder is driven with the whole target, never left-padded or cached by
            # tndebug; its masks are mask-broadcast's (an encoder-only model has no decoder)
            self.cover("", "not applicable", not_decoder_only(s.kind))
            return
        with s.evaluating():
            ids = _rows(s, 4, s.fit(9), seed=11)
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
                self._left_pad(s)
            self._kv_cache(s)

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

    # -- left padding --------------------------------------------------------------------
    def _left_pad(self, s: Subject) -> None:
        logits = lambda what, ids: _call(what, s.logits, ids[:, :0], ids)     # noqa: E731
        left, right = Check(), Check()
        try:
            for seed, length in ((1, 10), (2, 7)):
                T = s.fit(length + LEFT_PADS) - LEFT_PADS
                if T < 2:
                    self.skip(f"the model takes too few positions ({T + LEFT_PADS}) to pad a row",
                              where="")
                    return
                ids = _rows(s, 5, T, seed)
                ref = logits("rows without padding", ids)                      # [B, T, V]
                more = torch.cat([ids, _pads(s, 5, LEFT_PADS, ids)], 1)
                right = right.merge(compare(ref, logits(
                    f"the rows with {LEFT_PADS} pads appended", more)[:, :T]))
                less = torch.cat([_pads(s, 5, LEFT_PADS, ids), ids], 1)
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
        self._left_finding = self.findings[-1]

    def _left_pad_cause(self, s: Subject) -> tuple[str, str, str, bool]:
        """(where, cause, fix, unmasked) from one trace of the rows with and without left pads:
        attention mass on the pad keys, else the positional encoding added to the real tokens.
        `unmasked`: pads are attended, no real key is hidden from a real query after it and the
        pad queries attend causally like any token, in every attention: no padding mask at all,
        rather than a wrong one."""
        generic = ("the positions of a left-padded row are not counted from its first real "
                   "token, or its pads are attended (a trace could not tell which)")
        if s.capture is None:
            return "", generic, NOTE["positions_ignore_left_pad"] + " " + PAD_MASK_FIX, False
        T = s.fit(10 + LEFT_PADS) - LEFT_PADS
        ids = _rows(s, 5, T, 1)
        less = torch.cat([_pads(s, 5, LEFT_PADS, ids), ids], 1)
        try:
            ref = s.trace(ids[:, :0], ids, reads=self.reads)
            padded = s.trace(less[:, :0], less, reads=self.reads)
        except Exception:  # noqa: BLE001 - the behaviour test already decided; this only names
            return "", generic, NOTE["positions_ignore_left_pad"] + " " + PAD_MASK_FIX, False
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
                        "first real token", NOTE["positions_ignore_left_pad"], False)
        return "", generic, NOTE["positions_ignore_left_pad"] + " " + PAD_MASK_FIX, False

    # -- the KV cache --------------------------------------------------------------------
    def _kv_cache(self, s: Subject) -> None:
        if not s.has_cache:
            declared = declared_cache(s.model)
            if declared:            # a cache the adapter does not reach: untested, not absent
                self.cover(CACHE, "no verdict", f"the model has a KV cache ({declared}) that the "
                           f"adapter does not call, so cached decoding was not tested: "
                           f"{OFFER_CACHE}")
                self.part_not_run("KV cache", f"the model has a KV cache ({declared}) that the "
                                  f"adapter does not call: {OFFER_CACHE}")
                return
            self.cover(CACHE, "not applicable", "the model offers no KV cache (no incremental "
                       "call, no cache argument or module): generation reruns the whole prefix, "
                       "which the causality and padding tests cover")
            return
        T = s.fit(10)
        if T < 4:
            self.skip(f"the model takes too few positions ({T}) to decode through a cache", where=CACHE)
            return
        plain = _rows(s, 4, T, seed=21)
        ks = [0, 1, 2, 1]
        ragged = _pads(s, 4, T, plain)                                  # left-padded, as generation
        for b, k in enumerate(ks):
            ragged[b, k:] = plain[b, :T - k]
        # A model's small batches cost their weights' reads, not their rows: the unpadded and
        # the left-padded rows run as one batch (eval mode: each row's logits are its own), and
        # the cases that decode from the same split share one pass through the cache.
        both = torch.cat([plain, ragged])                                  # [8, T]
        P, R = [0, 1, 2, 3], [4, 5, 6, 7]
        mid, late = T // 2, max(max(ks) + 2, T // 2)   # the ragged prefix: >= 2 real tokens a row
        cases = {"rows without padding, split 1": (P, 1),
                 f"rows without padding, split {mid}": (P, mid),
                 f"left-padded rows, split {late}": (R, late)}
        worst, per_case = Check(), {}
        try:
            what = "rows with and without left padding"
            full = _call(what, s.logits, both[:, :0], both)                  # [8, T, V]
            causal = Check()
            for t in range(1, T):                        # the full forward must be causal first
                rows = P + R if t >= max(ks) + 2 else P
                part = _call(what, s.logits, both[rows, :0], both[rows, :t + 1])
                causal = causal.merge(compare(full[rows, t:t + 1], part[:, t:t + 1],
                                              (both[rows] != s.pad_id)[:, t:t + 1]))
            if causal.failed:
                self.skip(f"the full forward is not causal (its logit at t changes with later "
                          f"tokens by {causal.delta:.3g}; mask-broadcast names the leak): no "
                          f"cache can match it", where=CACHE)
                return
            for split in sorted({sp for _, sp in cases.values()}):
                group = [(name, rows) for name, (rows, sp) in cases.items() if sp == split]
                rows = [r for _, g in group for r in g]
                inc = _call(" and ".join(n for n, _ in group) + ", through the KV cache",
                            s.incremental, both[rows], split)                 # [B, T - split, V]
                want = full[rows, split:]
                if inc is None or tuple(inc.shape) != tuple(want.shape):
                    self.skip(f"the cache's logits have shape {None if inc is None else list(inc.shape)}"
                              f", not {list(want.shape)} (positions {split}..{T - 1})", where=CACHE)
                    return
                at = 0
                for name, g in group:
                    c = compare(want[at:at + len(g)], inc[at:at + len(g)].to(want.dtype),
                                both[g, split:] != s.pad_id)
                    per_case[name], worst, at = vars(c), worst.merge(c), at + len(g)
            if not worst.finite:
                self.skip("non-finite logits through the cache or the full forward: the "
                          "comparison cannot decide", where=CACHE)
                return
            self.cover(CACHE, "checked")
            if not worst.failed:
                return
            cause, fix, seen = self._cache_cause(s, plain, T // 2)
        except ModelRaised as e:
            self.skip(f"the model raised {type(e.error).__name__} on {e.what}: "
                      f"{str(e.error).strip()[:200]}", where=CACHE)
            return
        self.report("error", f"the logits decoded through the KV cache differ from the full "
                    f"forward's by {worst.delta:.3g} (tolerance {worst.tol:.2g}): {cause}",
                    where="", step=0, evidence={"cases": per_case, "sees": seen,
                                                "threshold": THRESHOLD},
                    fix=fix, code="kv-cache")

    def _cache_cause(self, s: Subject, ids: torch.Tensor, split: int):
        """Which earlier tokens a cached step sees, by resampling them: the first key, the other
        prefix keys, the first token decoded through the cache. Returns (cause, fix, seen)."""
        base = _call("rows without padding, through the KV cache", s.incremental, ids, split)

        def moves(cols, at) -> bool:
            other = _call("rows with tokens resampled, through the KV cache", s.incremental,
                          _resampled(s, ids, cols, seed=31 + len(cols)), split)
            return compare(base[:, at], other[:, at]).failed

        last = base.shape[1] - 1
        seen = {"first key": moves([0], [last]),
                "prefix keys after the first": moves(list(range(1, split)), [last]),
                "tokens decoded before": moves([split], list(range(1, last + 1)))}
        if not any(seen.values()):
            return ("each cached step sees only its own token: the cache is not read (the past "
                    "keys and values are dropped or not concatenated)",
                    "Concatenate the cached keys and values with the new token's (torch.cat([past_k, "
                    "k], dim=-2)) and pass the cache to every step", seen)
        if seen["first key"] and not seen["prefix keys after the first"]:
            return ("each cached step sees only the first key: the causal mask of the one-token "
                    "query is aligned top-left (SDPA is_causal=True with a cache)",
                    NOTE["kv_cache_causal_top_left"], seen)
        if not seen["tokens decoded before"]:
            return ("the tokens decoded through the cache never reach later steps: the cache is "
                    "not updated with them",
                    "Append each new token's keys and values to the cache and carry the updated "
                    "cache to the next step", seen)
        return ("each cached step sees every earlier token, yet its logits differ: the new token's "
                "position (one off?) or the cached keys and values differ from the full forward's",
                NOTE["kv_cache_position_off_by_one"], seen)


def _sig3(d: dict) -> dict:
    """Floats to 3 significant digits (evidence is read by people: 1.95, not 1.9534118175506592)."""
    return {k: (float(f"{v:.3g}") if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in d.items()}


def _padding_side(run: RunContext) -> str | None:
    """'left'/'right' where the run (run.extras['padding_side']), the subject (`padding_side`:
    triage of a Hugging Face directory sets its saved tokenizer's), the model's config or its
    generation config says how it pads, else None."""
    side = run.extras.get("padding_side") or getattr(run.subject, "padding_side", None)
    m = run.subject.model
    for cfg in (getattr(m, "config", None), getattr(m, "generation_config", None)):
        side = side or getattr(cfg, "padding_side", None)
    return side if isinstance(side, str) else None
