"""The judge: every re-judgement of a finding after its probe, in one stage run once.

    from tndebug import judge
    report = judge.conclude(run, probed.findings, probed.statuses, judge.Context(one_pass=True))

A probe judges what its Trace shows. What it cannot know -- the same code at a fresh
initialisation, non-finite weights in the file, a NaN that the gradient and the loss only carry
on, the words of a Hugging Face user, the user's module paths, one finding per place, the
statuses of the front-end's own checks, --select / --ignore -- is judged here, by the passes of
`stage.PASSES` in their declared order:

    nan-weights, code-on-fresh        judge/nan.py, judge/fresh.py   (the file's NaN weights)
    scale-at-init                     judge/scale.py                 (missing-scale)
    shift-at-init, growth-at-init,    judge/fresh.py                 (label-shift, variance-drift)
      rank-at-init
    gather                            the front-end's own checks join; the temperature
                                      sweep's findings (probes/missing_scale_sweep.py)
    wording                           hf/wording.py (Hugging Face), the user's paths,
                                      judge/arch.py (a decoder read by a guess)
    dedupe                            judge/status.py
    statuses                          judge/status.py                (checks, parts not run)
    nan-story                         judge/nan.py                   (one story per NaN)
    update-story                      judge/collateral.py            (one per broken update)
    select                            judge/status.py                (--select / --ignore)

Layer: below the front-ends (triage, library, train, commands call `conclude`), above the
probes (which never import it); it imports probes, findings and report.
"""
from tndebug.judge.stage import PASSES, Context, conclude, select_codes  # noqa: F401
from tndebug.judge.status import codes_option, first_sign  # noqa: F401
