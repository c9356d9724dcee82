"""A Hugging Face directory's config.json and the model it builds (`tndebug triage DIR`): which of
the three shapes it holds (encoder-decoder, decoder-only, encoder-only), read by transformers
with the hub offline, and the model built from it in float32.

transformers is an optional dependency (`tndebug[hf]`): it is imported only inside the functions
that need it, so the core package never imports it.
"""
from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from tndebug.errors import UsageError
from tndebug.hf.load import WEIGHTS, transformers_offline
from tndebug.safeload import first_line


def load_config(folder: Path):
    """(transformers, the config, "seq2seq" | "decoder" | "encoder")."""
    tf = transformers_offline()
    cfg_path = folder / "config.json"
    if cfg_path.exists() and not cfg_path.is_file():
        raise UsageError(f"{cfg_path} is a {'directory' if cfg_path.is_dir() else 'special file'}, "
                         f"not a file; a save_pretrained directory holds its configuration in "
                         f"the JSON file config.json")
    if not cfg_path.is_file():
        weights = next((folder / n for n in WEIGHTS if (folder / n).is_file()), None)
        raise UsageError(f"{folder} has no config.json; pass a directory written by "
                         f"model.save_pretrained(DIR) (config.json + model.safetensors)"
                         + (f", or the file {weights} itself to triage it as a plain checkpoint"
                            if weights and not weights.name.endswith(".json") else ""))
    try:
        raw = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise UsageError(f"{cfg_path} is not valid JSON ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise UsageError(f"{cfg_path} has no model_type; it is not a transformers config")
    # lazy: transformers is an optional dependency
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UsageError(f"{cfg_path}: model_type {model_type!r} is unknown to transformers "
                         f"{tf.__version__} (a newer transformers, or a model with custom code, "
                         f"which tndebug does not run)")
    shape = ("an encoder-decoder" if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES else
             model_shape(model_type, raw, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES))
    kinds = {"an encoder-decoder": "seq2seq", "a decoder-only": "decoder", "an encoder-only": "encoder"}
    if shape not in kinds:
        raise UsageError(f"{folder} holds a {model_type} model "
                         f"({', '.join(raw.get('architectures') or []) or 'no architectures'}) "
                         f"with no language-model head of the three shapes tndebug triages: "
                         f"encoder-decoders (AutoModelForSeq2SeqLM), decoder-only models "
                         f"(AutoModelForCausalLM) and encoder-only models (AutoModelForMaskedLM)")
    archs = raw.get("architectures") or []
    if shape == "an encoder-only" and archs and not any("MaskedLM" in a for a in archs):
        raise UsageError(f"{folder} holds an encoder-only model with a {', '.join(archs)} head: "
                         f"triage builds the masked-LM one (AutoModelForMaskedLM), whose weights "
                         f"this directory does not hold (a {archs[0].split('For')[0]}ForMaskedLM's "
                         f"save_pretrained directory is triaged)")
    try:
        config = tf.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types
        raise UsageError(f"{cfg_path} could not be read by transformers: {first_line(e)[:200]}") from None
    return tf, config, kinds[shape]


def build_model(tf, config, attn: str | None, kind: str = "seq2seq", *, init: bool = True) -> nn.Module:
    """The model in float32 whatever config.dtype says: 16-bit weights are upcast exactly on
    load, so every tolerance is fp32's while the values are the file's (issue 19; the saved
    dtype still decides the fp16 hazards, as run.compute_dtype).

    `init` False: the weights are left uninitialised (transformers' `no_init_weights`), for a
    model whose weights all come from the file: drawing 139M random numbers was half of building
    a BART-base-size model and its peak memory. Buffers computed in the modules' constructors
    are computed as ever; what only the initialisation fills and the file lacks is filled by
    `init_missing` after loading."""
    kw = {"attn_implementation": attn} if attn else {}
    kw["dtype"] = torch.float32
    auto = {"decoder": tf.AutoModelForCausalLM, "encoder": tf.AutoModelForMaskedLM}.get(
        kind, tf.AutoModelForSeq2SeqLM)
    quiet = nullcontext()
    if not init:
        try:                        # lazy: transformers is an optional dependency
            from transformers.initialization import no_init_weights       # transformers 5
        except ImportError:
            try:
                from transformers.modeling_utils import no_init_weights   # transformers 4
            except ImportError:
                no_init_weights = None
        quiet = no_init_weights() if no_init_weights is not None else quiet
    try:
        with quiet:
            model = auto.from_config(config, **kw)
        if not init:
            model.tie_weights()     # no_init_weights skips it with the init: ties as config.json says
        return model
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"cannot build {config.model_type} from config.json"
                         f"{f' with --attn {attn}' if attn else ''}: {first_line(e)[:200]}") from None


def model_shape(model_type: str, raw: dict, causal: dict, masked: dict) -> str:
    """What a directory that is no encoder-decoder holds, from its saved architectures first
    (BERT has a causal-LM head class too, yet a BertForMaskedLM is an encoder), then from the
    head classes its model_type has."""
    archs = " ".join(raw.get("architectures") or [])
    if any(w in archs for w in ("CausalLM", "LMHeadModel")) or raw.get("is_decoder"):
        return "a decoder-only"
    if model_type in masked:
        return "an encoder-only"
    return "a decoder-only" if model_type in causal else "not an encoder-decoder"
