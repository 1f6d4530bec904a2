"""Who writes the first step, and how the target writes its steps, on enough problems to tell them apart.

    python -m benchmarks.first_step            # 1000 problems (benchmarks/results/first-step.json)
    python -m benchmarks.first_step --quick    # 100 problems (first-step-quick.json), about 2 min

On the decode benchmark's 400 problems the two settings differ by less than its sampling noise. This benchmark
decodes target-only, SemanticSpec with the target's first step and SemanticSpec with the draft's, interleaved, on
other problems than decode.py's (seed 40,000), and reports each accuracy with its paired 95% interval against
target-only and the speedup. Both settings also run with the target's own steps (its first step and its rewrites of
refused steps) written by token-level speculative sampling (``token_sd=True``, lossless), the other knob that moves
the decoder's speed. The decoder's ``target_first_step`` and ``token_sd`` defaults follow this benchmark
(docs/benchmarks.md, "Who writes the first step").
"""

from __future__ import annotations

from benchmarks import harness
from benchmarks.common import interval, versus
from semanticspec.evaluate import paired_delta

VARIANTS = {"target_only": {}, "target_first_step": {"target_first_step": True, "token_sd": False},
            "draft_first_step": {"target_first_step": False, "token_sd": False},
            "target_first_step+token_sd": {"target_first_step": True, "token_sd": True},
            "draft_first_step+token_sd": {"target_first_step": False, "token_sd": True}}


DIFFERENCES = {  # report key: (setting, setting it is compared with, what the printed line says)
    "draft_minus_target_first_step": ("draft_first_step", "target_first_step", "draft - target first step"),
    **{f"{who}+token_sd_minus_{who}": (f"{who}+token_sd", who, f"{who} with token-level SD - without")
       for who in ("target_first_step", "draft_first_step")}}


def main(argv=None) -> dict:
    args, report, right = versus(__doc__, "first-step", VARIANTS, 1000, 100, 40_000, argv)
    methods = report["methods"]
    for key, (a, b, said) in DIFFERENCES.items():
        report[key] = paired_delta(right[a], right[b])
        print(f"{said}: {methods[a]['accuracy'] - methods[b]['accuracy']:+.3f} ({interval(report[key])}), "
              f"speedup {methods[a]['speedup']:.2f}x vs {methods[b]['speedup']:.2f}x")
    harness.write(report, harness.results_path("first-step", args.quick, args.out))
    return report


if __name__ == "__main__":
    main()
