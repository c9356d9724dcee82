"""tndebug: an instrumented debugger for encoder-decoder Transformers."""
__version__ = "0.1.0"
