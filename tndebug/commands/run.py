"""`tndebug run` (placeholder until the training loop lands)."""


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="train with probes attached")
    p.set_defaults(func=lambda a: 3)
