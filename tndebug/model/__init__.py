"""The instrumented Transformer: paper vocabulary, a tap point at every activation. Healthy:
the notes' faults are put in from outside (tndebug/inject.py, `make_model`)."""
from tndebug.model.embedding import PositionLimitError
from tndebug.model.hooks import HookPoint
from tndebug.model.transformer import Transformer, build
from tndebug.model.gpt import DecoderOnly

__all__ = ["DecoderOnly", "HookPoint", "PositionLimitError", "Transformer", "build"]
