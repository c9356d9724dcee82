"""Triage with the user's own model code (`--model FILE.py:FACTORY`, `--adapter`): the factory
called with the checkpoint's kwargs, the weights loaded, the model wrapped by one Subject
(Subject.of_kind), its vocabularies by the one rule (capture/subjects.py), and the same factory
called again on a fresh seeded initialisation, so the code is judged apart from the weights
(issue 19)."""
from __future__ import annotations

import torch
from torch import nn

from tndebug import driver
from tndebug.capture import GenericCapture, projection_weights
from tndebug.capture.adapters import BUILTIN, floating_logits, resolve_adapter
from tndebug.capture.user_model import build_user_model, load_weights, parse_config
from tndebug.capture.subjects import fed_tables, vocab_rule
from tndebug.data import Batch, as_lm
from tndebug.errors import UsageError
from tndebug.findings import user_path
from tndebug.probes.mask_broadcast import tndebug_masks_note
from tndebug.subject import Subject
from tndebug.judge.fresh import SEED, seeded
from tndebug.hf.encoder_only import MLM_LOSS
from tndebug.triage.loading import Checkpoint
from tndebug.triage.target import Target, check_task_vocab
from tndebug.triage.userdata import OneStack, for_kind, pad_ids, check_vocab as check_data_vocab


def user_target(ckpt: Checkpoint, batch, task, *, spec: str, config: str | None,
                adapter_spec: str | None, arch: str | None, pad_id: int | None, bos_id: int,
                data: str | None) -> Target:
    """The user's model (`spec`: --model FILE.py:FACTORY, kwargs from `config` or the
    checkpoint's) with the checkpoint's weights, called through `adapter_spec` (`arch`: what it is,
    when its code cannot say); `data`: the --data spec (None: the task's rows in `batch`)."""
    given = parse_config(config)
    kwargs = given if given is not None else (ckpt.config or {})
    model, used = build_user_model(spec, kwargs)
    load_weights(model, ckpt.state_dict, spec)
    model.eval()
    adapter = resolve_adapter(adapter_spec, model, arch)
    decoder, encoder = adapter.kind == "decoder", adapter.kind == "encoder"
    pad, data_pad = pad_ids(pad_id)                  # --pad-id none: (0, NO_PAD)
    if pad_id is None and adapter.kind == "seq2seq":
        raise UsageError("--pad-id none (data with no padding) applies to a decoder- or "
                         "encoder-only model; an encoder-decoder's batches are padded: pass its "
                         "pad id")
    one_row = isinstance(batch, OneStack)            # --data {'ids': ...}: one sequence per row
    batch = for_kind(batch, data_pad, adapter.kind)
    if decoder and not one_row:
        batch = lm_batch(batch, data)
    elif encoder and not one_row:
        batch = mlm_batch(batch, data)
    capture = GenericCapture(model, kind=adapter.kind)
    if data:                                 # ids beyond every embedding table: before any forward
        sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
        check_data_vocab(batch, max(sizes, default=None), max(sizes, default=None), data)
    src_v, tgt_v = _user_vocab(model, adapter, batch, pad)
    capture.discover(lambda: _call(adapter, model, batch[0][:2], batch[1][:2], pad))
    check_task_vocab(src_v, tgt_v, task, batch, data)
    subject_kw = dict(pad_id=pad, bos_id=bos_id, src_vocab=src_v, tgt_vocab=tgt_v,
                      padded=pad_id is not None)
    subject = _user_subject(model, adapter, capture, subject_kw)
    run = {"layout": "user code", "model": spec, "adapter": adapter.name,
           "model_kwargs": {k: v for k, v in used.items() if isinstance(v, (int, float, str, bool))},
           "config_source": "--config" if given is not None else (ckpt.config_key or None),
           "attention_modules": sorted(user_path(list(capture.attention))), "arch_from": adapter.kind_from}
    if encoder:
        run["calls"] = ("forward(model, ids, pad_id) -> logits [B, T, V] (encoder-only: "
                        "bidirectional, no target side)")
        run["loss"] = MLM_LOSS
        if not data:
            run["data"] = (f"task {task.name}'s source rows as the ids (right-padded; built-in, "
                           f"not the model's own data)")
    if decoder:
        run["calls"] = ("forward(model, ids, pad_id) -> logits [B, T, V] (decoder-only); KV cache: "
                        + ("incremental(model, ids, pad_id, split)" if adapter.incremental
                           else "none offered (the adapter defines no incremental)"))
        if not data:
            run["data"] = (f"task {task.name} as one sequence per row: BOS source EOS target EOS "
                           f"(data.as_lm; built-in, not the model's own data)")
    findings = []
    if getattr(adapter, "note", None) and not decoder:   # tndebug built what the user's code would
        run["adapter_note"] = adapter.note
        findings.append(tndebug_masks_note(adapter.note, adapter.name, "--adapter FILE.py:forward"))
    elif adapter.note:                       # how the model was called; its own masks ran
        run["adapter_note"] = adapter.note
    run["fresh_init"] = f"{spec} called again with the same kwargs, seed {SEED}, no weights loaded"
    return Target(subject, capture.scaling, run, lambda p: p, findings, projection_weights(model),
                   _fresh_prober(spec, kwargs, adapter_spec, arch, batch, subject_kw),
                   batch if decoder or encoder else None)


def lm_batch(batch, data: str | None) -> Batch:
    """The held-out batch for a decoder-only model: the task's pairs as one sequence per row
    (`as_lm`); --data {'src', 'tgt'} with a source is refused (its one-row forms are read by
    userdata.for_kind)."""
    if not data:
        return Batch(*(t.contiguous() for t in as_lm(Batch(*batch))))
    if batch[0].shape[1]:
        raise UsageError(f"--data {data}: the model is decoder-only, so it reads one sequence per "
                         f"row: {{'ids': LongTensor[N, T]}} (or {{'src': LongTensor[N, 0], 'tgt': "
                         f"ids}}); got a source {tuple(batch[0].shape)}")
    return batch


def mlm_batch(batch, data: str | None) -> Batch:
    """The held-out batch for an encoder-only model: its ids are the source rows, fed as they are
    and scored against themselves (src = tgt_in = tgt_out, as triage/hf_dir.py's random batch; the
    loss of hf.encoder_only.MLM_LOSS). --data: its src is the ids (tgt is not used)."""
    src = batch[0]
    if not src.shape[1]:
        raise UsageError(f"--data {data}: the model is encoder-only: pass {{'ids': LongTensor[N, "
                         f"T]}} (right-padded); got src {tuple(src.shape)}")
    src = src.contiguous()
    return Batch(src, src.clone(), src.clone())


def _own_adapter_hint(adapter) -> str:
    """For a built-in adapter (chosen by tndebug, or named): the line to write instead, so the
    model is called the way its own code calls it."""
    if adapter.name not in BUILTIN:
        return ""
    how = f" ({adapter.kind_from})" if getattr(adapter, "kind_from", "") else ""
    if adapter.kind in ("decoder", "encoder"):
        example = "def forward(model, ids, pad_id): return model(ids)"
    else:
        example = "def forward(model, src, tgt, pad_id): return model(src, tgt)"
    return (f"; tndebug chose the built-in {adapter.name} adapter{how}: call the model as your "
            f"code does, in a file, and pass --adapter FILE.py:forward, e.g. `{example}` "
            f"(docs/triage.md)")


def _call(adapter, model, src, tgt, pad_id):
    """The adapter's call: a decoder-only model is fed `tgt` alone (Subject kind "decoder"), an
    encoder-only one `src` alone (kind "encoder")."""
    if adapter.kind == "decoder":
        return adapter.forward(model, tgt, pad_id)
    if adapter.kind == "encoder":
        return adapter.forward(model, src, pad_id)
    return adapter.forward(model, src, tgt, pad_id)


def _user_subject(model, adapter, capture, subject_kw: dict) -> Subject:
    second = adapter.incremental if adapter.kind == "decoder" else adapter.encode
    return Subject.of_kind(model, adapter.forward, second, kind=adapter.kind, capture=capture,
                        **subject_kw)


def _fresh_prober(spec: str, kwargs, adapter_spec: str | None, arch: str | None, batch,
                  subject_kw: dict):
    """names -> ProbeResult of the probes on the user's factory called again (seeded, no
    weights loaded): the code judged apart from the checkpoint's weights (issue 19)."""
    def probe_fresh(names):
        model = seeded(lambda: build_user_model(spec, kwargs)[0]).eval()
        adapter = resolve_adapter(adapter_spec, model, arch)
        capture = GenericCapture(model, kind=adapter.kind)
        capture.discover(lambda: _call(adapter, model, batch[0][:2], batch[1][:2],
                                       subject_kw["pad_id"]))
        subject = _user_subject(model, adapter, capture, subject_kw)
        return driver.probe_once(subject, names, batch)       # fresh weights: float32
    return probe_fresh


def _runs(adapter, model, src, tgt, pad_id) -> bool:
    try:
        with torch.no_grad():
            _call(adapter, model, src, tgt, pad_id)
        return True
    except Exception:  # noqa: BLE001 - whether it runs is the question
        return False


def _user_vocab(model: nn.Module, adapter, batch, pad_id: int) -> tuple[int, int]:
    """The vocabularies by capture/subjects.py's rule, from one call of the adapter on two
    held-out rows; a call that raises or returns no logits [B, T, V] is a UsageError."""
    src, tgt_in, _ = batch
    try:
        with fed_tables(model, src[:2], tgt_in[:2]) as fed, torch.no_grad():
            logits = _call(adapter, model, src[:2], tgt_in[:2], pad_id)
    except UsageError:
        raise                   # the adapter's output already judged (its shape): that line is the one
    except Exception as e:  # noqa: BLE001 - the user's adapter may raise anything
        width = max(src.shape[1], tgt_in.shape[1])
        called = ("forward(model, ids [B,T], pad_id)" if adapter.kind in ("decoder", "encoder")
                  else "forward(model, src [B,S], tgt [B,T], pad_id)")
        if width > 4 and _runs(adapter, model, src[:2, :4], tgt_in[:2, :4], pad_id):
            raise UsageError(f"the held-out rows are {width} positions long and the model raises "
                             f"{type(e).__name__} on them but runs on 4: they are longer than "
                             f"the model takes (its position table): pass shorter --data, or "
                             f"--max-len N") from None
        raise UsageError(f"the adapter {adapter.name} raised {type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else ''} "
                         f"(it is called as {called}){_own_adapter_hint(adapter)}") from None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != tgt_in[:2].shape:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise UsageError(f"the adapter {adapter.name} returned {shape}; expected logits "
                         f"[B, T, V] = [2, {tgt_in.shape[1]}, V] (batch first)")
    floating_logits(logits, f"the adapter {adapter.name}")
    width, side = logits.shape[-1], "src" if adapter.kind == "encoder" else "tgt"
    sizes = {m.out_features for m in model.modules() if isinstance(m, nn.Linear)} | \
            {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    if width < fed.get(side, width) and width not in sizes:     # the check's rule (library/args.py)
        raise UsageError(f"the adapter {adapter.name} returns logits over {width} ids, but the "
                         f"model's token embedding has {fed[side]} rows (and no layer of the "
                         f"model has {width} outputs); a forward must return the model's full "
                         f"logits [B, T, {fed[side]}]")
    return vocab_rule(model, width, fed, adapter.kind)


# -- findings -------------------------------------------------------------------------------------------
