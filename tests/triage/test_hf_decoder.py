"""`tndebug triage DIR` on Hugging Face decoder-only directories: GPT2, Llama, Qwen2, Mistral and
GPTNeoX from small random-init configs (nothing is downloaded), eager and SDPA: healthy ones are
clean, a causal mask removed from the loaded model is named causal-leak, and the KV-cache call
(`incremental`) equals the full forward on a healthy model and not on one whose cache is broken.
(Encoder-only directories are triaged too: tests/triage/test_hf_encoder.py.)"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tndebug.cli import main                                          # noqa: E402
from tndebug.triage.hf_dir import triage_hf                               # noqa: E402
from tndebug.hf.decoder_only import choose_lm_ids, make_lm_adapter, positions  # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402
from conftest import clean_but_for_data                               # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ARCHS = ("gpt2", "llama", "qwen2", "mistral", "gpt_neox")
ATTN = ("eager", "sdpa")
V, D, L = 1000, 64, 2
# The KV-cache decode and the full forward sum the same products in another order: in fp32
# they agree to a few ulps of the logits' scale (measured: max |diff| 2e-7..4e-7 at max |logit|
# ~1 on these models). 1e-5 of that scale leaves a margin of ~25x for more layers and longer
# sums. A cache bug moves them 100x that at least: at random init attention is near uniform, so
# even positions off by one under RoPE move Llama's logits by only 5e-3 of their scale.
CACHE_RTOL = 1e-5


def config(arch: str):
    T = transformers
    if arch == "gpt2":                                            # no pad, bos = eos = 50256 >= V
        return T.GPT2Config(vocab_size=V, n_embd=D, n_layer=L, n_head=4, n_positions=64)
    sizes = dict(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=L,
                 num_attention_heads=4, max_position_embeddings=64)
    if arch == "gpt_neox":
        return T.GPTNeoXConfig(**sizes)
    cls = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "mistral": T.MistralConfig}[arch]
    return cls(**sizes, num_key_value_heads=2)                    # grouped-query attention


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_decoder")
    out = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config(arch)).save_pretrained(root / arch)
        out[arch] = root / arch
    return out


def flagged(report):
    return [(f.severity, f.code, f.where) for f in report.findings if f.severity != "info"]


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("arch", ARCHS)
def test_healthy_decoder_only_model_triages_clean(dirs, arch, attn):
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn))
    assert not flagged(report), flagged(report)
    shift = report.probes["label-shift"]
    if arch == "gpt2":
        # untrained, its head tied to the token embedding: it repeats its input, as a fresh
        # initialisation does, so which labels it learnt from cannot be told: no verdict, said
        assert shift["status"] == "no verdict" and "fresh initialisation" in shift["reason"], shift
        assert report.verdict == "incomplete"
    else:
        # no data given: the temperature sweep and the untied-head test did not run
        assert clean_but_for_data(report) and shift["status"] == "pass", (shift, report.incomplete())
    run = report.run
    assert run["arch"] == "decoder" and run["attn_implementation"] == attn
    assert run["model"].endswith(("ForCausalLM", "LMHeadModel"))
    assert len(run["attention_modules"]) == L                       # one self-attention per block
    assert {p["status"] for n, p in report.probes.items() if n != "label-shift"} <= {"pass", "skipped"}
    # a decoder's positions are tested by the token swap (issue 45), and where they enter is said
    pe = report.probes["positional-encoding"]["coverage"][""]
    assert pe["status"] == "checked" and "decoder positions:" in pe["reason"], pe
    assert ("embeddings" in pe["reason"]) == (arch == "gpt2"), pe           # the rest: rotary


def test_ids_gpt2_has_no_pad_and_its_bos_is_outside_a_small_vocabulary(dirs):
    run = triage_hf(TriageOptions(str(dirs["gpt2"]))).run
    assert (run["pad_id"], run["bos_id"]) == (V - 1, 0)             # largest id; first ordinary id
    assert run["probe_inputs"]["content_ids"] == [1, V - 2]
    assert "no pad_token_id" in run["ids_note"] and "no bos_token_id" in run["ids_note"]
    llama = triage_hf(TriageOptions(str(dirs["llama"]))).run       # bos 1, eos 2 from the config
    assert (llama["pad_id"], llama["bos_id"]) == (V - 1, 1)
    assert llama["probe_inputs"]["content_ids"] == [3, V - 2]


def test_pad_below_the_logits_the_probes_see():
    cfg = transformers.LlamaConfig(vocab_size=32000, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    ids = choose_lm_ids(cfg, 32000, limit=2048)
    assert ids["pad"] == 2047 and ids["content"] == (3, 2047)
    assert choose_lm_ids(transformers.LlamaConfig(pad_token_id=0), 32000)["pad"] == 0


def test_positions_are_generates():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    assert positions(mask).tolist() == [[0, 1, 2, 1, 1], [1, 1, 0, 1, 2]]


def no_causal(model, adapter):
    """The causal mask removed: config.is_causal off (create_causal_mask builds a bidirectional
    mask) and every attention's is_causal off (SDPA's is_causal= path)."""
    model.config.is_causal = False
    for m in model.modules():
        if hasattr(m, "is_causal"):
            m.is_causal = False


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("arch", ("gpt2", "llama"))
def test_removed_causal_mask_is_named_causal_leak(dirs, arch, attn):
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn), patch=no_causal)
    bad = flagged(report)
    assert bad and {code for _, code, _ in bad} == {"mask-broadcast/causal-leak"}, bad
    assert {sev for sev, _, _ in bad} == {"error"}
    f = next(f for f in report.findings if f.code == "mask-broadcast/causal-leak")
    assert f.where in report.run["attention_modules"] and "is_causal" in f.fix


# -- the KV cache ---------------------------------------------------------------------------------
def _model(arch, attn):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config(arch), attn_implementation=attn).eval()


def _ids(pad):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 900, (4, 12), generator=g)
    ids[:, 0] = 1
    ids[1, 7:] = pad                                              # right-padded rows
    ids[3, 9:] = pad
    return ids


def _gap(model, split=4, pad=999):
    forward, incremental = make_lm_adapter()
    ids = _ids(pad)
    with torch.no_grad():
        full = forward(model, ids, pad)[:, split:]                 # [B, T - split, V]
        cached = incremental(model, ids, pad, split)
    assert cached.shape == full.shape
    real = ids[:, split:] != pad
    return ((cached - full)[real].abs().max() / full.abs().max()).item()


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_equals_the_full_forward_on_a_healthy_model(arch, attn):
    assert _gap(_model(arch, attn)) < CACHE_RTOL


def _broken_cache(model, bug):
    """The model's own forward, wrapped: `ignores_cache` drops past_key_values (each step sees
    only its token); `positions_off_by_one` shifts the positions of every cached step."""
    inner = model.forward

    def forward(*a, past_key_values=None, position_ids=None, **kw):
        cached = past_key_values is not None and past_key_values.get_seq_length() > 0
        if cached and bug == "ignores_cache":
            past_key_values = None
        if cached and bug == "positions_off_by_one" and position_ids is not None:
            position_ids = position_ids + 1
        return inner(*a, past_key_values=past_key_values, position_ids=position_ids, **kw)
    model.forward = forward
    return model


@pytest.mark.parametrize("bug", ("ignores_cache", "positions_off_by_one"))
@pytest.mark.parametrize("arch", ("gpt2", "llama"))
def test_incremental_differs_on_a_broken_cache(arch, bug):
    assert _gap(_broken_cache(_model(arch, "sdpa"), bug)) > 100 * CACHE_RTOL


def test_triage_offers_the_cache_to_the_probes(dirs):
    """The subject the probes get has the KV-cache call (`subject.incremental`)."""
    seen = {}

    def spy(model, adapter):
        forward, incremental = adapter

        def inc(model, ids, pad_id, split):
            seen["called"] = True
            return incremental(model, ids, pad_id, split)
        seen["adapter"] = (forward, inc)
        return forward, inc
    report = triage_hf(TriageOptions(str(dirs["llama"])), patch=spy)
    assert "past_key_values" in report.run["calls"]
    assert "adapter" in seen
    assert seen.get("called") is True, "the probes never called the KV-cache call"


# -- refused (--data is read for decoder-only models: tests/triage/test_hf_figures_data.py) -------
def test_decoder_only_missing_data_is_one_line(dirs, tmp_path, capsys):
    code = main(["triage", str(dirs["gpt2"]), "--data", str(tmp_path / "x.pt"),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("tndebug: error:") == 1 and "no such file" in err


def test_cli_exit_code_without_data_is_incomplete(dirs, tmp_path, capsys):
    """Healthy, and no data given: what needs the data did not run: INCOMPLETE, exit 4, and the
    NOT CHECKED line says what to pass."""
    assert main(["triage", str(dirs["qwen2"]), "--attn", "sdpa", "--no-figures",
                 "--out", str(tmp_path / "out")]) == 4
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "NOT CHECKED" in out and "--text" in out
    assert (tmp_path / "out" / "report.json").is_file()


@pytest.mark.parametrize("bug", (None, "ignores_cache"))
def test_lm_decoding_probe_on_the_cache(dirs, bug):
    """lm-decoding: silent on a healthy Llama, kv-cache on a broken cache."""
    def patch(model, adapter):
        if bug:
            _broken_cache(model, bug)
    report = triage_hf(TriageOptions(str(dirs["llama"]), probes="lm-decoding"), patch=patch)
    codes = {f.code for f in report.findings if f.probe == "lm-decoding" and f.severity != "info"}
    assert codes == ({"lm-decoding/kv-cache"} if bug else set()), codes
