"""tndebug's own decoder-only model (`tndebug run --arch decoder`) as triage's user code.

Its checkpoint has no encoder, so the encoder-decoder layouts (triage/layouts.py) do not fit it;
it is triaged the way `--model FILE.py:FACTORY --adapter FILE.py:forward` triages a user's
decoder-only code (triage/user_code.py), with this file as both: `build` makes the model from the
checkpoint's `model_config` (without its faults: the weights are loaded into the model as the
code builds it, as the converted layouts are), `forward` calls it and `incremental` is its KV
cache. Nothing here reads a fault switch: the probes judge what the model does.
"""
from __future__ import annotations

from pathlib import Path

import torch

SPEC = f"{Path(__file__).resolve()}:build"
ADAPTER = f"{Path(__file__).resolve()}:forward"
# what report.json's `run` says of such a triage (over what --model's triage would say)
RUN = {"layout": "tndebug (decoder-only)",
       "model": "tndebug's decoder-only model (its model_config, no faults)",
       "adapter": "model(ids); KV cache: model.incremental",
       "fresh_init": "tndebug's decoder-only model built again from the checkpoint's "
                     "model_config, no weights loaded"}


def is_own_decoder(config: dict | None, state_dict: dict) -> bool:
    """A checkpoint written by `tndebug run --arch decoder`: its model_config says so and its
    tensors have the one stack (no encoder)."""
    return (isinstance(config, dict) and config.get("arch") == "decoder"
            and any(k.startswith("decoder.layers.") for k in state_dict)
            and not any(k.startswith("encoder.") for k in state_dict))


def build(**model_config) -> torch.nn.Module:
    from tndebug.config import ModelConfig
    from tndebug.model.transformer import build as build_model
    from tndebug.errors import UsageError
    try:
        cfg = ModelConfig.from_dict(dict(model_config, faults=[]))
    except (TypeError, ValueError) as e:
        raise UsageError(f"the checkpoint's model_config does not fit tndebug's decoder-only model "
                         f"({e}); a checkpoint of another tndebug version, or edited? Pass your "
                         f"own code with --model FILE.py:FACTORY") from None
    return build_model(cfg)


def forward(model, ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    return model(ids)                                                   # [B, T, vocab]


def incremental(model, ids: torch.Tensor, pad_id: int, split: int) -> torch.Tensor:
    return model.incremental(ids, split)                                # [B, T - split, vocab]
