"""Triage rebuilds tndebug's own code for a tndebug checkpoint (a layout, or the decoder-only
model from its model_config), always without the faults `tndebug run --fault` put in from
outside (tndebug/inject.py). A checkpoint whose model_config lists faults was trained with other
code than triage runs: the exact tests (missing-scale's fitted scale, the masks) judge the code
rebuilt, not the one trained, so the report says so (issue 44: a `--fault no_scale` checkpoint
'passed' missing-scale, the code rebuilt having its scale)."""
from __future__ import annotations

from tndebug.findings import Finding


def rebuilt_code(config: dict | None) -> list[Finding]:
    """An info finding `checkpoint/rebuilt-code` when the checkpoint's config lists faults."""
    faults = [str(f) for f in ((config or {}).get("faults") or [])]
    if not faults:
        return []
    names = ", ".join(faults)
    return [Finding(
        "checkpoint", "info",
        f"the checkpoint was trained with tndebug's fault{'s' * (len(faults) != 1)} {names} "
        f"(its model_config), but triage rebuilds tndebug's code without faults: the code tests "
        f"(the fitted scale, the masks, the positions) judge that code, not the one the weights "
        f"were trained with; only the comparisons of the weights with the code (the temperature "
        f"sweep, on data the checkpoint solves) can show the difference",
        step=0, code="checkpoint/rebuilt-code",
        evidence={"trained_with_faults": faults, "rebuilt": "tndebug's model, no faults"},
        fix="triage the run itself (tndebug run --fault ... names the faults as it trains), or "
            "pass --data / the --task it was trained on so the temperature sweep can judge the "
            "weights against the code")]
