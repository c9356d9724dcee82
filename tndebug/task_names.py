"""The synthetic tasks' names, one-line summaries and vocabularies, torch-free: the CLI's parser lists them
(`tndebug run --task`) without importing torch; `tndebug.data.TASKS` builds each task from its
line here."""
SUMMARIES = {
    "copy": "target = source (The Annotated Transformer's copy task)",
    "reverse": "target = source reversed",
    "sort": "target = source sorted ascending",
    "translate": "toy translation: word bijection + adjective-noun swap (needs reordering)",
}
TASK_NAMES = tuple(SUMMARIES)
# each task's vocabulary (source = target): model_config sizes a model from it without torch;
# tndebug.data builds its tasks from these (tests/test_cheap_refusals.py holds them equal)
VOCAB = {"copy": 11, "reverse": 11, "sort": 11, "translate": 25}
# the built-in adapters' names (--adapter NAME): refused before torch when unknown;
# capture/adapters.py's BUILTIN is this tuple
ADAPTER_NAMES = ("annotated", "tndebug", "gpt", "bert")
