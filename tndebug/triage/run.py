"""`triage()`: a checkpoint (and optionally the user's model code) in, a `Report` out.

    report = triage(TriageOptions("model.pt", task="copy"))

1. load the file safely; hygiene of the file (non-finite weights, resume state, config);
2. without --model: recognise the layout, convert it into tndebug's instrumented model, settle
   what the weights cannot say (heads, Pre/Post-LN, embedding scale) from flags, the
   checkpoint's config, or held-out loss; with --model: build the user's module, load the
   weights and wrap it with an adapter and the generic capture;
3. run the probes that make sense for weights (RunContext(mode="triage"), compute dtype = the
   weights' dtype) on one held-out batch, forward and backward, no optimizer step;
4. hygiene of the weights and behaviour (duplicate heads, temperature sweep);

Held-out data: the user's own with --data (`tndebug.triage.userdata`), else --task's eval set.
5. findings in the checkpoint's own module naming, one Report.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from tndebug.config import ModelConfig
from tndebug.data import get_task, eval_set
from tndebug.errors import UsageError
from tndebug.paths import text_file
from tndebug.report import Report
from tndebug import driver, judge
from tndebug.findings import Finding
from tndebug.triage.rebuilt import rebuilt_code
from tndebug.probes import TRIAGE_PROBES  # noqa: F401 - tndebug.triage exports it
from tndebug.probes.head_collapse_weights import duplicate_heads
from tndebug.subject import tndebug_subject
from tndebug.triage import hygiene, layouts, own_decoder
from tndebug.triage import hf_dir as hf       # a save_pretrained directory: no user code (issue 11)
from tndebug.capture.user_model import parse_config
from tndebug.probes.kv_order import kv_order, undecided as kv_undecided
from tndebug.triage.loading import Checkpoint, load_checkpoint
from tndebug.triage.target import Target, check_ids, check_task_vocab
from tndebug.triage.user_code import user_target
from tndebug.triage.userdata import for_kind, load_data, pad_ids
from tndebug.triage.options import (OWN_CODE_PROBES, TriageOptions, probes_of,  # noqa: F401
                                     refuse_longer, weights_dtype)

HELD_OUT = 16           # held-out sequences for the loss comparisons (heads, norm, sweep)


def triage(opts: TriageOptions, sinks=()) -> Report:
    """`sinks`: the reporters' (ReportSession.sinks), shown the probed step for figures and tb/."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        timings[name] = round(time.perf_counter() - t0 - sum(timings.values()), 3)

    if hf.is_hf_dir(opts.checkpoint):
        if opts.text:
            text_file(opts.text)             # a binary --text: one line before the model is built
        return hf.triage_hf(opts, sinks=sinks)
    _refuse_flags(opts)
    probe_names = probes_of(opts.probes, OWN_CODE_PROBES)
    task = _task(opts.task)
    ckpt = load_checkpoint(opts.checkpoint, trust=opts.trust)
    findings = (hygiene.non_finite(ckpt.state_dict) + hygiene.implausible(ckpt.state_dict, ckpt.optimizer)
                + hygiene.resume_state(ckpt))
    # every comparison (layout settling, the probes' batch, the sweep) runs on these sequences
    _, data_pad = pad_ids(opts.pad_id)       # NO_PAD with --pad-id none
    batch = (load_data(opts.data, data_pad, opts.bos_id) if opts.data
             else eval_set(task, n=HELD_OUT, seed=0))
    lap("load")
    own = not opts.model and own_decoder.is_own_decoder(ckpt.config, ckpt.state_dict)
    if not opts.model:                       # tndebug's own code, rebuilt without faults
        findings += rebuilt_code(ckpt.config)
    if opts.adapter and not opts.model and not own:      # a layout tndebug calls itself
        raise UsageError(f"--adapter {opts.adapter} applies with --model (your own code); "
                         f"{opts.checkpoint} is read as one of tndebug's layouts, which tndebug "
                         f"calls itself, so it would be ignored: drop --adapter, or pass --model "
                         f"FILE.py:FACTORY to build the model from your code")
    if own:                                  # `tndebug run --arch decoder`: no encoder layout fits
        opts = dataclasses.replace(opts, model=own_decoder.SPEC, arch="decoder",
                                   adapter=opts.adapter or own_decoder.ADAPTER)
    if not opts.model:                       # tndebug's encoder-decoder layouts: src and tgt
        if opts.pad_id is None:
            raise UsageError("--pad-id none (data with no padding) applies to a decoder- or "
                             "encoder-only model's own code (--model); an encoder-decoder's "
                             "batches are padded: pass its pad id")
        batch = for_kind(batch, data_pad, "seq2seq")
    target = (user_target(ckpt, batch, task, spec=opts.model, config=opts.config,
                          adapter_spec=opts.adapter, arch=opts.arch, pad_id=opts.pad_id,
                          bos_id=opts.bos_id, data=opts.data) if opts.model
              else _layout_target(ckpt, opts, batch, task, probe_names))
    if own:
        target.run.update(own_decoder.RUN)
    findings += target.findings
    subject = target.subject
    check_ids(subject, opts.pad_id, opts.bos_id)     # before any probe feeds them
    batch = target.batch if target.batch is not None else batch
    if opts.max_len:
        subject.max_len = opts.max_len
    refuse_longer(subject, batch[:2], f"--data {opts.data}" if opts.data else f"--task {task.name}")
    lap("model")

    probed = driver.probe_once(subject, probe_names, batch,
                               compute_dtype=weights_dtype(ckpt.state_dict), sinks=sinks)
    probe_seconds = probed.seconds
    lap("probes")
    checks = duplicate_heads(target.attention_weights)
    sweep_evidence = hygiene.temperature_sweep(
        lambda s, t: subject.logits(s, t), target.scaled, batch, data_pad, subject.tgt_vocab,
        own_code=bool(opts.model), data="--data" if opts.data else "--task")
    kv, kv_evidence = kv_order(lambda s, t: subject.logits(s, t), subject.capture, batch,
                               data_pad, subject.tgt_vocab,
                               data="--data" if opts.data else "--task")
    lap("hygiene")
    run = {**_run_record(ckpt, task, batch, subject, probe_names, data=opts.data, pad_id=opts.pad_id,
                         bos_id=opts.bos_id), "temperature_sweep":
           sweep_evidence, "kv_head_order": kv_evidence, **target.run, "timings_s": timings,
           "probe_seconds": probe_seconds, "wall_s": round(time.perf_counter() - t0, 3),
           "status": "completed"}
    undecided = kv_undecided(kv_evidence)     # applied to trained weights, decided nothing: no pass
    return judge.conclude(run, probed.findings, probed.statuses, judge.Context(
        one_pass=True, probe_fresh=target.fresh, fresh_how=target.run.get("fresh_init", ""),
        probe_names=probe_names, weights_finite=hygiene.weights_finite(ckpt.state_dict),
        first=findings, checks=checks + kv, rename=target.user_path,
        sweep=sweep_evidence,
        not_run=[("checkpoint", "grouped-query head order", undecided)] if undecided else [],
        started=t0))


def _refuse_flags(opts: TriageOptions) -> None:
    """Flags that apply to a Hugging Face directory or to --model only."""
    if opts.attn or opts.text:
        raise UsageError("--attn and --text apply to a Hugging Face directory (config.json + weights)")
    if opts.arch and not opts.model:
        raise UsageError(f"--arch {opts.arch} applies with --model (your own code); tndebug's "
                         f"layouts and a Hugging Face directory say their shape")


def _run_record(ckpt: Checkpoint, task, batch, subject, probe_names, *, data: str | None,
                pad_id: int | None, bos_id: int) -> dict:
    """report.json's `run` of a checkpoint's triage, before the hygiene's evidence, the target's
    own fields and the timings: the file, the data, the shape and ids, the probes run."""
    return {"mode": "triage", "checkpoint": str(ckpt.path), "format": ckpt.fmt,
            "container": ckpt.container, "stripped_prefix": ckpt.stripped_prefix or None,
            "task": None if data else task.name,
            "data": (f"--data {data}" if data
                     else f"task {task.name} (built-in; not the model's own data)"),
            "arch": subject.kind,
            "held_out_sequences": int(batch[0].shape[0]),
            "compute_dtype": str(weights_dtype(ckpt.state_dict)).removeprefix("torch."),
            "pad_id": pad_id, "bos_id": bos_id,
            "step": ckpt.step, "has_optimizer_state": ckpt.has_optimizer_state,
            "weight_dtypes": sorted({str(v.dtype).removeprefix("torch.") for v in ckpt.state_dict.values()
                                     if v.is_floating_point()}),
            "trusted_pickle": ckpt.trusted, "probes_run": probe_names,
            "probe_inputs": subject.inputs()}


# -- inputs ---------------------------------------------------------------------------------------

def _task(name: str):
    try:
        return get_task(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


# -- without --model: tndebug's model --------------------------------------------------------------
def _layout_target(ckpt: Checkpoint, opts: TriageOptions, batch, task, probe_names) -> Target:
    sd = ckpt.state_dict
    layout = layouts.detect_layout(sd)
    if layout is None:
        raise UsageError(f"unknown layout ({layouts.describe_keys(sd)}); tndebug knows its own, "
                         f"The Annotated Transformer's and torch.nn.Transformer's: pass "
                         f"--model FILE.py:FACTORY to triage your code")
    conv = layouts.convert(sd, layout)
    check_task_vocab(conv.sizes["src_vocab"], conv.sizes["tgt_vocab"], task, batch, opts.data)
    saved = layouts.normalise_config(ckpt.config)
    given = layouts.normalise_config(parse_config(opts.config))
    findings = hygiene.config_vs_weights(saved, conv.sizes, ckpt.config_key)
    findings += hygiene.stored_pe(conv.pe, conv.pe_key, conv.sizes["d_model"])

    fixed = dict(conv.sizes)
    for src in (saved, given):               # flags and --config beat the checkpoint's config
        for k in ("n_heads", "norm", "max_len"):
            if k in src:
                fixed[k] = src[k]
    if opts.heads:
        fixed["n_heads"] = opts.heads
    if opts.norm:
        fixed["norm"] = opts.norm
    if fixed.get("n_heads") and conv.sizes["d_model"] % fixed["n_heads"]:
        raise UsageError(f"--heads {fixed['n_heads']} does not divide d_model={conv.sizes['d_model']}")
    if "emb_scale" in given:
        fixed["emb_scale"] = given["emb_scale"]
    fixed["pad_id"] = opts.pad_id
    unknown = {k: v for k, v in conv.unknown.items() if k not in fixed}
    source = "--data" if opts.data else "--task"
    model, chosen, tried = _settle(conv, fixed, unknown, batch, opts.pad_id, source)
    cfg = model.cfg
    if tried:
        findings.append(Finding("checkpoint", "info",
                                "inferred " + ", ".join(f"{k}={v}" for k, v in chosen.items())
                                + f" from held-out loss on {source} (tried {tried['n']} variants)",
                                evidence=tried, step=0, code="checkpoint/inferred-config"))
    subject = tndebug_subject(model)
    subject.pad_id, subject.bos_id = opts.pad_id, opts.bos_id
    weights = [(f"{stack}.layers.{i}.{name}", a.w_q.weight.detach(), a.w_k.weight.detach(),
                a.w_v.weight.detach(), cfg.n_heads)
               for stack in ("encoder", "decoder") for i, layer in enumerate(getattr(model, stack).layers)
               for name in ("self_attn", "cross_attn") if (a := getattr(layer, name, None)) is not None]
    if "positional-encoding" not in probe_names:   # else the probe judges it from behaviour
        for side in ("src_embed", "tgt_embed"):
            emb = getattr(model, side)
            findings += hygiene.embedding_scale(emb.lut.weight.detach(), emb.scale, side)
    run = {"layout": layout, "model": "tndebug (converted)", "adapter": "tndebug",
           "inferred_config": {k: v for k, v in cfg.to_dict().items() if k != "faults"},
           "emb_scale": "no_emb_scale" not in cfg.faults,
           "final_norm": conv.final_norm, "layout_notes": conv.notes}
    return Target(subject, lambda a: hygiene.hook_scores_scaled(model, a), run,
                   conv.user_path, findings, weights)


SOFT_DEFAULTS = {"emb_scale": True}    # what to assume when the loss cannot decide (the paper's)


def _settle(conv, fixed: dict, unknown: dict, batch, pad_id: int, source: str = "--task"):
    """Build the model; try every combination of what is unknown, keep the lowest loss.

    Returns (model, chosen values, evidence of what was tried). Raises UsageError when the loss
    cannot decide something that has no safe default (heads, norm).
    """
    names = list(unknown)
    combos = [{}]
    for n in names:
        combos = [{**c, n: v} for c in combos for v in unknown[n]]
    if len(combos) == 1:
        return layouts.build_model(conv, _config(conv, fixed)), {}, {}
    results = []
    for combo in combos:
        cfg = _config(conv, {**fixed, **combo})
        model = layouts.build_model(conv, cfg)
        with torch.no_grad():
            loss = min(_loss(model, batch, pad_id, alpha) for alpha in _alphas(cfg))
        results.append((loss if math.isfinite(loss) else float("inf"), combo))
    results.sort(key=lambda r: r[0])
    (best_loss, best), second = results[0], results[1][0]
    ln_v = math.log(conv.sizes["tgt_vocab"])
    tried = {"n": len(results), "losses": [{**c, "loss": round(l, 4)} for l, c in results[:12]],
             "ln_V": ln_v}
    if best_loss > hygiene.SOLVED * ln_v or second < best_loss * 1.02:
        hard = [n for n in names if n not in SOFT_DEFAULTS]
        if hard:
            flags = {"n_heads": "--heads N", "norm": "--norm pre|post"}
            raise UsageError(
                f"cannot tell {', '.join(hard)} from the weights, and held-out loss on {source} "
                f"does not decide (best {best_loss:.2f}, next {second:.2f}, ln V {ln_v:.2f}): "
                f"pass {', '.join(flags[n] for n in hard)}")
        best = {n: SOFT_DEFAULTS[n] for n in names}
        tried["assumed"] = best
    return layouts.build_model(conv, _config(conv, {**fixed, **best})), best, tried


def _alphas(cfg: ModelConfig) -> tuple[float, ...]:
    """Loss is compared with and without the scores rescaled by sqrt(d_k), so that a checkpoint
    trained without the scale still tells its head count apart."""
    return (1.0, math.sqrt(cfg.d_k))


def _loss(model, batch, pad_id: int, alpha: float) -> float:
    src, tgt_in, tgt_out = batch
    with hygiene.hook_scores_scaled(model, alpha) if alpha != 1.0 else _nullctx():
        return hygiene.held_out_loss(lambda s, t: model(s, t), src, tgt_in, tgt_out, pad_id)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _config(conv, values: dict) -> ModelConfig:
    kw = {k: v for k, v in values.items() if k in {f for f in ModelConfig.__dataclass_fields__}}
    faults = []
    if values.get("emb_scale") is False:
        faults.append("no_emb_scale")
    if values.get("norm", "pre") == "pre" and not conv.final_norm:
        faults.append("pre_ln_no_final_norm")
    return ModelConfig(dropout=0.0, faults=tuple(faults), **kw)


# -- with --model: the user's code -----------------------------------------------------------------
def output_name(checkpoint: str) -> str:
    return f"triage-{Path(checkpoint).stem}"
