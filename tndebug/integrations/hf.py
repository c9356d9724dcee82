"""tndebug's probes in a Hugging Face `Trainer` / `Seq2SeqTrainer` run.

    from tndebug.integrations.hf import TndebugCallback
    cb = TndebugCallback(out="runs/bart")
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train()
    cb.report.verdict, cb.exit_code

A thin adapter over `tndebug.watch`: `on_train_begin` opens the watch on the trainer's model
and optimizer (accelerate's wrapper is unwrapped; its step pre-hook is the probes' moment,
after backward and gradient clipping, before the update), with the trainer's LambdaLR as the
declared schedule, `state.global_step` as the start step (a resumed run is checked for a
restarted warmup) and `max_steps` as the horizon; `on_train_end` closes it and writes the
report. The batch and the loss come from the model's own call (`input_ids`, `labels`,
`outputs.loss`). Gradient accumulation: the first micro-batch of each step is probed.
Several processes: rank 0 writes the one report, the others say so on stderr (as `watch`).
FSDP2 through the Trainer is not tested here: on CPU accelerate (1.15) ignores `fsdp=` and
wraps the model in DDP (2 gloo processes, `fsdp=True, fsdp_config={"version": 2}`:
distributed type MULTI_CPU, `is_fsdp_enabled` False); the Lightning callback is tested under
FSDP2 (tests/api/test_fsdp.py).
"""
from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from tndebug.library.watch import Watch


class TndebugCallback(TrainerCallback):
    """Args: `out` (default: `<output_dir>/tndebug`; None after construction means that),
    and any `tndebug.watch` keyword (`probes`, `fail_on`, `quiet`, `forward`, `pad_id`, ...).
    After training: `report`, `exit_code`, `watch`."""

    def __init__(self, out: str | Path | None = None, **watch_kwargs) -> None:
        self.out = out
        self.watch_kwargs = watch_kwargs
        self.watch: Watch | None = None
        self.report = None
        self.exit_code: int | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                       **kwargs):
        schedule = getattr(lr_scheduler, "scheduler", lr_scheduler)    # accelerate's wrapper
        kw = {"lr_schedule": schedule, "start_step": state.global_step,
              "total_steps": state.max_steps or None, **self.watch_kwargs}
        out = self.out if self.out is not None else Path(args.output_dir) / "tndebug"
        self.watch = Watch(model, optimizer, out=out, **kw)
        self.watch.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is None:
            return
        self.watch.__exit__(None, None, None)
        self.report, self.exit_code = self.watch.report, self.watch.exit_code
