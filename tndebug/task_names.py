"""The synthetic tasks' names and one-line summaries, torch-free: the CLI's parser lists them
(`tndebug run --task`) without importing torch; `tndebug.data.TASKS` builds each task from its
line here."""
SUMMARIES = {
    "copy": "target = source (The Annotated Transformer's copy task)",
    "reverse": "target = source reversed",
    "sort": "target = source sorted ascending",
    "translate": "toy translation: word bijection + adjective-noun swap (needs reordering)",
}
TASK_NAMES = tuple(SUMMARIES)
