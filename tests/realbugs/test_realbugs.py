"""The real-bug corpus in brief: the healthy model and four representative reported bugs through
`tndebug.check` / `tndebug.watch` (the whole corpus: `python bench/realbugs.py`)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tndebug  # noqa: E402
from bugs import BUGS, build  # noqa: E402
from loops import run_watch  # noqa: E402
from model import forward  # noqa: E402

SERIOUS = ("warning", "error")


def serious(report):
    return sorted({(f.probe, f.severity) for f in report.findings if f.severity in SERIOUS})


def test_corpus_records_a_thread_and_an_expectation_for_every_bug():
    assert len(BUGS) >= 20
    assert sum(b.expected_severity is not None for b in BUGS.values()) >= 20
    for b in BUGS.values():
        assert b.url.startswith("https://github.com/") and ("/issues/" in b.url or "/pull/" in b.url), b
        assert (b.expected_probe is None) == (b.expected_severity is None), b
        assert b.front in ("check", "watch"), b


@pytest.mark.parametrize("seed", [0, 1])
def test_healthy_model_is_clean(seed):
    report = tndebug.check(build(None, seed), forward, pad_id=0, bos_id=1)
    assert serious(report) == [], report.findings
    assert report.verdict == "clean"


@pytest.mark.parametrize("name, probe", [("no_scale", "missing-scale"),
                                         ("no_tgt_mask", "mask-broadcast"),
                                         ("pe_single_row", "positional-encoding")])
def test_reported_bug_is_named_by_its_probe(name, probe):
    bug = BUGS[name]
    report = tndebug.check(build(bug, 0), forward, pad_id=0, bos_id=1)
    assert (probe, "error") in serious(report), report.findings
    assert bug.expected_probe == probe


def test_benign_reported_bug_stays_clean():
    # the scale split as 1/d_k^(1/4) on q and on k (openai/guided-diffusion#38): the same numbers
    report = tndebug.check(build(BUGS["scale_split_qk"], 0), forward, pad_id=0, bos_id=1)
    assert serious(report) == [], report.findings


def test_training_loop_bug_is_named_and_its_benign_twin_is_not():
    bug = BUGS["no_train_after_eval"]
    assert ("train-mode", "warning") in serious(run_watch(build(bug, 0), steps=8, **bug.loop))
    twin = BUGS["no_train_after_eval_no_dropout"]          # no dropout: the mode changes nothing
    assert serious(run_watch(build(twin, 0), steps=8, **twin.loop)) == []


@pytest.mark.parametrize("name", ["softmax_dim0", "scale_after_softmax"])
def test_a_broken_softmax_is_not_also_called_a_normalised_residual(name):
    """The capture places these attention sites at the residual wrapper, whose output minus
    itself is 0: ln-placement's residual identity must not read that as norm(x) (it did: a
    collateral error on both bugs)."""
    report = tndebug.check(build(BUGS[name], 0), forward, pad_id=0, bos_id=1)
    assert not [f for f in report.findings if f.code == "ln-placement/residual-normalised"], \
        report.findings
    assert (BUGS[name].expected_probe, "error") in serious(report)


def test_the_normalised_residual_itself_is_still_named():
    report = tndebug.check(build(BUGS["residual_of_normed_input"], 0), forward, pad_id=0, bos_id=1)
    got = {(f.code, f.severity) for f in report.findings}
    assert ("ln-placement/residual-normalised", "error") in got, report.findings
    assert report.verdict == "errors" and report.exit_code() == 1


@pytest.mark.parametrize("name, side", [("split_heads_no_transpose", "split"),
                                        ("merge_heads_no_permute", "merge")])
def test_head_split_and_merge_get_their_own_finding(name, side):
    """Issue 19: heads split without the transpose, or merged without it, were named by
    mask-broadcast as 'positions mixed outside the softmax'; the head reshape is now fitted on
    both sides (q, k, v on the module's input; the output on the heads' outputs) and named."""
    report = tndebug.check(build(BUGS[name], 0), forward, pad_id=0, bos_id=1)
    errors = [f for f in report.findings if f.severity == "error"]
    assert errors and {f.code for f in errors} == {"mask-broadcast/head-split"}, report.findings
    word = {"split": "heads split", "merge": "heads merged"}[side]
    assert all(word in f.message for f in errors), errors[0].message
    assert "transpose(1,2)" in errors[0].fix


def test_one_head_merged_without_the_permute_stays_clean():
    # with one head the reshape is the identity (hackiey/QAnet-pytorch#2: "not changing")
    report = tndebug.check(build(BUGS["merge_no_permute_one_head"], 0), forward, pad_id=0, bos_id=1)
    assert serious(report) == [], report.findings


def test_a_nan_forward_is_one_story_not_also_a_gradient_defect():
    """Fully masked pad query rows under a -inf fill (hyunwoongko/transformer#40): the forward is
    NaN in those rows, and the gradient NaN because of it. nan-scores names the first op (error);
    gradient-flow's non-finite gradient says it is carried back from there (info, nan-scores'
    fix), not a second defect with an initialisation fix."""
    report = tndebug.check(build(BUGS["pad_mask_on_queries_inf"], 0), forward, pad_id=0, bos_id=1)
    assert serious(report) == [("nan-scores", "error")], report.findings
    grad = [f for f in report.findings if f.code == "gradient-flow/nonfinite-grad"]
    nan = [f for f in report.findings if f.code == "nan-scores/nonfinite-forward"]
    assert grad and grad[0].severity == "info" and "carried back" in grad[0].message, grad
    assert grad[0].fix == nan[0].fix and grad[0].evidence["follows"] == nan[0].code
    assert report.probes["gradient-flow"]["status"] == "pass"
