"""Turn bench/results/detection.jsonl (bench/detection.py) into detection.json and detection.md.

    python bench/detection_report.py                       # the default paths
    python bench/detection_report.py --jsonl /tmp/d.jsonl --json /tmp/d.json --md /tmp/d.md

Definitions (FAILURE_MODES §3):
* alarm: a finding of severity warning or error (info never counts).
* recall of a fault: share of its evaluation runs in which its probe (`Fault.probe`) raised an
  alarm; Wilson 95% interval. fp16-only faults (`Fault.needs == "fp16"`) run fp32 on CPU, where
  only the fp16 portability advisory is possible, an info by docs/severity.md (a warning before
  that policy); they are counted as detected on that finding of their probe and marked latent.
* steps-to-detection: the `Finding.step` of the expected probe's first alarm, counted from the
  step the fault became active (the resume step for resume faults); median and IQR. A finding
  without a step comes from a static test at setup and counts as 0.
* localisation: whether the expected probe's first alarm names a module the fault affects
  (`EXPECTED_WHERE`, a regular expression on `Finding.where`); "any": whether any of its alarms does.
* false positives: share of healthy (benign) runs in which a probe raised any alarm.
* silent fault: a faulty run whose held-out exact match is not below the worst healthy run of
  the same task and norm; per fault, an exact one-sided permutation test (stratified by norm)
  of the mean exact match, faulty vs healthy: "worse" when p < 0.05 (the same test on the
  greedy token accuracy beside it: short runs leave exact match low everywhere). The reference
  of resume faults is the healthy resume control (benign variant "resume"), that of rotary
  faults (`Fault.needs == "rotary"`) the healthy decoder-only model with rotary positions
  (healthy variant "rotary").
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import Provenance, provenance_line  # noqa: E402
from _tables import md_table  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ALARM = ("warning", "error")

# Which module(s) each fault affects: a regular expression on Finding.where.
ATTN = r"(^|\.)(self_attn|cross_attn)(\.|$)"
EXPECTED_WHERE = {
    "no_scale": ATTN,                       # every attention module
    "scale_by_d_model": ATTN,
    "mask_inverted": ATTN,                  # every mask is inverted
    "pad_mask_query_axis": r"^encoder\.layers\.\d+\.self_attn",   # only the encoder's padding mask
    "no_causal_mask": r"^decoder\.layers\.\d+\.self_attn",       # decoder self-attention
    "causal_transposed": r"^decoder\.layers\.\d+\.self_attn",
    "mask_after_softmax": ATTN,
    "no_memory_mask": r"^decoder\.layers\.\d+\.cross_attn",      # cross-attention
    "softmax_wrong_dim": ATTN,
    "view_without_transpose": ATTN,
    "shared_qkv": ATTN,
    "identical_head_init": ATTN,
    "no_pos_encoding": r"^(src_embed|tgt_embed)",                # the embedding (+PE) modules
    "no_emb_scale": r"^(src_embed|tgt_embed)",
    "pos_max_len_small": r"^(src_embed|tgt_embed)",
    "no_residual": r"^(encoder|decoder)\.layers\.\d+",          # a block or one of its sublayers
    "pre_ln_no_final_norm": r"^(encoder|decoder)(\.(norm|hook_out))?$",   # the stack's output
    "tiny_ln_eps": r"(^|\.)norm(\.|$)|sublayer\.\d+\.norm",    # a LayerNorm module
    "neg_inf_fill_all_masked": r"^(encoder|decoder)\.layers\.\d+\.self_attn",   # pad query rows
    "fill_1e9_fp16": ATTN,
    "label_smoothing_on_pad": r"^criterion$",
    "kl_raw_logits": r"^criterion$",
    "warmup_restart_on_resume": r"^(lr_schedule|optimizer(\.state)?)$",
    "no_warmup_high_lr": r"^(lr_schedule|optimizer|)$",        # the run's schedule (run level)
    "dead_relu_init": r"(^|\.)ffn(\.|$)",
    "rotary_q_only": r"^decoder\.layers\.0\.self_attn$",     # the first attention (periodic test)
    "rotary_on_v": r"^decoder\.layers\.0\.self_attn$",
    "rotary_halves": r"^decoder\.layers\.0\.self_attn$",
}
# faults whose probe has an exact (static or behavioural) test when the fault becomes active
EXACT_AT_ACTIVATION = {
    "no_scale", "scale_by_d_model", "mask_inverted", "pad_mask_query_axis", "no_causal_mask",
    "causal_transposed", "mask_after_softmax", "no_memory_mask", "softmax_wrong_dim",
    "view_without_transpose", "shared_qkv", "identical_head_init", "no_pos_encoding", "no_emb_scale",
    "pos_max_len_small", "no_residual", "pre_ln_no_final_norm", "tiny_ln_eps",
    "neg_inf_fill_all_masked", "fill_1e9_fp16", "label_smoothing_on_pad", "warmup_restart_on_resume",
    "dead_relu_init", "kl_raw_logits", "rotary_q_only", "rotary_on_v", "rotary_halves",
}
RECALL_TARGET = 0.95


# -- statistics --------------------------------------------------------------------------------
def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float | None, float | None]:
    if n == 0:
        return None, None
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return round(max(0.0, c - h), 4), round(min(1.0, c + h), 4)


def rate(k: int, n: int) -> dict:
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "rate": round(k / n, 4) if n else None, "wilson95": [lo, hi]}


def quartiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "median": None, "q1": None, "q3": None}
    xs = sorted(xs)
    if len(xs) == 1:
        return {"n": 1, "median": xs[0], "q1": xs[0], "q3": xs[0]}
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return {"n": len(xs), "median": statistics.median(xs), "q1": q[0], "q3": q[2]}


def stratified_permutation_p(strata: list[tuple[list[float], list[float]]]) -> float | None:
    """One-sided exact p that the faulty values are lower: statistic = sum over strata of
    (mean healthy - mean faulty); labels permuted within each stratum."""
    strata = [(f, h) for f, h in strata if f and h]
    if not strata:
        return None

    def stat_options(f, h):
        pool, k = f + h, len(f)
        out = []
        for idx in itertools.combinations(range(len(pool)), k):
            s = set(idx)
            ff = [pool[i] for i in idx]
            hh = [pool[i] for i in range(len(pool)) if i not in s]
            out.append(sum(hh) / len(hh) - sum(ff) / len(ff))
        return out

    observed = sum(sum(h) / len(h) - sum(f) / len(f) for f, h in strata)
    options = [stat_options(f, h) for f, h in strata]
    total = hits = 0
    for combo in itertools.product(*options):
        total += 1
        if sum(combo) >= observed - 1e-12:
            hits += 1
    return hits / total


# -- loading -----------------------------------------------------------------------------------
def load(path: Path) -> tuple[list[dict], list[dict]]:
    runs: dict[str, dict] = {}
    metas = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("meta"):
            metas.append(r)
        elif r.get("ok"):
            runs[r["key"]] = r          # the last good record of a configuration wins
        else:
            runs.setdefault(r["key"], r)
    return list(runs.values()), metas


def alarms(run: dict, probe: str | None = None, severities=ALARM) -> list[dict]:
    return [f for f in run.get("findings", []) if f["severity"] in severities
            and (probe is None or f["probe"] == probe)]


# Deviations from the paper that models train with: their probe names them as info unless the
# model's behaviour shows the harm (docs/severity.md, issue 19), so that info is the detection.
DEVIATIONS = frozenset({"no_emb_scale"})
# what a fault's exact match is compared with, by the reference runs' variant
REFERENCE = {"": "healthy", "resume": "healthy resume control", "rotary": "healthy rotary decoder"}


def _named_at(fault) -> tuple[str, ...]:
    """The severities at which a fault's own probe detects it: its alarms, and also its info
    for a latent fp16 fault (the advisory on CPU fp32) or a deviation."""
    return ALARM + ("info",) if fault.needs == "fp16" or fault.name in DEVIATIONS else ALARM


def _detected(run: dict) -> list[dict]:
    """The fault's own probe's alarms (for a latent fp16 fault or a deviation, its info too)."""
    from tndebug.faults import FAULTS
    fault = FAULTS[run["fault"]]
    return alarms(run, fault.probe, _named_at(fault))


def first_alarm(run: dict, probe: str, severities=ALARM) -> dict | None:
    fs = alarms(run, probe, severities)
    if not fs:
        return None
    return min(enumerate(fs), key=lambda t: (t[1]["step"] if t[1]["step"] is not None else 1e12, t[0]))[1]


def em(run: dict) -> float:
    x = run.get("exact_match")
    return float(x) if x is not None else 0.0


def tok(run: dict) -> float:
    x = run.get("token_accuracy")
    return float(x) if x is not None else 0.0


# -- the analysis ------------------------------------------------------------------------------
def analyse(runs: list[dict], metas: list[dict], main_steps: int | None = None) -> dict:
    """Everything, for the runs of `main_steps` steps (default: the step count of most fault
    runs); healthy/benign runs of other lengths form the long false-positive track."""
    from tndebug.faults import FAULTS
    from tndebug.probes import PROBE_NAMES

    every_ok = [r for r in runs if r.get("ok")]
    if main_steps is None:
        counts = _count(r["steps"] for r in every_ok if r["kind"] == "fault") or \
            _count(r["steps"] for r in every_ok)
        main_steps = int(max(counts, key=counts.get)) if counts else 0
    ok = [r for r in every_ok if r["steps"] == main_steps]
    other = [r for r in every_ok if r["steps"] != main_steps and r["kind"] != "fault"]
    failed = [{"key": r["key"], "error": r.get("error")} for r in runs if not r.get("ok")]
    by_split = defaultdict(list)
    for r in ok:
        by_split[r["split"]].append(r)
    ev = by_split["eval"]
    healthy = [r for r in ev if r["kind"] == "healthy"]
    benign = [r for r in ev if r["kind"] == "benign"]
    faulty = [r for r in ev if r["kind"] == "fault"]

    # healthy reference exact match per (task, norm, variant)
    ref, ref_tok = defaultdict(list), defaultdict(list)
    for r in healthy:               # variant "" or "rotary" (the rotary faults' healthy model)
        ref[(r["task"], r["norm"], r["variant"])].append(em(r))
        ref_tok[(r["task"], r["norm"], r["variant"])].append(tok(r))
    for r in benign:
        ref[(r["task"], r["norm"], r["variant"])].append(em(r))
        ref_tok[(r["task"], r["norm"], r["variant"])].append(tok(r))

    faults_out = {}
    for name, fault in FAULTS.items():
        rs = [r for r in faulty if r["fault"] == name]
        if not rs:
            continue
        probe = fault.probe
        # latent on CPU fp32: the expected probe's fp16 advisory (info) is the detection
        sevs = _named_at(fault)
        det, loc_first, loc_any, steps, sev, no_step = 0, 0, 0, [], defaultdict(int), 0
        per_norm = defaultdict(lambda: [0, 0])
        where_seen = defaultdict(int)
        for r in rs:
            per_norm[r["norm"]][1] += 1
            if not probe:
                continue
            fa = first_alarm(r, probe, sevs)
            if fa is None:
                continue
            det += 1
            per_norm[r["norm"]][0] += 1
            sev[fa["severity"]] += 1
            where_seen[fa["where"]] += 1
            rx = re.compile(EXPECTED_WHERE.get(name, r"$^"))
            loc_first += bool(rx.search(fa["where"] or ""))
            loc_any += any(rx.search(f["where"] or "") for f in alarms(r, probe, sevs))
            if fa["step"] is None:          # a static test (no step attached): before step 0
                no_step += 1
                steps.append(0)
            else:
                steps.append(fa["step"] - (r.get("fault_active_from") or 0))
        confusion = {p: rate(sum(bool(alarms(r, p)) for r in rs), len(rs)) for p in PROBE_NAMES}
        # silent fault
        ref_variant = fault.needs if fault.needs in ("resume", "rotary") else ""
        strata, strata_tok, silent = [], [], 0
        ems_f, ems_h = [], []
        for norm in sorted({r["norm"] for r in rs}):
            f_em = [em(r) for r in rs if r["norm"] == norm]
            h_em = ref.get((rs[0]["task"], norm, ref_variant), [])
            strata.append((f_em, h_em))
            strata_tok.append(([tok(r) for r in rs if r["norm"] == norm],
                               ref_tok.get((rs[0]["task"], norm, ref_variant), [])))
            ems_f += f_em
            ems_h += h_em
            if h_em:
                silent += sum(x >= min(h_em) for x in f_em)
        p = stratified_permutation_p(strata)
        p_tok = stratified_permutation_p(strata_tok)
        tok_f = [x for f, _ in strata_tok for x in f]
        tok_h = [x for _, h in strata_tok for x in h]
        out = {
            "probe": probe or None, "where_rule": EXPECTED_WHERE.get(name), "needs": fault.needs or None,
            "norms": list(fault.norms), "runs": len(rs),
            "latent_only": fault.needs == "fp16",
            "exact_at_activation": name in EXACT_AT_ACTIVATION,
            "recall": rate(det, len(rs)) if probe else None,
            "recall_by_norm": {n: rate(k, m) for n, (k, m) in per_norm.items()} if probe else None,
            "first_alarm_severity": dict(sev),
            "first_alarm_where": dict(where_seen),
            "localisation_first": rate(loc_first, det) if probe else None,
            "localisation_any": rate(loc_any, det) if probe else None,
            "steps_to_detection": quartiles(steps) if probe else None,
            "first_alarm_static_no_step": no_step,
            "detected_at_activation": rate(sum(s == 0 for s in steps), len(rs)) if probe else None,
            "confusion": confusion,
            "exact_match_faulty_mean": round(statistics.mean(ems_f), 4) if ems_f else None,
            "exact_match_reference_mean": round(statistics.mean(ems_h), 4) if ems_h else None,
            "reference": f"{REFERENCE[ref_variant]} {rs[0]['task']}",
            "silent_runs": rate(silent, len(rs)),
            "worse_than_healthy_p": round(p, 4) if p is not None else None,
            "worse_than_healthy": (p is not None and p < 0.05),
            "token_accuracy_faulty_mean": round(statistics.mean(tok_f), 4) if tok_f else None,
            "token_accuracy_reference_mean": round(statistics.mean(tok_h), 4) if tok_h else None,
            "token_accuracy_worse_p": round(p_tok, 4) if p_tok is not None else None,
            "token_accuracy_worse": (p_tok is not None and p_tok < 0.05),
            "run_status": dict(sorted(_count(r.get("run_status") for r in rs).items())),
        }
        if probe:
            r_ = out["recall"]["rate"]
            out["meets_recall_target"] = r_ is not None and r_ >= RECALL_TARGET
            if name in EXACT_AT_ACTIVATION:
                out["meets_exact_target"] = det == len(rs) and all(s == 0 for s in steps) and len(steps) == det
        if name == "no_dropout":
            out["head_collapse_findings"] = _count(
                f["severity"] for r in rs for f in r.get("findings", []) if f["probe"] == "head-collapse")
            out["head_collapse_alarm_runs"] = rate(sum(bool(alarms(r, "head-collapse")) for r in rs), len(rs))
            out["head_collapse_messages"] = sorted({f["message"][:160] for r in rs for f in r.get("findings", [])
                                                    if f["probe"] == "head-collapse"})[:5]
        faults_out[name] = out

    def fp_table(rs):
        table = {p: rate(sum(bool(alarms(r, p)) for r in rs), len(rs)) for p in PROBE_NAMES}
        table["any"] = rate(sum(bool(alarms(r)) for r in rs), len(rs))
        return table

    fp = {"healthy": fp_table(healthy), "benign": fp_table(benign),
          "healthy_by_task": {t: fp_table([r for r in healthy if r["task"] == t])
                              for t in sorted({r["task"] for r in healthy})},
          "benign_by_variant": {v: fp_table([r for r in benign if r["variant"] == v])
                                for v in sorted({r["variant"] for r in benign})}}
    false_alarms = [{"key": r["key"], "probe": f["probe"], "severity": f["severity"], "where": f["where"],
                     "step": f["step"], "message": f["message"]}
                    for r in healthy + benign for f in alarms(r)]

    calib = by_split.get("calibration", [])
    calib_faults = [r for r in calib if r["kind"] == "fault" and FAULTS[r["fault"]].probe]
    calib_out = {
        "runs": len(calib),
        "fault_recall": rate(sum(bool(_detected(r)) for r in calib_faults), len(calib_faults)),
        "fault_misses": sorted({r["key"] for r in calib_faults if not _detected(r)}),
        "fp_healthy": fp_table([r for r in calib if r["kind"] == "healthy"]),
        "fp_benign": fp_table([r for r in calib if r["kind"] == "benign"]),
        "false_alarms": [{"key": r["key"], "probe": f["probe"], "severity": f["severity"],
                          "where": f["where"], "step": f["step"], "message": f["message"]}
                         for r in calib if r["kind"] != "fault" for f in alarms(r)],
    }

    long_track = {}
    for steps in sorted({r["steps"] for r in other}):
        rs = [r for r in other if r["steps"] == steps and r["split"] == "eval"]
        h = [r for r in rs if r["kind"] == "healthy"]
        b = [r for r in rs if r["kind"] == "benign"]
        ems = defaultdict(list)
        for r in rs:
            ems[f"{r['task']}/{r['norm']}/{r['variant'] or 'healthy'}"].append(em(r))
        long_track[str(steps)] = {
            "runs": len(rs), "fp_healthy": fp_table(h), "fp_benign": fp_table(b),
            "benign_by_variant": {v: fp_table([r for r in b if r["variant"] == v])
                                  for v in sorted({r["variant"] for r in b})},
            "false_alarms": [{"key": r["key"], "probe": f["probe"], "severity": f["severity"],
                              "where": f["where"], "step": f["step"], "message": f["message"]}
                             for r in h + b for f in alarms(r)],
            "exact_match": {k: {"mean": round(statistics.mean(v), 4), "min": min(v), "max": max(v),
                                "n": len(v)} for k, v in sorted(ems.items())},
        }

    steps_used = sorted({r["steps"] for r in ok})
    loads = [r["load_before"][0] for r in ok if r.get("load_before")]
    targets = {
        "recall_ge_95": {n: o.get("meets_recall_target") for n, o in faults_out.items() if o["probe"]},
        "exact_at_activation_100": {n: o.get("meets_exact_target") for n, o in faults_out.items()
                                    if o["exact_at_activation"] and o["probe"]},
        "zero_alarms_healthy": fp["healthy"]["any"]["k"] == 0,
        "zero_alarms_benign": fp["benign"]["any"]["k"] == 0,
    }
    targets["faults_missing_recall"] = sorted(n for n, v in targets["recall_ge_95"].items() if not v)
    targets["faults_missing_exact"] = sorted(n for n, v in targets["exact_at_activation_100"].items() if not v)
    return {
        "bench": "detection",
        "setting": {
            "preset": sorted({r["preset"] for r in ok}), "steps": steps_used,
            "resume_at": sorted({r["resume_at"] for r in ok if r.get("fault_active_from") or r["variant"] == "resume"}),
            "eval_size": sorted({r["eval_size"] for r in ok}), "device": "cpu", "dtype": "float32",
            "probes": "all (each probe's default schedule)",
            "fault_task": sorted({r["task"] for r in faulty}),
            "healthy_tasks": sorted({r["task"] for r in healthy}),
            "eval_seeds": {"fault": sorted({r["seed"] for r in faulty}),
                           "healthy": sorted({r["seed"] for r in healthy}),
                           "benign": sorted({r["seed"] for r in benign})},
            "calibration_seeds": sorted({r["seed"] for r in calib}),
            "benign_variants": sorted({r["variant"] for r in benign}),
        },
        "commands": [" ".join(m["argv"]) for m in metas if "argv" in m],
        # each invocation's provenance (bench/_provenance.py), from the line it writes when it ends;
        # None for an invocation before it recorded one, or one that did not end
        "runs_provenance": [m.get("provenance") for m in metas if m.get("end")] or [None],
        "code": [m.get("code") for m in metas if "code" in m],
        "machine": {"cpus": next((m["cpus"] for m in metas if "cpus" in m), None),
                    "load_at_starts": [m["load"] for m in metas if "load" in m],
                    "load_1min_during_runs": quartiles(loads),
                    "run_wall_s": quartiles([r["wall_s"] for r in ok]),
                    "run_cpu_s": quartiles([r["cpu_s"] for r in ok])},
        "counts": {"runs_ok": len(ok), "runs_failed": len(failed), "eval_fault": len(faulty),
                   "eval_healthy": len(healthy), "eval_benign": len(benign), "calibration": len(calib)},
        "failed_runs": failed,
        "targets": targets,
        "faults": faults_out,
        "false_positives": fp,
        "false_alarms": false_alarms,
        "calibration": calib_out,
        "long_track": long_track,
        "healthy_exact_match": {f"{t}/{n}/{v or 'healthy'}": {"mean": round(statistics.mean(x), 4),
                                                              "min": min(x), "max": max(x), "n": len(x)}
                                for (t, n, v), x in sorted(ref.items())},
    }


def _count(xs) -> dict:
    out: dict = defaultdict(int)
    for x in xs:
        out[str(x)] += 1
    return dict(out)


# -- markdown ----------------------------------------------------------------------------------
def _pct(r: dict | None) -> str:
    if not r or r["n"] == 0:
        return "–"
    lo, hi = r["wilson95"]
    return f"{r['k']}/{r['n']} ({100 * r['rate']:.0f}%, {100 * lo:.0f}–{100 * hi:.0f})"


def _q(q: dict | None) -> str:
    if not q or not q["n"]:
        return "–"
    return f"{q['median']:g} [{q['q1']:g}, {q['q3']:g}]"


def markdown(d: dict) -> str:
    import pandas as pd
    from tndebug.probes import PROBE_NAMES
    s, t = d["setting"], d["targets"]
    m = d["machine"]
    L = ["# Fault-injection detection benchmark", "",
         "Generated by `bench/detection_report.py` from `bench/results/detection.jsonl` "
         "(written by `bench/detection.py`). Definitions: see the docstring of `bench/detection_report.py`.", "",
         f"* Setting: preset {s['preset']}, {s['steps']} optimizer steps per run (resume faults/control: "
         f"{s['resume_at']} + the rest), CPU fp32, `--probe all` on default schedules, held-out set "
         f"{s['eval_size']} sequences. Fault and benign runs on {s['fault_task']}; healthy on {s['healthy_tasks']}.",
         f"* Evaluation seeds: faults {s['eval_seeds']['fault']}, healthy {s['eval_seeds']['healthy']}, "
         f"benign {s['eval_seeds']['benign']} (variants {s['benign_variants']}); calibration seeds "
         f"{s['calibration_seeds']} (read only: probe thresholds were not changed).",
         f"* Runs: {d['counts']}.",
         f"* Machine: {m['cpus']} CPUs shared with other work; 1-min load during runs median "
         f"{_q(m['load_1min_during_runs'])}; per run wall {_q(m['run_wall_s'])} s, CPU {_q(m['run_cpu_s'])} s "
         "(one torch thread per worker, 2 workers).",
         "* Commands: " + "; ".join(f"`{c}`" for c in dict.fromkeys(d["commands"])),
         "* Code (tndebug/ as the workers imported it): " + "; ".join(
             f"HEAD {c['git_head'][:8]}{' + uncommitted edits' if c['tndebug_dirty'] else ''} "
             f"(sha256 {c['tndebug_sha256']})" for c in d.get("code", []) if c),
         *[provenance_line(p).replace("Provenance", "Provenance of the runs", 1) if p else
           "* Provenance of the runs: not recorded (written before bench/_provenance.py); no commit is "
           "known to reproduce them: rerun `python -m bench run detection`" for p in d.get("runs_provenance", [None])],
         *([provenance_line(d["provenance"]).replace("Provenance", "Provenance of this report", 1)]
           if d.get("provenance") else []), "",
         "## Targets", "",
         f"* Recall >= 95% per fault: missed by {t['faults_missing_recall'] or 'none'}.",
         f"* 100% at the activation step where an exact test exists: missed by {t['faults_missing_exact'] or 'none'}.",
         f"* Zero alarms on healthy runs: {'yes' if t['zero_alarms_healthy'] else 'NO'} "
         f"({_pct(d['false_positives']['healthy']['any'])} runs with an alarm); on benign runs: "
         f"{'yes' if t['zero_alarms_benign'] else 'NO'} ({_pct(d['false_positives']['benign']['any'])}).", "",
         "## Per fault", "",
         "Recall and localisation: k/n (rate, Wilson 95%). Steps: median [Q1, Q3] from activation. "
         "EM: held-out exact match, faulty vs reference mean; p: one-sided stratified permutation test.", ""]
    L += md_table(pd.DataFrame.from_dict({name: {
        "norms": "/".join(o["norms"]),
        "probe": (o["probe"] or "(claim)") + (" (latent, fp32)" if o["latent_only"] else ""),
        "recall": _pct(o["recall"]),
        "first-alarm severity": ", ".join(f"{k} {v}" for k, v in sorted(o["first_alarm_severity"].items())) or "–",
        "steps to detection": _q(o["steps_to_detection"]), "localised (first)": _pct(o["localisation_first"]),
        "localised (any)": _pct(o["localisation_any"]), "silent runs": _pct(o["silent_runs"]),
        "EM faulty / ref": f"{o['exact_match_faulty_mean']} / {o['exact_match_reference_mean']}",
        "EM worse (p)": f"{'yes' if o['worse_than_healthy'] else 'no'} ({o['worse_than_healthy_p']})",
        "tok-acc faulty / ref": f"{o['token_accuracy_faulty_mean']} / {o['token_accuracy_reference_mean']}",
        "tok-acc worse (p)": f"{'yes' if o['token_accuracy_worse'] else 'no'} ({o['token_accuracy_worse_p']})"}
        for name, o in d["faults"].items()}, orient="index").rename_axis("fault"))
    nd = d["faults"].get("no_dropout")
    if nd:
        L += ["", f"**no_dropout (claim):** head-collapse raised an alarm in {_pct(nd['head_collapse_alarm_runs'])} "
                  f"runs; its findings by severity: {nd['head_collapse_findings'] or 'none'}."]
    fp = d["false_positives"]
    cols = [("healthy", fp["healthy"]), ("benign", fp["benign"])]
    cols += [(f"benign: {v}", t) for v, t in fp["benign_by_variant"].items()]
    cols += [(f"healthy: {k}", t) for k, t in fp["healthy_by_task"].items()]
    L += ["", "## False positives per probe", "",
          "Share of runs in which the probe raised any warning or error.", "",
          *md_table(pd.DataFrame({c: {p: _pct(t[p]) for p in [*PROBE_NAMES, "any"]} for c, t in cols})
                    .rename_axis("probe"))]
    if d["false_alarms"]:
        L += ["", "False alarms (evaluation):", ""]
        for f in d["false_alarms"][:40]:
            L.append(f"* `{f['key']}` {f['probe']} {f['severity']} at step {f['step']} `{f['where']}`: "
                     f"{f['message'][:200]}")
    c = d["calibration"]
    if c["runs"]:
        L += ["", f"Calibration runs ({c['runs']}): any alarm on healthy {_pct(c['fp_healthy']['any'])}, "
                  f"on benign {_pct(c['fp_benign']['any'])}; faults caught by their probe "
                  f"{_pct(c['fault_recall'])}" + (f", missed: {c['fault_misses']}" if c["fault_misses"] else "") + "."]
        for f in c["false_alarms"][:20]:
            L.append(f"* `{f['key']}` {f['probe']} {f['severity']} at step {f['step']} `{f['where']}`: "
                     f"{f['message'][:200]}")
    for steps, lt in d.get("long_track", {}).items():
        L += ["", f"### Longer runs: {steps} steps, healthy and benign only ({lt['runs']} runs)", "",
              f"Any alarm: healthy {_pct(lt['fp_healthy']['any'])}, benign {_pct(lt['fp_benign']['any'])}"
              + "".join(f"; {v} {_pct(t['any'])}" for v, t in lt["benign_by_variant"].items()) + ".", ""]
        probes_alarmed = [p for p in PROBE_NAMES if lt["fp_healthy"][p]["k"] or lt["fp_benign"][p]["k"]]
        if probes_alarmed:
            L += md_table(pd.DataFrame({c: {p: _pct(lt[f"fp_{c}"][p]) for p in probes_alarmed}
                                        for c in ("healthy", "benign")}).rename_axis("probe"))
        for f in lt["false_alarms"][:20]:
            L.append(f"* `{f['key']}` {f['probe']} {f['severity']} at step {f['step']} `{f['where']}`: "
                     f"{f['message'][:200]}")
        L += ["", "Exact match: " + "; ".join(f"{k} {v['mean']} (n={v['n']})" for k, v in lt["exact_match"].items())]
    L += ["", "## Confusion matrix (probe x fault)", "",
          "Share of a fault's evaluation runs in which each probe raised an alarm; the expected probe's "
          "cell is in bold. Latent fp16 faults run fp32 on CPU, where their probe's finding is an fp16 "
          "advisory (info, docs/severity.md): it counts for recall above, not as an alarm here.", ""]
    def cell(o, p, r):
        v = f"{100 * r['rate']:.0f}" if r["n"] else "–"
        return f"**{v}**" if p == o["probe"] else (v if r["k"] else "·")
    L += md_table(pd.DataFrame.from_dict({name: {p.replace("-", "‑"): cell(o, p, o["confusion"][p])
                                                 for p in PROBE_NAMES} for name, o in d["faults"].items()},
                                         orient="index").rename_axis("fault"))
    L += ["", "## Localisation rules (expected `Finding.where`)", "",
          *md_table(pd.DataFrame.from_dict({name: {
              "regular expression": "`" + (o["where_rule"] or "").replace("|", "\\|") + "`",
              "first-alarm `where` seen": ", ".join(f"`{w or '(run)'}` ×{k}"
                                                    for w, k in o["first_alarm_where"].items()) or "–"}
              for name, o in d["faults"].items() if o["probe"]}, orient="index").rename_axis("fault"))]
    L += ["", "## Held-out exact match of the references", "",
          *md_table(pd.DataFrame.from_dict({k: {c: str(v[c]) for c in ("mean", "min", "max", "n")}
                                            for k, v in d["healthy_exact_match"].items()},
                                           orient="index").rename_axis("task/norm/variant"))]
    if d["failed_runs"]:
        L += ["", "## Runs that failed", ""] + [f"* `{f['key']}`: {f['error']}" for f in d["failed_runs"]]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jsonl", default=str(RESULTS / "detection.jsonl"))
    ap.add_argument("--json", default=str(RESULTS / "detection.json"))
    ap.add_argument("--md", default=str(RESULTS / "detection.md"))
    ap.add_argument("--steps", type=int, default=None,
                    help="the main track's step count (default: that of most fault runs)")
    args = ap.parse_args(argv)
    prov = Provenance.start(__file__, argv)
    runs, metas = load(Path(args.jsonl))
    d = analyse(runs, metas, args.steps)
    d["provenance"] = block = prov.finish()
    # clean only when this report and every invocation of the runs are clean, on the same code
    runs_prov = d["runs_provenance"]
    block["clean"] = block["clean"] and all(p and p["clean"] and p["code_tree"] == block["code_tree"] for p in runs_prov)
    Path(args.json).write_text(json.dumps(d, indent=1, default=str) + "\n")
    Path(args.md).write_text(markdown(d))
    print(f"wrote {args.json} and {args.md} ({d['counts']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
