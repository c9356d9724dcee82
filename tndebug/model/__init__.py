"""The instrumented Transformer: paper vocabulary, a tap point at every activation."""
from tndebug.model.embedding import PositionLimitError
from tndebug.model.hooks import HookPoint
from tndebug.model.transformer import Transformer, make_model
from tndebug.model.gpt import DecoderOnly

__all__ = ["DecoderOnly", "HookPoint", "PositionLimitError", "Transformer", "make_model"]
