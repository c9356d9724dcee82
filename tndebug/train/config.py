"""Training configuration: a frozen dataclass with commented defaults, and the model config a task needs."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tndebug.config import PRESETS, ModelConfig
from tndebug.task_names import TASK_NAMES, VOCAB

DEVICES = ("auto", "cpu", "cuda")
AMPS = ("none", "bf16", "fp16")


# `tndebug run --arch decoder` defaults, measured on copy (small preset, one thread, 2026-12-01,
# /tmp runs, not kept): at the seq2seq defaults (400 steps, warmup 20, factor 0.2, dropout 0.1)
# the decoder-only model reached 67% exact match; dropout 0.1 -> 0 took the final loss from 0.28
# to 0.04 (nanoGPT's default dropout is 0 too); warmup 100, factor 1.5, 500 steps gave exact
# match 0.89 / 0.98 / 0.95 (seeds 0, 1, 2, Pre-LN) and 0.90 (Post-LN), token accuracy 0.97-0.996,
# in 15-19 s of training without probes. 500 steps left one of bench/decoder_run.py's six runs
# (seed 0, Post-LN, at ffeb3b1) at token accuracy 0.969, under the 0.97 target; steps were then set
# on other seeds (10-14, Post-LN, the slower to learn; 2026-12-04, /tmp runs, not kept, so that
# decoder_run's seeds 0-2 stay the evaluation): 700 steps 0.959 (seed 10); 800 steps with every
# probe 0.989 / 0.975 (seeds 10, 14) in 19.6-20.3 s; 900 steps 0.983 / 0.986 in 22.2-22.5 s;
# 1000 steps 0.994-0.995 (seeds 10, 13, 14) but 23-25 s without probes, near the 30 s target.
DECODER_RUN = {"steps": 900, "warmup": 100, "lr_factor": 1.5}
DECODER_DROPOUT = 0.0


@dataclass(frozen=True)
class TrainConfig:
    task: str = "copy"            # copy | reverse | sort | translate (tndebug.data.TASKS)
    steps: int = 400              # optimizer steps to take (on resume: steps *more*); small copy reaches
                                  # >= 99% by ~200 (Pre-LN), ~350 (Post-LN); see bench/default_run.py
    batch_size: int = 64          # sequences per step
    warmup: int = 20              # Noam warmup steps (short: the copy task is learnt in a few hundred;
                                  # 10 learnt slower: 76% at step 200 vs 99.4%, d_model 128)
    lr_factor: float = 0.2        # Noam factor: lr = factor * d_model^-0.5 * min(s^-0.5, s*warmup^-1.5);
                                  # peak 5.6e-3 at d_model=64 (small), 4.0e-3 at 128; factor 1 or 2
                                  # spikes or stalls on copy, 0.3-0.5 learnt slower, 0.1 too
    label_smoothing: float = 0.1  # eps of §5.4
    pad_share: float = 0.5        # share of rows shorter than the longest (right-padded)
    seed: int = 0                 # model init, dropout and the data streams
    device: str = "auto"          # auto | cpu | cuda
    amp: str = "none"             # none | bf16 | fp16 (autocast; fp16 adds a GradScaler)
    eval_size: int = 1000         # held-out sequences for exact match / token accuracy
    log_every: int = 10           # steps between scalar logs
    save_every: int = 100         # steps between periodic checkpoints (0: only at the end); a save
                                  # of the small preset is ~0.008 s CPU, a step ~0.035 s (1 CPU
                                  # thread): 100 keeps saving < 1% of training time
    probe_budget: float | None = None   # the probed steps may cost this share of the measured
                                  # step time (probes/budget.py); None: every scheduled look, and
                                  # a run that repeats bit for bit (which steps a budget defers
                                  # depends on the machine's timing). `tndebug run` passes its
                                  # --probe-budget, default DEFAULT_FRACTION (0.03, as watch's).
                                  # Under DDP the ranks agree on the timings (Budget's agree=), so
                                  # every rank probes the same steps.

    def __post_init__(self) -> None:
        if self.task not in TASK_NAMES:      # tndebug.data (torch) is not imported: the CLI's parser reads _D
            raise ValueError(f"unknown task {self.task!r}; expected one of {', '.join(TASK_NAMES)}")
        if self.steps < 0 or self.batch_size < 1 or self.warmup < 1 or self.save_every < 0:
            raise ValueError(f"steps={self.steps}, batch_size={self.batch_size}, warmup={self.warmup}, "
                             f"save_every={self.save_every}: need steps >= 0, batch_size >= 1, "
                             "warmup >= 1, save_every >= 0")
        if not (math.isfinite(self.lr_factor) and self.lr_factor > 0):
            raise ValueError(f"lr_factor={self.lr_factor}: need a finite number > 0")
        if self.probe_budget is not None and not (isinstance(self.probe_budget, (int, float))
                                                  and 0 <= self.probe_budget <= 1):
            raise ValueError(f"probe_budget={self.probe_budget!r}: need a share in [0, 1] or None")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}; expected one of {DEVICES}")
        if self.amp not in AMPS:
            raise ValueError(f"amp={self.amp!r}; expected one of {AMPS}")

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def model_config(task: str = "copy", preset: str = "small", norm: str = "pre",
                 faults: tuple[str, ...] | list[str] = (), **kw) -> ModelConfig:
    """The preset sized for `task` (its vocabularies), with faults; `no_dropout` sets dropout 0."""
    if task not in VOCAB:                # tndebug.data (torch) is not imported: the CLI checks flags first
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASK_NAMES)}")
    cfg = ModelConfig.preset(preset, norm=norm, src_vocab=VOCAB[task], tgt_vocab=VOCAB[task], **kw)
    cfg = cfg.with_faults(*faults)
    return apply_config_faults(cfg)


def apply_config_faults(cfg: ModelConfig) -> ModelConfig:
    """Config-level faults: `no_dropout` is dropout 0 everywhere."""
    if cfg.has("no_dropout") and cfg.dropout:
        cfg = cfg.replace(dropout=0.0)
    return cfg


def preset_name(cfg: ModelConfig) -> str:
    """The preset whose dimensions `cfg` has, or "custom"."""
    dims = ("d_model", "n_heads", "n_layers", "d_ff")
    for name in PRESETS:
        ref = ModelConfig.preset(name)
        if all(getattr(cfg, k) == getattr(ref, k) for k in dims):
            return name
    return "custom"
