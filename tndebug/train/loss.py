"""Label smoothing through KL divergence (paper §5.4; The Annotated Transformer's `LabelSmoothing`).

The smoothed target puts 1 - eps on the true token and spreads eps over the V - 2 classes that
are neither the true token nor pad; the pad column gets no mass and rows whose target is pad
contribute nothing. The loss is KL(true || model), summed and divided by the real tokens.

Fault `label_smoothing_on_pad`: eps / (V - 1) over every other class, pad included.
Fault `kl_raw_logits`: the KL divergence is given the raw logits where it expects log-probs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LabelSmoothingLoss(nn.Module):
    """`loss(logits [N, V], target [N]) -> scalar`, the mean over non-pad targets.

    Args:
        eps: smoothing mass (0.1 in the paper); 0 gives cross-entropy.
        pad_id: the padding id: its column and its rows are ignored.
        smooth_pad: the `label_smoothing_on_pad` fault: pad column keeps its share of eps.
        raw_logits: the `kl_raw_logits` fault: no log_softmax before the KL divergence.
    """

    def __init__(self, eps: float = 0.1, pad_id: int = 0, *, smooth_pad: bool = False,
                 raw_logits: bool = False) -> None:
        super().__init__()
        if not 0.0 <= eps < 1.0:
            raise ValueError(f"label smoothing eps={eps} must lie in [0, 1)")
        self.eps, self.pad_id, self.smooth_pad = eps, pad_id, smooth_pad
        self.raw_logits = raw_logits

    def true_dist(self, target: torch.Tensor, V: int, dtype=torch.float32) -> torch.Tensor:
        """The smoothed target distribution.  target [N] -> [N, V]"""
        others = V - 1 if self.smooth_pad else V - 2
        true = torch.full((target.shape[0], V), self.eps / others, dtype=dtype, device=target.device)
        true.scatter_(1, target[:, None], 1.0 - self.eps)
        if not self.smooth_pad:
            true[:, self.pad_id] = 0.0
        # pad rows: no mass, no gradient (masked_fill: boolean indexing would sync with the GPU)
        true.masked_fill_((target == self.pad_id)[:, None], 0.0)
        return true

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.float()                                        # [N, V]; fp32 under autocast
        true = self.true_dist(target, logits.shape[-1])                # [N, V]
        n_real = (target != self.pad_id).sum().clamp(min=1)
        logp = logits if self.raw_logits else logits.log_softmax(-1)
        return F.kl_div(logp, true, reduction="sum") / n_real
