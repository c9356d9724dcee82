"""Learned positions (`ModelConfig(pos="learned")`, `tndebug run --pos learned`, issue 21): a
trained [max_len, d_model] table added at the embedding in place of the sinusoids (GPT-2's wpe),
in the encoder-decoder and the decoder-only model alike. Positions still count from a row's
first real token, so left pads and the KV cache leave a decoder's logits exact; the table's
faults stay with the sinusoidal table."""
from __future__ import annotations

import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.inject import make_model

from test_rope import ids     # BOS-led rows, some left-padded

TOL = dict(atol=1e-5, rtol=1e-5)


def build(arch="decoder", **kw):
    torch.manual_seed(0)
    return make_model(ModelConfig.tiny(arch=arch, dropout=0.0, pos="learned", **kw)).eval()


@pytest.mark.parametrize("arch", ["seq2seq", "decoder"])
def test_the_rows_added_are_a_trained_table(arch):
    m = build(arch)
    emb = m.tgt_embed
    assert isinstance(emb.wpe, torch.nn.Embedding) and emb.wpe.weight.requires_grad
    assert emb.wpe.weight.shape == (m.cfg.max_len, m.cfg.d_model)
    assert 0.6 < float(emb.wpe.weight.detach().std()) < 0.8           # the sinusoids' RMS, 1/sqrt(2)
    assert torch.equal(emb.positions(5), emb.wpe.weight[:5])
    assert any(n.endswith("wpe.weight") for n in m.state_dict())
    x = torch.randint(3, 11, (2, 6))
    out = emb(x)
    with torch.no_grad():
        emb.wpe.weight.zero_()
    assert (out - emb(x)).abs().max() > 0.1                  # the table reaches the embedding


@torch.no_grad()
def test_left_pads_and_the_kv_cache_leave_the_decoders_logits_exact():
    m = build()
    x = ids(left_pads=(0, 0, 0, 0))
    lp = torch.cat([torch.zeros(4, 3, dtype=x.dtype), x], 1)
    assert torch.allclose(m(x), m(lp)[:, 3:], **TOL)
    ragged = ids()
    for split in (1, 4):
        real = (ragged != 0)[:, split:]
        got, want = m.incremental(ragged, split), m(ragged)[:, split:]
        assert torch.allclose(got[real], want[real], **TOL)


def test_the_sinusoidal_tables_faults_stay_with_it():
    with pytest.raises(ValueError, match="sinusoidal table"):
        ModelConfig.tiny(arch="decoder", pos="learned").with_faults("no_pos_encoding")
    ModelConfig.tiny(pos="learned").with_faults("no_scale")        # the other faults apply


def test_a_short_run_with_every_probe_has_no_warning_or_error():
    from tndebug.train import TrainConfig, model_config, run_training
    torch.manual_seed(0)
    cfg = model_config("copy", "tiny", "pre", arch="decoder", pos="learned", dropout=0.0)
    report = run_training(cfg, TrainConfig(steps=60, device="cpu", warmup=20, lr_factor=1.5),
                          probes="all", evaluate_at_end=False).report
    bad = [(f.probe, f.code, f.message[:120]) for f in report.findings
           if f.severity in ("warning", "error")]
    assert not bad, bad


@pytest.mark.parametrize("flags, pos, tied", [([], "sinusoidal", False),
                                               (["--pos", "learned", "--tie-embeddings"], "learned", True)])
def test_tndebug_run_flags_give_learned_positions_and_a_tied_head(flags, pos, tied):
    from tndebug.cli import build_parser
    from tndebug.commands.run import configs
    args = build_parser().parse_args(["run", "--arch", "decoder", *flags])
    mcfg, _, _, out, _ = configs(args)
    assert (mcfg.pos, mcfg.tie_embeddings) == (pos, tied)
    assert ("-learned" in out) is (pos == "learned")
    m = make_model(mcfg)
    assert (m.tgt_embed.lut.weight is m.generator.proj.weight) is tied
