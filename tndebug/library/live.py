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

from dataclasses import dataclass, field
import numbers
from typing import Callable

from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from tndebug.errors import UsageError
from tndebug.findings import user_path
from tndebug.library.args import forward_vocab, ids_in_vocabulary
from tndebug.capture.adapters import ARCHS, Adapter, adapter_kind, as_logits, floating_logits, guess_adapter, \
    resolve_adapter
from tndebug.capture import GenericCapture
from tndebug.capture.subjects import vocab_rule
from tndebug.capture.user_model import refuse_meta
from tndebug.hf.decoder_only import choose_lm_ids, make_lm_adapter
from tndebug.hf.encoder_decoder import choose_ids, make_adapter
from tndebug.hf.encoder_only import make_mlm_adapter
from tndebug.library.first_call import first_batch, first_call, vocab_sizes
from tndebug.model import DecoderOnly
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


def _token_id(value, name: str) -> int:
    """`pad_id=` / `bos_id=`: an integer >= 0 (numpy's integers too)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UsageError(f"{name}={value!r}: expected an integer token id")
    if value < 0:
        raise UsageError(f"{name}={value} is not a token id (ids are >= 0); pass the id your data "
                         f"uses (e.g. tokenizer.{name[:3]}_token_id)")
    return int(value)


@dataclass
class _Call:
    """How the probes call the model, as far as it is known before its first call."""
    kind: str                             # "seq2seq" | "decoder" | "encoder"
    adapter: Adapter                      # the 4-argument call (model, src, tgt, pad_id)
    pad_id: int | None
    bos_id: int | None
    src_vocab: int | None
    tgt_vocab: int | None
    lm_forward: Callable | None = None    # one stack: forward(model, ids, pad_id)
    incremental: Callable | None = None   # decoder-only: the KV cache's call
    first_content: int | None = None      # HF: the first ordinary id (its config's ids)
    info: dict = field(default_factory=lambda: {"hf": False})


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
    refuse_meta(model)                   # before any call: torch's kernel text says nothing
    padded = pad_id is not None          # None: the data hold no padding (character-level text)
    c = _how_to_call(model, forward, arch, _Call("seq2seq", None, pad_id, bos_id, src_vocab,
                                                 tgt_vocab))
    info, adapter, kind = c.info, c.adapter, c.kind
    pad_id = 0 if c.pad_id is None else _token_id(c.pad_id, "pad_id")
    bos_id = (1 if pad_id != 1 else 2) if c.bos_id is None else _token_id(c.bos_id, "bos_id")
    src, tgt = first_batch(model, c, pad_id, bos_id)
    capture = GenericCapture(model, kind=kind)
    logits_module, src, tgt = first_call(model, adapter, src, tgt, pad_id, info)
    logits = logits_module.pop("logits")
    floating_logits(logits, adapter.name)
    if forward is not None:
        forward_vocab(logits.shape[-1], given=c.tgt_vocab, from_module=logits_module["path"] is not None,
                      sizes=vocab_sizes(model), tokens=vocab_sizes(model, heads=False),
                      name=adapter.name)
    src_v, tgt_v = vocab_rule(model, logits.shape[-1], logits_module.pop("fed"), kind,
                              c.src_vocab, c.tgt_vocab)
    if c.first_content is None:           # the user's ids (HF: from the model's config)
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
        adapter = Adapter(adapter.name, c.lm_forward, None, adapter.note)
    subject = Subject.of_kind(
        model, adapter.forward, c.incremental if kind == "decoder" else adapter.encode, kind=kind,
        capture=capture, pad_id=pad_id, bos_id=bos_id, src_vocab=src_v, tgt_vocab=tgt_v,
        first_content=c.first_content, padded=padded,
        max_len=getattr(getattr(model, "config", None), "max_position_embeddings", None)
        or getattr(getattr(model, "cfg", None), "max_len", None))
    info.update(adapter=adapter.name, attention_modules=sorted(user_path(list(capture.attention))),
                logits_module=logits_module.get("path"), pad_id=pad_id if padded else None,
                bos_id=bos_id,
                src_vocab=src_v, tgt_vocab=tgt_v)
    if adapter.note:
        info["adapter_note"] = adapter.note
    return subject, info


def _how_to_call(model: nn.Module, forward: Callable | None, arch: str | None, c: _Call) -> _Call:
    """`c` completed: a Hugging Face model by its API (its ids from its config), tndebug's own
    decoder, a layout the built-in adapters know, or the user's `forward`."""
    one_stack = None if forward is not None else (
        "decoder" if is_hf_causal(model) else "encoder" if is_hf_masked_lm(model) else None)
    if one_stack is not None:                     # a Hugging Face decoder-only model or masked LM
        ids = choose_lm_ids(model.config, model.get_input_embeddings().num_embeddings)
        if one_stack == "decoder":
            c.lm_forward, c.incremental = make_lm_adapter()
            call = _ignoring_src(c.lm_forward)
        else:
            c.lm_forward = make_mlm_adapter()
            call = _ignoring_tgt(c.lm_forward)
        c.kind, c.adapter = one_stack, Adapter("huggingface", call)
        return _hf_ids(c, ids, ids["start"])
    if forward is None and _is_tndebug_decoder(model):
        c.lm_forward = lambda m, ids, pad: m(ids)                               # noqa: E731
        c.incremental = lambda m, ids, pad, split: m.incremental(ids, split)  # noqa: E731
        c.kind, c.adapter = "decoder", Adapter("tndebug", _ignoring_src(c.lm_forward))
        return c
    if forward is None and is_hf_seq2seq(model):
        in_v = model.get_input_embeddings().num_embeddings
        out_emb = model.get_output_embeddings()
        out_v = getattr(out_emb, "out_features", None) or getattr(out_emb, "num_embeddings", None) or in_v
        ids = choose_ids(model.config, min(in_v, out_v))
        fwd, enc = make_adapter(ids["start"], ids["marker"])
        c.adapter = Adapter("huggingface", fwd, enc)
        return _hf_ids(c, ids, ids["marker"])
    if forward is None:
        return _guessed_call(model, arch, c)
    if forward in ("annotated", "tndebug"):      # a built-in encoder-decoder call, by its name
        c.adapter = resolve_adapter(forward, model, arch)
        return c
    return _given_call(forward, arch, c)


def _hf_ids(c: _Call, ids: dict, bos_id: int) -> _Call:
    """A Hugging Face model's ids, from its config: they override pad_id= and bos_id=."""
    c.pad_id, c.bos_id = ids["pad"], bos_id
    lo, hi = ids["content"]
    c.first_content = lo
    c.src_vocab, c.tgt_vocab = c.src_vocab or hi, c.tgt_vocab or hi
    c.info.update(hf=True, hf_ids=ids)
    return c


def _guessed_call(model: nn.Module, arch: str | None, c: _Call) -> _Call:
    """No forward given: one of the built-in adapters, told from the model's layout."""
    if guess_adapter(model) is None and arch not in ("decoder", "encoder"):
        raise UsageError(
            f"do not know how to call {type(model).__name__}: pass forward=fn (on the command "
            f"line: --adapter FILE.py:FUNCTION) with "
            f"def fn(model, src, tgt, pad_id) -> logits [B, T, V] (src [B, S] and tgt [B, T] "
            f"batch first, tgt BOS-led), or def fn(model, ids, pad_id) -> logits [B, T, V] "
            f"for one stack (arch='encoder' if bidirectional)")
    if arch == "seq2seq" and guess_adapter(model) in ("gpt", "bert"):
        raise UsageError(f"arch='seq2seq', but {type(model).__name__} takes one input: pass "
                         f"forward=fn with def fn(model, src, tgt, pad_id) -> logits")
    adapter = resolve_adapter(None, model, arch)
    c.info["arch_from"] = (adapter.kind_from.replace("--arch encoder", "arch='encoder'")
                           .replace("--arch decoder", "arch='decoder'"))
    c.adapter = adapter
    if adapter.kind in ("decoder", "encoder"):   # gpt / bert: forward(model, ids, pad_id)
        c.kind, c.lm_forward = adapter.kind, adapter.forward
        wrap = _ignoring_src if c.kind == "decoder" else _ignoring_tgt
        c.adapter = Adapter(adapter.name, wrap(c.lm_forward), note=adapter.note)
    return c


def _given_call(forward, arch: str | None, c: _Call) -> _Call:
    """The user's `forward`: (model, src, tgt, pad_id), or (model, ids, pad_id) for one stack."""
    if not callable(forward):
        raise UsageError(f"forward: expected a callable forward(model, src, tgt, pad_id) -> "
                         f"logits, got {type(forward).__name__}")
    name = getattr(forward, "__name__", "forward")
    one = adapter_kind(forward, name, "forward") == "decoder"   # forward(model, ids, pad_id)
    if one and arch == "seq2seq" or not one and arch in ("decoder", "encoder"):
        raise UsageError(f"arch={arch!r} does not fit forward={name}, which takes "
                         f"{'(model, ids, pad_id)' if one else '(model, src, tgt, pad_id)'}")
    if not one:
        c.adapter = Adapter(f"forward={name}", _checked(forward, name))
        return c
    c.lm_forward = _checked_lm(forward, name)
    c.kind = "encoder" if arch == "encoder" else "decoder"
    # the model's KV cache, where the user offers it: forward.incremental(model, ids,
    # pad_id, split) -> logits of positions split.. decoded through the cache
    inc = getattr(forward, "incremental", None)
    c.incremental = inc if callable(inc) and c.kind == "decoder" else None
    wrap = _ignoring_tgt if c.kind == "encoder" else _ignoring_src
    c.adapter = Adapter(f"forward={name}", wrap(c.lm_forward))
    c.info["arch_from"] = (f"arch={arch!r}" if arch else "forward(model, ids, pad_id): one "
                           "stack, read as decoder-only (arch='encoder' if bidirectional)")
    return c


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


def declared_schedule(spec):
    """step -> lr from a callable, a LambdaLR (Hugging Face's schedules are), or None.

    Returns (schedule or None, note or None)."""
    if spec is None:
        return None, None
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
