"""positional-encoding's tests of the position table itself (the probe's class is in
positional_encoding.py; these are its methods, with their messages):

* padded shape: the embedding output at real positions must not depend on the padded length or
  on the batch (a PE indexed by the padded shape);
* overflow: feed one constant-token sequence as long as the model accepts; the embedding rows
  then differ only by position, so two positions with identical rows share a PE row;
* rank: the position part of those rows spans how many directions (one frequency in every pair
  spans 2).
"""
from __future__ import annotations

import torch

from tndebug.capture.assignments import table_line
from tndebug.faults import FAULT_NOTES
from tndebug.probes._embed_moves import embedding_moves
from tndebug.probes._misc_stats import first_reason
from tndebug.subject import Subject

# DUP_TOL: exact in kind (sinusoid rows differ by O(1)); no run.
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
# the fix for rows past the table, with the notes it cites
REUSED_FIX = f"{FAULT_NOTES['pos_max_len_small'][2]} [notes {FAULT_NOTES['pos_max_len_small'][1]}]"


class TableTests:
    """positional-encoding's table tests, mixed into PositionalEncodingProbe: they report as it."""

    # -- 2b. PE rows that depend on the padded shape ----------------------------------------------
    def padded_shape_test(self, subject: Subject) -> None:
        """The embedding output at real positions must not change when pad columns are appended
        or when the example is alone (exact, `_embed_moves`). A PE indexed by the padded shape
        moves it; reported unless this probe already named an error at setup (the order test on
        `x + pe[:, T]`, which adds one row to every position), so the PE is named once."""
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
    def overflow_test(self, subject: Subject) -> None:
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
            self.skip_also(f"overflow test: the model refused every probe length"
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
                self._rank_test(site, rows, length, subject.model)
                continue
            j = int(dup_cols[0])
            i = int(same[:, j].nonzero()[0])
            self.report("error", f"{site}: {len(dup_cols)} positions from {j} on reuse the PE row of an "
                        f"earlier position ({j} gets the row of {i}); the PE table is too short",
                        where=site, step=0, fix=REUSED_FIX,
                        evidence={"first_duplicate_position": j, "same_row_as": i,
                                  "duplicate_positions": len(dup_cols), "probe_length": length,
                                  "threshold_rel_distance": DUP_TOL,
                                  "refused_length": refused[0] if refused else None}, code="pe-rows-reused")

    def _rank_test(self, site: str, rows: torch.Tensor, length: int, model=None) -> None:
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
                              "probe_length": length}, code="pe-one-frequency",
                    # the table is built in __init__, outside every probed forward: found by its
                    # values, its line read from the source (assignments.table_line)
                    source=table_line(model, rows))
