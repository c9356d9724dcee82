"""Hugging Face directories' weights (`tndebug triage DIR`): which files hold them, reading
them, loading them tie-aware, and the output layer sliced for the probes.

transformers is an optional dependency (`tndebug[hf]`): it is imported only inside the functions
that need it (`transformers_offline`, `renamed`), so the core package never imports it."""
from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tndebug.errors import UsageError
from tndebug.safeload import damaged, first_line, unsafe_globals

INSTALL = "pip install 'tndebug[hf]'"

WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
           "pytorch_model.bin")


# -- files -------------------------------------------------------------------------------------
def weight_files(folder: Path) -> list[Path]:
    """The files holding the weights (shards sorted by name); a shard the index names but the
    directory lacks is an error."""
    for name in WEIGHTS:
        p = folder / name
        if not p.is_file():
            continue
        if not name.endswith(".index.json"):
            return [p]
        try:
            shards = sorted(set(json.loads(p.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{p} is not a shard index (no weight_map); save the model again") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise UsageError(f"{p} names {len(missing)} shard(s) that are not in {folder} "
                             f"(e.g. {', '.join(missing[:3])}): copy the whole directory")
        return [folder / s for s in shards]
    raise UsageError(f"{folder} has config.json but no weights (model.safetensors, "
                     f"pytorch_model.bin or their .index.json)")


def read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for p in files:
        try:
            if p.suffix == ".safetensors":
                part = load_file(str(p))
            else:
                if damaged(p):                   # torch.load checks no CRC: bit flips would load
                    raise UsageError(damaged(p))
                part = torch.load(p, map_location="cpu", weights_only=True)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file
            raise UsageError(_refused(p, e)) from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise UsageError(f"{p} does not hold a state_dict of tensors")
        sd.update(part)
    return sd


def _refused(p: Path, e: Exception) -> str:
    """One line for a weight file torch.load refused: pickled code is named, never loaded (the
    plain-file path's words, tndebug/safeload.py), and torch's advice on unpickling it anyway
    (and its ANSI colours) never shown."""
    unsafe = unsafe_globals(p) if p.suffix != ".safetensors" else []
    if unsafe:
        shown = ", ".join(unsafe[:6]) + (f" (+{len(unsafe) - 6} more)" if len(unsafe) > 6 else "")
        return (f"{p} holds pickled code ({shown}); it was not loaded. Re-save the model with "
                f"model.save_pretrained(DIR) (model.safetensors holds tensors only)")
    return f"{p} is corrupt or truncated ({ANSI.sub('', first_line(e)[:200])[:120]}); copy or save it again"


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")     # terminal colours inside torch's messages


def load_tied(model: nn.Module, sd: dict[str, torch.Tensor], folder: Path) -> tuple[list[str], list[str]]:
    """Load `sd` into `model`; returns (the missing keys restored by weight tying, the missing
    keys the model declares it may lack: `_keys_to_ignore_on_load_missing`, which only the
    initialisation fills: see `init_missing`). Anything else that does not fit is a one-line
    UsageError naming a few keys."""
    own = model.state_dict()
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    unexpected = [k for k in sd if k not in own and not any(r.search(k) for r in ignore)]
    shapes = [f"{k} {list(sd[k].shape)} in the file, {list(own[k].shape)} from config.json"
              for k in sd if k in own and sd[k].shape != own[k].shape]
    if shapes:
        raise UsageError(f"the weights in {folder} do not fit its config.json: {len(shapes)} shape "
                         f"mismatch(es) (e.g. {'; '.join(shapes[:2])})")
    if unexpected:
        raise UsageError(f"the weights in {folder} do not fit its config.json: {len(unexpected)} "
                         f"unexpected key(s) (e.g. {', '.join(unexpected[:3])})")
    missing = [k for k in own if k not in sd]
    del own                                  # its references would keep the random weights alive
    take_file_tensors(model, sd)
    model.tie_weights()
    after = model.state_dict()
    # the file's tensors give way to the model's own where they hold the same values in the
    # same dtype: one copy of the weights in memory from here on, not two
    for k, v in sd.items():
        if k in after and after[k].dtype == v.dtype and after[k].data_ptr() != v.data_ptr() \
                and torch.equal(after[k], v):
            sd[k] = after[k].detach()
    loaded = {after[k].data_ptr() for k in sd if k in after}
    tied = [k for k in missing if after[k].data_ptr() in loaded]
    ignore_missing = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    allowed = [k for k in missing if k not in tied and any(r.search(k) for r in ignore_missing)]
    untied = [k for k in missing if k not in tied and k not in allowed]
    if untied:
        raise UsageError(f"the weights in {folder} do not fit its config.json: {len(untied)} "
                         f"missing key(s) not tied to a loaded weight (e.g. {', '.join(untied[:3])})")
    return tied, allowed


def init_missing(model: nn.Module, keys: list[str]) -> None:
    """Initialise, as the model's own initialisation would, the modules owning `keys`: weights
    the file lacks and the model built without initialising (`build_model(init=False)`), such as
    Marian's sinusoidal position tables, which transformers computes in `_init_weights`.
    Nothing for a model without `_init_weights`."""
    init = getattr(model, "_init_weights", None)
    if init is None:
        return
    with torch.no_grad():
        for name in sorted({k.rpartition(".")[0] for k in keys}):
            init(model.get_submodule(name) if name else model)


def take_file_tensors(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Load `sd` into `model` by handing each parameter or buffer the file's tensor (converted to
    the model's dtype where the file's differs) instead of copying it into the model's own
    random one, which is then freed: one copy of the weights at the peak, not two (issue 21:
    peak memory of a BART-base-size triage; a safetensors file's tensors are memory-mapped).

    Ties are kept as they were: every place that held one tensor object (shared embeddings, a
    tied head) gets one new object. Where the file gives the places of one tensor different
    values, they are copied in turn into the shared one, as `load_state_dict` does (the last
    wins). `sd` itself is unchanged: its tensors keep the file's dtype."""
    places: dict[int, list[tuple[nn.Module, str, bool, str]]] = {}
    held: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, name, True, dot + name))
                held[id(p)] = p
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                places.setdefault(id(b), []).append((module, name, False, dot + name))
                held[id(b)] = b
    with torch.no_grad():
        for key, where in places.items():
            old = held[key]
            given = [sd[full] for *_, full in where if full in sd]
            if not given:
                continue                       # tied to another, or not in the file: kept
            if any(not torch.equal(given[0], g) for g in given[1:]):
                for g in given:                # one tensor, different values: as load_state_dict
                    old.copy_(g)
                continue
            new = given[0] if given[0].dtype == old.dtype else given[0].to(old.dtype)
            if where[0][2]:
                new = nn.Parameter(new, requires_grad=old.requires_grad)
            for module, name, is_param, _ in where:
                (module._parameters if is_param else module._buffers)[name] = new


class _RowsLinear(torch.autograd.Function):
    """y = x @ W[:keep].T (+ b[:keep]), W's gradient row-sparse: only its first `keep` rows get
    one, and a dense [V, d] gradient for a 50k vocabulary (154 MB on GPT-2 small, and as much
    again for a tied embedding) was the triage pass's peak. Same values as slicing the weight."""

    @staticmethod
    def forward(ctx, x, weight, bias, keep):
        ctx.save_for_backward(x, weight)
        ctx.keep, ctx.has_bias = keep, bias is not None
        return F.linear(x, weight[:keep], None if bias is None else bias[:keep])

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        keep = ctx.keep
        gx = g @ weight[:keep] if ctx.needs_input_grad[0] else None
        rows = torch.arange(keep, device=g.device).unsqueeze(0)
        gw = gb = None
        if ctx.needs_input_grad[1]:
            part = g.reshape(-1, keep).transpose(0, 1) @ x.reshape(-1, x.shape[-1])
            gw = torch.sparse_coo_tensor(rows, part, weight.shape, is_coalesced=True,
                                         check_invariants=False)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = torch.zeros(weight.shape[0], dtype=g.dtype, device=g.device)
            gb[:keep] = g.reshape(-1, keep).sum(0)
        return gx, gw, gb, None


@contextmanager
def sliced_output(model: nn.Module, keep: int | None, check=None):
    """Within: the output layer computes the logits of ids [0, keep) only, exactly (its weight
    rows and BART's `final_logits_bias` sliced; parameters and hooks unchanged), and the
    vocabulary-sized matrices get row-sparse gradients (the head's through _RowsLinear, the
    embeddings' through nn.Embedding's own `sparse`), with the values a dense one has. Yields
    `keep`, or None when there is nothing to slice or the model does not allow it: `check()`
    (a small forward returning logits) must then give `keep` columns, else nothing is changed."""
    head = model.get_output_embeddings()
    bias = getattr(model, "final_logits_bias", None)
    if keep is None or not isinstance(head, nn.Linear) or head.out_features <= keep:
        yield None
        return

    def forward(x):
        return _RowsLinear.apply(x, head.weight, head.bias, keep)
    head.forward = forward                                   # an instance attribute: undone below
    if isinstance(bias, torch.Tensor):
        model.final_logits_bias = bias[..., :keep]
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding)
              and m.num_embeddings > keep and not m.sparse]
    for m in tables:
        m.sparse = True
    try:
        if check is not None:
            try:
                with torch.no_grad():
                    ok = check().shape[-1] == keep
            except Exception:  # noqa: BLE001 - the model's forward needs its whole vocabulary
                ok = False
            if not ok:
                keep = None
                del head.forward
                if isinstance(bias, torch.Tensor):
                    model.final_logits_bias = bias
                bias = None
                for m in tables:
                    m.sparse = False
                tables = []
        yield keep
    finally:
        if "forward" in vars(head):
            del head.forward
        if isinstance(bias, torch.Tensor):
            model.final_logits_bias = bias
        for m in tables:
            m.sparse = False


def transformers_offline():
    """transformers, imported with the hub offline (nothing is ever fetched); a UsageError
    naming the extra to install when it is missing. Lazy: an optional dependency."""
    os.environ["HF_HUB_OFFLINE"] = "1"               # read at import: nothing is fetched
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import transformers         # lazy: an optional dependency
    except ImportError:
        raise UsageError(f"triaging a Hugging Face directory needs transformers: {INSTALL}") from None
    transformers.logging.set_verbosity_error()
    return transformers


# tokenizer_config.json classes that say "the tokenizer is tokenizer.json, nothing of the model's
# own": transformers 5 writes TokenizersBackend for any tokenizers-library tokenizer, and its
# AutoTokenizer then maps the directory's model_type to that model's class (Qwen2Tokenizer), which
# rebuilds its own pre-tokenizer and reads a WordLevel vocabulary as no tokens at all (measured:
# `w5 w9 w10` -> []; the generic class gives [5, 9, 10]). Those load as the generic class.
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_saved_tokenizer(tf, folder: Path):
    """transformers' tokenizer for `folder`: the generic fast class when tokenizer_config.json
    names a generic class and tokenizer.json is there, else AutoTokenizer (raises as they do)."""
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
        return tf.PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    return tf.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def renamed(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sd` with the key renames and merges transformers applies on load (its conversion
    mapping, through its own functions: GPTNeoX saves `embed_out.weight` for the model's
    `lm_head.weight`; transformers 5 holds a mixture of experts' weights fused,
    `mlp.experts.gate_up_proj`, and saves them per expert, `block_sparse_moe.experts.0.w1.weight`,
    which the mapping's operations stack and concatenate). A key is renamed only when it is not
    one of the model's own and its new name is; without the mapping (older transformers), or
    where a merge fails, the keys stay as saved (and what does not fit is refused)."""
    try:                            # lazy: transformers is an optional dependency
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
        mapping = list(get_model_conversion_mapping(model) or [])
    except Exception:  # noqa: BLE001 - no mapping in this transformers: keys as saved
        return sd
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
    own = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out: dict[str, torch.Tensor] = {}
    merges: dict[str, tuple] = {}                   # target key -> (converter, {pattern: [tensors]})
    for k in sorted(sd, key=dot_natural_key):       # experts in their index order
        new, pattern = k, None
        if k not in own:
            try:
                new, pattern = rename_source_key(k, renamings, converters, prefix, own)
            except Exception:  # noqa: BLE001 - a key the mapping cannot read: as saved
                new, pattern = k, None
        if new not in own or new == k:
            out[k] = sd[k]
        elif pattern is None:
            out[new] = sd[k]
        else:
            conv = next(t for t in converters if pattern in t.source_patterns)
            merges.setdefault(new, (conv, {}))[1].setdefault(pattern, []).append((k, sd[k]))
    for new, (conv, parts) in merges.items():
        try:
            d = {p: [v for _, v in kv] for p, kv in parts.items()}
            for op in conv.operations:
                d = op.convert(d, conv.source_patterns, conv.target_patterns)
            (value,) = d.values()
            if not isinstance(value, torch.Tensor):
                raise TypeError(type(value).__name__)
            out[new] = value
        except Exception:  # noqa: BLE001 - not merged: the keys as saved, refused by load_tied
            out.update({k: v for kv in parts.values() for k, v in kv})
    return out
