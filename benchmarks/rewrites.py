"""Refused steps rewritten inside the loop's rounds, or in a phase of their own: accuracy and speed at 8 prompts.

    python -m benchmarks.rewrites            # 1000 problems (benchmarks/results/rewrites.json), about 3 minutes
    python -m benchmarks.rewrites --quick    # 200 problems (rewrites-quick.json)

With ``rewrite_in_rounds`` (the default) the target redraws a refused step from the verification forward
that read it and an unfinished rewrite continues in the next round's forwards; without it the target rewrites
refused rows in a phase of its own while the other rows wait. Both are exact draws from the target, so their
accuracies differ only by the draws, which the decode benchmark's 400 problems cannot tell apart. This
benchmark decodes target-only and both settings, a chunk of 8 problems at a time by each in rotating order, on
other problems than decode.py's (seed 40,000), and reports each accuracy with its paired 95% interval against
target-only, the two settings' paired difference and how many problems each gets right that the other does not,
and the speedups at 8 prompts. Prompts sample from their own streams, so the texts (and accuracies) are
those of any batch size.
"""

from __future__ import annotations

from benchmarks import harness
from benchmarks.common import interval, versus
from semanticspec.evaluate import paired_delta

VARIANTS = {"target_only": {}, "in_rounds": {"rewrite_in_rounds": True}, "rewrite_phase": {"rewrite_in_rounds": False}}
BATCH = 8


def main(argv=None) -> dict:
    args, report, right = versus(__doc__, "rewrites", VARIANTS, 1000, 200, 40_000, argv, batch=BATCH,
                                 speedup_label=f"speedup at {BATCH} prompts")  # a chunk of BATCH decoded at once
    a, b = right["in_rounds"], right["rewrite_phase"]
    d = report["in_rounds_minus_rewrite_phase"] = {
        **paired_delta(a, b), "only_in_rounds_right": sum(x and not y for x, y in zip(a, b)),
        "only_rewrite_phase_right": sum(y and not x for x, y in zip(a, b))}
    print(f"in rounds - rewrite phase: {d['accuracy_delta']:+.3f} ({interval(d)}); right only in rounds "
          f"{d['only_in_rounds_right']}, only with the phase {d['only_rewrite_phase_right']}")
    harness.write(report, harness.results_path("rewrites", args.quick, args.out))
    return report


if __name__ == "__main__":
    main()
