"""lm-decoding's KV-cache test (the probe's class is in lm_decoding.py; these are its methods,
with their messages):

* `kv-cache`: where the subject offers its cache (`subject.incremental`), the logits of positions
  split.. decoded through it must equal the full forward's. Checked only where the full forward
  is causal (its logits at t the same on ids[:, :t+1]): a forward that reads the future cannot be
  matched by any cache, and mask-broadcast names that leak.
When it fails, which earlier tokens a cached step still sees (by resampling them) names the cause.
"""
from __future__ import annotations

import inspect
import re

import torch

from tndebug.capture.cache_divergence import cache_divergence
from tndebug.faults import FAULT_NOTES
from tndebug.probes._mask_tests import Check, compare
from tndebug.probes.raised import ModelRaised, call as _call
from tndebug.probes.lm_decoding_rows import THRESHOLD, content_rows, pad_columns
from tndebug.subject import Subject

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

NOTE = {k: FAULT_NOTES[k][2] for k in ("kv_cache_causal_top_left", "kv_cache_position_off_by_one")}


def _resampled(s: Subject, ids: torch.Tensor, cols, seed: int) -> torch.Tensor:
    """ids with other content tokens at columns `cols`."""
    g = torch.Generator().manual_seed(seed)
    out = ids.clone()
    lo, n = s.first_content, s.tgt_vocab - s.first_content
    r = torch.randint(1, max(n, 2), out[:, cols].shape, generator=g).to(ids.device)
    out[:, cols] = lo + (out[:, cols].clamp(min=lo) - lo + r) % n
    return out


class CacheTests:
    """lm-decoding's KV-cache test, mixed into LMDecoding: it reports as the probe."""

    # -- the KV cache --------------------------------------------------------------------
    def _no_cache(self, s: Subject) -> None:
        """No incremental call: a cache the adapter does not reach is untested, not absent."""
        declared = declared_cache(s.model)
        if declared:
            self.cover(CACHE, "no verdict", f"the model has a KV cache ({declared}) that the "
                       f"adapter does not call, so cached decoding was not tested: "
                       f"{OFFER_CACHE}")
            self.part_not_run("KV cache", f"the model has a KV cache ({declared}) that the "
                              f"adapter does not call: {OFFER_CACHE}")
            return
        self.cover(CACHE, "not applicable", "the model offers no KV cache (no incremental "
                   "call, no cache argument or module): generation reruns the whole prefix, "
                   "which the causality and padding tests cover")

    def kv_cache(self, s: Subject) -> None:
        if not s.has_cache:
            self._no_cache(s)
            return
        T = s.fit(10)
        if T < 4:
            self.skip(f"the model takes too few positions ({T}) to decode through a cache", where=CACHE)
            return
        plain = content_rows(s, 4, T, seed=21)
        ks = [0, 1, 2, 1]
        ragged = pad_columns(s, 4, T, plain)                                  # left-padded, as generation
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
            # the user's line where the cached step first computes what the full forward does not
            with s.evaluating():
                line = cache_divergence(s.model, lambda: s.logits(plain[:, :0], plain),
                                        lambda: s.incremental(plain, T // 2), T // 2)
        except ModelRaised as e:
            self.skip(f"the model raised {type(e.error).__name__} on {e.what}: "
                      f"{str(e.error).strip()[:200]}", where=CACHE)
            return
        self.report("error", f"the logits decoded through the KV cache differ from the full "
                    f"forward's by {worst.delta:.3g} (tolerance {worst.tol:.2g}): {cause}",
                    where="", step=0, evidence={"cases": per_case, "sees": seen,
                                                "threshold": THRESHOLD},
                    fix=fix, code="kv-cache", source=line)

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
