"""Hugging Face consistency checks for `tndebug triage DIR` (issue 19): configs and files that
break a model while every tensor looks normal. Findings under probe "checkpoint".

* `tied_head`: an output layer (lm_head.weight) saved in the file that differs from the
  embedding config.json ties it to. transformers then unties them and predicts with the saved
  head (issue 19 measured a BART with a stray lm_head at 0.4% held-out accuracy); the model is untied here
  too, so triage examines what transformers runs.
  (An untied head that does not fit the trained body needs the user's data:
  `head.head_unfit_on_data`.)
* `ids_vs_tokenizer`: pad / eos / decoder-start ids of config.json against the tokenizer saved
  in DIR (transformers' shift_tokens_right, generate() and the embeddings' padding_idx read the
  config's ids; the tokenizer writes its own).
* `ids_vs_data`: the same ids against --data (pads, the id leading every target, the id ending
  them).
* `weight_files_differ`: model.safetensors and a pytorch_model.bin side by side that hold
  different tensors: which one is triaged is said, never silently.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tndebug.findings import Finding
from tndebug.hf.load import load_saved_tokenizer, transformers_offline

FIX_TIE = ("save the model again after model.tie_weights() (the head then is the embedding), or, "
           "if the head is meant to be its own matrix, set \"tie_word_embeddings\": false in "
           "config.json and train that head")


def tied_head(model: nn.Module, sd: dict[str, torch.Tensor]) -> list[Finding]:
    """triage's check of the output head, before loading `sd` into the fresh `model`: a saved
    head that differs from the embedding it is tied to (untied here, as transformers does)."""
    return _tied_differs(model, sd)


def _tied_differs(model: nn.Module, sd: dict[str, torch.Tensor]) -> list[Finding]:
    """Before loading: the keys sharing the output layer's storage (the tie config.json
    declares). When the file holds the head and an embedding of that group with different
    values, untie the head (as transformers does) and return the error."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return []
    ptr = head.weight.data_ptr()
    group = [k for k, v in model.state_dict().items() if v.data_ptr() == ptr]
    head_key = next((k for k, p in model.named_parameters(remove_duplicate=False) if p is head.weight
                     and k in sd and not any(w in k for w in ("embed", "shared", "wte"))), None)
    if head_key is None or len(group) < 2:
        return []
    emb_key = next((k for k in group if k != head_key and k in sd), None)
    if emb_key is None:
        return []
    h, e = sd[head_key].float(), sd[emb_key].float()
    if h.shape != e.shape or torch.equal(h, e):
        return []
    head.weight = nn.Parameter(head.weight.detach().clone())          # untied, as transformers does
    model.config.tie_word_embeddings = False
    if not _tie_declared(model.config):
        return []           # T5 v1.1 / mT5 / Flan-T5: config.json unties; transformers 5 ties the
                            # class anyway and unties on load: the saved head is the design
    diff = (h - e).abs().max().item()
    return [Finding("checkpoint", "error",
                    f"{head_key} in the file differs from {emb_key}, to which config.json ties it "
                    f"(tie_word_embeddings): transformers unties them and predicts with "
                    f"{head_key} (norm {h.norm():.4g}, embedding norm {e.norm():.4g}, max "
                    f"|difference| {diff:.4g})", where=head_key, step=0, fix=FIX_TIE,
                    evidence={"head": head_key, "embedding": emb_key, "head_norm": h.norm().item(),
                              "embedding_norm": e.norm().item(), "max_abs_difference": diff,
                              "tied_group": group, "triaged": "untied, as transformers loads it",
                              "threshold": "torch.equal(head, embedding) when config.json ties them"}, code="checkpoint/tied-head-differs")]


def _tie_declared(config) -> bool:
    """Whether config.json itself ties the head (`tie_word_embeddings`, true when absent). The
    loaded config may not say: transformers 5's T5Config forces tie_word_embeddings = True and
    keeps the file's false only as scale_decoder_outputs = False."""
    try:
        raw = json.loads((Path(config._name_or_path) / "config.json").read_text())
        return raw.get("tie_word_embeddings", True) is not False
    except (OSError, ValueError, TypeError, AttributeError):
        return getattr(config, "scale_decoder_outputs", True) is not False


# (config field, tokenizer field, severity): pad and eos are read by the model's own code as it
# trains and runs (the embeddings' padding_idx, shift_tokens_right, generate()'s stop), so a
# mismatch there is an error; bos only by generate() started without a prompt (the tokenizer
# prepends its own id to every text it encodes): a mismatch bites that one use, a warning.
ID_FIELDS = (("pad_token_id", "pad_token_id", "error"), ("eos_token_id", "eos_token_id", "error"),
             ("bos_token_id", "bos_token_id", "warning"))
BOS_WHY = ("generate() without a prompt starts from config.json's bos_token_id, while the "
           "tokenizer starts every text it encodes with its own: the model is asked to continue "
           "a first token it was not trained after")


def _ids(value) -> set[int]:
    vals = value if isinstance(value, (list, tuple)) else [value]
    return {v for v in vals if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def ids_vs_tokenizer(folder: Path, config) -> list[Finding]:
    """config.json's pad and eos ids against the saved tokenizer's; decoder_start must be one
    of the tokenizer's special ids. Nothing when no tokenizer is saved (or it does not load)."""
    tok = _tokenizer(folder)
    if tok is None:
        return []
    out = []
    for cfg_field, tok_field, severity in ID_FIELDS:
        mine, theirs = _ids(getattr(config, cfg_field, None)), _ids(getattr(tok, tok_field, None))
        if mine and theirs and not mine & theirs:
            out.append(Finding(
                "checkpoint", severity,
                f"config.json {cfg_field} = {_show(mine)}, but the tokenizer in {folder.name} "
                f"writes {_show(theirs)} ({getattr(tok, tok_field.replace('_id', ''), '?')!s})"
                + (f": {BOS_WHY}" if cfg_field == "bos_token_id" else ""),
                where=cfg_field, step=0,
                fix=f"set \"{cfg_field}\": {_show(theirs)} in config.json (" + (
                    "generate() reads config.json; the tokenizer writes its own id)"
                    if cfg_field == "bos_token_id" else
                    "transformers' shift_tokens_right, generate() and the embeddings' padding_idx "
                    "read config.json; the tokenizer writes its own ids)"),
                evidence={"config": sorted(mine), "tokenizer": sorted(theirs), "source": "tokenizer",
                          "threshold": "the config's id must be the tokenizer's"}, code="checkpoint/id-vs-tokenizer"))
    start = _ids(getattr(config, "decoder_start_token_id", None))
    specials = set(getattr(tok, "all_special_ids", []) or [])
    if start and specials and not start & specials:
        word = tok.convert_ids_to_tokens(sorted(start)[0]) if hasattr(tok, "convert_ids_to_tokens") else "?"
        out.append(Finding(
            "checkpoint", "error",
            f"config.json decoder_start_token_id = {_show(start)} is an ordinary token of the "
            f"tokenizer ({word!r}), not one of its special ids {sorted(specials)}: the decoder "
            f"starts every target with it", where="decoder_start_token_id", step=0,
            fix="set \"decoder_start_token_id\" to the id the model was trained to start from "
                "(BART: eos 2; T5, Marian, Pegasus: pad)",
            evidence={"config": sorted(start), "tokenizer_special_ids": sorted(specials),
                      "source": "tokenizer", "threshold": "a special id of the tokenizer"}, code="checkpoint/start-id-ordinary"))
    return out


def ids_vs_data(src: torch.Tensor, tgt: torch.Tensor, config, source: str) -> list[Finding]:
    """The ids the user's data shows, each against config.json: the one id leading every
    target (the decoder start), the one id ending every target (eos), the id filling the short
    rows (pad). `src`, `tgt`: the data as read (tgt with its start in column 0)."""
    out = []
    pad = _ids(getattr(config, "pad_token_id", None))
    found = {"decoder_start_token_id": _constant(tgt[:, 0]),
             "eos_token_id": _constant(_last_real(tgt, pad)),
             "pad_token_id": _pad_fill(src.tolist() + tgt[:, 1:].tolist())}
    what = {"decoder_start_token_id": "leads every target", "eos_token_id": "ends every target",
            "pad_token_id": "fills the short rows"}
    for cfg_field, data_id in found.items():
        mine = _ids(getattr(config, cfg_field, None))
        if not mine or data_id is None or data_id in mine:
            continue
        if cfg_field == "pad_token_id" and any(bool((t == p).any()) for t in (src, tgt) for p in mine):
            continue                       # the config's pad is in the data too: not decided
        out.append(Finding(
            "checkpoint", "error",
            f"id {data_id} {what[cfg_field]} in {source}, but config.json {cfg_field} = {_show(mine)}",
            where=cfg_field, step=0,
            fix=f"the data and the model disagree: set \"{cfg_field}\": {data_id} in config.json if "
                f"that is the id training used, else make the data use {_show(mine)}",
            evidence={"config": sorted(mine), "data": data_id, "source": source,
                      "threshold": f"the one id that {what[cfg_field]} (>= 2 rows)"}, code="checkpoint/id-vs-data"))
    return out


def _constant(col: torch.Tensor) -> int | None:
    """The one value of a column of >= 2 entries, else None."""
    return int(col[0]) if col.numel() >= 2 and bool((col == col[0]).all()) else None


def _last_real(tgt: torch.Tensor, pad: set[int]) -> torch.Tensor:
    """Each row's last id that is not a pad (the row's last id when it has none)."""
    real = ~torch.isin(tgt, torch.tensor(sorted(pad), dtype=tgt.dtype)) if pad else torch.ones_like(tgt, dtype=torch.bool)
    idx = torch.where(real.any(1), (real.long() * torch.arange(tgt.shape[1])).argmax(1), tgt.shape[1] - 1)
    return tgt.gather(1, idx[:, None])[:, 0]


def _pad_fill(rows: list[list[int]]) -> int | None:
    """The id that fills the end of rows of different lengths: each row's trailing run of one
    id, of length >= 2; one id for >= 2 rows whose runs differ in length. None otherwise."""
    runs = {}
    for row in rows:
        n = 1
        while n < len(row) and row[-n - 1] == row[-1]:
            n += 1
        if n >= 2:
            runs.setdefault(row[-1], set()).add(n)
    ids = [i for i, lengths in runs.items() if len(lengths) >= 2]
    return ids[0] if len(ids) == 1 else None


def weight_files_differ(folder: Path, used: list[Path], read) -> tuple[list[Finding], str | None]:
    """model.safetensors and pytorch_model.bin (or their indexes) side by side: compare the
    other one with the triaged one. (findings, a note for the report, or None)."""
    names = {p.name for p in used}
    st = any(n.endswith(".safetensors") for n in names)
    other = (folder / "pytorch_model.bin") if st else (folder / "model.safetensors")
    if not other.is_file():
        return [], None
    try:
        a, b = read(used), read([other])
    except Exception as e:  # noqa: BLE001 - a corrupt second file: said, not fatal
        return [], f"{other.name} is also in {folder.name} but does not read ({str(e)[:100]})"
    keys = sorted(set(a) | set(b))
    differ = [k for k in keys if k not in a or k not in b or a[k].shape != b[k].shape
              or not torch.equal(a[k].float(), b[k].float())]
    triaged = ", ".join(sorted(names))
    if not differ:
        return [], f"{other.name} is also in {folder.name}, with the same tensors as {triaged}"
    diffs = [(a[k].float() - b[k].float()).abs().max().item() for k in differ
             if k in a and k in b and a[k].shape == b[k].shape]
    return [Finding(
        "checkpoint", "warning",
        f"{folder.name} holds {triaged} and {other.name}, and they differ ({len(differ)} of "
        f"{len(keys)} tensors, e.g. {differ[0]}{f'; max |difference| {max(diffs):.4g}' if diffs else ''}): "
        f"triaged {triaged}, which transformers' from_pretrained loads too (it prefers safetensors)",
        where=other.name, step=0,
        fix=f"delete the stale file, or save the model again (save_pretrained writes "
            f"model.safetensors only): a tool or a transformers version that reads {other.name} "
            f"runs another model",
        evidence={"triaged": sorted(names), "other": other.name, "differing_tensors": len(differ),
                  "tensors": len(keys), "examples": differ[:5],
                  "max_abs_difference": max(diffs) if diffs else None}, code="checkpoint/weight-files-differ")], None


def _show(ids: set[int]) -> str:
    return str(sorted(ids)[0]) if len(ids) == 1 else str(sorted(ids))


def _tokenizer(folder: Path):
    if not ((folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file()):
        return None
    tf = transformers_offline()
    try:
        if (folder / "tokenizer_config.json").is_file():
            return load_saved_tokenizer(tf, folder)
        return tf.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - an unreadable tokenizer: --text says so when used
        return None
