"""Findings in Hugging Face terms, for every front-end that probes a transformers model (`tndebug
triage DIR`, `check`/`watch` on a transformers model): fixes that speak of config fields,
`attention_mask` and `decoder_input_ids` instead of Annotated-Transformer code, and a whole
stack named by its module path. Chosen by the finding's probe and code, never its wording.

    f = hf_where(with_switches(hf_fix(f), scale_switches(config)), model)   # the judge's wording

And the facts about a transformers model that the judge's fresh-initialisation pass needs:
whether its modules run the installed package's own code (`runs_package_code`,
`package_code`), and the config fields that set a scale away from their defaults
(`scale_switches`). transformers is an optional dependency (`tndebug[hf]`): it is imported only
inside the functions that need it.
"""
from __future__ import annotations

import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from tndebug.findings import Finding

HF_FIXES = {
    "missing-scale": "transformers' attention multiplies q k^T by `self.scaling` = head_dim**-0.5 "
                     "(eager) or passes `scale=self.scaling` to SDPA; a subclass or patch that sets "
                     "`scaling = 1.0` or drops `scale=` removes it (T5 has none by design: its "
                     "initialisation folds it into q). An architecture published without it "
                     "(GPT-Neo) was trained that way: do not add it to a trained checkpoint's "
                     "code; retrain with the scale, or keep the learning rate and d_k it was "
                     "trained with",
    "mask-broadcast:causal": "the decoder's self-attention must be causal: keep the decoder "
                             "config's `is_decoder=True` / `is_causal=True` and its attention modules' "
                             "`is_causal`; pass decoder_input_ids = labels shifted right with "
                             "decoder_start_token_id (model.prepare_decoder_input_ids_from_labels), "
                             "and a decoder_attention_mask of 1 = keep, 0 = padding (never a full "
                             "4-D mask without the causal part)",
    "mask-broadcast:padding": "pass attention_mask with 1 = keep, 0 = padding, as the tokenizer "
                              "returns it: attention_mask = (input_ids != config.pad_token_id).long() "
                              "(not inverted, not True at padding); the same mask reaches the "
                              "cross-attention, so pass it to generate() and forward() alike",
    "nan-scores": "masks in transformers add torch.finfo(dtype).min, not -inf; a patched mask or "
                  "an all-padding row (attention_mask all 0) gives NaN: keep at least one 1 per row",
    "positional-encoding": "check the positions: learned `embed_positions` (BART, mBART; "
                           "config.max_position_embeddings) must be loaded and trained, not zero or "
                           "frozen; Marian/Pegasus build sinusoidal tables from the config; T5 needs "
                           "`relative_attention_bias` in layer 0 of each stack; "
                           "config.scale_embedding multiplies embeddings by sqrt(d_model)",
    "head-collapse": "each attention needs its own q_proj / k_proj / v_proj (T5: q, k, v): check that "
                     "a patch, a tie or a custom init does not share or copy them across heads",
    "variance-drift": "each layer must add its sublayer's output to its input "
                      "(hidden_states = residual + hidden_states): check a subclassed or patched layer",
    "ln-placement": "the norm placement is fixed by the architecture (BART/Marian post-LN; mBART, "
                    "Pegasus, T5 pre-LN with a final layer_norm): check a patched layer or a config "
                    "field such as normalize_before / add_final_layer_norm",
    "ln-placement:norm-collapsed": "the norm's weight is 0 in the file: a key that did not load "
                                   "(from_pretrained's missing-keys warning), a conversion or a "
                                   "patch that zeroed it; reload the trained weights (Gemma-style "
                                   "norms that scale by 1 + weight keep zeros and are not this)",
    "gradient-flow": "a part gets no gradient: check requires_grad (frozen parameters), detach() in "
                     "a patched forward, and tie_word_embeddings",
}


# mask-broadcast's kinds whose HF fix is the causal one, or the padding one; the others (a softmax
# axis, a head split, positions mixed outside the softmax, ...) keep their own fix
MASK_CAUSAL = {"causal-leak", "causal-transposed"}
MASK_PADDING = {"pad-leak", "memory-leak", "tgt-pad-leak", "src-pad-leak", "mask-inverted",
                "mask-after-softmax", "row-sums"}


def hf_fix(f: Finding) -> Finding:
    """The finding with a fix written for transformers code (the generic one in evidence)."""
    key = f.probe
    if f.code == "ln-placement/norm-collapsed":
        key = "ln-placement:norm-collapsed"
    if f.probe == "mask-broadcast":          # by the finding's kind, never its wording
        kind = f.code.partition("/")[2]
        key += (":causal" if kind in MASK_CAUSAL else ":padding" if kind in MASK_PADDING else ":other")
    if key not in HF_FIXES or f.severity == "info" or "best_alpha" in f.evidence:
        return f
    return replace(f, fix=HF_FIXES[key], evidence={**f.evidence, "generic_fix": f.fix})


def hf_where(f: Finding, model: nn.Module) -> Finding:
    """'encoder' / 'decoder' (a probe's word for a whole stack) -> the stack's HF path, and for
    positional-encoding its position table (`model.encoder.embed_positions`) where it has one."""
    if f.where not in ("encoder", "decoder"):
        return f
    try:
        stack = model.get_encoder() if f.where == "encoder" else model.get_decoder()
    except (AttributeError, NotImplementedError):     # a decoder-only model may have neither
        return f
    path = next((n for n, m in model.named_modules() if m is stack), None)
    if not path:
        return f
    if f.probe == "positional-encoding" and hasattr(stack, "embed_positions"):
        path += ".embed_positions"
    return replace(f, where=path, evidence={**f.evidence, "tndebug_where": f.where})


def runs_package_code(model: nn.Module) -> bool:
    """Whether every function the model's modules run is the installed package's own: each
    module class comes from transformers (or torch), and no function in the namespaces of
    those transformers modules, nor any forward, was defined outside an installed package (a
    user's or a test's monkeypatch, e.g. Falcon's apply_rotary_pos_emb replaced by one that
    undoes the scale). Only then can an unscaled attention be the package's published design."""
    import transformers as tf   # lazy: an optional dependency
    roots = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"],
                                          sysconfig.get_paths()["platlib"])}
    roots |= {Path(tf.__file__).resolve().parent, Path(torch.__file__).resolve().parent}

    def installed(fn) -> bool:
        code = getattr(fn, "__code__", None)
        if code is None:
            return True                                        # builtin, C or a class
        where = Path(code.co_filename).resolve()
        return any(where.is_relative_to(r) for r in roots)

    names = {type(m).__module__ for m in model.modules()}
    if any(not n.startswith(("transformers.", "torch.")) for n in names):
        return False
    for n in names:
        if n.startswith("transformers.") and not all(
                installed(v) for v in vars(sys.modules.get(n, object())).values()):
            return False
    return all(installed(getattr(type(m).forward, "__func__", type(m).forward))
               for m in model.modules())


def scale_switches(config) -> dict[str, tuple]:
    """{field: (saved, class default)} for the config's fields whose names say they set an
    attention scale (GPT-2's scale_attn_weights, Gemma-2's query_pre_attn_scalar, Granite's
    attention_multiplier) and whose saved value differs from the config class's default. Names
    are a hint: they keep an error and point its fix at the field, never clear one."""
    try:
        saved, default = config.to_dict(), type(config)().to_dict()
    except Exception:  # noqa: BLE001 - a config class that cannot build its defaults: no hint
        return {}
    words = ("scale", "scaling", "multiplier", "scalar")
    return {k: (v, default.get(k)) for k, v in saved.items()
            if any(w in k.lower() for w in words) and isinstance(v, (bool, int, float))
            and k in default and default[k] != v}


def scale_fields(config) -> dict[str, float]:
    """{field: value} for every numeric config field whose name says it sets an attention
    scale, at its default or not (Gemma-2's query_pre_attn_scalar, Granite's
    attention_multiplier)."""
    try:
        saved = config.to_dict()
    except Exception:  # noqa: BLE001 - a config that cannot list its fields: no hint
        return {}
    words = ("scale", "scaling", "multiplier", "scalar")
    return {k: float(v) for k, v in saved.items() if any(w in k.lower() for w in words)
            and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def with_scale_field(f, fields: dict):
    """A missing-scale error whose fitted scale is a config field's value v as transformers
    uses it (v**-0.5, or v itself): the fix names the field first, even at its class default
    (Gemma-2's query_pre_attn_scalar = 256 on a config whose heads are 16 wide: scale 1/16)."""
    fitted = f.evidence.get("fitted_scale")
    if f.probe != "missing-scale" or f.severity != "error" or not fitted:
        return f
    forms = {"**-0.5": lambda v: v ** -0.5, "": lambda v: v}
    hit = next(((k, v, form) for k, v in fields.items() for form, of in forms.items()
                if abs(of(v) - fitted) <= 1e-3 * fitted), None)
    if hit is None:
        return f
    k, v, form = hit
    d_k = f.evidence.get("d_k")
    want = f"{d_k:g}" if form and d_k else "the scale you meant"
    return replace(f, fix=f"config.{k} = {v:g} sets this scale ({k}{form} = {fitted:.3g}); set "
                          f"it to {want}. " + (f.fix or ""),
                   evidence={**f.evidence, "config_scale_field": {k: v}})


def with_switches(f, switches: dict):
    """A missing-scale error whose config sets a scale switch away from its default: the fix
    names the field first."""
    if f.probe != "missing-scale" or f.severity != "error":
        return f
    said = ", ".join(f"{k}={v!r} (the default is {d!r})" for k, (v, d) in switches.items())
    return replace(f, fix=f"config.json sets {said}: that field sets this scale in transformers' "
                          f"code. " + (f.fix or ""),
                   evidence={**f.evidence, "config_scale_fields": {k: v for k, (v, _) in switches.items()}})


def package_code(model: nn.Module, config, patched: bool = False) -> str:
    """"transformers 4.x's GPTNeoForCausalLM" when the model runs the installed package's
    unmodified code with its class defaults for every scale switch (scale_at_init's `library`:
    no scale there is the architecture's published design); "" when a patch (`patched`), a
    function swapped into the package's modules, or a scale field set away from its default
    (the config chose the scale: the error stays, its fix names the field) makes it not so."""
    import transformers as tf   # lazy: an optional dependency
    if patched or scale_switches(config) or not runs_package_code(model):
        return ""
    return f"transformers {tf.__version__}'s {type(model).__name__}"
