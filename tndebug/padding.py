"""Where the pad id sits in a user's batch (their --data, `check(data=)`, `watch`'s batches).

Padding fills only the ends of a row (right padding; left padding, and a decoder start equal to
the pad as T5's, at the start), so a pad with real tokens on both sides is a real token and the
pad id given is wrong. Used by triage's --data reader and by the library's argument checks.
"""
from __future__ import annotations

import torch

PLACES_SHOWN = 3        # (row, position) pairs quoted in the line; the count covers them all


def mid_sequence_pads(tensors: dict[str, torch.Tensor], pad_id: int) -> dict[str, dict]:
    """Where the pad id occurs mid-sequence: a pad with a real token before it *and* after it
    in its row. Padding is only at the ends (right padding; left padding and a decoder start
    equal to the pad, as T5's, are at the start), so such a pad is a real token and the pad id
    given is wrong. {name: {"rows": count, "of": N, "at": [(row, position), ...]}}, {} if none."""
    found = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] < 3:
            continue
        real = (t != pad_id).long()                                        # [N, L]
        seen = real.cumsum(1)                                              # real tokens up to i
        mid = (t == pad_id) & (seen > 0) & (seen < seen[:, -1:])          # [N, L]: real before and after
        rows = mid.any(1).nonzero().flatten()
        if rows.numel():
            at = [(int(r), int(mid[r].nonzero()[0, 0])) for r in rows[:PLACES_SHOWN]]
            found[name] = {"rows": int(rows.numel()), "of": int(t.shape[0]), "at": at}
    return found


def pad_text(found: dict[str, dict], pad_id: int) -> str:
    """`pad id 5 occurs mid-sequence in 12 of 16 rows of src (row 0 position 3, ...)...`"""
    parts = []
    for name, d in found.items():
        at = ", ".join(f"row {r} position {i}" for r, i in d["at"])
        more = ", ..." if d["rows"] > len(d["at"]) else ""
        parts.append(f"{d['rows']} of {d['of']} rows of {name} ({at}{more})")
    return (f"pad id {pad_id} occurs mid-sequence (a real token on both sides) in "
            f"{' and '.join(parts)}: padding only fills the ends of a row, so {pad_id} is likely "
            f"a real token and the pad id given is wrong")
