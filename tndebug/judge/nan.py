"""The NaN story, told once: a non-finite forward and what it carries on, and weights that are
non-finite in the file.

    findings, statuses = not_judged_on_nan(findings, statuses)   # the file's NaN weights
    findings, statuses = after_nan_forward(findings, statuses)   # one story per NaN

The code behind NaN weights is judged on a fresh initialisation (judge/fresh.py code_on_fresh).
"""
from __future__ import annotations

from dataclasses import replace

from tndebug.findings import Finding
from tndebug.judge.status import restatus

CODE_PROBES = ("nan-scores", "missing-scale", "mask-broadcast")   # exact tests of the code
# nan-scores' findings that a forward through non-finite weights makes whatever the code
NAN_CARRIED = ("nan-scores/nonfinite-forward", "nan-scores/nonfinite-grad", "nan-scores/nonfinite-loss")


NAN_FORWARD = "nan-scores/nonfinite-forward"
DOWNSTREAM_OF_NAN = ("gradient-flow/nonfinite-grad", "loss-health/nonfinite-loss")


def after_nan_forward(findings: list[Finding], statuses: dict[str, dict]):
    """One story per NaN. A gradient or a loss that is non-finite at or after the step whose
    forward nan-scores found non-finite (its first op named, an error) is that NaN carried on (a
    NaN in a padded row is multiplied by a zero weight in the loss, and the product is NaN):
    gradient-flow's and loss-health's errors there are info that says so, with nan-scores' fix,
    not second and third defects with an initialisation or learning-rate fix (the real-bug
    corpus' fully masked query rows got the gradient one; sample_runs/neg_inf_fill_all_masked
    both, "NaN to lr/warmup" among them). A gradient that goes non-finite before any forward
    does (an exploding update) stays an error.
    Returns (findings, statuses), the demoted probes' status following their own findings."""
    nan = [f for f in findings if f.code == NAN_FORWARD and f.severity == "error"]
    if not nan:
        return findings, statuses
    first = min(nan, key=lambda f: f.step or 0)
    out, touched = [], set()
    for f in findings:
        if f.code in DOWNSTREAM_OF_NAN and f.severity in ("warning", "error") \
                and (f.step or 0) >= (first.step or 0):
            f = replace(f, severity="info",
                        message=f"{f.message}: carried back from the non-finite forward at step "
                                f"{first.step or 0} ({first.where or 'the model'}; nan-scores)",
                        evidence={**f.evidence, "follows": NAN_FORWARD, "follows_where": first.where},
                        fix=first.fix)
            touched.add(f.probe)
        out.append(f)
    for name in touched:
        restatus(statuses, out, name)
    return out, statuses


def not_judged_on_nan(findings: list[Finding], statuses: dict) -> tuple[list, dict]:
    """Statistics of a forward and backward through non-finite weights (non-finite gradients,
    dead units, rank, norms) say only that the weights are NaN, which checkpoint/nonfinite-
    weights says; their fixes (an init, a residual) would send the user the wrong way. Their
    warnings and errors are withdrawn, each such probe "no verdict" with the reason. The exact
    tests of the code (CODE_PROBES, judged on a fresh initialisation too) and the file's own
    findings stay. Called only when the weights are not finite (judge's nan-weights pass). Returns
    (findings, statuses)."""
    keep = set(CODE_PROBES) | {"checkpoint", "lr-schedule"}
    out, withdrawn = [], {}
    for f in findings:
        # the first NaN of the forward (or backward) reads the NaN weights: the file's finding,
        # not an op's (the code's own NaNs are looked for on the fresh initialisation)
        carried = f.code in NAN_CARRIED and f.evidence.get("judged_on") != "fresh init"
        if not carried and (f.probe in keep or f.severity == "info"
                            or f.evidence.get("judged_on") == "fresh init"):
            out.append(f)
        else:
            withdrawn.setdefault(f.probe, []).append(f.code or f.probe)
    for name, codes in withdrawn.items():
        statuses[name] = {**statuses.get(name, {}), "status": "no verdict",
                          "reason": "the checkpoint's weights are non-finite (checkpoint/"
                                    "nonfinite-weights): what this probe measured through them "
                                    f"({', '.join(sorted(set(codes)))}) says only that",
                          "withdrawn": sorted(set(codes))}
    return out, statuses
