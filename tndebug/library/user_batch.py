"""The batch of the user's own training step, as `tndebug.watch` reads it from the model's call
(`default_batch`, `shift_left`), and the pad id seen in it (`pad_id_findings`): a pad id that is
a real token of the user's data.
"""
from __future__ import annotations

import torch

from tndebug.findings import Finding
from tndebug.padding import mid_sequence_pads, pad_text


def default_batch(args: tuple, kwargs: dict, pad_id: int, start_id: int | None = None,
                  kind: str = "seq2seq"):
    """(src, tgt_in, tgt_out) from the arguments the user's loop passed to the model, or None.

    * an encoder-only model (`kind="encoder"`): its ids are src and tgt_in; Hugging Face
      `labels` (-100 -> pad), unshifted (a masked LM predicts each position's own token), are
      the target, else None.
    * a decoder-only model (`kind="decoder"`): its ids, `input_ids` or the first 2-D integer
      tensor, are tgt_in and src is empty; Hugging Face `labels` (the ids, -100 -> pad, which
      the model shifts itself) shifted left are the target, else None.

    * Hugging Face style: `input_ids`, then `decoder_input_ids`, else `labels` shifted right
      (what the model itself does); `labels` (-100 -> pad) is the target.
    * otherwise: the first two 2-D integer tensors among the positional, then keyword
      arguments are src and tgt_in (`model(src, tgt_in, ...)`); the target is None, for the
      caller to take as `shift_left(tgt_in)` where it needs one.
    """
    ids = kwargs.get("input_ids")
    if kind in ("encoder", "decoder"):        # one sequence
        if not isinstance(ids, torch.Tensor):
            ids = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                        and a.dim() == 2 and not a.is_floating_point() and a.dtype != torch.bool), None)
        if ids is None:
            return None
        labels = kwargs.get("labels")
        tgt_out = None
        if isinstance(labels, torch.Tensor) and labels.shape == ids.shape:
            tgt_out = labels.masked_fill(labels < 0, pad_id)          # -100 -> pad
            if kind == "decoder":                 # the model shifts them itself: so do we
                tgt_out = shift_left(tgt_out, pad_id)
        return (ids, ids, tgt_out) if kind == "encoder" else (ids[:, :0], ids, tgt_out)
    if isinstance(ids, torch.Tensor):
        labels = kwargs.get("labels")
        tgt_out = None
        if isinstance(labels, torch.Tensor):
            tgt_out = labels.masked_fill(labels < 0, pad_id)
        tgt_in = kwargs.get("decoder_input_ids")
        if not isinstance(tgt_in, torch.Tensor) and tgt_out is not None:
            start = pad_id if start_id is None else start_id
            tgt_in = torch.cat([torch.full_like(tgt_out[:, :1], start), tgt_out[:, :-1]], dim=1)
        if not isinstance(tgt_in, torch.Tensor):
            return None
        return ids, tgt_in, tgt_out
    found = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() == 2
             and not a.is_floating_point() and a.dtype != torch.bool]
    if len(found) < 2:
        return None
    return found[0], found[1], None


def shift_left(tgt_in: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The target of teacher forcing from its input: tgt_out[:, i] = tgt_in[:, i+1], exact but
    for the last position, unknown and so pad (ignored).  [B, T] -> [B, T]"""
    return torch.cat([tgt_in[:, 1:], torch.full_like(tgt_in[:, :1], pad_id)], dim=1)


def pad_id_findings(batch, pad_id: int, step: int) -> list[Finding]:
    """A warning when the pad id occurs mid-sequence in `batch` (src, tgt_in, ...) of the user's
    loop: then it is a real token, and every mask verdict judged the wrong positions. [] if not
    (and always with pad_id=None, NO_PAD: no id equals it).

    The fix names the argument to change: the pad id (`pad_id=`), `pad_id=None` for data with
    no padding, or `batch=` when the pads fill only row ends once the tensors are read
    sequence-first ([T, B]: a model called as `model(src.T, tgt.T)`)."""
    if batch is None:
        return []
    tensors = {k: t for k, t in (("src", batch[0]), ("tgt_in", batch[1]))
               if isinstance(t, torch.Tensor) and t.dim() == 2 and t.numel()}
    found = mid_sequence_pads(tensors, pad_id)
    if not found:
        return []
    # read the other way round, do the pads only fill row ends? then the call is sequence-first
    seq_first = (all(t.shape[0] >= 3 for t in tensors.values())     # a [T, B] row needs 3 ids
                 and not mid_sequence_pads({k: t.T for k, t in tensors.items()}, pad_id))
    evidence = {"pad_id": pad_id, **{f"{k}_rows": f"{v['rows']} of {v['of']}" for k, v in found.items()},
                **{f"{k}_positions": v["at"] for k, v in found.items()},
                "read_as": "batch-first [B, T]",
                "pads_at_row_ends_if_sequence_first": seq_first}
    example = "batch=lambda args, kwargs: " + (
        "(args[0].T[:, :0], args[0].T)" if "src" not in tensors          # one stack: [T, B] ids
        else "(args[0].T, args[0].T)" if batch[0] is batch[1] else "(args[0].T, args[1].T)")
    layout = (f"if your model is called sequence-first (model(src.T, tgt.T), [T, B] tensors), tell "
              f"watch how to read its call: tndebug.watch(..., {example})")
    if seq_first:
        message = (pad_text(found, pad_id) + "; read as [T, B] (sequence-first) the pads only fill "
                   "the ends of each sequence: the call is likely sequence-first, not the pad id wrong")
        fix = (f"{layout[0].upper()}{layout[1:]}; the tensors were read batch-first ([B, T]). If "
               f"they are batch-first, pass the id your rows are padded with (pad_id=ID, e.g. "
               f"tokenizer.pad_token_id), or pad_id=None if your data has no padding")
    else:
        message = pad_text(found, pad_id)
        fix = (f"pass the id your rows are padded with: tndebug.watch(..., pad_id=ID) (e.g. "
               f"tokenizer.pad_token_id; {pad_id} is a real token of your data, see the positions "
               f"in the evidence); if your data has no padding (character-level text, fixed-length "
               f"windows), pass pad_id=None; {layout}")
    return [Finding("pad-id", "warning", message, where="", step=step, evidence=evidence,
                    fix=fix, code="pad-id/mid-sequence")]
