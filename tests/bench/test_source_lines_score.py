"""bench/_source_lines.py (issue 48's score): where each corpus says its bug is, and how a
finding's source line is judged against it."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_source_lines", ROOT / "bench" / "_source_lines.py")
sl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sl)

MODEL = '''BUGS = ("no_scale",)


class Attn:
    def forward(self, q, k):
        att = q @ k.transpose(-2, -1)
        if self.bug != "no_scale":
            att = att / 4
        return att.softmax(-1)

    def other(self):
        return 1
'''


def _src(file, line, **kw):
    return {"file": str(file), "line": line, "function": "Attn.forward", "code": "", **kw}


def test_switch_lines_are_the_guarded_statement_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    assert sl.switch_lines(f, "no_scale") == [7, 8]        # not line 1, the module's list of names
    assert sl.switch_lines(f, "absent") == []
    assert sl.function_at(str(f), 6) == "Attn.forward" and sl.function_at(str(f), 12) == "Attn.other"


def test_score_right_given_and_function(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    err = {"probe": "missing-scale", "severity": "error"}
    right = sl.score([{**err, "source": _src(f, 8)}], "missing-scale", f, [7, 8])
    assert (right["given"], right["right"], right["function_right"]) == (True, True, True)
    near = sl.score([{**err, "source": _src(f, 6)}], "missing-scale", f, [7, 8])
    assert (near["given"], near["right"], near["function_right"]) == (True, False, True)
    elsewhere = sl.score([{**err, "source": _src(other, 1)}], "missing-scale", f, [7, 8])
    assert (elsewhere["given"], elsewhere["right"]) == (True, False)      # a user line, not the bug's
    for not_given in (_src(f, 8, package="transformers"), _src(f, 5, **{"def": True}), None):
        s = sl.score([{**err, "source": not_given}], "missing-scale", f, [7, 8])
        assert not s["given"] and not s["right"], not_given
    info = sl.score([{"probe": "missing-scale", "severity": "info", "source": _src(f, 8)}],
                    "missing-scale", f, [7, 8])
    assert not info["given"]                                # only the findings that named the bug
    assert sl.score([{**err, "source": _src(f, 8)}], "mask-broadcast", f, [7, 8])["given"] is False
    assert sl.score([], "missing-scale", f, []) is None     # no known line: not scored


def test_method_lines_of_a_swapped_in_class():
    sys.path.insert(0, str(ROOT / "tests" / "realbugs"))
    import mechanisms
    file, lines = sl.method_lines([mechanisms.NoScale])
    assert Path(file).name == "mechanisms.py"
    text = Path(file).read_text().splitlines()
    assert [text[i - 1].strip() for i in lines] == ["def scores(self, q, k):", "return q @ k.transpose(-2, -1)"]


def test_summary_and_spans():
    recs = [{"named": True, "source_line": {"given": True, "right": True, "function_right": True}},
            {"named": True, "source_line": {"given": True, "right": False, "function_right": True}},
            {"named": True, "source_line": {"given": False, "right": False, "function_right": False}},
            {"named": False, "source_line": None}]
    s = sl.summary(recs)
    assert s == {"named_with_known_line": 3, "line_given": 2, "line_right": 1, "function_right": 2}
    assert "line right 1/2" in sl.summary_line(s) and "line given 2/3" in sl.summary_line(s)
    assert sl.spans([9, 3, 4, 5, 11, 12]) == "3-5, 9, 11-12"
