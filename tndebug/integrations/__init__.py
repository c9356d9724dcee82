"""Framework callbacks over the one probe engine (`tndebug.watch`): thin adapters, each an
optional extra. `tndebug.integrations.hf.TndebugCallback` (transformers' Trainer and
Seq2SeqTrainer; `pip install tndebug[hf]`) and `tndebug.integrations.lightning.TndebugCallback`
(PyTorch Lightning; `pip install tndebug[lightning]`)."""
