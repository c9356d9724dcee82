"""`tndebug triage DIR` on Hugging Face encoder-only directories: Bert, Roberta, DistilBert and
Electra from small random-init configs (nothing is downloaded), eager and SDPA. Healthy ones are clean, with the
decoder-only probe skipped for its reason; attention made causal (the decoder's mask helper in
the encoder, or a causal mask added to every layer's, or to one layer's) is mask-broadcast's
encoder-causal, a transposed one encoder-one-sided, and an attention_mask that never reaches the
attention is mask-broadcast's pad-leak. The CLI exits 0 clean, 1 on an error."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tndebug.cli import main                                          # noqa: E402
from tndebug.probes.base import DECODER_ONLY_ON_ENCODER               # noqa: E402
from tndebug.triage.hf_dir import triage_hf                               # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402
from conftest import clean_but_for_data                               # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ARCHS = ("bert", "roberta", "distilbert", "electra")
ATTN = ("eager", "sdpa")
V, D, L = 1000, 64, 2


def config(arch: str):
    T = transformers
    if arch == "distilbert":
        return T.DistilBertConfig(vocab_size=V, dim=D, n_layers=L, n_heads=4, hidden_dim=2 * D,
                                  max_position_embeddings=64)
    cls = {"bert": T.BertConfig, "roberta": T.RobertaConfig, "electra": T.ElectraConfig}[arch]
    extra = {"embedding_size": D // 2} if arch == "electra" else {}   # projected up, as ELECTRA-small
    return cls(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=4,
               intermediate_size=2 * D, max_position_embeddings=66, **extra)   # Roberta: pad + 1..


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_encoder")
    out = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        transformers.AutoModelForMaskedLM.from_config(config(arch)).save_pretrained(root / arch)
        out[arch] = root / arch
    return out


def flagged(report):
    return [(f.severity, f.code, f.where) for f in report.findings if f.severity != "info"]


def self_attentions(model):
    """The modules that hold the softmax (BertSelfAttention, DistilBert's MultiHeadSelfAttention)."""
    return [m for m in model.modules() if type(m).__name__.endswith("SelfAttention")]


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("arch", ARCHS)
def test_healthy_encoder_only_model_triages_clean(dirs, arch, attn):
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn))
    assert not flagged(report), flagged(report)
    assert clean_but_for_data(report), report.incomplete()       # no data: the sweep did not run
    run = report.run
    assert run["arch"] == "encoder" and run["attn_implementation"] == attn
    assert run["model"].endswith("ForMaskedLM") and run["bos_id"] is None
    mb = report.probes["mask-broadcast"]["coverage"]
    checked = [w for w, c in mb.items() if w and c["status"] == "checked"]
    assert len(checked) == L and set(checked) <= set(run["attention_modules"])   # one per block
    statuses = {k: p["status"] for k, p in report.probes.items()}
    assert statuses.pop("lm-decoding") == "skipped"
    assert set(statuses.values()) == {"pass"}, statuses
    assert report.probes["lm-decoding"]["reason"] == DECODER_ONLY_ON_ENCODER


def test_ids_come_from_the_config(dirs):
    bert = triage_hf(TriageOptions(str(dirs["bert"]), probes="mask-broadcast")).run
    assert bert["pad_id"] == 0 and "pad_token_id" in bert["ids_note"]
    roberta = triage_hf(TriageOptions(str(dirs["roberta"]), probes="mask-broadcast")).run
    assert roberta["pad_id"] == 1                              # Roberta counts positions from it
    assert roberta["probe_inputs"]["content_ids"] == [3, V - 1]    # <s> 0, <pad> 1, </s> 2 left out


# -- bugs, each injected by substituting one method or adding one hook -----------------------------
def causal_mask_helper(model, adapter):
    """The decoder's mask helper in the encoder: create_causal_mask where
    create_bidirectional_mask belongs (with is_causal on, as a decoder sets it for SDPA)."""
    from transformers.masking_utils import create_causal_mask
    base = model.base_model

    def masks(attention_mask, encoder_attention_mask, embedding_output, encoder_hidden_states,
              past_key_values):
        return create_causal_mask(config=base.config, inputs_embeds=embedding_output,
                                  attention_mask=attention_mask, past_key_values=None), None
    base._create_attention_masks = masks
    for m in self_attentions(model):
        m.is_causal = True


def one_sided(upper: bool, layers=None):
    """A forward pre-hook that adds a causal (upper: keys after the query hidden) or a transposed
    (keys before it hidden) mask to the attention mask of the self-attentions `layers`."""
    def patch(model, adapter):
        for i, m in enumerate(self_attentions(model)):
            if layers is not None and i not in layers:
                continue

            def pre(mod, args, kwargs):
                h = args[0] if args else kwargs["hidden_states"]
                S, lo = h.shape[1], torch.finfo(h.dtype).min
                keep = torch.ones(S, S, dtype=torch.bool, device=h.device)
                keep = keep.tril() if upper else keep.triu()
                am = kwargs.get("attention_mask")
                if am is None or am.dtype != torch.bool:
                    add = torch.zeros(S, S, dtype=h.dtype, device=h.device).masked_fill(~keep, lo)
                    kwargs["attention_mask"] = add[None, None] if am is None else (am + add).clamp(min=lo)
                else:
                    kwargs["attention_mask"] = am & keep
                return args, kwargs
            m.register_forward_pre_hook(pre, with_kwargs=True)
    return patch


def mask_ignored(model, adapter):
    """The padding mask dropped where the model builds its masks: every key is attended."""
    model.base_model._create_attention_masks = lambda *a, **k: (None, None)


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("arch", ("bert", "roberta"))
def test_causal_mask_helper_is_encoder_causal(dirs, arch, attn):
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn), patch=causal_mask_helper)
    bad = flagged(report)
    assert {code for _, code, _ in bad} == {"mask-broadcast/encoder-causal"}, bad
    f = next(f for f in report.findings if f.code == "mask-broadcast/encoder-causal")
    assert f.severity == "error" and f.where in report.run["attention_modules"]
    assert f.evidence["min_change"] <= f.evidence["tolerance"]
    assert "create_bidirectional_mask" in f.fix


@pytest.mark.parametrize("attn", ATTN)
def test_causal_and_transposed_masks_are_named_by_direction(dirs, attn):
    """A causal mask in every layer (DistilBert, whose attention takes no is_causal) and a
    transposed one, by behaviour; a causal mask in one layer of two, by its probabilities
    alone (the other layer still carries the later tokens back)."""
    for patch, code, where in ((one_sided(True), "encoder-causal", None),
                               (one_sided(False), "encoder-one-sided", None),
                               (one_sided(True, layers={1}), "encoder-causal", 1)):
        report = triage_hf(TriageOptions(str(dirs["distilbert"]), attn=attn), patch=patch)
        bad = flagged(report)
        assert {c for _, c, _ in bad} == {f"mask-broadcast/{code}"}, bad
        f = next(f for f in report.findings if f.code == f"mask-broadcast/{code}")
        if where is None:                                   # behaviour: no change beyond rounding
            assert f.evidence["min_change"] <= f.evidence["tolerance"]
        else:                                               # one layer: the outputs still change
            assert f.evidence["min_change"] > f.evidence["tolerance"]
            assert f.where == "distilbert.transformer.layer.1.attention"


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("arch", ("bert", "distilbert"))
def test_ignored_attention_mask_is_a_pad_leak(dirs, arch, attn):
    patch = mask_ignored if arch == "bert" else (
        lambda model, adapter: ((lambda m, ids, pad: m(input_ids=ids).logits), None))  # the caller's
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn), patch=patch)
    bad = flagged(report)
    assert {code for _, code, _ in bad} == {"mask-broadcast/pad-leak"}, bad
    f = next(f for f in report.findings if f.code == "mask-broadcast/pad-leak")
    assert f.severity == "error" and f.where in report.run["attention_modules"]


def test_the_feed_forward_split_over_two_modules_is_found(dirs):
    """BERT's FFN is `intermediate.dense` (d -> f, GELU) then `output.dense` (f -> d): the dead-unit
    test reads the hidden at output.dense's input; units pushed below zero never fire."""
    healthy = triage_hf(TriageOptions(str(dirs["bert"]), probes="gradient-flow"))
    cov = healthy.probes["gradient-flow"]["coverage"]
    assert all(cov[f"bert.encoder.layer.{i}.output.dense"]["status"] == "checked" for i in range(L))
    assert "" not in cov and not flagged(healthy)

    def dead(model, adapter):
        with torch.no_grad():
            model.bert.encoder.layer[0].intermediate.dense.bias.fill_(-1e4)
    report = triage_hf(TriageOptions(str(dirs["bert"]), probes="gradient-flow"), patch=dead)
    assert flagged(report) == [("warning", "gradient-flow/dead-units", "bert.encoder.layer.0.output.dense")]


@pytest.mark.parametrize("arch", ("bert", "distilbert"))
def test_duplicated_heads_are_read_from_the_weights(arch):
    from tndebug.hf.encoder_decoder import attention_weights
    from tndebug.probes.head_collapse_weights import duplicate_heads
    torch.manual_seed(0)
    model = transformers.AutoModelForMaskedLM.from_config(config(arch))
    sites = attention_weights(model)
    assert len(sites) == L and {h for *_, h in sites} == {4}          # query/key/value, q_lin/...
    assert not duplicate_heads(sites)
    with torch.no_grad():
        for _, wq, wk, wv, h in sites[:1]:
            for w in (wq, wk, wv):                                    # views of the weights
                w[16:32] = w[0:16]                                     # head 1 := head 0
    found = duplicate_heads(attention_weights(model))
    assert [f.code for f in found] == ["head-collapse/duplicated-heads"], found


# -- the CLI -----------------------------------------------------------------------------------------
def test_cli_exit_codes(dirs, tmp_path, capsys, monkeypatch):
    assert main(["triage", str(dirs["bert"]), "--out", str(tmp_path / "clean")]) == 4  # no data
    assert "INCOMPLETE" in capsys.readouterr().out
    base = transformers.BertModel
    real = base._create_attention_masks

    def causal(self, attention_mask, encoder_attention_mask, embedding_output, *a, **k):
        from transformers.masking_utils import create_causal_mask
        return create_causal_mask(config=self.config, inputs_embeds=embedding_output,
                                  attention_mask=attention_mask, past_key_values=None), None
    monkeypatch.setattr(base, "_create_attention_masks", causal)
    assert main(["triage", str(dirs["bert"]), "--attn", "eager", "--out", str(tmp_path / "bad")]) == 1
    report = json.loads((tmp_path / "bad" / "report.json").read_text())
    assert [f["code"] for f in report["findings"] if f["severity"] == "error"] == [
        "mask-broadcast/encoder-causal"]
    monkeypatch.setattr(base, "_create_attention_masks", real)
    assert main(["triage", str(dirs["bert"]), "--attn", "eager", "--out", str(tmp_path / "again")]) == 4


def test_a_model_of_no_triaged_shape_is_one_line(tmp_path, capsys):
    transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32).save_pretrained(tmp_path / "vit")
    assert main(["triage", str(tmp_path / "vit"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("tndebug: error:") == 1 and "AutoModelForMaskedLM" in err
    assert not (tmp_path / "out").exists()


def test_another_head_is_one_line(tmp_path, capsys):
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32)
    transformers.BertForSequenceClassification(cfg).save_pretrained(tmp_path / "cls")
    assert main(["triage", str(tmp_path / "cls"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("tndebug: error:") == 1 and "BertForSequenceClassification head" in err
    assert not (tmp_path / "out").exists()
