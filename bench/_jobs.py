"""What `python -m bench` regenerates: each job's commands, the results files they write, and how
long the full job takes on 2 quiet CPU cores.

A command is a list of arguments after `python`, run from the repository root. In a quick
command `{out}` stands for a scratch folder, so that `--quick` never overwrites a results file
that the README or docs quote. Estimates come from the wall times the results files recorded
(`wall_s`, or per-run times times the runs), scaled to the current presets where those changed;
where machines differed the slower one's (default_run 895 s, triage_speed 347 s, detection 3676 s
on the 2-core Intel Xeon of 2026-12-03, whose provenance the results files keep).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    name: str
    what: str
    commands: tuple[tuple[str, ...], ...]      # the full regeneration, into bench/results/
    quick: tuple[tuple[str, ...], ...]         # a short version, into {out}
    writes: tuple[str, ...]                    # results files, relative to the repository root
    minutes: float                             # estimate of `commands` on 2 quiet cores
    needs: str = ""                            # "cuda": skipped by `all` without a GPU
    ok_codes: tuple[int, ...] = (0,)           # exit codes that mean the results file was written


R = "bench/results/"
JOBS: tuple[Job, ...] = (
    Job("speed_vs_torch", "our model vs torch.nn.Transformer, training step, small and base",
        (("bench/speed_vs_torch.py",),),
        (("bench/speed_vs_torch.py", "--presets", "small", "--reps", "3", "--out", "{out}/speed_vs_torch.json"),),
        (R + "speed_vs_torch.json",), 1.5),
    Job("overhead", "probe overhead of `tndebug run`, default schedules and every probe every step",
        (("bench/overhead.py", "--steps", "200", "--rounds", "3", "--memory-steps", "20"),),
        (("bench/overhead.py", "--steps", "8", "--rounds", "1", "--no-memory", "--out", "{out}/overhead.json"),),
        (R + "overhead.json",), 3.0),
    Job("report_overhead", "report generation (TensorBoard, plots, markdown) against report.json only",
        (("bench/report_overhead.py",),),
        (("bench/report_overhead.py", "--steps", "8", "--pairs", "1", "--out", "{out}/report_overhead.json"),),
        (R + "report_overhead.json",), 2.0, ok_codes=(0, 1)),         # 1: over the 5% limit, written
    Job("ddp_overhead", "probe overhead under DDP, 2 gloo processes, tiny and small",
        (("bench/ddp_overhead.py", "--reps", "4"),
         ("bench/ddp_overhead.py", "--preset", "small", "--reps", "4", "--out", R + "ddp_overhead_small.json")),
        (("bench/ddp_overhead.py", "--steps", "8", "--reps", "1", "--out", "{out}/ddp_overhead.json"),),
        (R + "ddp_overhead.json", R + "ddp_overhead_small.json"), 4.0),
    Job("ddp_overhead_fsdp2", "watch under FSDP2, 2 gloo processes: a watched and a plain copy stepped in turn",
        (("bench/ddp_overhead.py", "--arm", "fsdp2"),),
        (("bench/ddp_overhead.py", "--arm", "fsdp2", "--steps", "12", "--reps", "1",
          "--out", "{out}/ddp_overhead_fsdp2.json"),),
        (R + "ddp_overhead_fsdp2.json",), 6.0),
    Job("default_run", "the default `tndebug run --probe all`, old and new, seeds 0-2, both norms; threads",
        (("bench/default_run.py",),),
        (("bench/default_run.py", "--settings", "new", "--seeds", "0", "--norms", "pre", "--only", "runs",
          "--out", "{out}/default_run.json"),),
        (R + "default_run.json", R + "default_run.md"), 15.0, ok_codes=(0, 1)),  # 1: target not met, written
    Job("decoder_run", "`tndebug run --arch decoder --probe all` (issue 21's target), seeds 0-2, both norms",
        (("bench/decoder_run.py",),),
        (("bench/decoder_run.py", "--seeds", "0", "--norms", "pre", "--out", "{out}/decoder_run.json"),),
        (R + "decoder_run.json", R + "decoder_run.md"), 4.0, ok_codes=(0, 1)),  # 1: target not met, written
    Job("triage_speed", "`tndebug triage` of a base checkpoint, three ways in, 1 and 2 threads",
        (("bench/triage_speed.py",),),
        (("bench/triage_speed.py", "--reps", "1", "--cases", "tndebug", "--threads", "1",
          "--out", "{out}/triage_speed.json"),),
        (R + "triage_speed.json",), 6.0),
    Job("triage_figures", "what triage's figures cost (issue 23: <= 2 s): the figure stage itself, "
        "timed in a base-checkpoint triage and in 5 fresh processes, one thread; --no-figures draws none",
        (("bench/triage_speed.py", "--reps", "0", "--figures-direct", "5", "--warm", "2",
          "--out", R + "triage_figures.json"),),
        (("bench/triage_speed.py", "--reps", "0", "--figures-direct", "1", "--warm", "1",
          "--out", "{out}/triage_figures.json"),),
        (R + "triage_figures.json",), 1.5),
    Job("hf_triage", "`tndebug triage DIR` of a Marian-size Hugging Face directory, the whole CLI",
        (("bench/hf_triage.py",),),
        (("bench/hf_triage.py", "--reps", "1", "--out", "{out}/hf_triage.json"),),
        (R + "hf_triage.json",), 2.0),
    Job("hf_unseen", "`tndebug triage DIR` on 24 Hugging Face architectures no test uses, healthy "
        "(trained and init) and with injected bugs; DEV and HELD-OUT halves (issues 19, 21)",
        (("bench/hf_unseen.py", "--half", "dev"), ("bench/hf_unseen.py", "--half", "held-out")),
        (("bench/hf_unseen.py", "--archs", "phi", "--steps", "20", "--out", "{out}/hf_unseen"),),
        (R + "hf_unseen.json", R + "hf_unseen.md"), 3.0),
    Job("hf_unseen_1000", "the same 24 architectures trained 1000 steps (issue 19: init-time "
        "properties drifted), DEV and HELD-OUT halves",
        (("bench/hf_unseen.py", "--half", "dev", "--steps", "1000", "--key", "dev-1000", "--note",
          "DEV architectures trained 1000 steps (issue 19: long enough for init-time properties to "
          "drift); the 150-step tables are hf_unseen.md", "--out", "bench/results/hf_unseen_1000_dev"),
         ("bench/hf_unseen.py", "--half", "held-out", "--steps", "1000", "--key", "held-out-1000",
          "--note", "HELD-OUT architectures trained 1000 steps (issue 19), at a commit, not tuned "
          "on; the 150-step tables are hf_unseen.md", "--out", "bench/results/hf_unseen_1000_held_out")),
        (("bench/hf_unseen.py", "--archs", "phi", "--steps", "20", "--key", "dev-1000", "--out",
          "{out}/hf_unseen_1000_dev"),),
        (R + "hf_unseen_1000_dev.json", R + "hf_unseen_1000_dev.md",
         R + "hf_unseen_1000_held_out.json", R + "hf_unseen_1000_held_out.md"), 5.0),
    Job("hf_shapes", "`tndebug triage DIR` on issue 21's shapes (GPT-2, Llama, Qwen2, Mistral, GPT-NeoX, "
        "BERT, RoBERTa), trained 1000 steps, seeds 0-2, healthy and with injected bugs (calibration side)",
        (("bench/hf_unseen.py", "--archs", "gpt2,llama,qwen2,mistral,gpt_neox,bert,roberta", "--steps",
          "1000", "--seeds", "3", "--key", "shapes", "--out", "bench/results/hf_shapes"),),
        (("bench/hf_unseen.py", "--archs", "gpt2", "--steps", "20", "--key", "shapes", "--out",
          "{out}/hf_shapes"),),
        (R + "hf_shapes.json", R + "hf_shapes.md"), 12.0),
    Job("hf_scan", "`tndebug triage DIR` on a development scan of 23 more architectures (QK-norm, "
        "mixtures of experts, fused gated FFNs, n-gram streams), trained 1000 steps, healthy and with "
        "injected bugs; not held out (what it found was fixed)",
        (("bench/hf_unseen.py", "--scan", "--steps", "1000", "--key", "scan", "--note",
          "SCAN: a development scan outside both halves (2026-12-07): what it found was fixed, so not "
          "held out", "--out", "bench/results/hf_scan"),),
        (("bench/hf_unseen.py", "--archs", "olmo2", "--steps", "20", "--key", "scan", "--out",
          "{out}/hf_scan"),),
        (R + "hf_scan.json", R + "hf_scan.md"), 6.0),
    Job("hf_triage_sizes", "`tndebug triage DIR` at GPT-2-small and BART-base size: time and peak "
        "memory against 30 s and 3x the fp32 weights (issue 21)",
        (("bench/hf_triage.py", "--size", "gpt2-small"), ("bench/hf_triage.py", "--size", "bart-base")),
        (("bench/hf_triage.py", "--size", "gpt2-small", "--reps", "1", "--out",
          "{out}/hf_triage_gpt2-small.json"),
         ("bench/hf_triage.py", "--size", "bart-base", "--reps", "1", "--out",
          "{out}/hf_triage_bart-base.json")),
        (R + "hf_triage_gpt2-small.json", R + "hf_triage_bart-base.json"), 6.0),
    Job("foreign", "triage verdicts on the foreign-code corpus (tests/foreign), now and at b735d21",
        (("bench/foreign.py",),
         ("bench/foreign.py", "--at", "b735d21", "--out", R + "foreign_at_b735d21")),
        (("bench/foreign.py", "--seeds", "1", "--bug-seeds", "1", "--steps", "2", "--styles", "seq_first",
          "--out", "{out}/foreign"),),
        (R + "foreign.json", R + "foreign.md", R + "foreign_at_b735d21.json", R + "foreign_at_b735d21.md"), 5.0),
    Job("foreign_styles", "the user-style decoder-only and encoder-only corpus (issue 45: einsum "
        "sequence-first, head modules, rotary three ways, ALiBi, NoPE, a KV cache, GQA; encoders with "
        "einsum and a learned table, T5's relative bias, sinusoids and per-head modules, rotary; "
        "one-line bugs in the user's file), 600 steps on character text, 16-bit copies, and whether "
        "findings point at the bug's line (issue 48)",
        (("bench/foreign.py", "--corpus", "styles"),),
        (("bench/foreign.py", "--corpus", "styles", "--steps", "20", "--seeds", "1", "--bug-seeds", "1",
          "--styles", "nope,head_modules,enc_rope", "--out", "{out}/foreign_styles"),),
        (R + "foreign_styles.json", R + "foreign_styles.md"), 16.0),
    Job("foreign_trained", "the foreign-code corpus trained 1000 steps, every style (issue 19: "
        "checkpoints trained long enough for init-time properties to drift); healthy over 3 seeds, "
        "each bug over 1",
        (("bench/foreign.py", "--steps", "1000", "--one-stack-steps", "1000", "--seeds", "3",
          "--bug-seeds", "0", "--out", R + "foreign_trained"),
         ("bench/foreign.py", "--steps", "1000", "--one-stack-steps", "1000", "--seeds", "0",
          "--bug-seeds", "1", "--out", R + "foreign_trained_bugs")),
        (("bench/foreign.py", "--seeds", "1", "--bug-seeds", "0", "--steps", "20", "--one-stack-steps", "20",
          "--styles", "seq_first,nanogpt", "--out", "{out}/foreign_trained"),),
        (R + "foreign_trained.json", R + "foreign_trained.md", R + "foreign_trained_bugs.json",
         R + "foreign_trained_bugs.md"), 40.0),
    Job("first_contact", "issue 44's first contact: a char-level nanoGPT-style loop with no pad "
        "(healthy, and its bugs), its 16-bit copies through check, triage --data of a decoder- and an "
        "encoder-only model; healthy flagged, bugs named, front-ends that refused",
        (("bench/first_contact.py",),),
        (("bench/first_contact.py", "--seeds", "1", "--steps", "60", "--bugs", "no_zero_grad",
          "--out", "{out}/first_contact"),),
        (R + "first_contact.json", R + "first_contact.md"), 4.0),
    Job("watch_overhead", "tndebug.watch on the user's loop, paired, SDPA, HF BART and a ~25 ms SDPA; "
                          "the default budget against none; 800 steps x 2 rounds",
        (("bench/watch_overhead.py", "--models", "sdpa,bart,sdpa-small"),),
        (("bench/watch_overhead.py", "--steps", "20", "--skip", "4", "--rounds", "1", "--models", "sdpa",
          "--no-memory", "--max-load", "100", "--out", "{out}/watch_overhead.json"),),
        (R + "watch_overhead.json",), 37.0),        # 2205 s at 3f79cb9 on a quiet Intel Xeon
    Job("watch_overhead_budget", "tndebug.watch at its default budget alone (the arm issue 20's 1.03x "
                                 "target is about), the three models, 800 steps x 2 rounds",
        (("bench/watch_overhead.py", "--models", "sdpa,bart,sdpa-small", "--arms", "default",
          "--out", R + "watch_overhead_budget.json"),),
        (("bench/watch_overhead.py", "--steps", "20", "--skip", "4", "--rounds", "1", "--models", "sdpa-small",
          "--arms", "default", "--no-memory", "--max-load", "100", "--out", "{out}/watch_overhead_budget.json"),),
        (R + "watch_overhead_budget.json",), 12.0),
    Job("watch_overhead_gpt", "tndebug.watch at its default budget on a nanoGPT-style decoder-only loop "
                              "(issue 21's 1.03x target), 800 steps x 2 rounds, paired",
        (("bench/watch_overhead.py", "--models", "gpt", "--arms", "default",
          "--out", R + "watch_overhead_gpt.json"),),
        (("bench/watch_overhead.py", "--steps", "20", "--skip", "4", "--rounds", "1", "--models", "gpt",
          "--arms", "default", "--no-memory", "--max-load", "100", "--out", "{out}/watch_overhead_gpt.json"),),
        (R + "watch_overhead_gpt.json",), 6.0),
    Job("watch_breakdown", "where the watch's overhead goes, step by step, SDPA and BART",
        (("bench/watch_breakdown.py", "--model", "sdpa", "--steps", "800"),
         ("bench/watch_breakdown.py", "--model", "bart", "--steps", "800")),
        (("bench/watch_breakdown.py", "--model", "sdpa", "--steps", "20", "--skip", "4",
          "--out", "{out}/watch_breakdown_sdpa.json"),),
        (R + "watch_breakdown_sdpa.json", R + "watch_breakdown_bart.json"), 4.0),
    Job("realbugs", "the real-bug corpus (tests/realbugs) through tndebug.check / watch, healthy controls",
        (("bench/realbugs.py",),),
        (("bench/realbugs.py", "--seeds", "1", "--steps", "0", "--watch-steps", "4", "--bugs", "no_scale",
          "--out", "{out}/realbugs"),),
        (R + "realbugs.json", R + "realbugs.md"), 5.0),      # a guess: no full run recorded yet
    Job("bad_input", "issue 47's promise: >= 150 bad inputs (docs/bad_input.py's and new kinds) at the CLI "
        "and the library, each in a fresh folder of the user's files: met, time to refuse, files changed",
        (("bench/bad_input.py",),),
        (("bench/bad_input.py", "--limit", "8", "--out", "{out}/bad_input.json"),),
        (R + "bad_input.json", R + "bad_input.md"), 6.0),
    Job("notes_claims", "the notes' claims a model at init settles: entropy, rho, initial loss / ln V, "
                        "self-argmax and score symmetry",
        (("bench/notes_claims.py",),),
        (("bench/notes_claims.py", "--presets", "tiny", "--seeds", "0", "--tasks", "copy",
          "--out", "{out}/notes_claims.json"),),
        (R + "notes_claims.json",), 2.0),
    Job("residual_skip", "ln-placement's missing-residual test: skip shares, calibration and evaluation sets",
        (("bench/residual_skip.py",),),
        (("bench/residual_skip.py", "--only", "nanogpt", "--steps", "10", "--out", "{out}/residual_skip.json"),),
        (R + "residual_skip.json", R + "residual_skip.md"), 4.0),
    Job("ln_warmup_symptom", "ln-placement's Post-LN-without-warmup symptom: calibration and evaluation runs",
        (("bench/ln_warmup_symptom.py",),),
        (("bench/ln_warmup_symptom.py", "--only", "eval", "--out", "{out}/ln_warmup_symptom.json"),),
        (R + "ln_warmup_symptom.json",), 2.1),
    Job("detection", "fault-injection detection: every fault x seeds x norms, healthy and benign runs",
        (("bench/detection.py", "--fresh"), ("bench/detection_report.py",)),
        (("bench/detection.py", "--fresh", "--faults", "no_scale", "--healthy-tasks", "copy", "--norms", "pre",
          "--eval-fault-seeds", "10", "--eval-healthy-seeds", "10", "--benign", "--eval-benign-seeds",
          "--calib-seeds", "--calib-benign-seeds", "--calib-fault-seeds", "--steps", "8", "--resume-at", "4",
          "--eval-size", "20", "--workers", "1", "--out", "{out}/detection.jsonl"),
         ("bench/detection_report.py", "--jsonl", "{out}/detection.jsonl", "--json", "{out}/detection.json",
          "--md", "{out}/detection.md")),
        (R + "detection.jsonl", R + "detection.json", R + "detection.md"), 62.0),
    Job("sample_runs", "sample_runs/: real `tndebug run` outputs, healthy and one fault per probe",
        (("bench/sample_runs.py",),),
        (("bench/sample_runs.py", "no_scale", "--root", "{out}/sample_runs", "--out", "{out}/sample_runs.json"),),
        ("sample_runs/", R + "sample_runs.json"), 3.0),
    Job("regression", "issue 20's regression set (detection faults, foreign corpus, sample runs, triage "
        "cases): findings at 8c9bc0d and at HEAD (regression_<HEAD>.json), compared, every difference explained",
        (("bench/regression.py", "--at", "8c9bc0d"), ("bench/regression.py",),
         ("bench/regression.py", "--compare", "8c9bc0d", "HEAD")),
        (("bench/regression.py", "--parts", "triage", "--out", "{out}/regression.json"),),
        (R + "regression_8c9bc0d.json", R + "regression.md"), 16.0,
        ok_codes=(0, 1)),                   # 1: --compare found unexplained differences, written
    Job("gpu_check", "the base preset on one GPU, probes off / default / every step, GPU faults",
        (("bench/gpu_check.py",),),
        (("bench/gpu_check.py", "--budget-s", "60", "--out", "{out}/gpu_check.json"),),
        (R + "gpu_check.json",), 5.0, needs="cuda"),
)

# Results files that no job regenerates, and why; the README and docs must not quote them as
# figures of the current code (tests/bench/test_figures.py checks both).
ARCHIVED = {
    R + "detection_eval_rerun.json": "ran on uncommitted edits at 240089a (no commit reproduces it); "
                                     "superseded by the detection job",
    R + "detection_eval_rerun.jsonl": "as detection_eval_rerun.json",
    R + "detection_eval_rerun.md": "as detection_eval_rerun.json",
    R + "watch_overhead_800.json": "the watch before its overhead work (separate runs); the code it "
                                   "measured is gone",
    R + "watch_overhead_long.json": "as watch_overhead_800.json, 400 steps",
}


def by_name(name: str) -> Job:
    for job in JOBS:
        if job.name == name:
            return job
    raise KeyError(f"no bench job {name!r}; known: {', '.join(j.name for j in JOBS)}")
