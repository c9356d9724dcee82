"""`tndebug faults`: the fault catalogue, one line each."""
from __future__ import annotations

from tndebug.faults import FAULTS, note_for


def add_parser(sub) -> None:
    p = sub.add_parser("faults", help="list the faults that can be switched on (--fault NAME)",
                       description="Every failure mode of the notes that `tndebug run --fault` can switch on.")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.format == "json":
        import json
        print(json.dumps([{"name": f.name, "probe": f.probe, "where": f.where, "summary": f.summary,
                           "note": note_for(f.name), "norms": list(f.norms), "needs": f.needs}
                          for f in FAULTS.values()], indent=2))
        return 0
    width = max(map(len, FAULTS))
    for f in FAULTS.values():
        note = note_for(f.name)
        src = f"[note {note}]" if note and not note.startswith("(") else f"[{note or 'FAILURE_MODES.md'}]"
        probe = f"-> {f.probe}" if f.probe else "-> (measured claim)"
        print(f"{f.name:<{width}}  {f.summary}  {probe} {src}")
    return 0
