"""Code judged apart from weights (issue 19): what is a property of the code is judged on a fresh
initialisation from the model's own constructor, the trained weights only for what training does.

    findings, statuses = scale_at_init(findings, statuses, probe_fresh)      # judge/scale.py
    findings, statuses = code_on_fresh(findings, statuses, probe_fresh, names)  # NaN weights
    findings, statuses = rank_at_init(findings, statuses, probe_fresh)      # variance-drift
    findings, statuses = growth_at_init(findings, statuses, probe_fresh)    # variance-drift
    findings, statuses = shift_at_init(findings, statuses, probe_fresh)     # label-shift

`probe_fresh(names) -> ProbeResult` runs the probes `names` on a model built again by its own
constructor, seeded, with no weights loaded: for a Hugging Face directory
`AutoModelForSeq2SeqLM.from_config(config)` with the same attention implementation, for
`--model` the user's factory called again. Every finding these functions return from a probe
they re-judged carries `evidence["judged_on"]`: "checkpoint" or "fresh init".

* **The 1/sqrt(d_k) fold** (T5): whether unscaled scores are compensated by an initialisation
  that makes q sqrt(d_k) smaller than k is a property of the code. Training moves rms(q)/rms(k)
  (a T5 after 30 AdamW steps: out of the band around 1/sqrt(d_k)), so a checkpoint's "no
  1/sqrt(d_k)" error is judged again at initialisation: folded there -> info, by design.
* **Rank collapse of a stream that keeps its token differences** (variance-drift's info,
  cause "statistic"): in trained weights a learned common component can dominate the stream,
  and a model on the plateau of its targets' prior gives one answer at every position (HF LED
  after 150 copy steps, Megatron-BERT on masked random ids), whatever its code. Whether the
  code collapses the stream is judged at initialisation: the same module collapsed there ->
  the severity variance-drift gives a first check (warning, or error with collapsed logits),
  judged_on "fresh init"; else the info stays, saying the fresh initialisation is clean.
* **Stream growth past the envelope of initialisation** (variance-drift's warning): trained
  causal LMs grow the residual stream 67-243x where the envelope (pre-LN 18x) was set at init
  and early training; whether the code grows it is judged at initialisation: there too -> the
  warning stays; else info (`growth_at_init`).
* **Exact tests of the code on non-finite weights**: NaN weights make every behavioural test
  "no verdict" (no finite probabilities) and hide a mask bug; nan-scores, missing-scale and
  mask-broadcast then also run on the fresh initialisation.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from tndebug.findings import Finding
from tndebug.judge.nan import CODE_PROBES
from tndebug.judge.status import status_of
from tndebug.probes.variance_drift import VarianceDrift

SEED = 0                                              # the fresh initialisation's seed


def seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """build() under torch.manual_seed(SEED), the caller's RNG state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return build()


def judged_on(f: Finding, where: str) -> Finding:
    return replace(f, evidence={**f.evidence, "judged_on": where})


def on_fresh(probe_fresh, name: str, statuses: dict) -> list | None:
    """Probe `name`'s findings on the fresh initialisation, or None when it cannot be built (the
    user's constructor may raise anything), which statuses[name]["fresh_init"] then says."""
    statuses.setdefault(name, {})
    try:
        return probe_fresh([name]).findings
    except Exception as e:  # noqa: BLE001 - the user's constructor may raise anything
        statuses.setdefault(name, {})["fresh_init"] = (f"not built ({type(e).__name__}: "
                                                       f"{str(e).strip()[:120]}); judged on the checkpoint")
        return None


def code_on_fresh(findings: list[Finding], statuses: dict, probe_fresh, names, how: str = ""):
    """Non-finite weights hide the code's bugs (every behavioural test lacks finite
    probabilities): run the exact tests of the code (CODE_PROBES among `names`) on the fresh
    initialisation too. Their findings join the checkpoint's, marked judged_on "fresh init";
    the checkpoint's findings of those probes are marked "checkpoint". Returns (findings,
    statuses)."""
    code = [n for n in CODE_PROBES if n in names]
    if not code:
        return findings, statuses
    out = [judged_on(f, "checkpoint") if f.probe in code else f for f in findings]
    try:
        probed = probe_fresh(code)
    except Exception as e:  # noqa: BLE001 - the user's constructor may raise anything
        for n in code:
            statuses.setdefault(n, {})["fresh_init"] = (f"not built ({type(e).__name__}: "
                                                        f"{str(e).strip()[:120]})")
        return out, statuses
    note = " (on a fresh initialisation of your code: the checkpoint's weights are non-finite)"
    seen = {(f.probe, f.where, f.severity, f.message) for f in out}
    for f in probed.findings:
        if f.probe not in code or (f.probe, f.where, f.severity, f.message) in seen:
            continue
        out.append(replace(f, message=f.message + note,
                           evidence={**f.evidence, "judged_on": "fresh init",
                                     "fresh_init": how or "the model's own constructor, seed 0"}))
    for n in code:
        st, new = statuses.setdefault(n, {}), probed.statuses.get(n, {})
        st["fresh_init"] = {"status": new.get("status"), "coverage": new.get("coverage")}
    return out, statuses


def shift_at_init(findings: list[Finding], statuses: dict, probe_fresh, how: str = ""):
    """Re-judge label-shift's "labels not shifted" error of trained weights on the fresh
    initialisation: a head tied to the token embedding predicts its own input there (self rate
    1.0 on tndebug's tied decoder-only and on GPT-2 at init), so a checkpoint that repeats its
    input may never have been trained, and says nothing about its labels. Where the fresh
    initialisation repeats its input too, the error is withdrawn and the place has no verdict,
    with the reason; elsewhere the error stands, judged_on "checkpoint", the fresh rate beside
    it. Returns (findings, statuses)."""
    target = [f for f in findings if f.code == "label-shift/unshifted"]
    if not target:
        return findings, statuses
    init = on_fresh(probe_fresh, "label-shift", statuses)
    if init is None:
        return findings, statuses
    built = how or "the model's own constructor, seed 0"
    st = statuses["label-shift"]
    again = next((g for g in init if g.code == "label-shift/unshifted"), None)
    if again is None:
        st["fresh_init"] = {"built": built, "repeats_input_at_init": False}
        return [judged_on(f, "checkpoint") if f in target else f for f in findings], statuses
    rate = again.evidence.get("self_rate")
    st["fresh_init"] = {"built": built, "repeats_input_at_init": True, "self_rate": rate}
    st.setdefault("coverage", {})["unshifted"] = {
        "status": "no verdict",
        "reason": (f"a fresh initialisation of the same code predicts its own input too "
                   f"({rate:.0%}; a head tied to the token embedding does): repeating the input "
                   f"does not tell which labels the weights were trained on")}
    rest = [f for f in findings if f not in target]
    if st.get("status") in ("pass", "warn", "fail"):
        checked = any(c.get("status") == "checked" for c in st["coverage"].values())
        st["status"] = status_of(rest, "label-shift")
        if st["status"] == "pass" and not checked:
            st["status"] = "no verdict"
        if st["status"] == "no verdict":
            st["reason"] = st["coverage"]["unshifted"]["reason"]
    return rest, statuses


def _trained_rank(f: Finding) -> bool:
    return (f.code == "variance-drift/rank-collapse" and f.evidence.get("cause") == "statistic"
            and f.evidence.get("judged_on") != "fresh init")


def rank_at_init(findings: list[Finding], statuses: dict, probe_fresh, how: str = ""):
    """Re-judge the checkpoint's rank-collapse infos of trained weights (a stream that keeps its
    token differences) on the fresh initialisation: where the same module collapses there, the
    code does it, and the finding takes the severity of a first check (VarianceDrift.at_init);
    elsewhere it stays info and says the fresh init is clean. Returns (findings, statuses)."""
    def rejudge(f: Finding, g: Finding | None, ev: dict) -> Finding:
        judged = VarianceDrift.at_init(g.evidence) if g is not None else None
        ev = {**ev, "init_r": None if g is None else g.evidence.get("r"),
              "init_logits_r": None if g is None else g.evidence.get("logits_r")}
        if judged is None:
            return replace(f, message=f.message + "; a fresh initialisation of the same code "
                           "keeps the tokens apart there", evidence=ev)
        sev, cause = judged
        return replace(
            f, severity=sev, fix=g.fix or VarianceDrift.fix,
            message=(f.message.split(" in the trained weights", 1)[0]
                     + f" in the trained weights, and at a fresh initialisation of the same code "
                       f"(r={g.evidence.get('r')}, from {g.evidence.get('r_input')}): the code "
                       f"collapses the stream, not training"),
            evidence={**ev, "cause": cause, "trained_cause": "statistic"})
    return _drift_at_init(findings, statuses, probe_fresh, how, _trained_rank,
                          "variance-drift/rank-collapse", rejudge, "collapsed_at_init")


GROWN_BY_TRAINING = ("; a fresh initialisation of the same code keeps the stream within the "
                     "band: training grew it, the code does not (a statistic of trained weights, "
                     "not a defect shown: the model's outputs are finite; it bites only where the "
                     "stream overflows its dtype)")


def growth_at_init(findings: list[Finding], statuses: dict, probe_fresh, how: str = ""):
    """Re-judge the checkpoint's stream-growth warnings on the fresh initialisation. Trained
    decoders grow their residual stream far past the envelope set at initialisation and early
    training (GROWTH_ENVELOPE, pre-LN 18x): bench/hf_unseen.py's healthy causal LMs after 1000
    steps at loss 1.6 (the task's floor), GPT-J 113x, Phi 74x, StableLM 213x (DEV), Phi-3 107x,
    Qwen3 243x, StarCoder2 67x (HELD-OUT), each clean at init. Where the same stack grows at
    the fresh initialisation too, the code does it: the warning stays, judged_on "fresh init";
    else it is info that says so. Returns (findings, statuses)."""
    def target(f: Finding) -> bool:
        return (f.code == "variance-drift/stream-growth" and f.severity == "warning"
                and f.evidence.get("judged_on") != "fresh init")

    def rejudge(f: Finding, g: Finding | None, ev: dict) -> Finding:
        ev = {**ev, "init_growth": None if g is None else g.evidence.get("growth")}
        if g is None:
            return replace(f, severity="info", message=f.message.replace(
                "residual stream RMS grows", "in the trained weights the residual stream RMS "
                "grows", 1) + GROWN_BY_TRAINING, evidence={**ev, "trained_cause": "statistic"})
        return replace(f, message=f.message + f"; at a fresh initialisation of the same code too "
                       f"({g.evidence.get('growth')}x): the code grows it", evidence=ev)
    return _drift_at_init(findings, statuses, probe_fresh, how, target,
                          "variance-drift/stream-growth", rejudge, "grown_at_init")


def _drift_at_init(findings, statuses, probe_fresh, how, is_target, code, rejudge, key):
    """The shared re-judgement of variance-drift findings on the fresh initialisation: the
    targets (`is_target`) each rejudge(f, the same module's `code` finding at init or None,
    evidence with judged_on) -> its new finding; statuses["variance-drift"] gets fresh_init
    {"built", key: the modules with `code` at init} and its status from the findings kept."""
    targets = [f for f in findings if is_target(f)]
    if not targets:
        return findings, statuses
    init = on_fresh(probe_fresh, "variance-drift", statuses)
    if init is None:
        return findings, statuses
    at_init = {f.where: f for f in init if f.code == code}
    built = how or "the model's own constructor, seed 0"
    result = [rejudge(f, at_init.get(f.where), {**f.evidence, "judged_on": "fresh init",
                                               "fresh_init": built})
              if f in targets else f for f in findings]
    st = statuses["variance-drift"]
    prior = st.get("fresh_init") if isinstance(st.get("fresh_init"), dict) else {}
    st["fresh_init"] = {**prior, "built": built, key: sorted(at_init)}
    if st.get("status") in ("pass", "warn", "fail"):
        st["status"] = status_of(result, "variance-drift")
    return result, statuses
