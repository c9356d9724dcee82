"""triage loads a Hugging Face directory as transformers does, without drawing random weights
first (issue 21: memory and time at real sizes). The model is built uninitialised
(`build_model(init=False)`), handed the file's tensors (`load_tied`), and what the file lacks is
initialised (`init_missing`): every parameter and buffer, the non-persistent ones too, must
equal `from_pretrained`'s, and the logits with them, on each architecture tndebug names, and on
mixtures of experts, whose saved keys transformers merges on load (before 2026-12-07 triage
refused a Mixtral directory: "unexpected keys")."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tndebug.judge.fresh import seeded                                          # noqa: E402
from tndebug.hf.build import build_model, load_config                           # noqa: E402
from tndebug.hf.load import init_missing, load_tied, read_weights, renamed, weight_files  # noqa: E402

V, D, H, L = 96, 32, 4, 2
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _configs():
    T = transformers
    dec = dict(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=L,
               num_attention_heads=H, max_position_embeddings=64, **IDS)
    s2s = dict(vocab_size=V, d_model=D, encoder_layers=L, decoder_layers=L, encoder_attention_heads=H,
               decoder_attention_heads=H, encoder_ffn_dim=2 * D, decoder_ffn_dim=2 * D,
               max_position_embeddings=64, decoder_start_token_id=2, **IDS)
    enc = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
               intermediate_size=2 * D, max_position_embeddings=64, **IDS)
    return {
        "bart": (T.BartConfig(**s2s), T.AutoModelForSeq2SeqLM),
        "marian": (T.MarianConfig(**s2s), T.AutoModelForSeq2SeqLM),   # sinusoids: _init_weights only
        "t5": (T.T5Config(vocab_size=V, d_model=D, d_kv=D // H, d_ff=2 * D, num_layers=L,
                          num_heads=H, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
               T.AutoModelForSeq2SeqLM),
        "gpt2": (T.GPT2Config(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=64, **IDS),
                 T.AutoModelForCausalLM),
        "llama": (T.LlamaConfig(**dec, num_key_value_heads=2), T.AutoModelForCausalLM),
        "qwen2": (T.Qwen2Config(**dec, num_key_value_heads=2), T.AutoModelForCausalLM),
        "mistral": (T.MistralConfig(**dec, num_key_value_heads=2), T.AutoModelForCausalLM),
        "gpt_neox": (T.GPTNeoXConfig(**dec), T.AutoModelForCausalLM),
        # a mixture of experts: held fused (experts.gate_up_proj [E, 2f, d]), saved per expert
        # (experts.0.w1.weight ...), merged on load by transformers' conversion mapping
        "mixtral": (T.MixtralConfig(**dec, num_key_value_heads=2, num_local_experts=4,
                                    num_experts_per_tok=2), T.AutoModelForCausalLM),
        "qwen2_moe": (T.Qwen2MoeConfig(**dec, num_key_value_heads=2, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=D,
                                       shared_expert_intermediate_size=D), T.AutoModelForCausalLM),
        "bert": (T.BertConfig(**enc), T.AutoModelForMaskedLM),
        "roberta": (T.RobertaConfig(**enc), T.AutoModelForMaskedLM),
    }


def _everything(model) -> dict[str, torch.Tensor]:
    """Parameters and every buffer, non-persistent ones included, by name."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    return out


def _shared(model) -> set[str]:
    """Names of the parameters that are one object with another name's."""
    named = list(model.named_parameters(remove_duplicate=False))
    return {k for k, p in named if any(p is q for j, q in named if j != k)}


@pytest.mark.parametrize("arch", list(_configs()))
def test_loading_without_random_init_gives_what_from_pretrained_gives(arch, tmp_path):
    cfg, auto = _configs()[arch]
    torch.manual_seed(0)
    auto.from_config(cfg).save_pretrained(tmp_path)
    tf, config, kind = load_config(tmp_path)
    model = build_model(tf, config, None, kind, init=False)
    # tied before loading as a built model is (the tied-head check reads the ties then)
    assert _shared(model) == _shared(build_model(tf, config, None, kind))
    sd = renamed(model, read_weights(weight_files(tmp_path)))
    _, unfilled = load_tied(model, sd, tmp_path)
    seeded(lambda: init_missing(model, unfilled))
    ref = auto.from_pretrained(tmp_path, dtype=torch.float32)
    ours, theirs = _everything(model), _everything(ref)
    assert set(ours) == set(theirs)
    differ = [k for k in ours if ours[k].shape != theirs[k].shape or not torch.equal(ours[k], theirs[k])]
    assert not differ, f"{arch}: {differ[:5]}"
    # ties as transformers keeps them: the same object where from_pretrained shares one
    assert _shared(model) == _shared(ref)
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(1))
    kw = {"decoder_input_ids": ids} if kind == "seq2seq" else {}
    model.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, **kw).logits, ref(input_ids=ids, **kw).logits)
