"""`tndebug triage DIR` on Hugging Face save_pretrained directories (issue 11): BART, mBART,
Marian, T5 and Pegasus from small configs, healthy and with one bug injected into the loaded
model (or its caller) through `triage_hf(..., patch=)`, under eager and SDPA attention; bad
directories are one line, exit 2, nothing written.

KNOWN lists the cases that fail because of a probe, not of the HF path, each with what the
probe reported; remove an entry once the probe is fixed (the marks are strict: a fixed case
fails as XPASS until its entry goes)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tndebug.cli import main                                          # noqa: E402
from tndebug.triage.hf_dir import triage_hf                               # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
DOC = Path(__file__).resolve().parents[2] / "docs" / "triage.md"

ARCHS = ("bart", "mbart", "marian", "t5", "pegasus")
ATTN = ("eager", "sdpa")
BUGS = ("no_scale", "no_causal", "inverted_pad_mask", "zero_positions", "shared_qkv")
EXPECTED = {"no_scale": "missing-scale", "no_causal": "mask-broadcast",
            "inverted_pad_mask": "mask-broadcast", "zero_positions": "positional-encoding",
            "shared_qkv": "head-collapse"}
FIX_WORDS = {"no_scale": "self.scaling", "no_causal": "is_causal",
             "inverted_pad_mask": "1 = keep, 0 = padding", "zero_positions": "embed_positions",
             "shared_qkv": "q_proj / k_proj / v_proj"}
HAS = {"no_scale": {"bart", "mbart", "marian", "pegasus"}}     # T5 has no scale by design

# (arch, attn, "healthy" | bug) -> what the probe reported
# (fixed in 30e4420: T5 with an inverted mask also gave a positional-encoding error, "encoder
# ignores token order ... no PE is added at encoder.embed_tokens", the mask absorbing T5's
# relative bias)
KNOWN: dict[tuple[str, str, str], str] = {
}


def config(arch: str):
    """d_model 32, 2+2 layers, 4 heads, vocabulary 96; special ids as the real checkpoints."""
    V = 96
    if arch == "t5":
        return transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                     num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                     relative_attention_num_buckets=8,
                                     relative_attention_max_distance=16, feed_forward_proj="relu",
                                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    sizes = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                 decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0)
    if arch == "bart":
        return transformers.BartConfig(**sizes)                        # pad 1, bos 0, eos 2
    if arch == "mbart":
        return transformers.MBartConfig(**sizes)                       # pre-LN, no decoder start
    if arch == "marian":                                              # pad = decoder start = V-1
        return transformers.MarianConfig(**sizes, decoder_vocab_size=V, pad_token_id=V - 1,
                                         decoder_start_token_id=V - 1, eos_token_id=0,
                                         scale_embedding=True)
    return transformers.PegasusConfig(**sizes, pad_token_id=0, eos_token_id=1,   # as google/pegasus
                                      decoder_start_token_id=0, scale_embedding=True)


def save(arch: str, folder: Path, **save_kw) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config(arch))
    model.save_pretrained(folder, **save_kw)
    return folder


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: save(arch, root / arch) for arch in ARCHS}


# -- bugs, injected into the loaded model or its caller ---------------------------------------------
def _attentions(model):
    return [m for m in model.modules() if hasattr(m, "q_proj") or hasattr(m, "relative_attention_bias")
            or type(m).__name__ == "T5Attention"]


def patch_for(bug: str):
    def patch(model, adapter):
        forward, encode = adapter
        if bug == "no_scale":
            for m in _attentions(model):
                m.scaling = 1.0
        elif bug == "no_causal":
            decoder = model.get_decoder()
            decoder.config.is_causal = False
            for name, m in decoder.named_modules():
                if ("self_attn" in name or "SelfAttention" in name) and hasattr(m, "is_causal"):
                    m.is_causal = False
        elif bug == "zero_positions":
            tables = [m.relative_attention_bias for m in model.modules()
                      if getattr(m, "has_relative_attention_bias", False)]
            tables += [s.embed_positions for s in (model.get_encoder(), model.get_decoder())
                       if hasattr(s, "embed_positions")]
            for t in tables:
                with torch.no_grad():
                    t.weight.zero_()
                t.weight.requires_grad_(False)
        elif bug == "shared_qkv":                             # one Linear as W_Q, W_K and W_V
            for m in model.modules():
                if hasattr(m, "q_proj"):
                    m.k_proj = m.v_proj = m.q_proj
                elif type(m).__name__ == "T5Attention":
                    m.k = m.v = m.q
        elif bug == "inverted_pad_mask":                      # the caller's bug: 1 at padding
            def fwd(model, src, tgt, pad_id):
                kw = dict(decoder_input_ids=forward.decoder_ids(tgt),
                          decoder_attention_mask=(tgt != pad_id).long(), use_cache=False)
                return model(input_ids=src, attention_mask=(src == pad_id).long(), **kw).logits

            def enc(model, src, pad_id):
                return model.get_encoder()(input_ids=src,
                                           attention_mask=(src == pad_id).long()).last_hidden_state
            return fwd, enc
        return None
    return patch


def flagged(report):
    return [f for f in report.findings if f.severity in ("warning", "error")]


def describe(findings) -> str:
    return "\n".join(f"  {f.severity:7s} {f.probe:20s} {f.where or '(run)'}: {f.message}"
                     for f in findings) or "  (none)"


def _param(arch, attn, what):
    reason = KNOWN.get((arch, attn, what))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(arch, attn, what, marks=marks, id=f"{arch}-{attn}-{what}")


HEALTHY = [_param(a, i, "healthy") for a in ARCHS for i in ATTN]
BUGGY = [_param(a, i, b) for b in BUGS for a in ARCHS if a in HAS.get(b, ARCHS) for i in ATTN]


@pytest.mark.parametrize("arch, attn, what", HEALTHY)
def test_healthy_model_triages_clean_but_for_the_data(dirs, arch, attn, what):
    """No warning or error; without --text/--data the verdict is INCOMPLETE (exit 4) for one
    reason only: missing-scale's temperature sweep needs in-distribution data."""
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn))
    assert not flagged(report), f"{arch}/{attn}: false alarms\n{describe(report.findings)}"
    assert report.verdict == "incomplete" and report.exit_code() == 4, report.verdict
    assert list(report.incomplete()) == ["missing-scale"], report.incomplete()
    assert report.incomplete()["missing-scale"].startswith("temperature sweep not run"), report.incomplete()
    assert report.run["attn_implementation"] == attn
    assert report.run["layout"] == "huggingface" and report.run["model_type"] == arch
    assert report.run["temperature_sweep"]["verdict"] == "skipped"          # no --text / --data
    assert any(p.startswith("model.decoder.layers.0.") or p.startswith("decoder.block.0.")
               for p in report.run["attention_modules"]), report.run["attention_modules"]


@pytest.mark.parametrize("arch, attn, bug", BUGGY)
def test_bug_is_named_by_its_probe(dirs, arch, attn, bug):
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn), patch=patch_for(bug))
    probe = EXPECTED[bug]
    bad = flagged(report)
    mine = [f for f in bad if f.probe == probe]
    assert mine, f"{arch}/{attn} {bug}: {probe} reports nothing\n{describe(report.findings)}"
    others = [f for f in bad if f.severity == "error" and f.probe != probe]
    assert not others, f"{arch}/{attn} {bug}: errors from other probes\n{describe(others)}"
    assert all(FIX_WORDS[bug] in f.fix for f in mine), (FIX_WORDS[bug], mine[0].fix)   # HF fixes


@pytest.mark.parametrize("arch, bug", [("bart", "no_causal"), ("mbart", "inverted_pad_mask"),
                                       ("marian", "no_scale"), ("t5", "zero_positions"),
                                       ("pegasus", "no_causal")])
def test_eager_and_sdpa_agree(dirs, arch, bug):
    verdicts = {}
    for attn in ATTN:
        report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn), patch=patch_for(bug))
        verdicts[attn] = sorted((f.probe, f.severity, f.where) for f in flagged(report))
        verdicts[attn].append(sorted((k, v["status"]) for k, v in report.probes.items()))
    assert verdicts["eager"] == verdicts["sdpa"], verdicts


def test_ids_come_from_the_config(dirs):
    report = triage_hf(TriageOptions(str(dirs["marian"])))
    run = report.run
    assert (run["pad_id"], run["bos_id"]) == (95, 95)
    assert "decoder_start_token_id" in run["ids_note"] and "feeds as 95" in run["ids_note"]
    assert run["tied_keys_restored"]                  # save_pretrained drops the tied copies
    assert "(1..94" in run["probe_data"]               # eos 0 and pad 95 are never random content


@pytest.mark.parametrize("arch, bug", [("marian", "no_causal"), ("bart", "inverted_pad_mask"),
                                       ("pegasus", "no_scale")])
def test_sliced_output_layer_keeps_verdicts(dirs, monkeypatch, arch, bug):
    """Above PROBE_VOCAB ids the probes see the first PROBE_VOCAB logits only: same verdicts."""
    import tndebug.triage.hf_dir as hf
    full = triage_hf(TriageOptions(str(dirs[arch])), patch=patch_for(bug))
    monkeypatch.setattr(hf, "PROBE_VOCAB", 40)
    sliced = triage_hf(TriageOptions(str(dirs[arch])), patch=patch_for(bug))
    assert sliced.run["probes_see_logits_of_ids"] == "0..39 (of 96; exact)"
    assert full.run["probes_see_logits_of_ids"] == "all 96"
    key = lambda r: sorted((f.probe, f.severity, f.where) for f in flagged(r))   # noqa: E731
    assert key(full) == key(sliced) and key(full), (key(full), key(sliced))


# -- --text and --data: the temperature sweep runs on the user's data ---------------------------------
def _word_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(60)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.save(str(folder / "tokenizer.json"))


def test_text_runs_the_sweep(dirs, tmp_path):
    folder = tmp_path / "bart"
    shutil.copytree(dirs["bart"], folder)
    _word_tokenizer(folder)
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"w{i} w{i + 1} w{i + 2}\tw{i + 2} w{i + 1} w{i}\n" for i in range(12)))
    from tndebug.hf.build import load_config
    from tndebug.hf.encoder_decoder import choose_ids
    from tndebug.triage.hf_data import load_text
    ids = choose_ids(load_config(folder)[1], 96)
    text = load_text(str(pairs), folder, ids)
    assert text["src"][0].tolist() == [0, 4, 5, 6, 2]                 # <s> w0 w1 w2 </s>
    assert text["tgt"][0].tolist() == [2, 0, 6, 5, 4, 2]              # decoder start, then the target
    saved = tmp_path / "bart_tok"                                  # saved as transformers does
    shutil.copytree(dirs["bart"], saved)
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")).save_pretrained(saved)
    assert (saved / "tokenizer_config.json").is_file()
    assert load_text(str(pairs), saved, ids)["src"][0].tolist() == [0, 4, 5, 6, 2]
    report = triage_hf(TriageOptions(str(folder), text=str(pairs)))
    sweep = report.run["temperature_sweep"]
    assert sweep["verdict"] != "skipped" and len(sweep["losses"]) == 13, sweep
    assert report.run["data"] == f"--text {pairs}" and report.run["held_out_sequences"] == 12
    assert not flagged(report), describe(report.findings)


def test_data_runs_the_sweep(dirs, tmp_path):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 90, (10, 7), generator=g)
    tgt = torch.cat([torch.full((10, 1), 2), torch.randint(4, 90, (10, 6), generator=g)], 1)  # decoder start 2
    torch.save({"src": src, "tgt": tgt}, tmp_path / "held_out.pt")
    report = triage_hf(TriageOptions(str(dirs["bart"]), data=str(tmp_path / "held_out.pt")))
    assert report.run["temperature_sweep"]["verdict"] != "skipped"
    assert report.run["held_out_sequences"] == 10


def _trained_copy_model(folder: Path, no_scale: bool) -> Path:
    """A tiny BART trained 150 steps on copying, by code with or without the 1/sqrt(d_k) scale,
    saved with save_pretrained; held-out batches beside it (tgt led by decoder start 2)."""
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=20, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0))
    if no_scale:                                              # the training code's bug
        for m in _attentions(model):
            m.scaling = 1.0
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    g = torch.Generator().manual_seed(1)

    def batch(n):
        src = torch.randint(3, 20, (n, 8), generator=g)
        return src, torch.cat([torch.full((n, 1), 2), src, torch.full((n, 1), 2)], 1)
    for _ in range(150):
        src, tgt = batch(32)
        loss = model(input_ids=src, decoder_input_ids=tgt[:, :-1], labels=tgt[:, 1:].contiguous()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(folder)
    src, tgt = batch(24)
    torch.save({"src": src, "tgt": tgt}, folder / "held_out.pt")
    return folder


def test_sweep_finds_a_checkpoint_trained_without_the_scale(tmp_path):
    """Weights trained by code without the scale, loaded into transformers' scaled code: the
    sweep on the user's data finds alpha ~ sqrt(d_k) (an error); trained with it: alpha ~ 1."""
    for no_scale in (False, True):
        folder = _trained_copy_model(tmp_path / f"copy{int(no_scale)}", no_scale)
        report = triage_hf(TriageOptions(str(folder), data=str(folder / "held_out.pt")))
        sweep = report.run["temperature_sweep"]
        errors = [f for f in flagged(report) if f.severity == "error"]
        if no_scale:
            assert sweep["verdict"] == "mismatch" and sweep["best_alpha"] >= 2, sweep
            assert [f.probe for f in errors] == ["missing-scale"], describe(report.findings)
        else:
            assert sweep["verdict"] == "matched", sweep
            assert not errors, describe(errors)


# -- bad input: one line, exit 2, nothing written --------------------------------------------------------
def _bad(argv, capsys, tmp_path, words):
    out = tmp_path / "out"
    code = main(["triage", *map(str, argv), "--out", str(out)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("tndebug:")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("tndebug: error: "), err
    assert "Traceback" not in err and words in lines[0], lines[0]
    assert not out.exists()


def test_bad_directories(dirs, tmp_path, capsys):
    no_config = tmp_path / "no_config"
    shutil.copytree(dirs["bart"], no_config)
    (no_config / "config.json").unlink()
    _bad([no_config], capsys, tmp_path, "has no config.json")

    unknown = tmp_path / "unknown"
    shutil.copytree(dirs["bart"], unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**cfg, "model_type": "florp"}))
    _bad([unknown], capsys, tmp_path, "model_type 'florp' is unknown")

    vit = transformers.ViTConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                 num_attention_heads=2)
    vit.save_pretrained(tmp_path / "vit")     # decoder-, encoder-only: tests/triage/test_hf_{de,en}coder.py
    _bad([tmp_path / "vit"], capsys, tmp_path, "with no language-model head of the three shapes")

    misfit = tmp_path / "misfit"
    shutil.copytree(dirs["bart"], misfit)
    cfg = json.loads((misfit / "config.json").read_text())
    (misfit / "config.json").write_text(json.dumps({**cfg, "d_model": 48}))
    _bad([misfit], capsys, tmp_path, "do not fit its config.json")

    from safetensors.torch import load_file, save_file
    sd = load_file(str(dirs["bart"] / "model.safetensors"))
    for name, change, words in (
            ("missing", lambda d: d.pop("model.encoder.layers.0.fc1.weight"),
             "1 missing key(s) not tied to a loaded weight (e.g. model.encoder.layers.0.fc1.weight)"),
            ("unexpected", lambda d: d.update({"model.encoder.extra.weight": torch.zeros(2)}),
             "1 unexpected key(s) (e.g. model.encoder.extra.weight)")):
        folder = tmp_path / name
        shutil.copytree(dirs["bart"], folder)
        changed = dict(sd)
        change(changed)
        save_file(changed, str(folder / "model.safetensors"), metadata={"format": "pt"})
        _bad([folder], capsys, tmp_path, words)

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(dirs["bart"] / "config.json", no_weights)
    _bad([no_weights], capsys, tmp_path, "no weights")

    _bad([dirs["bart"], "--model", "x.py:f"], capsys, tmp_path, "do not apply")
    (tmp_path / "no_tab.tsv").write_text("w1 w2 w3 w2 w1\nw4\tw5\n")
    _bad([dirs["bart"], "--text", tmp_path / "no_tab.tsv"], capsys, tmp_path, "line 1 has no TAB")
    (tmp_path / "pairs.tsv").write_text("w1\tw2\nw3\tw4\n")
    _bad([dirs["bart"], "--text", tmp_path / "pairs.tsv"], capsys, tmp_path, "no tokenizer saved in")


def _as_bin(folder: Path) -> None:
    """Rewrite safetensors shards as pytorch_model-*.bin with a pytorch_model.bin.index.json."""
    from safetensors.torch import load_file
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    names = {s: s.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
             for s in set(index["weight_map"].values())}
    for old, new in names.items():
        torch.save(load_file(str(folder / old)), folder / new)
        (folder / old).unlink()
    index["weight_map"] = {k: names[v] for k, v in index["weight_map"].items()}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors.index.json").unlink()


def test_unsharded_bin(dirs, tmp_path):
    from safetensors.torch import load_file
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(dirs["t5"] / "config.json", folder)
    torch.save(load_file(str(dirs["t5"] / "model.safetensors")), folder / "pytorch_model.bin")
    report = triage_hf(TriageOptions(str(folder)))
    assert report.run["weight_files"] == ["pytorch_model.bin"] and not flagged(report)


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_bad_shards(tmp_path, capsys, kind):
    sharded = save("bart", tmp_path / "sharded", max_shard_size="40KB")
    if kind == "bin":                 # transformers 5 writes safetensors only: as older ones did
        _as_bin(sharded)
    index = next(sharded.glob("*.index.json"))
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(shards) > 1
    report = triage_hf(TriageOptions(str(sharded)))            # sharded and whole: it loads
    assert not flagged(report), describe(report.findings)
    assert report.run["weight_files"] == shards

    corrupt = tmp_path / "corrupt"
    shutil.copytree(sharded, corrupt)
    data = (corrupt / shards[1]).read_bytes()
    (corrupt / shards[1]).write_bytes(data[: len(data) // 3])
    _bad([corrupt], capsys, tmp_path, f"{shards[1]} is corrupt or truncated")

    missing = tmp_path / "missing"
    shutil.copytree(sharded, missing)
    (missing / shards[-1]).unlink()
    _bad([missing], capsys, tmp_path, f"shard(s) that are not in")


def test_without_transformers_one_line(dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)        # `import transformers` fails
    _bad([dirs["bart"]], capsys, tmp_path, "pip install 'tndebug[hf]'")


def test_core_does_not_import_transformers():
    code = ("import sys, tndebug.cli, tndebug.triage, tndebug.triage.hf_dir, tndebug.triage.run; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"}
                          ).returncode == 0


def test_attn_and_text_need_a_hf_directory(tmp_path, capsys, annotated_ckpt):
    path, _ = annotated_ckpt()
    _bad([path, "--attn", "sdpa"], capsys, tmp_path, "apply to a Hugging Face directory")


# -- docs/triage.md's "Hugging Face models" section runs as written -----------------------------------
# numbers below 1e-5 (a permutation's "rel diff 3.8e-08") are fp32 rounding: they change with
# the CPU's summation order from machine to machine, so the docs' example does not pin them
_ROUNDING = re.compile(r"\b\d(\.\d+)?e-(0[5-9]|[1-9]\d)\b")


def _shown_in(expected: str, actual: str) -> None:
    """Each run of lines between `…` appears in `actual`, contiguous and in order (rounding-size
    numbers aside)."""
    have = [_ROUNDING.sub("<rounding>", ln.rstrip()) for ln in actual.splitlines()]
    at = 0
    for chunk in expected.split("…\n"):
        want = [_ROUNDING.sub("<rounding>", ln.rstrip()) for ln in chunk.splitlines()]
        if not want:
            continue
        hit = next((i for i in range(at, len(have) - len(want) + 1) if have[i:i + len(want)] == want), None)
        assert hit is not None, f"docs show lines the command does not print:\n" + "\n".join(want) + \
            "\n--- actual ---\n" + actual
        at = hit + len(want)


def test_docs_example(tmp_path, capsys, monkeypatch):
    import shlex
    text = DOC.read_text()
    section = text[text.index("## Hugging Face models"):]
    section = section[: section.find("\n## ", 5)] if "\n## " in section[5:] else section
    script = re.search(r"<!-- file: save_tiny_bart.py -->\s*```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "100")
    exec(compile(script, "save_tiny_bart.py", "exec"), {"__name__": "__main__"})
    session = re.search(r"```\n(\$ python save_tiny_bart\.py\n.*?)```", section, re.S).group(1)
    code, ran = None, 0
    for block in re.split(r"(?m)^\$ ", session)[1:]:
        cmd, _, expected = block.partition("\n")
        cmd = cmd.split("  #")[0].strip()
        if cmd.startswith("python"):
            continue
        if cmd == "echo $?":
            assert str(code) == expected.strip(), (code, expected)
            continue
        capsys.readouterr()
        code = main(shlex.split(cmd)[1:])
        _shown_in(expected, "".join(capsys.readouterr()))          # the console may be stderr
        ran += 1
    assert ran == 2
