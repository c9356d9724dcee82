"""Parameters and gradients sharded across processes (FSDP2's `fully_shard`: each is a DTensor
whose rows are split over the ranks), as the probes read them. Plain tensors pass through
unchanged, so a probe written for one process needs no second path.

Two ways to read one, chosen per probe (its docstring says which):

* `full(t)`: the whole tensor on every rank (`DTensor.full_tensor()`, an all-gather). A
  collective: only at moments every rank reaches in the same order (setup, the probed steps,
  the optimizer's hooks), which is how the probes already run under DDP. For weights read
  as a whole (head-collapse's per-head cosines): exact, and it costs a gather of those weights.
* `norms(ts)`: each tensor's L2 norm from the ranks' local shards: the squares of the local
  norms, summed over the ranks in one all-reduce per device mesh, then the root. For
  gradient and update norms (gradient-flow, ln-placement, lr-schedule): no gather, one small
  all-reduce a call.

`local(t)` is this rank's shard, for what stays per rank (zero-grad's identity test).

The other probes (missing-scale, mask-broadcast, nan-scores, variance-drift, loss-health,
label-shift, lm-decoding, label-smoothing, train-mode) read activations, the loss, the lr or the
modules' train/eval mode, never a parameter: the forward computes the activations from gathered
weights, so they are the one-process values; per-rank statistics are averaged over the ranks by
the engine's reducer, as under DDP.
"""
from __future__ import annotations

import torch


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:          # a torch without torch.distributed
        return None
    return DTensor


def is_sharded(t) -> bool:
    """A DTensor (FSDP2's parameters, their gradients)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def any_sharded(tensors) -> bool:
    return any(is_sharded(t) for t in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view sharing its version counter); `t` otherwise."""
    return t.to_local() if is_sharded(t) else t


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor (detached) on every rank; a collective for a DTensor (see the module)."""
    if t is None or not is_sharded(t):
        return t
    return t.detach().full_tensor()


def norms(tensors: list[torch.Tensor], dtype=torch.float32) -> list[torch.Tensor]:
    """The L2 norm of each tensor (device scalars in `dtype`), a DTensor's over every rank's
    shard: local squares summed by one all-reduce per device mesh (a collective: every rank
    calls it with the same tensors). Plain tensors: `torch._foreach_norm`."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    plain = [i for i, t in enumerate(tensors) if not is_sharded(t)]
    if plain:
        for i, n in zip(plain, torch._foreach_norm([tensors[i].detach() for i in plain], 2,
                                                   dtype=dtype)):
            out[i] = n
    by_mesh: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if is_sharded(t):
            by_mesh.setdefault(id(t.device_mesh), []).append(i)
    for idx in by_mesh.values():
        first = tensors[idx[0]]
        sq = torch.stack([torch.linalg.vector_norm(tensors[i].detach().to_local(), dtype=dtype)
                          for i in idx]).pow(2)                                  # [n] local
        sq = _sum_over_shards(sq, first)
        for i, v in zip(idx, sq.sqrt()):
            out[i] = v
    return out


def _sum_over_shards(sq: torch.Tensor, like) -> torch.Tensor:
    """Sum `sq` over the mesh dimensions along which `like` is sharded (a replicated dimension
    holds copies: summing there would count each element once per replica)."""
    import torch.distributed as tdist
    from torch.distributed.tensor import Shard
    mesh = like.device_mesh
    for dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            group = mesh.get_group(dim) if mesh.ndim > 1 else mesh.get_group()
            tdist.all_reduce(sq, group=group)
    return sq


def sharding(model: torch.nn.Module) -> str | None:
    """"fsdp2" when a parameter of `model` is a DTensor, "ddp" for a DistributedDataParallel
    wrapper, None otherwise (one process, or a model the caller unwrapped)."""
    if any(is_sharded(p) for p in model.parameters()):
        return "fsdp2"
    from torch.nn.parallel import DistributedDataParallel
    return "ddp" if isinstance(model, DistributedDataParallel) else None
