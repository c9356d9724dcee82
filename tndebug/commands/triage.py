"""`tndebug triage` (placeholder until the training loop lands)."""


def add_parser(sub) -> None:
    p = sub.add_parser("triage", help="diagnose a checkpoint")
    p.set_defaults(func=lambda a: 3)
