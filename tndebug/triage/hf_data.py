"""In-distribution data for `tndebug triage DIR` (a Hugging Face directory): --data, or --text.

    --text pairs.tsv      one `source<TAB>target` pair per line, tokenised with the tokenizer saved
                          in DIR (AutoTokenizer, else tokenizer.json through `tokenizers`)
    --data held_out.pt    token ids, as for any triage (tndebug.triage.userdata), targets led by
                          the config's decoder_start_token_id

Only the comparisons that need the model's own kind of text (the temperature sweep) use it; the
probes' behavioural tests run on random ids.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tndebug.data import Batch
from tndebug.errors import UsageError
from tndebug.triage.hf import _line, _transformers

TEXT_MAX_TOKENS = 64                                 # --text: longer lines are truncated


def load_text(spec: str, folder: Path, ids: dict) -> dict:
    """--text FILE: `source<TAB>target` per line -> {'src', 'tgt'} (tgt led by decoder start)."""
    path = Path(spec)
    if not path.is_file():
        raise UsageError(f"--text: no such file {spec}")
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise UsageError(f"--text {spec}: line {n} has no TAB; each line is source<TAB>target")
        s, t = line.split("\t", 1)
        pairs.append((s, t))
    if len(pairs) < 2:
        raise UsageError(f"--text {spec}: need at least 2 source<TAB>target lines, found {len(pairs)}")
    encode = _tokenizer(folder, spec)
    src = [encode(s, False)[:TEXT_MAX_TOKENS] for s, _ in pairs]
    tgt = [[ids["start"]] + encode(t, True)[:TEXT_MAX_TOKENS] for _, t in pairs]
    special = set(ids["specials"].values())
    if not any(i not in special for row in src + tgt for i in row):
        raise UsageError(f"--text {spec}: the tokenizer in {folder} gives only special ids for "
                         f"every line (is it the model's tokenizer?)")

    def padded(rows):
        width = max(map(len, rows))
        return torch.tensor([r + [ids["pad"]] * (width - len(r)) for r in rows], dtype=torch.long)
    return {"src": padded(src), "tgt": padded(tgt)}


def _tokenizer(folder: Path, spec: str):
    """encode(text, is_target) -> ids with the model's special tokens, from the tokenizer in DIR:
    a transformers tokenizer where `tokenizer_config.json` says which class it is (Marian's
    separate target vocabulary needs `text_target`), else `tokenizer.json` through `tokenizers`.
    (Without tokenizer_config.json, AutoTokenizer guesses the class from the model_type and may
    read a tokenizer.json of another kind into garbage ids.)"""
    if (folder / "tokenizer_config.json").is_file():
        tf = _transformers()
        try:
            tok = tf.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - missing vocab files, a missing sentencepiece, ...
            raise UsageError(f"--text {spec}: the tokenizer saved in {folder} does not load "
                             f"({_line(e)[:160]}); pass --data with token ids") from None

        def encode(text, target):
            return list(tok(text_target=text)["input_ids"] if target else tok(text)["input_ids"])
        return encode
    if (folder / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer
            raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"--text {spec}: {folder}/tokenizer.json is unreadable ({_line(e)})") from None
        return lambda text, target: raw.encode(text).ids
    raise UsageError(f"--text {spec}: no tokenizer saved in {folder} (tokenizer_config.json or "
                     f"tokenizer.json: tokenizer.save_pretrained(DIR)), or pass --data with token ids")


def held_out(opts, folder: Path, ids: dict, marker: int, config=None):
    """(the user's in-distribution batch (column 0 = the probes' marker), its source, the
    checkpoint findings of its ids against config.json), or (None, None, [])."""
    from tndebug.triage.hf_checks import ids_vs_data
    from tndebug.triage.userdata import _call, _read, to_batch
    if opts.data and getattr(opts, "text", None):
        raise UsageError("pass --data or --text, not both")
    if opts.data:
        path_s, sep, name = opts.data.rpartition(":")
        raw = _call(opts.data) if sep and path_s.endswith(".py") and name else _read(Path(opts.data))
        source = f"--data {opts.data}"
    elif getattr(opts, "text", None):
        raw, source = load_text(opts.text, folder, ids), f"--text {opts.text}"
    else:
        return None, None, []
    findings, start = [], ids["start"]
    if isinstance(raw, dict) and all(isinstance(raw.get(k), torch.Tensor) and raw[k].dim() == 2
                                     and not raw[k].is_floating_point() for k in ("src", "tgt")):
        findings = ids_vs_data(raw["src"].long(), raw["tgt"].long(), config, source) if config else []
        lead = raw["tgt"][:, 0]
        if any(f.where == "decoder_start_token_id" for f in findings):
            start = int(lead[0])         # named above; read the data as it is led
    batch = to_batch(raw, ids["pad"], start, opts.data or source)
    tgt_in = batch.tgt_in.clone()
    tgt_in[:, 0] = marker
    return Batch(batch.src, tgt_in, batch.tgt_out), source, findings
