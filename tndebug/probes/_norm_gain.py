"""A normalisation whose output is the same for every token: its gain collapsed to 0.

A LayerNorm or RMSNorm maps each token to γ ⊙ z + β. With γ = 0 (weights zeroed by a bad load,
a conversion, or `nn.init.zeros_` on the wrong parameter) every token leaves it as β, and
everything after it in its sublayer sees one input for all tokens: q = k = v, constant scores,
FFN units that never fire. Those downstream tests then tell the wrong story (a shared
projection, dead ReLUs); the cause is the norm, and this test names it from behaviour: one
forward pass on a batch without pads, each module whose class is a normalisation (the name is
only the hint of where to look) compared on its input and output.

    collapsed(subject) -> [Collapsed(module, in_spread, out_spread), ...]

Thresholds: an input whose tokens differ (spread across tokens > IN_VARIES of its own scale)
and an output whose tokens agree to float rounding (spread ≤ OUT_SAME of 1 + its scale). A
healthy norm's normalised tokens differ by O(1)·γ (γ of order 1 at initialisation; trained
gains stay within a decade of that in every model the corpora hold), a collapsed one by exactly
0; Gemma-style norms that store γ − 1 (zeros at initialisation) scale by 1 + w and are not
collapsed. Neither constant was tuned on a model: they sit orders of magnitude from both."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tndebug.capture.streams import is_norm
from tndebug.subject import Subject

IN_VARIES = 1e-3      # the input's tokens differ: spread across tokens / max|input|
OUT_SAME = 1e-6       # the output's tokens agree: spread across tokens / (1 + max|output|)


@dataclass
class Collapsed:
    module: str
    in_spread: float          # relative spread of the input across tokens
    out_spread: float         # relative spread of the output across tokens


def _spread(t: torch.Tensor) -> tuple[float, float]:
    """(max over features of max - min across tokens, max |t|) of a [..., d] tensor."""
    flat = t.detach().float().reshape(-1, t.shape[-1])
    return float((flat.amax(0) - flat.amin(0)).max()), float(flat.abs().max())


def collapsed(subject: Subject) -> list[Collapsed]:
    """The normalisation modules whose output is the same for every token while their input
    is not, in call order. [] when none, or when the model cannot run the batch (the other
    tests say why)."""
    norms = {n: m for n, m in subject.model.named_modules() if n and is_norm(m)}
    if not norms:
        return []
    seen: dict[str, tuple[float, float]] = {}

    def hook(name):
        def record(mod, args, out):
            x = args[0] if args else None
            if name in seen or not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) \
                    or not x.is_floating_point() or x.dim() < 2 or out.shape != x.shape:
                return
            (xs, xm), (os_, om) = _spread(x), _spread(out)
            seen[name] = (xs / max(xm, 1e-30), os_ / (1.0 + om))
        return record

    g = torch.Generator().manual_seed(31)
    src, tgt = subject.random_batch(batch=4, src_len=subject.fit(12), tgt_len=subject.fit(10),
                                    pad_share=0.0, generator=g)
    handles = [m.register_forward_hook(hook(n)) for n, m in norms.items()]
    try:
        with subject.evaluating(), torch.no_grad():
            subject.logits(src, tgt)
    except Exception:  # noqa: BLE001 - a model that cannot run this is named by the other tests
        return []
    finally:
        for h in handles:
            h.remove()
    return [Collapsed(n, i, o) for n, (i, o) in seen.items() if i > IN_VARIES and o <= OUT_SAME]
