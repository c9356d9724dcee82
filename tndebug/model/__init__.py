"""The instrumented Transformer: paper vocabulary, a tap point at every activation."""
from tndebug.model.embedding import PositionLimitError
from tndebug.model.hooks import HookPoint
from tndebug.model.transformer import Transformer, make_model

__all__ = ["HookPoint", "PositionLimitError", "Transformer", "make_model"]
