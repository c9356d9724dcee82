"""In-distribution data for `tndebug triage DIR` (a Hugging Face directory): --data, or --text.
transformers and tokenizers are optional dependencies (`tndebug[hf]`), imported only where a saved
tokenizer is loaded.

    --text pairs.tsv      one `source<TAB>target` pair per line, tokenised with the tokenizer saved
                          in DIR (AutoTokenizer, else tokenizer.json through `tokenizers`)
    --data held_out.pt    token ids, as for any triage (tndebug.triage.userdata), targets led by
                          the config's decoder_start_token_id

A decoder-only or encoder-only directory reads one sequence per line instead:

    --text lines.txt      one sequence per line (the whole line, TABs included), tokenised with
                          the saved tokenizer and its special tokens; a decoder-only row is led by
                          the config's BOS where the tokenizer adds none (as the probes' rows are)
    --data held_out.pt    torch.save({"ids": LongTensor[N, T]}): token ids, right-padded with the
                          config's pad id, used as they are

Given, it is the probes' recorded batch (their statistics and every figure: `run.figures_batch`)
and the held-out data of the temperature sweep and the untied-head check; the exact behavioural
tests keep their own inputs.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tndebug.data import Batch
from tndebug.errors import UsageError
from tndebug.findings import Finding
from tndebug.hf.checks import ids_vs_data
from tndebug.hf.load import load_saved_tokenizer, transformers_offline
from tndebug.one_stack import one_stack_batch
from tndebug.padding import mid_sequence_pads, pad_text
from tndebug.paths import text_file
from tndebug.safeload import first_line
from tndebug.triage.userdata import call_data_function, read_data_file, to_batch

TEXT_MAX_TOKENS = 64                                 # --text: longer lines are truncated


def load_text(spec: str, folder: Path, ids: dict, kind: str = "seq2seq") -> dict:
    """--text FILE: `source<TAB>target` per line -> {'src', 'tgt'} (tgt led by decoder start);
    a decoder- or encoder-only `kind`: one sequence per line -> {'ids'}."""
    path = Path(spec)
    text = text_file(spec)                   # missing, binary: one line (the CLI checks it first)
    if kind != "seq2seq":
        return {"ids": _lines(path, spec, folder, ids, kind)}
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
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


def _lines(path: Path, spec: str, folder: Path, ids: dict, kind: str) -> torch.Tensor:
    """One sequence per non-blank line -> [N, T] right-padded with the pad id; a decoder-only
    row led by BOS (ids['start']) where the tokenizer put none there."""
    lines = [ln for ln in text_file(spec).splitlines() if ln.strip()]
    if len(lines) < 2:
        raise UsageError(f"--text {spec}: need at least 2 lines (one sequence each), found {len(lines)}")
    encode = _tokenizer(folder, spec)
    rows = [encode(ln, False)[:TEXT_MAX_TOKENS] for ln in lines]
    if kind == "decoder":
        rows = [r if r[:1] == [ids["start"]] else [ids["start"]] + r[:TEXT_MAX_TOKENS - 1]
                for r in rows]
    special = set(ids["specials"].values()) | {ids["pad"]}
    if not any(i not in special for row in rows for i in row):
        raise UsageError(f"--text {spec}: the tokenizer in {folder} gives only special ids for "
                         f"every line (is it the model's tokenizer?)")
    width = max(map(len, rows))
    return torch.tensor([r + [ids["pad"]] * (width - len(r)) for r in rows], dtype=torch.long)


def _tokenizer(folder: Path, spec: str):
    """encode(text, is_target) -> ids with the model's special tokens, from the tokenizer in DIR:
    a transformers tokenizer where `tokenizer_config.json` says which class it is (Marian's
    separate target vocabulary needs `text_target`), else `tokenizer.json` through `tokenizers`.
    (Without tokenizer_config.json, AutoTokenizer guesses the class from the model_type and may
    read a tokenizer.json of another kind into garbage ids.)"""
    tok = _saved_tokenizer(folder, spec)
    if hasattr(tok, "convert_ids_to_tokens"):                    # a transformers tokenizer
        def encode(text, target):
            return list(tok(text_target=text)["input_ids"] if target else tok(text)["input_ids"])
        return encode
    if tok is not None:
        return lambda text, target: tok.encode(text).ids
    raise UsageError(f"--text {spec}: no tokenizer saved in {folder} (tokenizer_config.json or "
                     f"tokenizer.json: tokenizer.save_pretrained(DIR)), or pass --data with token ids")


_TOKENIZERS: dict = {}                 # folder -> the tokenizer loaded (--text, then the labels)


def _saved_tokenizer(folder: Path, spec: str):
    """The tokenizer saved in `folder` (transformers' where tokenizer_config.json names it, else
    tokenizer.json through `tokenizers`), loaded once; None when there is none."""
    key = (str(folder.resolve()),) + tuple(
        (folder / n).stat().st_mtime_ns if (folder / n).is_file() else None
        for n in ("tokenizer_config.json", "tokenizer.json"))         # a re-saved one reloads
    if key in _TOKENIZERS:
        return _TOKENIZERS[key]
    tok = None
    if (folder / "tokenizer_config.json").is_file():
        tf = transformers_offline()
        try:
            tok = load_saved_tokenizer(tf, folder)
        except Exception as e:  # noqa: BLE001 - missing vocab files, a missing sentencepiece, ...
            raise UsageError(f"--text {spec}: the tokenizer saved in {folder} does not load "
                             f"({first_line(e)[:160]}); pass --data with token ids") from None
    elif (folder / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer     # lazy: an optional dependency
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"--text {spec}: {folder}/tokenizer.json is unreadable ({first_line(e)[:200]})") from None
    _TOKENIZERS[key] = tok
    return tok


def token_names(folder: Path, batch) -> dict[int, str]:
    """{id: the saved tokenizer's token} for every id of `batch` (the figures' axis labels;
    reporters shorten and escape them); {} when DIR holds no tokenizer that loads, and an id
    the tokenizer cannot name is left out (the figure shows the id)."""
    try:
        tok = _saved_tokenizer(folder, "(labels)")
    except UsageError:
        return {}
    if tok is None:
        return {}
    found = sorted({int(i) for t in batch for i in t.flatten().tolist()})
    name = (tok.convert_ids_to_tokens if hasattr(tok, "convert_ids_to_tokens") else tok.id_to_token)
    out = {}
    for i in found:
        try:
            got = name(i)
        except Exception:  # noqa: BLE001 - an id past the tokenizer's vocabulary
            continue
        if isinstance(got, str) and got:
            out[i] = got
    return out


def held_out(data: str | None, text: str | None, folder: Path, ids: dict, marker: int, config=None,
             kind: str = "seq2seq"):
    """(the user's in-distribution batch (column 0 = the probes' marker), its source, the
    checkpoint findings of its ids against config.json), or (None, None, []), from `data` (the
    --data spec) or `text` (the --text file). A decoder- or encoder-only `kind` reads one
    sequence per row (`one_stack_batch`)."""
    if data and text:
        raise UsageError("pass --data or --text, not both")
    if data:
        path_s, sep, name = data.rpartition(":")
        raw = (call_data_function(data) if sep and path_s.endswith(".py") and name
               else read_data_file(Path(data)))
        source = f"--data {data}"
    elif text:
        raw, source = load_text(text, folder, ids, kind), f"--text {text}"
    else:
        return None, None, []
    if isinstance(raw, torch.Tensor):            # the bare ids tensor: {'ids': ...}
        raw = {"ids": raw}
    # --text: ids the model's own tokenizer wrote, so a config pad among them is the config's
    # defect (a finding); --data: ids the user made, refused below as bad input (exit 2)
    wrong_pad = pad_in_data(raw, ids["pad"], source) if not data else []
    if wrong_pad:                         # the config's pad is a real token here: read nothing
        return None, source, wrong_pad
    if kind != "seq2seq":
        return one_stack_batch(raw, ids["pad"], kind, source), source, []
    findings, start = [], ids["start"]
    if isinstance(raw, dict) and all(isinstance(raw.get(k), torch.Tensor) and raw[k].dim() == 2
                                     and not raw[k].is_floating_point() for k in ("src", "tgt")):
        findings = ids_vs_data(raw["src"].long(), raw["tgt"].long(), config, source) if config else []
        lead = raw["tgt"][:, 0]
        if any(f.where == "decoder_start_token_id" for f in findings):
            start = int(lead[0])         # named above; read the data as it is led
    batch = to_batch(raw, ids["pad"], start, data or source)
    tgt_in = batch.tgt_in.clone()
    tgt_in[:, 0] = marker
    return Batch(batch.src, tgt_in, batch.tgt_out), source, findings


def pad_in_data(raw, pad: int, source: str) -> list[Finding]:
    """config.json's pad id occurring mid-sequence (a real token on both sides) in the ids the
    saved tokenizer wrote from the user's --text: a config that contradicts the data the model
    reads (issue 19: a wrong pad_token_id masks real tokens), an error on pad_token_id, not bad
    input: the data are the model's own, as its tokenizer writes them. [] when the pad only fills row ends, or the ids are not
    tensors (their reader says what is wrong)."""
    tensors = {k: v for k, v in (raw.items() if isinstance(raw, dict) else ())
               if k in ("ids", "src", "tgt") and isinstance(v, torch.Tensor) and v.dim() == 2
               and not v.is_floating_point()}
    found = mid_sequence_pads(tensors, pad)
    if not found:
        return []
    return [Finding(
        "checkpoint", "error",
        f"config.json pad_token_id = {pad} is a real token of {source}: {pad_text(found, pad)}; "
        f"the model masks it as padding wherever it occurs, so the data were not used (the "
        f"checks that need them did not run)", where="pad_token_id", step=0,
        fix=f"set \"pad_token_id\" in config.json to the id that pads your rows (the "
            f"tokenizer's pad id), not {pad}, an id your data use as a word",
        evidence={"config": [pad], "mid_sequence": found, "source": source,
                  "threshold": "a pad only fills the ends of a row"},
        code="checkpoint/id-vs-data")]


def tokenizer_padding_side(folder: Path) -> str | None:
    """The padding_side of a saved tokenizer (`tokenizer_config.json` in `folder`), else None:
    lm-decoding reads it as `Subject.padding_side`."""
    try:
        side = json.loads((Path(folder) / "tokenizer_config.json").read_text()).get("padding_side")
    except (OSError, ValueError, AttributeError):
        return None
    return side if isinstance(side, str) else None


def mask_token_id(folder: Path, config) -> int | None:
    """The masked-LM's mask id: config.json's mask_token_id, else the saved tokenizer's
    (`mask_token_id`, or `[MASK]` / `<mask>` in a bare tokenizer.json); None when neither says."""
    got = getattr(config, "mask_token_id", None)
    if isinstance(got, int) and not isinstance(got, bool) and got >= 0:
        return got
    try:
        tok = _saved_tokenizer(folder, "(mask id)")
    except UsageError:
        return None
    if tok is None:
        return None
    got = getattr(tok, "mask_token_id", None) if hasattr(tok, "convert_ids_to_tokens") else next(
        (i for i in (tok.token_to_id(t) for t in ("[MASK]", "<mask>")) if i is not None), None)
    return got if isinstance(got, int) and got >= 0 else None


def tokenizer_specials(folder: Path) -> list[int]:
    """The saved tokenizer's special ids ([CLS], [SEP], ...: never masked for the sweep); [] when
    DIR has no transformers tokenizer."""
    try:
        tok = _saved_tokenizer(folder, "(special ids)")
    except UsageError:
        return []
    return list(getattr(tok, "all_special_ids", None) or [])
