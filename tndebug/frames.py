"""A Report as pandas DataFrames, for a notebook: `Report.findings_frame()`, `metrics_frame()`.

    m = load_report("runs/x/report.json").metrics_frame()
    m.query("family == 'head' and stat == 'entropy' and kind == 'enc_self'")
    #    step  tag                               family  stack    kind      layer  head  stat     ...  value
    #    0     attn/enc_self/layer0/head0/entropy  head    encoder  enc_self  0      0     entropy       0.93

The only module that imports pandas, and only when a frame is asked for: `tndebug --help` and
the CLI's bad-input path never pay for it. Both frames are built from what report.json holds
(evidence through JSON), so a loaded report gives the same frames as the one in memory.
"""
from __future__ import annotations

import json
from dataclasses import fields

from tndebug.findings import Finding, jsonable
from tndebug import tags

FIRST = ("probe", "code", "severity", "where", "step", "layer", "head", "rank")
INTS = ("step", "layer", "head", "rank")          # nullable integers: pandas' Int64
# an attention kind's stack (capture/trace.py's kinds), for the families that name a kind
STACK_OF_KIND = {"enc_self": "encoder", "dec_self": "decoder", "cross": "decoder"}


def finding_columns() -> list[str]:
    """probe, code, severity, where, step, layer, head, rank, then Finding's other fields but
    evidence (message, fix, and any added later), in declaration order."""
    names = [f.name for f in fields(Finding) if f.name != "evidence"]
    return [*FIRST, *(n for n in names if n not in FIRST)]


def findings_frame(report):
    """One row per finding; each evidence key a column `evidence.<key>` (nested dicts joined
    with dots, lists kept as cells), in order of first appearance."""
    import pandas as pd
    head = finding_columns()
    rows = json.loads(json.dumps([f.to_dict() for f in report.findings], default=jsonable))
    flat = [{**{k: r.get(k) for k in head}, **_flatten(r.get("evidence") or {}, "evidence.")}
            for r in rows]
    evidence = list(dict.fromkeys(k for r in flat for k in r if k not in head))
    frame = pd.DataFrame(flat, columns=[*head, *evidence])
    return frame.astype({k: "Int64" for k in INTS})


def metric_columns() -> list[str]:
    """step, tag, family, stack, then every other part of the tag families in their order
    (tags.FAMILIES: kind, layer, head, stat, module, site, name), value."""
    parts = dict.fromkeys(p for fam in tags.FAMILIES for p in fam.parts)
    parts.pop("stack", None)
    return ["step", "tag", "family", "stack", *parts, "value"]


def metrics_frame(report):
    """One row per recorded (tag, step), by step (a tag's points in the order recorded).

    `family` is the tag family's name (tags.py: head, diversity, depth, grad, relu, scale,
    grad-module, pe-rho, label-shift), blank for a single tag (train/loss, eval/exact_match,
    loss/ce, ...); each part of the family is its column (layer and head as integers);
    `stack` is the family's own or its attention kind's (enc_self: encoder; dec_self, cross:
    decoder); `stat` the family's, else the tag's last part (grad/.../norm: norm)."""
    import pandas as pd
    columns = metric_columns()
    numbered = {p for fam in tags.FAMILIES for p, rx in fam.parts.items() if rx == tags.NUMBER}
    data: dict[str, list] = {c: [] for c in columns}
    for tag, series in report.metrics.items():
        got = tags.parse(tag)
        fam, parts = got if got is not None else (None, {})
        fixed = {**parts, "tag": tag, "family": fam.name if fam else None,
                 "stack": parts.get("stack") or STACK_OF_KIND.get(parts.get("kind")),
                 "stat": parts.get("stat") or tag.rsplit("/", 1)[-1]}
        n = len(series)
        for c in columns[1:-1]:
            data[c] += [fixed.get(c)] * n
        data["step"] += [int(s) for s, _ in series]
        data["value"] += [float(v) for _, v in series]
    frame = pd.DataFrame(data, columns=columns)
    frame = frame.astype({"step": "int64", "value": "float64",
                          **{c: "Int64" for c in numbered}})
    return frame.sort_values("step", kind="stable", ignore_index=True)


def _flatten(d: dict, prefix: str) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
