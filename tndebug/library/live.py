"""A `Subject` for a live model object: the user's module, as `tndebug triage --model` wraps it,
without a checkpoint file.

    subject, info = live_subject(model, forward, pad_id=0)

`forward(model, src [B, S], tgt [B, T], pad_id) -> logits [B, T, V]` says how to call the model
(batch first, BOS-led targets). Without it: a Hugging Face encoder-decoder is called as
transformers users call it (ids from its config), tndebug's and The Annotated Transformer's
layouts by the built-in adapters; anything else is a UsageError asking for `forward`.

One call on a small synthetic batch checks the forward at once (it raises, or returns the wrong
shape: one UsageError naming what came back), gives the vocabulary, finds the attention sites
by behaviour (`GenericCapture.discover`) and the module whose output is the logits.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tndebug.errors import UsageError
from tndebug.findings import Finding, user_path
from tndebug.library.args import forward_vocab, ids_in_vocabulary
from tndebug.capture.adapters import ARCHS, Adapter, adapter_kind, as_logits, first_tensor, floating_logits, \
    guess_adapter, resolve_adapter
from tndebug.capture import GenericCapture
from tndebug.capture.subjects import fed_tables, token_tables, vocab_rule
from tndebug.subject import MIN_PROBE_LEN, Subject


def is_hf_seq2seq(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "is_encoder_decoder", False)) and hasattr(model, "get_encoder")


def unwrap(model: nn.Module) -> nn.Module:
    """DistributedDataParallel / DataParallel, torch.compile's OptimizedModule -> the module it
    runs (the probes read the eager model: compiled, every capture would recompile it)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module) \
                and type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        else:
            return model


def _embedding_vocab(model: nn.Module) -> int | None:
    """The ids every token table can look up (before the first call: its ids must fit)."""
    sizes = [v for _, v in token_tables(model)]
    return min(sizes) if sizes else None


def _vocab_sizes(model: nn.Module, heads: bool = True) -> set[int]:
    """The sizes a model's logits can have: its token embeddings' rows (and, with `heads`, its
    Linear layers' outputs)."""
    sizes = {v for _, v in token_tables(model)}
    if heads:
        sizes |= {m.out_features for m in model.modules() if isinstance(m, nn.Linear)}
    return sizes


def _token_id(value, name: str) -> int:
    """`pad_id=` / `bos_id=`: an integer >= 0 (numpy's integers too)."""
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UsageError(f"{name}={value!r}: expected an integer token id")
    if value < 0:
        raise UsageError(f"{name}={value} is not a token id (ids are >= 0); pass the id your data "
                         f"uses (e.g. tokenizer.{name[:3]}_token_id)")
    return int(value)


def live_subject(model: nn.Module, forward: Callable | None = None, *, pad_id: int | None = 0,
                 bos_id: int | None = None, src_vocab: int | None = None,
                 tgt_vocab: int | None = None, need_attention: bool = True,
                 arch: str | None = None):
    """(Subject with a GenericCapture, info dict) for `model` as it is now.

    info: {"adapter", "attention_modules", "logits_module", "pad_id", "bos_id", "hf"}.
    Raises UsageError for a model it cannot call, a forward of the wrong shape, or (with
    `need_attention`) a model in which no attention can be found.
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if arch is not None and arch not in ARCHS:
        raise UsageError(f"arch={arch!r}; expected one of {', '.join(ARCHS)} (or None: told from "
                         f"the model)")
    model = unwrap(model)
    for name, v in (("src_vocab", src_vocab), ("tgt_vocab", tgt_vocab)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 2):
            raise UsageError(f"{name}={v!r}: expected the vocabulary size, an int >= 2 (or None: "
                             f"read from the model's embeddings)")
    from tndebug.capture.user_model import refuse_meta
    refuse_meta(model)                   # before any call: torch's kernel text says nothing
    padded = pad_id is not None          # None: the data hold no padding (character-level text)
    info: dict = {"hf": False}
    first_content = None
    kind, incremental, lm_forward = "seq2seq", None, None
    one_stack = None if forward is not None else (
        "decoder" if is_hf_causal(model) else "encoder" if is_hf_masked_lm(model) else None)
    if one_stack is not None:                     # a Hugging Face decoder-only model or masked LM
        from tndebug.hf.decoder_only import choose_lm_ids, make_lm_adapter
        from tndebug.hf.encoder_only import make_mlm_adapter
        ids = choose_lm_ids(model.config, model.get_input_embeddings().num_embeddings)
        if one_stack == "decoder":
            lm_forward, incremental = make_lm_adapter()
            call = _ignoring_src(lm_forward)
        else:
            lm_forward = make_mlm_adapter()
            call = _ignoring_tgt(lm_forward)
        kind, adapter = one_stack, Adapter("huggingface", call)
        pad_id, bos_id = ids["pad"], ids["start"]
        lo, hi = ids["content"]
        first_content = lo
        src_vocab, tgt_vocab = src_vocab or hi, tgt_vocab or hi
        info.update(hf=True, hf_ids=ids)
    elif forward is None and _is_tndebug_decoder(model):
        lm_forward = lambda m, ids, pad: m(ids)                               # noqa: E731
        incremental = lambda m, ids, pad, split: m.incremental(ids, split)  # noqa: E731
        kind, adapter = "decoder", Adapter("tndebug", _ignoring_src(lm_forward))
    elif forward is None and is_hf_seq2seq(model):
        from tndebug.hf.encoder_decoder import choose_ids, make_adapter
        in_v = model.get_input_embeddings().num_embeddings
        out_emb = model.get_output_embeddings()
        out_v = getattr(out_emb, "out_features", None) or getattr(out_emb, "num_embeddings", None) or in_v
        ids = choose_ids(model.config, min(in_v, out_v))
        fwd, enc = make_adapter(ids["start"], ids["marker"])
        adapter = Adapter("huggingface", fwd, enc)
        pad_id, bos_id = ids["pad"], ids["marker"]
        lo, hi = ids["content"]
        first_content = lo
        src_vocab, tgt_vocab = src_vocab or hi, tgt_vocab or hi
        info.update(hf=True, hf_ids=ids)
    elif forward is None:
        if guess_adapter(model) is None and arch not in ("decoder", "encoder"):
            raise UsageError(
                f"do not know how to call {type(model).__name__}: pass forward=fn with "
                f"def fn(model, src, tgt, pad_id) -> logits [B, T, V] (src [B, S] and tgt [B, T] "
                f"batch first, tgt BOS-led), or def fn(model, ids, pad_id) -> logits [B, T, V] "
                f"for one stack (arch='encoder' if bidirectional)")
        if arch == "seq2seq" and guess_adapter(model) in ("gpt", "bert"):
            raise UsageError(f"arch='seq2seq', but {type(model).__name__} takes one input: pass "
                             f"forward=fn with def fn(model, src, tgt, pad_id) -> logits")
        adapter = resolve_adapter(None, model, arch)
        info["arch_from"] = (adapter.kind_from.replace("--arch encoder", "arch='encoder'")
                             .replace("--arch decoder", "arch='decoder'"))
        if adapter.kind in ("decoder", "encoder"):   # gpt / bert: forward(model, ids, pad_id)
            kind, lm_forward = adapter.kind, adapter.forward
            wrap = _ignoring_src if kind == "decoder" else _ignoring_tgt
            adapter = Adapter(adapter.name, wrap(lm_forward), note=adapter.note)
    else:
        if not callable(forward):
            raise UsageError(f"forward: expected a callable forward(model, src, tgt, pad_id) -> "
                             f"logits, got {type(forward).__name__}")
        name = getattr(forward, "__name__", "forward")
        one = adapter_kind(forward, name, "forward") == "decoder"   # forward(model, ids, pad_id)
        if one and arch == "seq2seq" or not one and arch in ("decoder", "encoder"):
            raise UsageError(f"arch={arch!r} does not fit forward={name}, which takes "
                             f"{'(model, ids, pad_id)' if one else '(model, src, tgt, pad_id)'}")
        if one:
            lm_forward = _checked_lm(forward, name)
            kind = "encoder" if arch == "encoder" else "decoder"
            # the model's KV cache, where the user offers it: forward.incremental(model, ids,
            # pad_id, split) -> logits of positions split.. decoded through the cache
            inc = getattr(forward, "incremental", None)
            incremental = inc if callable(inc) and kind == "decoder" else None
            wrap = _ignoring_tgt if kind == "encoder" else _ignoring_src
            adapter = Adapter(f"forward={name}", wrap(lm_forward))
            info["arch_from"] = (f"arch={arch!r}" if arch else "forward(model, ids, pad_id): one "
                                 "stack, read as decoder-only (arch='encoder' if bidirectional)")
        else:
            adapter = Adapter(f"forward={name}", _checked(forward, name))
    pad_id = 0 if pad_id is None else _token_id(pad_id, "pad_id")
    bos_id = (1 if pad_id != 1 else 2) if bos_id is None else _token_id(bos_id, "bos_id")
    lo = first_content if first_content is not None else max(pad_id, bos_id) + 1
    vocab = _embedding_vocab(model)
    n_ids = min(v for v in (src_vocab, tgt_vocab, vocab) if v) if (src_vocab or tgt_vocab or vocab) else None
    user_ids = first_content is None      # HF: the ids come from the model's config
    if n_ids is not None and user_ids:    # before the call, which would index out of range
        largest = max([n_ids, *(v for v in (src_vocab, tgt_vocab) if v), *_vocab_sizes(model, heads=False)])
        ids_in_vocabulary(pad_id, bos_id, n_ids, largest)
    if n_ids is None or n_ids <= lo + 1:
        raise UsageError(f"cannot tell the vocabulary of {type(model).__name__} (no nn.Embedding "
                         f"with more than {lo + 1} rows): pass src_vocab= and tgt_vocab=")
    g = torch.Generator().manual_seed(0)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    src = torch.randint(lo, n_ids, (2, 7), generator=g).to(device)
    tgt = torch.randint(lo, n_ids, (2, 6), generator=g).to(device)
    tgt[:, 0] = bos_id
    if kind == "decoder":
        src = src[:, :0]                          # one sequence: tgt
    elif kind == "encoder":
        tgt = src.clone()                         # one sequence: src (tgt is ignored)
    capture = GenericCapture(model, kind=kind)
    try:
        logits_module = _call_once(model, adapter, src, tgt, pad_id)
    except UsageError:
        # A model may raise on rows without padding (an inverted key padding mask masks every
        # key of such a row): then call it with a pad ending every row, and let the probes'
        # own calls show what it raises on. Raising on both batches is a usage error.
        src, tgt = src.clone(), tgt.clone()
        src[:, -1], tgt[:, -1] = pad_id, pad_id
        try:
            logits_module = _call_once(model, adapter, src, tgt, pad_id)
        except UsageError:
            pass
        else:
            info["first_call"] = "rows ending in a pad (the model raised on rows without padding)"
        if "first_call" not in info:
            raise
    logits = logits_module.pop("logits")
    floating_logits(logits, adapter.name)
    if forward is not None:
        forward_vocab(logits.shape[-1], given=tgt_vocab, from_module=logits_module["path"] is not None,
                      sizes=_vocab_sizes(model), tokens=_vocab_sizes(model, heads=False),
                      name=adapter.name)
    src_v, tgt_v = vocab_rule(model, logits.shape[-1], logits_module.pop("fed"), kind,
                              src_vocab, tgt_vocab)
    if user_ids:
        ids_in_vocabulary(pad_id, bos_id, min(src_v, tgt_v), tgt_v)
    capture.discover(lambda: adapter.forward(model, src, tgt, pad_id))
    if need_attention and not capture.attention:
        raise UsageError(
            f"found no attention in {type(model).__name__}: no module named *Attention*/*Attn*, and "
            f"one forward made no softmax over a product of two activations and no "
            f"scaled_dot_product_attention call. tndebug covers Transformers: encoder-decoder, "
            f"decoder-only and encoder-only (attention between tokens); to watch only the "
            f"training pass probes='loss-health,lr-schedule,gradient-flow'")
    if kind in ("decoder", "encoder"):           # the Subject's call: one sequence
        adapter = Adapter(adapter.name, lm_forward, None, adapter.note)
    subject = Subject.of_kind(
        model, adapter.forward, incremental if kind == "decoder" else adapter.encode, kind=kind,
        capture=capture, pad_id=pad_id, bos_id=bos_id, src_vocab=src_v, tgt_vocab=tgt_v,
        first_content=first_content, padded=padded,
        max_len=getattr(getattr(model, "config", None), "max_position_embeddings", None)
        or getattr(getattr(model, "cfg", None), "max_len", None))
    info.update(adapter=adapter.name, attention_modules=sorted(user_path(list(capture.attention))),
                logits_module=logits_module.get("path"), pad_id=pad_id if padded else None,
                bos_id=bos_id,
                src_vocab=src_v, tgt_vocab=tgt_v)
    if adapter.note:
        info["adapter_note"] = adapter.note
    return subject, info


def is_hf_causal(model: nn.Module) -> bool:
    """A Hugging Face model that generates with one stack (GPT2, Llama, ...): it can generate
    and is no encoder-decoder."""
    cfg = getattr(model, "config", None)
    can = getattr(model, "can_generate", None)
    return (cfg is not None and not getattr(cfg, "is_encoder_decoder", False) and callable(can)
            and bool(can()) and hasattr(model, "get_input_embeddings"))


def is_hf_masked_lm(model: nn.Module) -> bool:
    """A Hugging Face model with one bidirectional stack and a per-token head (Bert, Roberta,
    DistilBert, Electra as masked LMs): no encoder-decoder, cannot generate, has an output
    embedding."""
    cfg = getattr(model, "config", None)
    can = getattr(model, "can_generate", None)
    return (cfg is not None and not getattr(cfg, "is_encoder_decoder", False) and callable(can)
            and not bool(can()) and hasattr(model, "get_input_embeddings")
            and callable(getattr(model, "get_output_embeddings", None))
            and model.get_output_embeddings() is not None)


def _ignoring_tgt(mlm_forward: Callable) -> Callable:
    """An encoder-only call in the 4-argument shape: the sequence is `src`."""
    def forward(model, src, tgt, pad_id):
        return mlm_forward(model, src, pad_id)
    forward.__wrapped__ = mlm_forward
    return forward


def _is_tndebug_decoder(model: nn.Module) -> bool:
    from tndebug.model import DecoderOnly
    return isinstance(model, DecoderOnly)


def _ignoring_src(lm_forward: Callable) -> Callable:
    """A decoder-only call in the 4-argument shape tndebug's own first calls use."""
    def forward(model, src, tgt, pad_id):
        return lm_forward(model, tgt, pad_id)
    forward.__wrapped__ = lm_forward
    return forward


def _checked_lm(fn: Callable, name: str) -> Callable:
    def forward(model, ids, pad_id):
        return as_logits(fn(model, ids, pad_id), ids, f"forward={name}")
    forward.__wrapped__ = fn
    return forward


def _checked(fn: Callable, name: str) -> Callable:
    def forward(model, src, tgt, pad_id):
        return as_logits(fn(model, src, tgt, pad_id), tgt, f"forward={name}")
    forward.__wrapped__ = fn
    return forward


def _call_once(model: nn.Module, adapter: Adapter, src, tgt, pad_id: int) -> dict:
    """One forward in eval mode, no grad: the logits, and the path of the module whose output
    they are (the root for most models; `generator` for The Annotated Transformer's)."""
    outputs: list[tuple[str, torch.Tensor]] = []    # held for the call: ids are not reused

    def hook(name):
        def record(mod, args, out):
            t = first_tensor(out)
            if t is not None:
                outputs.append((name, t))                         # returns None: output unchanged
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()]
    was = model.training
    model.eval()
    try:
        with fed_tables(model, src, tgt) as fed, torch.no_grad():
            logits = adapter.forward(model, src, tgt, pad_id)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's forward may raise anything
        text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UsageError(f"{adapter.name} raised {type(e).__name__}: {text} (it is called as "
                         f"forward(model, src [B, S], tgt [B, T], pad_id), or decoder-only forward(model, "
                         f"ids [B, T], pad_id), batch first)") from None
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    path = next((n for n, t in outputs if t is logits), None)
    outputs.clear()
    return {"logits": logits, "path": path, "fed": fed}


# -- the batch of the user's own call --------------------------------------------------------------
def default_batch(args: tuple, kwargs: dict, pad_id: int, start_id: int | None = None,
                  kind: str = "seq2seq"):
    """(src, tgt_in, tgt_out) from the arguments the user's loop passed to the model, or None.

    * an encoder-only model (`kind="encoder"`): its ids are src and tgt_in; Hugging Face
      `labels` (-100 -> pad), unshifted (a masked LM predicts each position's own token), are
      the target, else None.
    * a decoder-only model (`kind="decoder"`): its ids, `input_ids` or the first 2-D integer
      tensor, are tgt_in and src is empty; Hugging Face `labels` (the ids, -100 -> pad, which
      the model shifts itself) shifted left are the target, else None.

    * Hugging Face style: `input_ids`, then `decoder_input_ids`, else `labels` shifted right
      (what the model itself does); `labels` (-100 -> pad) is the target.
    * otherwise: the first two 2-D integer tensors among the positional, then keyword
      arguments are src and tgt_in (`model(src, tgt_in, ...)`); the target is None, for the
      caller to take as `shift_left(tgt_in)` where it needs one.
    """
    ids = kwargs.get("input_ids")
    if kind in ("encoder", "decoder"):        # one sequence
        if not isinstance(ids, torch.Tensor):
            ids = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                        and a.dim() == 2 and not a.is_floating_point() and a.dtype != torch.bool), None)
        if ids is None:
            return None
        labels = kwargs.get("labels")
        tgt_out = None
        if isinstance(labels, torch.Tensor) and labels.shape == ids.shape:
            tgt_out = labels.masked_fill(labels < 0, pad_id)          # -100 -> pad
            if kind == "decoder":                 # the model shifts them itself: so do we
                tgt_out = shift_left(tgt_out, pad_id)
        return (ids, ids, tgt_out) if kind == "encoder" else (ids[:, :0], ids, tgt_out)
    if isinstance(ids, torch.Tensor):
        labels = kwargs.get("labels")
        tgt_out = None
        if isinstance(labels, torch.Tensor):
            tgt_out = labels.masked_fill(labels < 0, pad_id)
        tgt_in = kwargs.get("decoder_input_ids")
        if not isinstance(tgt_in, torch.Tensor) and tgt_out is not None:
            start = pad_id if start_id is None else start_id
            tgt_in = torch.cat([torch.full_like(tgt_out[:, :1], start), tgt_out[:, :-1]], dim=1)
        if not isinstance(tgt_in, torch.Tensor):
            return None
        return ids, tgt_in, tgt_out
    found = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() == 2
             and not a.is_floating_point() and a.dtype != torch.bool]
    if len(found) < 2:
        return None
    return found[0], found[1], None


def shift_left(tgt_in: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The target of teacher forcing from its input: tgt_out[:, i] = tgt_in[:, i+1], exact but
    for the last position, unknown and so pad (ignored).  [B, T] -> [B, T]"""
    return torch.cat([tgt_in[:, 1:], torch.full_like(tgt_in[:, :1], pad_id)], dim=1)


def declared_schedule(spec):
    """step -> lr from a callable, a LambdaLR (Hugging Face's schedules are), or None.

    Returns (schedule or None, note or None)."""
    if spec is None:
        return None, None
    from torch.optim.lr_scheduler import LambdaLR, LRScheduler
    if isinstance(spec, LambdaLR):
        base, fn = spec.base_lrs[0], spec.lr_lambdas[0]
        return (lambda step: base * fn(step)), None
    if isinstance(spec, LRScheduler):
        return None, (f"lr_schedule: a {type(spec).__name__} has no step -> lr formula tndebug can "
                      f"read; pass lr_schedule=lambda step: ... to check it (only resume jumps "
                      f"are checked)")
    if callable(spec):
        return spec, None
    raise UsageError(f"lr_schedule: expected step -> lr or a LambdaLR, got {type(spec).__name__}")


# -- the pad id in the user's own batches -----------------------------------------------------
def pad_id_findings(batch, pad_id: int, step: int) -> list[Finding]:
    """A warning when the pad id occurs mid-sequence in `batch` (src, tgt_in, ...) of the user's
    loop: then it is a real token, and every mask verdict judged the wrong positions. [] if not
    (and always with pad_id=None, NO_PAD: no id equals it).

    The fix names the argument to change: the pad id (`pad_id=`), `pad_id=None` for data with
    no padding, or `batch=` when the pads fill only row ends once the tensors are read
    sequence-first ([T, B]: a model called as `model(src.T, tgt.T)`)."""
    from tndebug.padding import mid_sequence_pads, pad_text
    if batch is None:
        return []
    tensors = {k: t for k, t in (("src", batch[0]), ("tgt_in", batch[1]))
               if isinstance(t, torch.Tensor) and t.dim() == 2 and t.numel()}
    found = mid_sequence_pads(tensors, pad_id)
    if not found:
        return []
    # read the other way round, do the pads only fill row ends? then the call is sequence-first
    seq_first = (all(t.shape[0] >= 3 for t in tensors.values())     # a [T, B] row needs 3 ids
                 and not mid_sequence_pads({k: t.T for k, t in tensors.items()}, pad_id))
    evidence = {"pad_id": pad_id, **{f"{k}_rows": f"{v['rows']} of {v['of']}" for k, v in found.items()},
                **{f"{k}_positions": v["at"] for k, v in found.items()},
                "read_as": "batch-first [B, T]",
                "pads_at_row_ends_if_sequence_first": seq_first}
    example = "batch=lambda args, kwargs: " + (
        "(args[0].T[:, :0], args[0].T)" if "src" not in tensors          # one stack: [T, B] ids
        else "(args[0].T, args[0].T)" if batch[0] is batch[1] else "(args[0].T, args[1].T)")
    layout = (f"if your model is called sequence-first (model(src.T, tgt.T), [T, B] tensors), tell "
              f"watch how to read its call: tndebug.watch(..., {example})")
    if seq_first:
        message = (pad_text(found, pad_id) + "; read as [T, B] (sequence-first) the pads only fill "
                   "the ends of each sequence: the call is likely sequence-first, not the pad id wrong")
        fix = (f"{layout[0].upper()}{layout[1:]}; the tensors were read batch-first ([B, T]). If "
               f"they are batch-first, pass the id your rows are padded with (pad_id=ID, e.g. "
               f"tokenizer.pad_token_id), or pad_id=None if your data has no padding")
    else:
        message = pad_text(found, pad_id)
        fix = (f"pass the id your rows are padded with: tndebug.watch(..., pad_id=ID) (e.g. "
               f"tokenizer.pad_token_id; {pad_id} is a real token of your data, see the positions "
               f"in the evidence); if your data has no padding (character-level text, fixed-length "
               f"windows), pass pad_id=None; {layout}")
    return [Finding("pad-id", "warning", message, where="", step=step, evidence=evidence,
                    fix=fix, code="pad-id/mid-sequence")]


def set_max_len(subject, max_len, who: str) -> None:
    """The user's `max_len` (the longest sequence their model takes) for the probes' batches; it
    replaces what the config says. Refused unless it is an int that an exact test can run at."""
    if max_len is None:
        return
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < MIN_PROBE_LEN:
        raise UsageError(f"{who}: max_len={max_len!r}; expected an int >= {MIN_PROBE_LEN} (the "
                         f"longest sequence the model takes; the exact tests need "
                         f"{MIN_PROBE_LEN} positions)")
    subject.max_len = max_len
