"""missing-scale's judgement after its probe:

    findings, statuses = scale_at_init(findings, statuses, probe_fresh, how, library)

the probe's "no 1/sqrt(d_k)" error judged again on a fresh initialisation (issue 19): folded
into the initialisation (T5), or left out by the installed package's own unmodified code
(GPT-Neo), is the design, an info; else the error stays. (The temperature sweep's findings are
the probe's own: probes/missing_scale_sweep.py.)
"""
from __future__ import annotations

import math
from dataclasses import replace

from tndebug.findings import Finding
from tndebug.judge.fresh import judged_on, on_fresh
from tndebug.judge.status import restatus
from tndebug.probes.missing_scale import by_design_fix

NO_SCALE = "no 1/sqrt(d_k)"


def unscaled_error(f: Finding) -> bool:
    return (f.probe == "missing-scale" and f.severity == "error"
            and f.evidence.get("diagnosis") == NO_SCALE)


def scale_at_init(findings: list[Finding], statuses: dict, probe_fresh, how: str = "",
                  library: str = ""):
    """Re-judge the checkpoint's "no 1/sqrt(d_k)" errors on the fresh initialisation: the
    modules whose q/k rms ratio shows the fold there (missing-scale's by-design test, info at
    init) become one info finding, by design; the others stay errors. Returns (findings,
    statuses); missing-scale findings carry judged_on. `how`: how the fresh model was built.

    `library` names the installed package whose unmodified code the fresh model runs (a Hugging
    Face directory: transformers builds the model from config.json; nothing of the checkpoint's
    author runs). Scores with no scale at all there too are that package's published design
    (GPT-Neo leaves the scale out): info, the architecture's design, not this checkpoint's defect.
    Only the exact "no 1/sqrt(d_k)" (a scale of 1 is hard-coded; no config field sets it); a
    wrong constant comes from the config (Gemma-2's query_pre_attn_scalar left at 256 on a
    head of 8) and stays an error. "" (the user's own code, or a test's patch): unscaled at init
    stays an error: the same tensors are the notes' first bug."""
    out = [f if f.probe != "missing-scale" or "judged_on" in f.evidence else judged_on(f, "checkpoint")
           for f in findings]
    targets = [f for f in out if unscaled_error(f) and f.evidence.get("judged_on") != "fresh init"]
    if not targets:
        return out, statuses
    init = on_fresh(probe_fresh, "missing-scale", statuses)
    if init is None:
        return out, statuses
    st = statuses["missing-scale"]
    folded, unfolded = {}, set()
    for f in init:
        if f.probe == "missing-scale" and f.evidence.get("diagnosis") == NO_SCALE:
            if f.severity == "info":
                folded.update(f.evidence.get("qk_rms_ratio", {}))
            else:
                unfolded.update(f.evidence.get("modules", {}))
    result = []
    for f in out:
        if f not in targets:
            result.append(f)
            continue
        mods = f.evidence.get("modules", {})
        design = {s: r for s, r in mods.items() if s in folded}
        published = {s: r for s, r in mods.items() if library and s not in folded and s in unfolded}
        rest = {s: r for s, r in mods.items() if s not in folded and s not in published}
        if design:
            result.append(by_design_finding(f, design, folded, how))
        if published:
            result.append(published_finding(f, published, library, how))
        if rest:
            result.append(f if not (design or published) else subset_finding(f, rest))
    st["fresh_init"] = {"built": how or "the model's own constructor, seed 0",
                        "folded_at_init": sorted(folded), "unscaled_at_init": sorted(unfolded),
                        **({"package_code": library} if library else {})}
    restatus(statuses, result, "missing-scale")
    return result, statuses


def head_line(site: str, ratio: float, d_k: int, n_more: int) -> str:
    tail = f" (+{n_more} more attention modules)" if n_more else ""
    return (f"{site}: scale {ratio / math.sqrt(d_k):.3f}, expected 1/sqrt({d_k})="
            f"{1 / math.sqrt(d_k):.3f} ({NO_SCALE}){tail}")


def by_design_finding(f: Finding, mods: dict, folded: dict, how: str) -> Finding:
    d_k = int(f.evidence["d_k"])
    site = next(iter(mods))
    r_init = folded[site]
    r_ckpt = f.evidence.get("qk_rms_ratio", {}).get(site, math.nan)
    msg = (head_line(site, mods[site], d_k, len(mods) - 1)
           + f"; by design (the initialisation folds the scale into W_Q: measured ratio "
             f"rms(q)/rms(k) {r_init:.3g} at init, 1/sqrt(d_k) = {1 / math.sqrt(d_k):.3g}; "
             f"{r_ckpt:.3g} in the checkpoint, where training moved it)")
    ev = {**f.evidence, "judged_on": "fresh init", "modules": mods,
          "init_qk_rms_ratio": {s: folded[s] for s in mods},
          "checkpoint_qk_rms_ratio": {s: f.evidence.get("qk_rms_ratio", {}).get(s) for s in mods},
          "fresh_init": how or "the model's own constructor, seed 0"}
    ev.pop("qk_rms_ratio", None)
    return replace(f, severity="info", message=msg, where=site, fix=by_design_fix(d_k), evidence=ev)


def published_finding(f: Finding, mods: dict, library: str, how: str) -> Finding:
    """The package's own code leaves the scale out, at initialisation too: its design."""
    d_k = int(f.evidence["d_k"])
    site = next(iter(mods))
    msg = (head_line(site, mods[site], d_k, len(mods) - 1)
           + f"; by design of {library}: the installed package's own code applies no scale, on a "
             f"fresh from_config model too (q and k of one size there: nothing folded into the "
             f"weights), so this is the architecture's published design, not a defect of this "
             f"checkpoint")
    ev = {**f.evidence, "judged_on": "fresh init", "modules": mods, "design_of": library,
          "fresh_init": how or "the model's own constructor, seed 0"}
    fix = ("Nothing to fix in this checkpoint: its weights were trained for scores without "
           "1/sqrt(d_k). Loaded into code that divides by sqrt(d_k) (a port, a reimplementation), "
           f"its attention would be {math.sqrt(d_k):.4g}x flatter; pass --data to check that the "
           "weights fit this code (the temperature sweep).")
    return replace(f, severity="info", message=msg, where=site, fix=fix, evidence=ev)


def subset_finding(f: Finding, mods: dict) -> Finding:
    d_k = int(f.evidence["d_k"])
    site = next(iter(mods))
    rest = f.message.split(f"({NO_SCALE})", 1)[1].split(" (+", 1)[0] if f"({NO_SCALE})" in f.message else ""
    return replace(f, where=site, message=head_line(site, mods[site], d_k, len(mods) - 1) + rest,
                   evidence={**f.evidence, "modules": mods,
                             "qk_rms_ratio": {s: f.evidence.get("qk_rms_ratio", {}).get(s) for s in mods}})
