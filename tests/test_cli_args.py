"""The CLI's argument rules of issue 18: no prefix matching anywhere (`--prob all` is refused, not
taken for --probe), and an empty --probe selection refused with exit 2 for run and triage."""
from __future__ import annotations

import argparse

import pytest

from tndebug.cli import build_parser, main


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_prefix_matching_is_off_on_every_parser():
    parsers = list(_parsers(build_parser()))
    assert len(parsers) >= 5                        # tndebug, run, triage, probes, faults
    assert all(p.allow_abbrev is False for p in parsers), [p.prog for p in parsers if p.allow_abbrev]


@pytest.mark.parametrize("argv", [["run", "--prob", "all"], ["run", "--step", "3"],
                                  ["triage", "x.pt", "--prob", "all"]])
def test_an_abbreviated_flag_is_refused(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tndebug: error: unrecognized arguments: {argv[-2]} {argv[-1]}")


@pytest.mark.parametrize("command", [["run"], ["triage", "x.pt"]])
@pytest.mark.parametrize("spec", ["", ",", " "])
def test_an_empty_probe_selection_is_refused(command, spec, capsys):
    assert main([*command, "--probe", spec]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"tndebug: error: argument --probe: {spec!r} selects no probe; pass probe "
                      f"names (`tndebug probes` lists them), all, or none on purpose (see "
                      f"`tndebug {command[0]} --help`)")


def test_a_full_flag_still_parses():
    args = build_parser().parse_args(["run", "--probe", "nan-scores", "--steps", "3"])
    assert (args.probe, args.steps) == ("nan-scores", 3)
