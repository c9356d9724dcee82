"""Which module is what, from names and classes (hints only: behaviour decides in the
generic capture's discovery): attention classes, stacks and layers, FFNs, positional modules.
"""
from __future__ import annotations

import re

from torch import nn
import torch

_ATTN_CLASS = re.compile(r"attention|attn", re.I)
CROSS_NAME = re.compile(r"cross|src_attn|enc_dec|encdec|multihead_attn|memory|inter_attn", re.I)
LAYER = re.compile(r"(?:^|\.)(?P<stack>enc\w*|dec\w*)(?:[._](?:layers|layer|blocks|block|h))?\.(?P<i>\d+)$",
                    re.I)
STACK = re.compile(r"(?:^|\.)(?P<stack>enc\w*|dec\w*)$", re.I)
_POS = re.compile(r"position|pos_?enc|pos_?emb|^w?pe$|^pos$", re.I)
FFN = re.compile(r"feed_?forward|ffn|mlp|positionwise", re.I)
FFN_OUT = ("w_2", "linear2", "fc2", "lin2", "w2", "out_proj", "dense_2", "c_proj")
_LAYER_INDEX = re.compile(r"(?:layers|layer|blocks|block|h)\.(\d+)")


def is_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or bool(_ATTN_CLASS.search(type(module).__name__))


def stack_of(path: str) -> str | None:
    for part in reversed(path.split(".")):
        low = part.lower()
        if low.startswith("dec"):
            return "decoder"
        if low.startswith("enc"):
            return "encoder"
    return None


def layer_index(path: str) -> int | None:
    m = _LAYER_INDEX.search(path)
    if m:
        return int(m.group(1))
    nums = re.findall(r"\.(\d+)(?=\.|$)", path)
    return int(nums[0]) if nums else None


def position_only(pe: torch.Tensor, rel: float = 1e-4) -> bool:
    """Is `out - tok` the same for every row of the batch (a function of position only)?"""
    if pe.dim() != 3 or pe.shape[0] < 2:
        return True
    scale = pe.abs().max().clamp_min(1e-12)
    return bool(((pe - pe[:1]).abs().max() / scale) <= rel)


def owner_layer(path: str, layers: dict) -> str | None:
    parent = path.rpartition(".")[0]
    while parent:
        if parent in layers:
            return parent
        parent = parent.rpartition(".")[0]
    return None


def is_positional(name: str, m: nn.Module) -> bool:
    """A positional-encoding module: by its name, its class, or a `pe`/`pos_*` tensor it owns."""
    own = [b for b, _ in m.named_buffers(recurse=False)] + [p for p, _ in m.named_parameters(recurse=False)]
    return bool(_POS.search(name.rpartition(".")[2]) or _POS.search(type(m).__name__)
                or any(_POS.search(b) for b in own))
