"""ln-placement's residual tests (the probe's class is in ln_placement.py; these are its
methods, with their messages):

* the residual of each attention sublayer (pre-LN or mixed): output minus the attention's
  output is the input x (healthy) or g * norm(x) + b (the bug), exactly (`_residual`): an error
  (exact; the skip path no longer carries the stream, so Pre-LN's identity path is gone).
* a missing residual (`x = attn(ln_1(x))`, any placement): each block's input is moved while
  every weight inside it is held (`_skip_path`); a block whose output does not move has no
  skip path, exactly: an error naming the sublayer (the attention, or the FFN after it).
  Measured (bench/residual_skip.py): with a residual a block passes 0.40-0.92 of the input's
  share (calibration: tndebug tiny pre/post, nanoGPT at init), without it 0 (bit-identical);
  MIN_SHARE (1e-6) absorbs float32 rounding only.
"""
from __future__ import annotations

import torch

from tndebug.capture.source import call_site
from tndebug.probes import _depth_stats as ds
from tndebug.probes._depth_setup import probe_batch
from tndebug.probes import _skip_path
from tndebug.probes._residual import NORM_TOL, normalised_residuals, residual_carries
from tndebug.probes.base import RunContext
from tndebug.capture.trace import Trace


class ResidualTests:
    """ln-placement's residual tests, mixed into LnPlacement: they report as it."""

    def residual_input(self, run: RunContext, step: int, inline: bool = False) -> None:
        """Pre-LN sublayers whose residual carries norm(x) instead of x (`_residual`)."""
        subject = run.subject
        src, tgt = probe_batch(subject)
        try:
            with subject.evaluating():
                trace = subject.trace(src, tgt, reads=("stream", "attn.out", "attn.probs"))
        except Exception:  # noqa: BLE001 - the placement is decided; this test is extra
            return
        by_stack: dict[str, list[dict]] = {}
        carried = residual_carries(trace)
        for e in carried:
            self.cover(e["where"], "checked")
            if e["carries"] == "normalised input":
                by_stack.setdefault(e["stack"], []).append(e)
        if not carried and inline:         # no sublayer points: read the adds themselves (pre-LN
            self._residual_by_identity(subject, src, tgt, trace, step)   # only: a Post-LN block
            return                                                      # adds its input, a norm output)
        for stack, bad in by_stack.items():
            first = bad[0]
            self.report(
                "error", f"the residual of {first['where']} carries the normalised input: its "
                f"output is norm(x) + f(norm(x)), not x + f(norm(x)) ({len(bad)} {stack} "
                f"sublayer{'s' if len(bad) > 1 else ''}: {', '.join(e['where'] for e in bad[:3])})",
                where=first["where"], step=step, layer=first["layer"],
                evidence={"sublayers": [e["where"] for e in bad],
                          "rel_to_input": round(first["rel_input"], 6),
                          "rel_to_normalised_input": first["rel_norm"],
                          "threshold": NORM_TOL, "attention": first["attention"]},
                fix="Keep the residual on the unnormalised stream: x = x + f(norm(x)); do not "
                    "assign norm(x) back to x before adding the sublayer's output", code="residual-normalised")

    def _residual_by_identity(self, subject, src, tgt, trace, step: int) -> None:
        """Sublayers written inline (`x = self.norm1(x); x = x + self.attn(x, x, x, mask)`): the
        residual added to an attention output is the very tensor a norm produced and the
        attention read (`_residual.normalised_residuals`, by tensor identity: exact)."""
        sites = [r.site for r in trace.records()]
        try:
            bad = normalised_residuals(subject, src, tgt, sites)
        except Exception:  # noqa: BLE001 - the placement is decided; this test is extra
            return
        if not sites:
            return
        for site in sites:
            self.cover(site, "checked")
        if not bad:
            return
        first = bad[0]
        where = ", ".join(sorted({e["where"] for e in bad})[:3])
        self.report(
            "error", f"the residual of {first['where']} carries the normalised input: "
            f"{first['norm']}'s output is both what the attention reads and what its output is "
            f"added to, so the block computes norm(x) + f(norm(x)), not x + f(norm(x)) "
            f"({len(bad)} attention sublayer{'s' if len(bad) > 1 else ''}: {where})",
            where=first["where"], step=step,
            evidence={"sublayers": [e["where"] for e in bad], "norms": [e["norm"] for e in bad],
                      "test": "the residual operand is the norm's output tensor (identity)"},
            fix="Keep the residual on the unnormalised stream: h = norm(x); x = x + f(h); do not "
                "assign norm(x) back to x before adding the sublayer's output", code="residual-normalised")

    def residual_missing(self, trace: Trace, run: RunContext, step: int) -> None:
        """Blocks with a sublayer that lost its residual (`_skip_path`): one error per stack."""
        subject = run.subject
        points = {ds.module_path(sp.name): sp for sp in ds.block_points(trace)}
        # 4 sequences: the test is exact, and each weight module's output is kept for the held run
        src, tgt = (x if x is None else x[:4] for x in probe_batch(subject))

        def skips(sites=None):
            def forward():
                subject.logits(src, tgt)
            with subject.evaluating(), torch.no_grad():
                got = _skip_path.block_skips(subject.model, forward, list(points), sites, sites is not None)
            if any(r.reason == _skip_path.FUSED for r in got):   # torch's fused encoder layer runs
                with subject.evaluating(), torch.enable_grad():  # its modules only with grad on
                    got = _skip_path.block_skips(subject.model, forward, list(points), sites,
                                                 sites is not None)
            return got
        try:
            found = skips()
            if any(r.share is not None and r.share < _skip_path.MIN_SHARE for r in found):
                with subject.evaluating():                         # the attention modules, to name
                    found = skips([r.site.split("#")[0] for r in   # the part that lost it
                                   subject.trace(src, tgt, reads=("attn.probs",)).records()])
        except Exception as e:  # noqa: BLE001 - a model the test cannot run: no verdict
            self.cover("", "no verdict", f"the residual test could not run: {type(e).__name__}: {e}")
            return
        by_stack: dict[str, list] = {}
        for r in found:
            if r.share is None:
                self.cover(r.where, "no verdict", f"residual test: {r.reason}")
                continue
            self.cover(r.where, "checked")
            if r.share < _skip_path.MIN_SHARE:
                sp = points.get(r.where)
                by_stack.setdefault(sp.stack if sp is not None else "", []).append((r, sp))
        for stack, bad in by_stack.items():
            r, sp = bad[0]
            parts = [p for p, v in r.by_part.items() if v is not None and v < _skip_path.MIN_SHARE]
            names = [f"the FFN of {r.where} (the sublayer after its attention)" if p == "rest" else p
                     for p in parts]
            what = (f"the residual around {' and around '.join(names)} is missing" if names else
                    f"a residual inside {r.where} is missing")
            blocks = [x.where for x, _ in bad]
            part = next((p for p in parts if p != "rest"), None)
            self.report(
                "error", f"{what}: with every weight inside {r.where} held, moving the block's input "
                f"moves its output by {r.share:.1g} of the input's share (a residual passes "
                f"{_skip_path.MIN_SHARE:g} or more; {r.moves:.2f} with nothing held): the sublayer's "
                f"output replaces the stream instead of adding to it ({len(bad)} "
                f"{stack or 'model'} block{'s' if len(bad) > 1 else ''}: "
                f"{', '.join(blocks[:3])}{' ...' if len(blocks) > 3 else ''})",
                where=part or r.where, step=step,
                # where the user's code takes the attention's output in the test's own forward
                # (`x = self.attn(self.ln_1(x))`, a sublayer connection's forward: BlockSkip.lines),
                # else the block's line that calls it; the FFN's loss is placed at the line that
                # made the block's output (the engine)
                source=(r.lines.get(part) or call_site(subject.model, part)) if part else None,
                layer=sp.layer if sp is not None else None,
                evidence={"blocks": blocks, "skip_share": r.share,
                          "share_nothing_held": round(r.moves, 4), "weights_held": r.held,
                          "parts_without_residual": [("ffn" if p == "rest" else p) for p in parts],
                          "share_by_part": {("ffn" if p == "rest" else p): (None if v is None else round(v, 4))
                                            for p, v in r.by_part.items()},
                          "threshold": _skip_path.MIN_SHARE,
                          "test": "the block's input moved by its own size, every weight module in "
                                  "the block held at its output without the move"},
                fix="Add each sublayer's output to its input: x = x + self.attn(self.ln_1(x)) "
                    "(pre-LN) or x = norm(x + attn(x)) (post-LN), for the attention and the FFN alike",
                code="residual-missing")
