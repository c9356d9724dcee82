"""Training: data task, Adam + Noam, label-smoothed KL loss, probes, checkpoints, evaluation.

    from tndebug.train import TrainConfig, model_config, run_training
    result = run_training(model_config("copy", "small"), TrainConfig(), probes="all")

The names are imported on first use (PEP 562), so that `tndebug.train.config` (the CLI's parser
reads its defaults) comes without torch.
"""
import importlib

_WHERE = {"TrainConfig": "config", "model_config": "config", "preset_name": "config",
          "evaluate": "evaluate", "greedy_decode": "evaluate",
          "TrainResult": "loop", "build_probes": "loop", "declared_schedule": "loop",
          "run_training": "loop", "LabelSmoothingLoss": "loss", "constant": "schedule",
          "noam": "schedule"}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"tndebug.train.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'tndebug.train' has no attribute {name!r}")


__all__ = ["TrainConfig", "TrainResult", "model_config", "preset_name", "run_training",
           "build_probes", "declared_schedule", "evaluate", "greedy_decode",
           "LabelSmoothingLoss", "noam", "constant"]
