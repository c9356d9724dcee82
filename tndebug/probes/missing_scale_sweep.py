"""missing-scale's findings from the temperature sweep (triage/hygiene.py temperature_sweep
measures it: held-out loss with every attention's scores scaled by alpha; the judge adds these
findings after the probes, judge/stage.py): weights trained without the scale their code applies
(FAILURE_MODES 2.2) are an error; on the user's own code, at most an info."""
from __future__ import annotations

from tndebug.findings import Finding
from tndebug.probes.paired import SOLVED

FIX_SCALE = ("the checkpoint was trained by code without the 1/sqrt(d_k) scale (or with another "
             "one): evaluate it with the code it was trained with, or fix the code and retrain / "
             "fine-tune; do not load it into correctly scaled code")


def sweep_findings(ev: dict | None, where: str = "") -> list[Finding]:
    """missing-scale's findings from the temperature sweep's evidence (hygiene.temperature_sweep):
    an error when the loss is significantly lowest outside [1/sqrt 2, sqrt 2] ("mismatch"); on
    the user's own code ("not applicable": it runs the scale it was trained with) the same
    outcome on solved data is only an info; else none (a sweep that decided nothing is a part
    not run: judge/status.py sweep_not_run)."""
    if not ev or "best_alpha" not in ev:
        return []
    best, at_1, best_loss, test = ev["best_alpha"], ev["loss_at_1"], ev["best_loss"], ev["paired"]
    if ev.get("verdict") == "mismatch":
        what = "without the 1/sqrt(d_k) scale" if best > 1 else "with a larger scale than this code's"
        return [Finding("missing-scale", "error",
                        f"the checkpoint was trained {what}: held-out loss is lowest with the scores "
                        f"scaled by alpha={best:.3g} ({best_loss:.3f} vs {at_1:.3f} at alpha=1, "
                        f"lower on {test['share_better']:.0%} of {test['n']} sequences; "
                        f"healthy: alpha in [0.71, 1.41])", where=where, step=0, evidence=ev,
                        fix=FIX_SCALE, code="missing-scale/sweep-mismatch")]
    low, high = ev["interval"]
    outside = not (low - 1e-9 <= best <= high + 1e-9)
    if ev.get("verdict") == "not applicable" and outside and ev.get("significant") \
            and best_loss < SOLVED * ev["ln_V"]:
        return [Finding("missing-scale", "info",
                        f"temperature sweep (not applicable on your own code): held-out loss is "
                        f"lowest at alpha={best:.3g} ({best_loss:.3f} vs {at_1:.3f} at alpha=1); the "
                        f"code runs the scale it was trained with, so this says the held-out data "
                        f"or the attention temperature differ from training, not that a scale is "
                        f"missing", where=where, step=0, evidence=ev,
                        code="missing-scale/sweep-not-applicable")]
    return []
