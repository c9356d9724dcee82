"""Adapters: how tndebug calls a user's model (the user's own files are imported by
capture/user_files.py, whose `import_file` this module hands on; The Annotated Transformer's
masks are capture/annotated.py).

An adapter is a function

    def forward(model, src, tgt, pad_id) -> logits      # src [B, S], tgt [B, T] (BOS-led),
                                                        # -> [B, T, V] logits or log-probs
and, optionally, in the same file,

    def encode(model, src, pad_id) -> memory            # [B, S, d]

A user's adapter may also return a tuple (its first tensor is taken: `(logits, attn)`), an
object with `.logits` (a Hugging Face output), or flattened logits [B*T, V]; anything else is a
UsageError naming the shape.

A decoder-only (GPT-style) model's adapter has three parameters:

    def forward(model, ids, pad_id) -> logits            # ids [B, T] (BOS-led, right-padded)
                                                         # -> [B, T, V]
and, optionally, `incremental(model, ids, pad_id, split) -> logits [B, T - split, V]` through
the model's KV cache (Subject). The number of parameters decides which kind of model it is.

Built in: `annotated` (The Annotated Transformer's call: `model(src, tgt, src_mask, tgt_mask)`
then `model.generator`, masks built by the model module's own `Batch.make_std_mask` /
`subsequent_mask` where it defines them, else by tndebug, which `Adapter.note` then says),
`tndebug` (`model(src, tgt)`) and `gpt` (decoder-only: `model(idx)` returning logits or
`(logits, loss)`; nanoGPT's `forward(idx, targets=None)`, which returns only the last
position's logits without targets, is called `model(idx, idx)`, which `Adapter.note` says) and
`bert` (encoder-only, BERT-style: `model(ids)` returning per-token logits; the model builds its
own padding mask from the ids). Anything else: `--adapter FILE.py:FUNCTION`.

A decoder-only and an encoder-only model are called alike (`forward(model, ids, pad_id)`), so
which one a model is comes from `--arch` when the user says it, else from the class name (a
hint: `Bert`, `Roberta`, `Electra`, `Encoder`, `MLM`, `MaskedLM` in it read as encoder-only),
else decoder-only; `Adapter.kind_from` says which, and the report repeats it.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tndebug.errors import UsageError
from tndebug.capture.annotated import TNDEBUG_MASKS_NOTE, annotated_encode, annotated_forward, \
    annotated_mask_source
from tndebug.capture.model_parts import numbered_blocks
from tndebug.capture.structure import is_attention
from tndebug.capture.user_files import import_file, line, load_callable  # noqa: F401 - handed on
from tndebug.model import Transformer
from tndebug.task_names import ADAPTER_NAMES

BUILTIN = ADAPTER_NAMES                 # torch-free there: the CLI refuses an unknown name early
ARCHS = ("seq2seq", "decoder", "encoder")


# -- built-in adapters --------------------------------------------------------------------------
def tndebug_forward(model, src, tgt, pad_id):
    return model(src, tgt)


def tndebug_encode(model, src, pad_id):
    return model.encode(src)


GPT_TARGETS_NOTE = ("model(idx) returned only the last position's logits ([B, 1, V], as "
                    "nanoGPT's forward(idx, targets=None) does), so the gpt adapter calls "
                    "model(idx, idx): every position's logits; the loss it returns is not used")


def gpt_adapter(model: nn.Module) -> "Adapter":
    """The built-in `gpt` adapter, decided by one call on 3 positions (eval, no grad): `model(idx)`
    when that returns logits [1, 3, V] (or a tuple whose first tensor they are); `model(idx, idx)`
    when `model(idx)` gives [1, 1, V] and this gives [1, 3, V] (nanoGPT returns the last
    position alone unless it is given targets); anything else is a UsageError saying what came
    back."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    idx = torch.ones(1, 3, dtype=torch.long, device=device)

    def shape_of(*args):
        try:
            with torch.no_grad():
                out = first_tensor(model(*args))
        except Exception as e:  # noqa: BLE001 - the user's model may raise anything
            return f"raised {type(e).__name__}: {line(e)}"
        return tuple(out.shape) if out is not None else "no tensor"

    plain = shape_of(idx)
    if isinstance(plain, tuple) and len(plain) == 3 and plain[:2] == (1, 3):
        return Adapter("gpt", lambda m, ids, pad_id: as_logits(m(ids), ids, "gpt"), kind="decoder")
    if isinstance(plain, tuple) and len(plain) == 3 and plain[:2] == (1, 1):
        with_targets = shape_of(idx, idx)
        if isinstance(with_targets, tuple) and len(with_targets) == 3 and with_targets[:2] == (1, 3):
            return Adapter("gpt", lambda m, ids, pad_id: as_logits(m(ids, ids.contiguous()), ids, "gpt"),
                           note=GPT_TARGETS_NOTE, kind="decoder")
        raise UsageError(f"the gpt adapter: model(idx [1, 3]) returns only the last position's "
                         f"logits {plain} and model(idx, targets) gives {with_targets}: pass "
                         f"--adapter FILE.py:forward with def forward(model, ids, pad_id) -> "
                         f"logits [B, T, V] for every position")
    raise UsageError(f"the gpt adapter: model(idx [1, 3]) gave {plain}; expected logits [1, 3, V] "
                     f"or (logits, loss): pass --adapter FILE.py:forward with def forward(model, "
                     f"ids, pad_id) -> logits [B, T, V]")


def bert_adapter(model: nn.Module) -> "Adapter":
    """The built-in `bert` adapter (encoder-only): `model(ids)` -> per-token logits [B, T, V] (or
    a tuple whose first tensor they are, or `.logits`), decided by one call on 3 positions; the
    model makes its own padding mask from the ids. Anything else is a UsageError saying what
    came back."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    idx = torch.ones(1, 3, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            out = first_tensor(model(idx))
        got = tuple(out.shape) if out is not None else "no tensor"
    except Exception as e:  # noqa: BLE001 - the user's model may raise anything
        got = f"raised {type(e).__name__}: {line(e)}"
    if isinstance(got, tuple) and len(got) == 3 and got[:2] == (1, 3):
        return Adapter("bert", lambda m, ids, pad_id: as_logits(m(ids), ids, "bert"), kind="encoder")
    raise UsageError(f"the bert adapter: model(ids [1, 3]) gave {got}; expected per-token logits "
                     f"[1, 3, V]: pass --adapter FILE.py:forward with def forward(model, ids, "
                     f"pad_id) -> logits [B, T, V] (and --arch encoder)")


@dataclass
class Adapter:
    name: str
    forward: Callable
    encode: Callable | None = None
    note: str | None = None          # what the report should say about how the model was called
    kind: str = "seq2seq"            # "decoder": forward(model, ids, pad_id); "encoder": the same
    incremental: Callable | None = None   # decoder-only: through the model's KV cache
    kind_from: str = ""              # how `kind` was decided (--arch, the class name, the shape)


def builtin_adapter(name: str, model: nn.Module | None = None) -> Adapter:
    if name == "annotated":
        note = None
        if model is not None and annotated_mask_source(model) == "tndebug":
            note = TNDEBUG_MASKS_NOTE
        return Adapter("annotated", annotated_forward, annotated_encode, note)
    if name == "tndebug":
        if model is not None and not callable(getattr(model, "encode", None)):
            return Adapter("tndebug", _normalised(tndebug_forward, "tndebug"))  # model(src, tgt) only
        return Adapter("tndebug", tndebug_forward, tndebug_encode)
    if name == "gpt" and model is not None:
        return gpt_adapter(model)
    if name == "bert" and model is not None:
        return bert_adapter(model)
    raise UsageError(f"unknown adapter {name!r}; use annotated, tndebug, gpt, bert or FILE.py:FUNCTION")


def first_tensor(out) -> torch.Tensor | None:
    """The logits a model or adapter returned: the tensor itself, the first tensor of a tuple or
    list, or `.logits` of an output object (Hugging Face); else None."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def floating_logits(logits: torch.Tensor, name: str) -> None:
    """A forward must return floating logits (scores before the softmax): integer "logits"
    (argmax ids, a count) would be probed as scores and read as anything (issue 47)."""
    if isinstance(logits, torch.Tensor) and not (logits.is_floating_point() or logits.is_complex()):
        raise UsageError(f"{name} returned {str(logits.dtype).replace('torch.', '')} \"logits\" "
                         f"{tuple(logits.shape)}; a forward must return floating logits (the "
                         f"scores before the softmax) over the model's vocabulary, [B, T, V], not "
                         f"ids or counts")


def as_logits(out, tgt: torch.Tensor, name: str) -> torch.Tensor:
    """A user adapter's output -> logits [B, T, V]: the first tensor of a tuple or list, `.logits`
    of an output object, [B*T, V] reshaped; otherwise a UsageError naming what came back."""
    found = first_tensor(out)
    out = found if found is not None else out
    B, T = tgt.shape[:2]
    if isinstance(out, torch.Tensor):
        if out.dim() == 3 and tuple(out.shape[:2]) == (B, T):
            return out
        if out.dim() == 2 and out.shape[0] == B * T:
            return out.reshape(B, T, out.shape[1])                            # [B*T, V] -> [B, T, V]
        hint = (" (it looks sequence-first: return logits.transpose(0, 1))"
                if out.dim() == 3 and tuple(out.shape[:2]) == (T, B) else "")
        got = f"a tensor of shape {tuple(out.shape)}"
    else:
        got = (f"a {type(out).__name__} with no tensor in it" if isinstance(out, (tuple, list))
               else f"a {type(out).__name__}")
        hint = ""
    raise UsageError(f"the adapter {name} returned {got}; expected logits [B, T, V] = [{B}, {T}, V] "
                     f"(batch first), flattened [B*T, V] = [{B * T}, V], or a tuple whose first "
                     f"tensor is one of these{hint}")


def _normalised(fn: Callable, name: str, kind: str = "seq2seq") -> Callable:
    if kind == "decoder":
        def forward(model, ids, pad_id):
            return as_logits(fn(model, ids, pad_id), ids, name)
    else:
        def forward(model, src, tgt, pad_id):
            return as_logits(fn(model, src, tgt, pad_id), tgt, name)
    forward.__wrapped__ = fn
    forward.__doc__ = fn.__doc__
    return forward


def adapter_kind(fn: Callable, spec: str, who: str = "--adapter") -> str:
    """'decoder' for forward(model, ids, pad_id), 'seq2seq' for forward(model, src, tgt, pad_id):
    from the number of positional parameters (3 or 4; beyond 4, those without a default; a
    signature that cannot be read: 'seq2seq'); anything else is a UsageError."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "seq2seq"
    params = sig.parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    if len(positional) == 3 or (len(positional) > 4 and required == 3):
        return "decoder"
    if len(positional) >= 4 or any(p.kind == p.VAR_POSITIONAL for p in params):
        return "seq2seq"
    raise UsageError(f"{who} {spec}: {getattr(fn, '__name__', 'it')}{sig} takes "
                     f"{len(positional)} arguments; expected forward(model, ids, pad_id) "
                     f"(decoder-only) or forward(model, src, tgt, pad_id) (encoder-decoder)")


def _required_inputs(model: nn.Module) -> int | None:
    """How many arguments model.forward requires (None: its signature cannot be read)."""
    try:
        return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                   for p in inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def _fused_qkv(m: nn.Module) -> bool:
    """A Linear d -> 3d (a fused q, k, v projection)."""
    return isinstance(m, nn.Linear) and m.out_features == 3 * m.in_features


def _lm_shape(model: nn.Module) -> dict:
    """What says a model is GPT-shaped, from structure: its token tables (nn.Embedding), heads
    (an nn.Linear outside the blocks whose out_features is a table's size, or that shares its
    weight), numbered
    blocks holding an attention-shaped module (nn.MultiheadAttention, an attention class, or a
    fused d -> 3d projection), and how many arguments its forward requires."""
    modules = dict(model.named_modules())
    tables = {n: m for n, m in modules.items() if isinstance(m, nn.Embedding)}
    numbered = numbered_blocks(modules)
    blocks = sorted(numbered, key=lambda n: numbered[n][1])
    heads = [n for n, m in modules.items() if isinstance(m, nn.Linear)
             and not any(n.startswith(b + ".") for b in blocks) and any(
                 m.out_features == t.num_embeddings or m.weight is t.weight for t in tables.values())]
    attn = [b for b in blocks if any((n == b or n.startswith(b + "."))
                                     and (is_attention(m) or _fused_qkv(m))
                                     for n, m in modules.items())]
    return {"tables": {n: t.num_embeddings for n, t in tables.items()}, "heads": heads,
            "blocks": blocks, "attention_blocks": attn, "inputs": _required_inputs(model)}


def describe_shape(model: nn.Module) -> str:
    """One line: what the GPT-shape test found (for the 'do not know how to call' error)."""
    shape = _lm_shape(model)
    tables = ", ".join(f"{n or 'the model'} ({v})" for n, v in shape["tables"].items()) or "no nn.Embedding"
    heads = ", ".join(shape["heads"][:3]) or "none (no Linear with a table's size)"
    blocks = (f"{len(shape['blocks'])} numbered blocks ({shape['blocks'][0]}, ...), "
              f"{len(shape['attention_blocks'])} with attention") if shape["blocks"] else "no numbered blocks"
    inputs = "?" if shape["inputs"] is None else shape["inputs"]
    return f"found embeddings {tables}; head {heads}; {blocks}; forward requires {inputs} argument(s)"


# Class-name hints that a one-input model is encoder-only (BERT-style). A hint only: it picks
# which shape's tests run when the user did not say (--arch), and the report says it was a
# guess; a GPT named like this gets the encoder's tests and the report's line to correct it.
GUESSED = "guessed from"
ENCODER_NAMES = re.compile(r"bert|roberta|electra|encoder|mlm|maskedlm", re.IGNORECASE)


def guess_adapter(model: nn.Module) -> str | None:
    """A built-in adapter that fits the model's shape, or None."""
    return _guess(model)[0]


def _guess(model: nn.Module) -> tuple[str | None, str]:
    """(the built-in adapter that fits the model's shape or None, how that was told)."""
    if isinstance(model, Transformer):
        return "tndebug", "tndebug's own model"
    names = dict(model.named_children())
    if {"encoder", "decoder", "src_embed", "tgt_embed", "generator"} <= set(names) \
            and hasattr(model, "encode") and hasattr(model, "decode"):
        return "annotated", "The Annotated Transformer's module names"
    shape = _lm_shape(model)                 # one stack: a head, attention blocks, one input
    if shape["heads"] and shape["attention_blocks"] and shape["inputs"] == 1:
        cls = type(model).__name__
        if ENCODER_NAMES.search(cls):
            return "bert", (f"{GUESSED} the class name {cls} (one input; pass --arch decoder "
                            f"if it is causal)")
        return "gpt", (f"{GUESSED} its shape (one input, a head the vocabulary's size; pass "
                       f"--arch encoder if it is bidirectional on purpose)")
    if shape["heads"] and shape["inputs"] == 2 and any(is_attention(m) for m in model.modules()):
        return "tndebug", (f"{GUESSED} its shape (forward takes two inputs, a head the "
                           f"vocabulary's size: called as model(src, tgt); pass --adapter "
                           f"FILE.py:FUNCTION if it is called otherwise)")
    return None, ""


def resolve_adapter(spec: str | None, model: nn.Module, arch: str | None = None) -> Adapter:
    """The adapter for `--adapter spec` (None: guessed from the model), its kind set by `arch`
    (--arch: seq2seq, decoder or encoder) where the user gave one; a spec that contradicts it
    is a UsageError."""
    if spec is None:
        guess, how = _guess(model)
        one_stack = {"decoder": "gpt", "encoder": "bert"}
        if arch in one_stack and guess in (None, "gpt", "bert"):
            guess, how = one_stack[arch], f"--arch {arch}"
        elif arch == "seq2seq" and guess in ("gpt", "bert"):
            raise UsageError(f"--arch seq2seq, but {type(model).__name__} takes one input "
                             f"({describe_shape(model)}): pass --adapter FILE.py:FUNCTION with "
                             f"def forward(model, src, tgt, pad_id) -> logits")
        if guess is None:
            raise UsageError(
                f"do not know how to call {type(model).__name__} ({describe_shape(model)}): pass "
                f"--adapter gpt (decoder-only) or bert (encoder-only), or --adapter "
                f"FILE.py:FUNCTION with def forward(model, ids, pad_id) -> logits (one stack; "
                f"--arch encoder if bidirectional) or def forward(model, src, tgt, pad_id) -> "
                f"logits (encoder-decoder); see docs/triage.md")
        adapter = builtin_adapter(guess, model)
        adapter.kind_from = how
        return _agree(adapter, arch, f"the {guess} adapter")
    if spec in BUILTIN:
        adapter = builtin_adapter(spec, model)
        adapter.kind_from = f"--adapter {spec}"
        return _agree(adapter, arch, f"--adapter {spec}")
    fn, module = load_callable(spec, "--adapter")
    kind = adapter_kind(fn, spec)
    if kind == "decoder":
        if arch == "encoder":
            return Adapter(spec, _normalised(fn, spec, kind), kind="encoder", kind_from="--arch encoder")
        inc = getattr(module, "incremental", None)
        return _agree(Adapter(spec, _normalised(fn, spec, kind), kind=kind,
                              incremental=inc if callable(inc) and inc is not fn else None,
                              kind_from=f"--arch {arch}" if arch else
                              "forward(model, ids, pad_id): one stack, read as decoder-only "
                              "(pass --arch encoder if it is BERT-style)"), arch, f"--adapter {spec}")
    enc = getattr(module, "encode", None)
    return _agree(Adapter(spec, _normalised(fn, spec), enc if callable(enc) and enc is not fn else None,
                          kind_from="forward(model, src, tgt, pad_id)"), arch, f"--adapter {spec}")


def _agree(adapter: Adapter, arch: str | None, what: str) -> Adapter:
    """The adapter, when its kind is what --arch says (or --arch was not given)."""
    if arch and adapter.kind != arch:
        calls = {"seq2seq": "forward(model, src, tgt, pad_id)", "decoder": "forward(model, ids, pad_id)",
                 "encoder": "forward(model, ids, pad_id)"}
        raise UsageError(f"--arch {arch} does not fit {what}, which calls the model as "
                         f"{calls[adapter.kind]} ({adapter.kind}); pass an adapter that calls it "
                         f"as {calls[arch]}")
    return adapter
