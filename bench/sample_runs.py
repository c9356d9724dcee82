"""Regenerate sample_runs/ (sample_runs/regenerate.py) and record where they came from.

    python bench/sample_runs.py                    # every sample -> sample_runs/, bench/results/sample_runs.json
    python bench/sample_runs.py no_scale --root /tmp/s --out /tmp/s.json

The samples are `tndebug run` outputs (report.json, report.md, TensorBoard files); their reports
carry no commit. This writes the provenance of the regeneration beside each sample's verdict and
findings (probe, severity, where), so that a reader can tell which commit produced sample_runs/.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sample_runs"))
sys.path.insert(0, str(ROOT / "bench"))
import regenerate  # noqa: E402
from _provenance import Provenance  # noqa: E402

OUT = ROOT / "bench" / "results" / "sample_runs.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="samples (default: all)")
    ap.add_argument("--root", type=Path, default=regenerate.HERE, help="where the samples go")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in regenerate.SAMPLES]
    if unknown:
        ap.error(f"unknown samples {unknown}; known: {', '.join(regenerate.SAMPLES)}")
    prov = Provenance.start(__file__, argv)
    samples = {}
    for name in args.names or list(regenerate.SAMPLES):
        print(f"regenerating {name} ...", file=sys.stderr, flush=True)
        report = json.loads((regenerate.regenerate(name, root=args.root) / "report.json").read_text())
        samples[name] = {"argv": regenerate.argv_for(name, Path(name))[:-4], "verdict": report["verdict"],
                         "findings": sorted([f["probe"], f["severity"], f["where"]] for f in report["findings"]),
                         "exact_match": report["run"].get("exact_match"),
                         "final_loss": report["run"].get("final_loss")}
    result = {"bench": "sample_runs", "root": str(args.root), "samples": samples, "provenance": prov.finish()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
