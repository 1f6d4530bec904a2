"""``python -m semanticspec.evaluate`` on the embedded world with its default config and the shipped probes.

    python -m benchmarks.evaluate            # 40 held-out problems (benchmarks/results/evaluate.json, .md, .png)
    python -m benchmarks.evaluate --quick    # 8 problems, same code path (evaluate-quick.*)

It runs the command a user runs after training (``--config configs/arithmetic.yaml``), on a copy of
``checkpoints/arithmetic/probes`` so that the picked ``threshold.json`` lands in the copy (the shipped probes keep
deciding at 0.5 until a person replaces them), with the records in a temporary folder: every figure is decoded in
this run. The figures are the command's own report (``semanticspec.evaluate.Evaluation.report``), its paths made
portable.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks import harness
from benchmarks.common import PROBE_ROOT
from generation.paths import portable_paths

PROG = "python -m benchmarks.evaluate"


def main(argv: list[str] | None = None) -> dict:
    """Run the evaluation and write ``evaluate[-quick].json`` with its table and plot."""
    ap = harness.parser(__doc__, quick="8 problems, writes evaluate-quick.*", threads=1, name="evaluate")
    ap.add_argument("--n-problems", type=harness.count, default=None, help="held-out problems (default 40, quick 8)")
    args = ap.parse_args(argv)
    from semanticspec import evaluate
    from semanticspec.evaluation_report import markdown, plot

    n = args.n_problems or (8 if args.quick else 40)
    with tempfile.TemporaryDirectory() as tmp:
        probes = Path(tmp) / "probes"
        for role in ("target", "draft"):
            shutil.copytree(PROBE_ROOT / role, probes / role)
        command = ["--config", str(harness.REPO / "configs" / "arithmetic.yaml"), "--probes", str(probes),
                   "--n_problems", str(n), "--out_dir", str(Path(tmp) / "out"), "--threads", str(args.threads),
                   "--progress", "false"]
        try:
            report = evaluate.main(command, echo=False)
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted; nothing is kept (the records were in a temporary folder): run it again to "
                  "start over", file=sys.stderr)
            raise SystemExit(130) from None
        report["threshold_written"] = json.loads((probes / "threshold.json").read_text()) if report[
            "threshold_file"] else None
    report["command"] = f"python -m semanticspec.evaluate --config configs/arithmetic.yaml --probes <copy of " \
                        f"checkpoints/arithmetic/probes> --n_problems {n} --threads {args.threads}"
    for key in ("probes", "threshold_file"):
        report.pop(key, None)
    if report["threshold_written"]:
        report["threshold_written"].pop("command", None)
    report = portable_paths(report)
    out = harness.results_path("evaluate", args.quick, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(report, out.with_suffix(".png"))
    harness.write(report, out, markdown(report), save_table=True, also=[out.with_suffix(".png")])
    return report


if __name__ == "__main__":
    main()
