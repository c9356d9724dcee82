"""`tndebug triage DIR --text/--data` for every shape (issue 21), and figures that show the batch
the probes recorded, with the saved tokenizer's tokens on their axes (issue 23): BART and Marian
(seq2seq), GPT-2 and Llama (decoder-only), BERT (encoder-only), each from a tiny random-init
config with a WordLevel tokenizer trained here and saved beside it (nothing is downloaded).
Through the CLI: exit 4 (INCOMPLETE: these models are untrained, so the temperature sweep cannot
judge them, with data or without), report.json lists the figures and says which batch they show,
the attention maps' tick labels are the decoded tokens of that batch, the PNGs are not blank,
TensorBoard's own reader sees one step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tndebug.cli import main                                            # noqa: E402
from tndebug.reporters import figures_common                            # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

V, D = 96, 32
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "a", "big", "red", "fox", "$",
         "jumps", "over", "lazy", "bird", "sings", "at", "dawn"]
FILL = [f"t{i}" for i in range(V - len(WORDS))]        # the rest of the vocabulary, named too
# per shape: the tokenizer's special tokens at the ids the config gives them, and its template
SPECIAL = {"bart": ({"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}, "<s> $A </s>"),
           "marian": ({"</s>": 0, "<unk>": 1, "<pad>": V - 1}, "$A </s>"),
           "gpt2": ({"<|endoftext|>": 0}, None),
           "llama": ({"<unk>": 0, "<s>": 1, "</s>": 2}, "<s> $A"),
           "bert": ({"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}, "[CLS] $A [SEP]")}
KIND = {"bart": "seq2seq", "marian": "seq2seq", "gpt2": "decoder", "llama": "decoder",
        "bert": "encoder"}
MAP = {"seq2seq": "attention_enc_self.png", "decoder": "attention_dec_self.png",
       "encoder": "attention_enc_self.png"}


def config(arch: str):
    T = transformers
    if arch in ("bart", "marian"):
        sizes = dict(vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, max_position_embeddings=128, dropout=0.0)
        if arch == "bart":
            return T.BartConfig(**sizes)
        return T.MarianConfig(**sizes, decoder_vocab_size=V, pad_token_id=V - 1,
                              decoder_start_token_id=V - 1, eos_token_id=0)
    if arch == "gpt2":
        return T.GPT2Config(vocab_size=V, n_embd=D, n_layer=2, n_head=4, n_positions=128,
                            bos_token_id=0, eos_token_id=0)              # as its tokenizer
    sizes = dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=128)
    if arch == "llama":
        return T.LlamaConfig(**sizes, num_key_value_heads=2)
    return T.BertConfig(**sizes)


def save(arch: str, folder: Path, tokenizer: bool = True) -> Path:
    """The model (save_pretrained) and, with `tokenizer`, a WordLevel tokenizer of WORDS wrapped
    in PreTrainedTokenizerFast and saved as users save theirs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    torch.manual_seed(0)
    auto = {"seq2seq": transformers.AutoModelForSeq2SeqLM, "decoder": transformers.AutoModelForCausalLM,
            "encoder": transformers.AutoModelForMaskedLM}[KIND[arch]]
    auto.from_config(config(arch)).save_pretrained(folder)
    if not tokenizer:
        return folder
    special, template = SPECIAL[arch]
    free = [i for i in range(V) if i not in special.values()]
    vocab = {**special, **dict(zip(WORDS + FILL, free))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=next(t for t in special if "unk" in t.lower())
                                     if any("unk" in t.lower() for t in special) else None))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(t, special[t]) for t in template.split() if t != "$A"])
    roles = {"<s>": "bos_token", "</s>": "eos_token", "<unk>": "unk_token", "<pad>": "pad_token",
             "[PAD]": "pad_token", "[UNK]": "unk_token", "[CLS]": "cls_token", "[SEP]": "sep_token",
             "[MASK]": "mask_token", "<|endoftext|>": "eos_token"}
    kw = {roles[t]: t for t in special}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kw).save_pretrained(folder)
    return folder


def lines(n: int = 12) -> list[str]:
    g = torch.Generator().manual_seed(1)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(k),), generator=g))
            for k in torch.randint(4, 10, (n,), generator=g)]


def text_file(arch: str, path: Path) -> Path:
    rows = lines()
    if KIND[arch] == "seq2seq":
        path.write_text("".join(f"{a}\t{b}\n" for a, b in zip(rows, reversed(rows))))
    else:
        path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture
def drawn(monkeypatch):
    """{figure file: {"x": [tick labels], "y": [...]}} of every figure saved in this process."""
    seen, save_fig = {}, figures_common.save

    def save_and_look(fig, path):
        ax = fig.axes[0]
        seen[Path(path).name] = {"x": [t.get_text() for t in ax.get_xticklabels()],
                                 "y": [t.get_text() for t in ax.get_yticklabels()]}
        save_fig(fig, path)
    monkeypatch.setattr(figures_common, "save", save_and_look)
    return seen


def not_blank(png: Path) -> bool:
    from matplotlib.image import imread
    img = imread(png)
    return img.shape[0] > 50 and float(img[..., :3].std()) > 0.05


def tensorboard_steps(tb: Path) -> set[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert any(t.endswith("/entropy") for t in tags), tags
    return {e.step for t in tags for e in acc.Scalars(t)}


@pytest.mark.parametrize("arch", list(KIND))
def test_text_figures_show_the_users_tokens(arch, tmp_path, drawn, capsys):
    folder = save(arch, tmp_path / arch)
    text = text_file(arch, tmp_path / "held_out.txt")
    out = tmp_path / "out"
    code = main(["triage", str(folder), "--text", str(text), "--out", str(out)])
    # untrained: the sweep ran on the data and could not judge it (not solved): INCOMPLETE
    assert code == 4, capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    run = report["run"]
    assert run["temperature_sweep"]["verdict"] == "inconclusive", run["temperature_sweep"]
    assert {p for p, st in report["probes"].items() if st.get("not_run")} == {"missing-scale"}
    assert run["figures_batch"].startswith(f"--text {text}") and "tokenizer" in run["figures_batch"]
    assert run["probe_data"].startswith(f"--text {text}")
    files = {Path(f["file"]).name for f in run["figures"]}
    assert {MAP[KIND[arch]], "entropy.png", "head_similarity.png", "depth.png"} <= files, files
    for f in files:
        assert not_blank(out / "figures" / f), f
    ticks = drawn[MAP[KIND[arch]]]
    names = set(WORDS) | {"\\$"} | set(SPECIAL[arch][0])
    real = [t for t in ticks["x"] + ticks["y"] if t not in ("pad", "BOS")]
    assert len(real) >= 6 and all(t in names for t in real), ticks        # decoded, not ids
    assert tensorboard_steps(out / "tb") == {0}
    md = (out / "report.md").read_text()
    assert "figures_batch" in md and f"--text {text}" in md


@pytest.mark.parametrize("arch", ["bart", "gpt2", "bert"])
def test_without_data_the_random_ids_are_decoded(arch, tmp_path, drawn):
    folder = save(arch, tmp_path / arch)
    out = tmp_path / "out"
    assert main(["triage", str(folder), "--out", str(out)]) == 4        # no data: INCOMPLETE
    run = json.loads((out / "report.json").read_text())["run"]
    assert run["figures_batch"].startswith("the probes' random ids")
    assert run["temperature_sweep"]["verdict"] == "skipped"
    names = set(WORDS + FILL) | {"\\$"} | set(SPECIAL[arch][0])
    ticks = [t for t in drawn[MAP[KIND[arch]]]["x"] if t not in ("pad", "BOS")]
    assert len(ticks) >= 6 and all(t in names for t in ticks), ticks     # random ids, decoded


def test_without_a_tokenizer_ids_label_the_axes(tmp_path, drawn):
    folder = save("gpt2", tmp_path / "gpt2", tokenizer=False)
    assert main(["triage", str(folder), "--out", str(tmp_path / "out")]) == 4   # no data
    run = json.loads((tmp_path / "out" / "report.json").read_text())["run"]
    assert run["figures_batch"].endswith("(axis tokens as ids)")
    ticks = drawn["attention_dec_self.png"]["x"]
    assert ticks and all(t.isdigit() or t in ("pad", "BOS") for t in ticks), ticks


def test_no_figures_draws_none(tmp_path, drawn):
    folder = save("llama", tmp_path / "llama")
    text = text_file("llama", tmp_path / "held_out.txt")
    out = tmp_path / "out"
    assert main(["triage", str(folder), "--text", str(text), "--out", str(out), "--no-figures"]) == 4
    assert not drawn and not list((out / "figures").glob("*.png"))
    assert "figures" not in json.loads((out / "report.json").read_text())["run"]
    assert tensorboard_steps(out / "tb") == {0}


def test_long_rows_get_thinned_labels(tmp_path, drawn):
    """90 tokens a row (--data ids): every label would overlap; every k-th is drawn."""
    folder = save("gpt2", tmp_path / "gpt2")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1 + len(WORDS), (6, 90), generator=g)
    ids[:, 0] = 0                                                    # BOS: the first ordinary id
    torch.save({"ids": ids}, tmp_path / "long.pt")
    out = tmp_path / "out"
    assert main(["triage", str(folder), "--data", str(tmp_path / "long.pt"), "--out", str(out)]) == 4
    ticks = drawn["attention_dec_self.png"]
    per_head = len(ticks["x"]) / 4                                    # 4 heads side by side
    assert 4 <= per_head <= 45, len(ticks["x"])                       # thinned, still labelled
    assert sum(t in WORDS for t in ticks["x"]) >= per_head
    assert not_blank(out / "figures" / "attention_dec_self.png")


def test_one_stack_text_formats(tmp_path):
    from tndebug.hf.decoder_only import choose_lm_ids
    from tndebug.hf.build import load_config
    from tndebug.triage.hf_data import load_text
    from tndebug.one_stack import one_stack_batch
    for arch in ("gpt2", "llama", "bert"):
        folder = save(arch, tmp_path / arch)
        ids = choose_lm_ids(load_config(folder)[1], V)
        path = tmp_path / f"{arch}.txt"
        path.write_text("the cat\tsat\n\nthe dog\n")
        rows = load_text(str(path), folder, ids, KIND[arch])["ids"]
        assert rows.shape[0] == 2                                     # blank line skipped
        vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
        lead = {"gpt2": [ids["start"]], "llama": [1], "bert": [2]}[arch]   # BOS added / <s> / [CLS]
        assert rows[0].tolist()[:4] == lead + [vocab["the"], vocab["cat"], vocab["sat"]], rows
        if arch == "bert":
            assert rows[1].tolist()[:4] == [2, vocab["the"], vocab["dog"], 3]       # [SEP], then pad
        batch = one_stack_batch({"ids": rows}, ids["pad"], KIND[arch], "--text")
        if KIND[arch] == "decoder":
            assert batch.src.shape == (2, 0) and torch.equal(batch.tgt_out, rows[:, 1:])
        else:
            assert torch.equal(batch.src, rows) and torch.equal(batch.tgt_out, rows)


def test_one_stack_bad_data_is_one_line(tmp_path, capsys):
    folder = save("gpt2", tmp_path / "gpt2", tokenizer=False)
    capsys.readouterr()                                              # save_pretrained's progress
    torch.save({"src": torch.ones(3, 4, dtype=torch.long), "tgt": torch.ones(3, 4, dtype=torch.long)},
               tmp_path / "pairs.pt")
    assert main(["triage", str(folder), "--data", str(tmp_path / "pairs.pt"),
                 "--out", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert "decoder-only model reads {'ids'" in err and len(err.strip().splitlines()) == 1, err
    mid = torch.tensor([[0, 5, 95, 6], [0, 5, 6, 95]])                # pad 95 mid-row
    torch.save({"ids": mid}, tmp_path / "mid.pt")
    assert main(["triage", str(folder), "--data", str(tmp_path / "mid.pt"),
                 "--out", str(tmp_path / "o2")]) == 2
    assert "pad" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_encoder_sweep_needs_a_mask_id(tmp_path):
    """BERT's --data without a tokenizer: no mask id (BertConfig has none), the sweep says so."""
    from tndebug.triage.hf_dir import triage_hf
    from tndebug.triage.run import TriageOptions
    folder = save("bert", tmp_path / "bert", tokenizer=False)
    g = torch.Generator().manual_seed(0)
    torch.save({"ids": torch.randint(5, 60, (10, 8), generator=g)}, tmp_path / "ids.pt")
    report = triage_hf(TriageOptions(str(folder), data=str(tmp_path / "ids.pt")))
    sweep = report.run["temperature_sweep"]
    assert sweep["verdict"] == "skipped" and "mask id" in sweep["reason"], sweep


def test_masked_lm_batch_masks_ordinary_tokens():
    from tndebug.data import Batch
    from tndebug.hf.encoder_only import masked_lm_batch
    ids = torch.tensor([[2, 10, 11, 12, 13, 3, 0, 0]] * 20)
    src, tgt_in, tgt_out = masked_lm_batch(Batch(ids, ids, ids), 4, 0, [0, 2, 3])
    picked = src == 4
    assert picked.any(1).all() and not picked[:, 6:].any()            # each row; never a pad
    assert not picked[:, 0].any() and not picked[:, 5].any()          # nor [CLS], [SEP]
    assert torch.equal(tgt_out[picked], ids[picked]) and (tgt_out[~picked] == 0).all()
    assert 0.05 < picked.float()[:, 1:6].mean() < 0.5


def _no_causal(model, adapter):
    """The causal mask removed from the loaded model (as tests/triage/test_hf_decoder.py does)."""
    model.config.is_causal = False
    for m in model.modules():
        if hasattr(m, "is_causal"):
            m.is_causal = False


@pytest.mark.parametrize("bug", [None, "no_causal"])
def test_one_batch_feeds_every_figure(bug, tmp_path):
    """With --text, the sinks see one trace, of the user's rows: the attention snapshot and the
    entropy metric the entropy figure reads are of the same step and the same batch. Healthy:
    no warning; the causal mask removed: still named causal-leak (the exact test's own inputs)."""
    from tndebug.reporters.recorder import Recorder
    from tndebug.triage.hf_dir import triage_hf
    from tndebug.triage.run import TriageOptions
    folder = save("llama", tmp_path / "llama")
    text = text_file("llama", tmp_path / "held_out.txt")
    traces, rec = [], Recorder()
    on_trace = rec.on_trace
    rec.on_trace = lambda step, trace: (traces.append(step), on_trace(step, trace))
    report = triage_hf(TriageOptions(str(folder), text=str(text)),
                       patch=_no_causal if bug else None, sinks=[rec])
    bad = {f.code for f in report.findings if f.at_least("warning")}
    assert bad == ({"mask-broadcast/causal-leak"} if bug else set()), bad
    assert traces == [0] and len(rec.snapshots) == 1
    snap = rec.snapshots[0]
    from tndebug.triage.hf_data import load_text
    rows = load_text(str(text), folder, {"start": 1, "pad": snap.pad_id, "specials": {}}, "decoder")["ids"]
    for i, r in zip(snap.rows, snap.tgt.tolist()):
        assert r == rows[i, :-1].masked_fill(rows[i, 1:] == snap.pad_id, snap.pad_id).tolist()
    from tndebug import tags
    entropy = rec.series_of(tags.HEAD, kind="dec_self", stat="entropy")
    steps = {s for series in entropy.values() for s, _ in series}
    assert steps == {0}
    assert set(rec.token_names.values()) >= set(lines()[0].split())
