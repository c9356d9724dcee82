"""The parts of a model found once from its modules, before any forward: the numbered blocks
and the stacks they belong to, the token-embedding wrappers, the feed-forward blocks (by the
shapes of their Linear maps) and a module's one weight matrix (`affine_dims`). The parts found
from behaviour (attention wherever a softmax follows a product, blocks called several times)
are `discovery.py`'s.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from tndebug.capture.structure import FFN, FFN_OUT, is_attention, stack_of


_BLOCK = re.compile(r"(?:^|\.)(?:layers|layer|blocks|block|h)\.(?P<i>\d+)$")


def numbered_blocks(modules: dict, stack: str = "decoder") -> dict[str, tuple[str, int]]:
    """The numbered blocks of a one-stack model -> (stack, index): children of a
    ModuleList named layers/blocks/h that are not inside another such block; where no list is
    named so, the items of a list that hold attention (`listed_blocks`)."""
    found = {n: int(m.group("i")) for n in modules for m in [_BLOCK.search(n)] if m} \
        or listed_blocks(modules)
    outer = {n: i for n, i in found.items()
             if not any(n.startswith(o + ".") for o in found if o != n)}
    return {n: (stack, i) for n, i in outer.items()}


def listed_blocks(modules: dict) -> dict[str, int]:
    """The blocks of a stack whatever its list is called (`layer_stack`, `resblocks`,
    `enc_layers`): the items of an nn.ModuleList or nn.Sequential that are no attention module
    themselves but hold one, outermost first -> index. The list's name is the user's; this
    reads only what its items are."""
    found: dict[str, int] = {}
    for path, m in modules.items():
        if not path or not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        if any(path.startswith(o + ".") for o in found):
            continue                                   # inside a block found already
        for i, item in enumerate(m):
            if not is_attention(item) and any(is_attention(sub) for sub in item.modules()):
                found[f"{path}.{i}"] = i
    return found


def stacked_blocks(modules: dict) -> dict[str, tuple[str, int]]:
    """The numbered blocks of an encoder-decoder whose block paths name no stack, the stack
    named by an ancestor instead (x-transformers: `encoder.attn_layers.layers.3`,
    `decoder.net.attn_layers.layers.3`) -> (stack, index); blocks under no named stack are
    left out. Such a block may be one sublayer (x-transformers numbers attention and FFN
    apart); its residual-add module gives the stream points."""
    return {n: (stack, i) for n, (_, i) in numbered_blocks(modules).items()
            for stack in [stack_of(n)] if stack is not None}


def called_stacks(modules: dict, layers: dict) -> dict[str, str]:
    """Where a stack is entered when its numbered blocks are containers that are never called
    (x-transformers: `attn_layers.layers.0` is a ModuleList of norm, block and residual, run
    by `attn_layers.forward`): the module that owns the list -> the stack. Its input is what
    enters the stack (the embedding output), its output what leaves it."""
    out = {}
    for path, (stack, i) in layers.items():
        owner = path.rpartition(".")[0].rpartition(".")[0]
        if i == 0 and owner and isinstance(modules[path], (nn.ModuleList, nn.ModuleDict)):
            out[owner] = stack
    return out


def token_embedding_modules(modules: dict, positional: set, layers: dict,
                            stacks: dict) -> dict[str, bool]:
    """Token-embedding wrappers: the outermost module around an nn.Embedding that holds no
    positional part -> whether its output is the token part alone (False when the PE is
    added inside the same module, so the two cannot be told apart)."""
    out = {}
    for name, m in modules.items():
        if not isinstance(m, nn.Embedding) or name in positional:
            continue
        best, parent = name, name.rpartition(".")[0]
        clean = True
        while parent:
            subtree = list(modules[parent].named_modules(prefix=parent))
            if any(n in positional for n, _ in subtree):
                if parent in positional:    # the PE is added in the same module
                    best, clean = parent, False
                break
            if (any(is_attention(x) for _, x in subtree)
                    or sum(isinstance(x, nn.Embedding) for _, x in subtree) > 1
                    or parent in layers or parent in stacks):
                break
            best, parent = parent, parent.rpartition(".")[0]
        out[best] = clean
    return out


def ffn_outputs(modules: dict, attention: set, layers: dict) -> dict[str, str]:
    """Second-Linear path -> the key its input (the FFN hidden) is stored under.

    From structure, not names: outside attention, a module whose own Linear children include
    an expansion d -> f and a contraction f -> d (two Linears around an activation, or three
    in a gated FFN such as T5's wi_0/wi_1/wo, or a gated FFN's two fused into d -> 2f, as
    Phi-3's gate_up_proj; Hugging Face's Conv1D counts as a Linear, see
    `affine_dims`) is a feed-forward block; the contraction's
    input is the hidden. When f == d the two cannot be told apart by shape, and the one
    registered second is taken (every implementation we know defines w_1 before w_2).
    The usual names (`w_2`, `linear2`, `fc2`, ...) count too.
    """
    out = {}
    for owner, m in modules.items():
        if any(owner == a or owner.startswith(a + ".") for a in attention):
            continue
        linears = [(n, c, affine_dims(c)) for n, c in m.named_children()]
        linears = [(n, c, dims) for n, c, dims in linears if dims is not None]
        for i, (n2, l2, (in2, out2)) in enumerate(linears):
            # an expansion d -> f before it, or d -> 2f: a gated FFN's gate and up maps
            # fused into one (Phi-3's and GLM's gate_up_proj, chunked in two)
            pairs = [l1 for n1, l1, (in1, out1) in linears if l1 is not l2
                     and out1 in (in2, 2 * in2) and in1 == out2]
            contraction = in2 > out2 or (
                in2 == out2 and any(l1 is c for _, c, _ in linears[:i] for l1 in pairs))
            named = n2 in FFN_OUT and (owner in layers or FFN.search(owner.rpartition(".")[2])
                                       or FFN.search(type(m).__name__))
            if not ((pairs and contraction) or named):
                continue
            name = f"{owner}.{n2}" if owner else n2
            holds_attention = any(c.startswith(owner + ".") for c in attention) if owner else True
            block = owner and owner not in layers and not holds_attention
            out[name] = owner if block else name
    out.update(_split_ffns(modules, attention, layers, out))
    return out


def _split_ffns(modules: dict, attention: set, layers: dict,
                found: dict[str, str]) -> dict[str, str]:
    """Feed-forwards split over two children of a layer, each holding one Linear: the
    expansion d -> f (f > d) in the first, the contraction f -> d in a later one (Hugging
    Face's BERT family: `intermediate.dense`, then `output.dense`, whose module also adds
    the residual and norms). The contraction's input is the hidden, keyed by its path.
    Only in layers where no FFN was found within one module."""
    out = {}
    for layer in layers:
        if any(n.startswith(layer + ".") for n in found):
            continue
        kids = []
        for n, c in modules[layer].named_children():
            path = f"{layer}.{n}"
            if any(a == path or a.startswith(path + ".") for a in attention):
                continue
            affine = [(f"{path}.{k}", d) for k, x in c.named_children()
                      for d in [affine_dims(x)] if d is not None]
            if len(affine) == 1:
                kids.append(affine[0])
        for i, (_, (d_in, f)) in enumerate(kids):
            later = [p for p, (f_in, d_out) in kids[i + 1:] if f > d_in and (f_in, d_out) == (f, d_in)]
            if later:
                out[later[0]] = later[0]
                break
    return out


def affine_dims(m: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a module that is one weight matrix applied to the last dimension: an
    nn.Linear (weight [out, in]), or a leaf whose 2-d weight is [in, out] with `nf` = out, as
    Hugging Face's Conv1D (GPT-2: x @ W + b through torch.addmm); else None."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and getattr(m, "nf", None) == w.shape[1] \
            and not any(True for _ in m.children()):
        return int(w.shape[0]), int(w.shape[1])
    return None
