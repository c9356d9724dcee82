"""Design properties judged at initialisation, shared by `tndebug triage` and the library
(`tndebug.check`, `tndebug.watch`), which share only what lies below both (tests/test_layers.py):
a fresh model built by the model's own constructor, seeded, and the re-judgement of a
checkpoint's "no 1/sqrt(d_k)" error on it (`scale_at_init`): folded into the initialisation
(T5), or left out by the installed package's own unmodified code (GPT-Neo), is the design, an
info. triage/fresh.py holds the other re-judgements (NaN weights, rank, growth, label shift).

For a Hugging Face model: whether its modules run the installed package's own code
(`runs_package_code`), and the config fields that set a scale away from their defaults
(`scale_switches`, `with_switches`).
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tndebug.driver import restatus
from tndebug.findings import Finding
from tndebug.probes.missing_scale import by_design_fix

SEED = 0                                              # the fresh initialisation's seed
NO_SCALE = "no 1/sqrt(d_k)"


def seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """build() under torch.manual_seed(SEED), the caller's RNG state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return build()


def judged_on(f: Finding, where: str) -> Finding:
    return replace(f, evidence={**f.evidence, "judged_on": where})


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
    init = _on_fresh(probe_fresh, "missing-scale", statuses)
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
            result.append(_by_design(f, design, folded, how))
        if published:
            result.append(_published(f, published, library, how))
        if rest:
            result.append(f if not (design or published) else _subset(f, rest))
    st["fresh_init"] = {"built": how or "the model's own constructor, seed 0",
                        "folded_at_init": sorted(folded), "unscaled_at_init": sorted(unfolded),
                        **({"package_code": library} if library else {})}
    restatus(statuses, result, "missing-scale")
    return result, statuses


def _head(site: str, ratio: float, d_k: int, n_more: int) -> str:
    tail = f" (+{n_more} more attention modules)" if n_more else ""
    return (f"{site}: scale {ratio / math.sqrt(d_k):.3f}, expected 1/sqrt({d_k})="
            f"{1 / math.sqrt(d_k):.3f} ({NO_SCALE}){tail}")


def _by_design(f: Finding, mods: dict, folded: dict, how: str) -> Finding:
    d_k = int(f.evidence["d_k"])
    site = next(iter(mods))
    r_init = folded[site]
    r_ckpt = f.evidence.get("qk_rms_ratio", {}).get(site, math.nan)
    msg = (_head(site, mods[site], d_k, len(mods) - 1)
           + f"; by design (the initialisation folds the scale into W_Q: measured ratio "
             f"rms(q)/rms(k) {r_init:.3g} at init, 1/sqrt(d_k) = {1 / math.sqrt(d_k):.3g}; "
             f"{r_ckpt:.3g} in the checkpoint, where training moved it)")
    ev = {**f.evidence, "judged_on": "fresh init", "modules": mods,
          "init_qk_rms_ratio": {s: folded[s] for s in mods},
          "checkpoint_qk_rms_ratio": {s: f.evidence.get("qk_rms_ratio", {}).get(s) for s in mods},
          "fresh_init": how or "the model's own constructor, seed 0"}
    ev.pop("qk_rms_ratio", None)
    return replace(f, severity="info", message=msg, where=site, fix=by_design_fix(d_k), evidence=ev)


def _published(f: Finding, mods: dict, library: str, how: str) -> Finding:
    """The package's own code leaves the scale out, at initialisation too: its design."""
    d_k = int(f.evidence["d_k"])
    site = next(iter(mods))
    msg = (_head(site, mods[site], d_k, len(mods) - 1)
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


def _subset(f: Finding, mods: dict) -> Finding:
    d_k = int(f.evidence["d_k"])
    site = next(iter(mods))
    rest = f.message.split(f"({NO_SCALE})", 1)[1].split(" (+", 1)[0] if f"({NO_SCALE})" in f.message else ""
    return replace(f, where=site, message=_head(site, mods[site], d_k, len(mods) - 1) + rest,
                   evidence={**f.evidence, "modules": mods,
                             "qk_rms_ratio": {s: f.evidence.get("qk_rms_ratio", {}).get(s) for s in mods}})


def _on_fresh(probe_fresh, name: str, statuses: dict) -> list | None:
    """Probe `name`'s findings on the fresh initialisation, or None when it cannot be built (the
    user's constructor may raise anything), which statuses[name]["fresh_init"] then says."""
    statuses.setdefault(name, {})
    try:
        return probe_fresh([name]).findings
    except Exception as e:  # noqa: BLE001 - the user's constructor may raise anything
        statuses.setdefault(name, {})["fresh_init"] = (f"not built ({type(e).__name__}: "
                                                       f"{str(e).strip()[:120]}); judged on the checkpoint")
        return None


def runs_package_code(model: nn.Module) -> bool:
    """Whether every function the model's modules run is the installed package's own: each
    module class comes from transformers (or torch), and no function in the namespaces of
    those transformers modules, nor any forward, was defined outside an installed package (a
    user's or a test's monkeypatch, e.g. Falcon's apply_rotary_pos_emb replaced by one that
    undoes the scale). Only then can an unscaled attention be the package's published design."""
    import sys
    import sysconfig

    import transformers as tf
    roots = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"],
                                          sysconfig.get_paths()["platlib"])}
    roots |= {Path(tf.__file__).resolve().parent, Path(torch.__file__).resolve().parent}

    def installed(fn) -> bool:
        code = getattr(fn, "__code__", None)
        if code is None:
            return True                                        # builtin, C or a class
        where = Path(code.co_filename).resolve()
        return any(where.is_relative_to(r) for r in roots)

    names = {type(m).__module__ for m in model.modules()}
    if any(not n.startswith(("transformers.", "torch.")) for n in names):
        return False
    for n in names:
        if n.startswith("transformers.") and not all(
                installed(v) for v in vars(sys.modules.get(n, object())).values()):
            return False
    return all(installed(getattr(type(m).forward, "__func__", type(m).forward))
               for m in model.modules())


def scale_switches(config) -> dict[str, tuple]:
    """{field: (saved, class default)} for the config's fields whose names say they set an
    attention scale (GPT-2's scale_attn_weights, Gemma-2's query_pre_attn_scalar, Granite's
    attention_multiplier) and whose saved value differs from the config class's default. Names
    are a hint: they keep an error and point its fix at the field, never clear one."""
    try:
        saved, default = config.to_dict(), type(config)().to_dict()
    except Exception:  # noqa: BLE001 - a config class that cannot build its defaults: no hint
        return {}
    words = ("scale", "scaling", "multiplier", "scalar")
    return {k: (v, default.get(k)) for k, v in saved.items()
            if any(w in k.lower() for w in words) and isinstance(v, (bool, int, float))
            and k in default and default[k] != v}


def with_switches(f, switches: dict):
    """A missing-scale error whose config sets a scale switch away from its default: the fix
    names the field first."""
    if f.probe != "missing-scale" or f.severity != "error":
        return f
    said = ", ".join(f"{k}={v!r} (the default is {d!r})" for k, (v, d) in switches.items())
    return replace(f, fix=f"config.json sets {said}: that field sets this scale in transformers' "
                          f"code. " + (f.fix or ""),
                   evidence={**f.evidence, "config_scale_fields": {k: v for k, (v, _) in switches.items()}})
