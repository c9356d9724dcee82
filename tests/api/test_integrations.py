"""The framework callbacks, each in a real short training run of its framework."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import models as M


def _copy_dataset(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n // 16):
        src, tgt = M.copy_batch(g)
        for s, t in zip(src, tgt):
            labels = t[1:].masked_fill(t[1:] == M.PAD, -100)
            rows.append({"input_ids": s, "attention_mask": (s != M.PAD).long(), "labels": labels})
    return rows


def _hf_train(tmp_path, **args):
    pytest.importorskip("accelerate")
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from tndebug.integrations.hf import TndebugCallback
    model = M.bart()
    cb = TndebugCallback(out=tmp_path / "tndebug", quiet=True)
    defaults = dict(output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=16,
                    learning_rate=1e-3, warmup_steps=10, lr_scheduler_type="linear",
                    save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                    logging_steps=10, dataloader_num_workers=0, seed=0)
    trainer = Seq2SeqTrainer(model=model, args=Seq2SeqTrainingArguments(**{**defaults, **args}),
                             train_dataset=_copy_dataset(), callbacks=[cb])
    trainer.train()
    return cb, trainer


def test_hf_seq2seq_trainer_healthy(tmp_path):
    cb, trainer = _hf_train(tmp_path)
    assert [f for f in cb.report.findings if f.severity != "info"] == [], cb.report.findings
    assert cb.report.verdict == "clean" and cb.exit_code == 0
    probes = cb.report.probes
    assert probes["lr-schedule"]["status"] == "pass"           # the trainer's LambdaLR, every step
    assert probes["lr-schedule"]["steps_observed"] == 30
    assert probes["loss-health"]["status"] == "pass" and probes["gradient-flow"]["status"] == "pass"
    assert json.loads((tmp_path / "tndebug" / "report.json").read_text())["run"]["steps"] == 30
    assert not trainer.model._forward_pre_hooks                 # removed at on_train_end


def test_hf_seq2seq_trainer_diverging_lr(tmp_path):
    cb, _ = _hf_train(tmp_path, optim="sgd", learning_rate=1e4, warmup_steps=0,
                      lr_scheduler_type="constant", max_grad_norm=0.0, max_steps=12)
    errors = [f for f in cb.report.findings if f.severity == "error"]
    assert errors and errors[0].probe in ("nan-scores", "loss-health"), cb.report.findings
    assert cb.watch.diverged is not None and errors[0].step == cb.watch.diverged
    assert cb.exit_code == 1


# -- PyTorch Lightning -----------------------------------------------------------------------------
def _lightning_run(tmp_path, lr, steps=30, criterion=None):
    pl = pytest.importorskip("pytorch_lightning")
    from tndebug.integrations.lightning import TndebugCallback

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = M.FusedSDPA()

        def training_step(self, batch, _):
            src, tgt = batch
            logits = self.model(src, tgt[:, :-1], M.PAD)
            crit = criterion or (lambda lg, t: F.cross_entropy(lg, t, ignore_index=M.PAD))
            return crit(logits.reshape(-1, M.V), tgt[:, 1:].reshape(-1))

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=lr)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    g = torch.Generator().manual_seed(0)
    batches = [M.copy_batch(g) for _ in range(steps)]
    cb = TndebugCallback(forward=M.fused_forward, out=tmp_path / "tndebug", quiet=True)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, callbacks=[cb],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Lit(), torch.utils.data.DataLoader(batches, batch_size=None))
    return cb


def test_lightning_healthy(tmp_path):
    cb = _lightning_run(tmp_path, lr=1e-3)
    assert [f for f in cb.report.findings if f.severity != "info"] == [], cb.report.findings
    assert cb.report.verdict == "clean"
    probes = cb.report.probes
    assert probes["lr-schedule"]["status"] == "pass" and probes["lr-schedule"]["steps_observed"] == 30
    assert probes["loss-health"]["steps_observed"] == 3
    assert (tmp_path / "tndebug" / "report.md").is_file()


def test_lightning_criterion_given_raw_logits(tmp_path):
    kl = torch.nn.KLDivLoss(reduction="batchmean")

    def raw_kl(logits, target):
        true = torch.full_like(logits, 0.1 / (M.V - 2))
        true.scatter_(1, target[:, None], 0.9)
        true[:, M.PAD] = 0
        return kl(logits, true)

    cb = _lightning_run(tmp_path, lr=1e-3, steps=12, criterion=raw_kl)
    (f,) = [f for f in cb.report.findings if f.severity == "error"]
    assert (f.probe, f.where, f.step) == ("loss-health", "criterion", 0)


# -- the other shapes (issue 21): a decoder-only and an encoder-only model through the callbacks --
def _lm_rows(n=256, seed=0, mlm=False):
    """Copy rows as one sequence: [BOS] x [BOS] x (the second x predictable from the first),
    labels on the copy only (decoder-only); or a masked LM over x x with 15% of the ids masked
    (encoder-only, id 3 the mask), labels at the masked ones."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        x = torch.randint(4, 60, (6,), generator=g)
        if mlm:
            ids = torch.cat([x, x])
            pick = torch.rand(ids.shape, generator=g) < 0.15
            pick[0] = True
            rows.append({"input_ids": ids.masked_fill(pick, 3), "attention_mask": torch.ones_like(ids),
                         "labels": torch.where(pick, ids, torch.full_like(ids, -100))})
        else:
            ids = torch.cat([torch.ones(1, dtype=torch.long), x, torch.ones(1, dtype=torch.long), x])
            labels = ids.clone()
            labels[:8] = -100                               # the loss on the copy only
            rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return rows


@pytest.mark.parametrize("shape", ["decoder", "encoder"])
def test_hf_trainer_on_a_decoder_only_and_an_encoder_only_model(tmp_path, shape):
    pytest.importorskip("accelerate")
    tf = pytest.importorskip("transformers")
    from tndebug.integrations.hf import TndebugCallback
    torch.manual_seed(0)
    if shape == "decoder":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=2,
                                                 n_positions=64, pad_token_id=0,
                                                 attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
    else:
        model = tf.BertForMaskedLM(tf.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=4, intermediate_size=64,
                                                 max_position_embeddings=64, pad_token_id=0,
                                                 hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0))
    cb = TndebugCallback(out=tmp_path / "tndebug", quiet=True)
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=16,
                                learning_rate=1e-3, warmup_steps=10, lr_scheduler_type="linear",
                                save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                                logging_steps=10, dataloader_num_workers=0, seed=0)
    tf.Trainer(model=model, args=args, train_dataset=_lm_rows(mlm=shape == "encoder"),
               callbacks=[cb]).train()
    report = cb.report
    assert [f for f in report.findings if f.severity != "info"] == [], report.findings
    assert report.run["arch"] == shape, report.run.get("arch")
    assert report.probes["mask-broadcast"]["status"] == "pass"
    assert report.probes["lr-schedule"]["status"] == "pass"
    assert report.probes["lr-schedule"]["steps_observed"] == 30
    assert report.probes["lm-decoding"]["status"] == ("pass" if shape == "decoder" else "skipped")


# -- Lightning on a decoder-only loop (issue 21) ------------------------------------------------
@pytest.mark.parametrize("labels", ["shifted", "unshifted"])
def test_lightning_on_a_decoder_only_loop(tmp_path, labels):
    """tndebug's own decoder-only model in a LightningModule that trains copy as a language
    model; the callback watches it with `forward(model, ids, pad_id)`. Healthy: clean, the
    decoder-only probes checked. The loss computed against the input ids (labels not shifted):
    label-shift names it once the loss has halved."""
    pl = pytest.importorskip("pytorch_lightning")
    from tndebug.config import ModelConfig
    from tndebug.data import as_lm, data_generator, get_task
    from tndebug.integrations.lightning import TndebugCallback
    from tndebug.model import DecoderOnly

    class LitLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = DecoderOnly(ModelConfig.tiny(arch="decoder", dropout=0.0))

        def training_step(self, batch, _):
            ids, nxt = batch
            target = nxt if labels == "shifted" else ids.masked_fill(nxt == 0, 0)
            logits = self.model(ids)
            return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    task, g = get_task("copy"), data_generator(0, "train")
    batches = [tuple(as_lm(task.batch(g, 32))[1:]) for _ in range(200)]   # (tgt_in, tgt_out)
    cb = TndebugCallback(forward=lambda m, ids, pad_id: m(ids), pad_id=0, out=tmp_path / "tndebug",
                         quiet=True)
    trainer = pl.Trainer(max_steps=200, accelerator="cpu", devices=1, logger=False, callbacks=[cb],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(LitLM(), torch.utils.data.DataLoader(batches, batch_size=None))
    report = cb.report
    assert report.run["arch"] == "decoder", report.run.get("arch")
    bad = [(f.code, f.severity) for f in report.findings if f.severity != "info"]
    if labels == "shifted":
        assert bad == [] and report.verdict == "clean", (bad, report.incomplete())
        for probe in ("mask-broadcast", "lm-decoding", "label-shift"):
            assert report.probes[probe]["status"] == "pass", (probe, report.probes[probe])
    else:
        assert ("label-shift/unshifted", "error") in bad, bad
        assert cb.exit_code == 1
