"""Training: data task, Adam + Noam, label-smoothed KL loss, probes, checkpoints, evaluation.

    from tndebug.train import TrainConfig, model_config, run_training
    result = run_training(model_config("copy", "small"), TrainConfig(), probes="all")
"""
from tndebug.train.config import TrainConfig, model_config, preset_name
from tndebug.train.evaluate import evaluate, greedy_decode
from tndebug.train.loop import TrainResult, build_probes, declared_schedule, run_training
from tndebug.train.loss import LabelSmoothingLoss
from tndebug.train.schedule import constant, noam

__all__ = ["TrainConfig", "TrainResult", "model_config", "preset_name", "run_training",
           "build_probes", "declared_schedule", "evaluate", "greedy_decode",
           "LabelSmoothingLoss", "noam", "constant"]
