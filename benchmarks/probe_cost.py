"""What one probe call costs in the decoder, in float32 and float16, with and without the fast path, at equal decisions.

    python -m benchmarks.probe_cost            # 200 problems at 1 prompt (benchmarks/results/probe-cost.json)
    python -m benchmarks.probe_cost --quick    # 40 problems (probe-cost-quick.json)

Per call (the shipped target probe, one world step, ``STEP``, 10 tokens): the features (``rows_features``: pooled hidden
states and token statistics from the verification forward's logits) and the MLP, the MLP timed warm (called
again at once) and cold (after a target forward, as in the decoder's loop, where the forwards evict the MLP's
5.8 MB of weights from the CPU's caches), in float32 and in float16 (``probe.mlp.half()``). Then SemanticSpec decodes
the same problems with float32 probes without the fast path (the exported probes alone: the reference), float16 MLPs
(``probe_dtype="float16"``), and float16 MLPs with the gated fast path (``ProbePolicy(top_k=1)``: a step whose
every token is the target's top-1 at log-probability >= log 0.5 is kept without a probe call), interleaved, from the
same seeds: each draft step's decision (kept or not) and ``q`` compared with the reference's one to one (each prompt
samples from its own streams, so the texts agree as long as the decisions do), and each run's ``probe_overhead``
(probe seconds over wall seconds, the decode benchmark's figure; its goal is 2%). ``default`` names the variant the
decoder runs by default on this machine (``probe_dtype="auto"``, :func:`~semanticspec.policies.default_policy`).
"""

from __future__ import annotations

import time

import torch

from benchmarks import harness
from benchmarks.common import other_problems, shipped_decoder, versus_runs
from arithmetic_world import models
from generation.features import probe_features
from semanticspec.decoder import summarize
from semanticspec.policies import ProbePolicy

VARIANTS = {"float32": ("float32", 0), "float16": ("float16", 0), "float16+fast_path": ("float16", 1)}
"""name: (the probes' MLP dtype, fast path top_k); ``default`` in the report names the one the decoder runs by default
on the machine (``probe_dtype="auto"`` and :func:`~semanticspec.policies.default_policy`), None where that is
float32 with the fast path (a CPU on which ``auto`` keeps float32)."""

STEP = "Add 5: 14 + 5 = 19.\n\n"


def call_costs(world: models.WorldModels, probe) -> dict:
    """Per-call microseconds of the features and of the MLP (warm and cold, float32 and float16)."""
    tok, target, spec = world.tokenizer, world.target, probe.config.features
    prefix = tok("Take 14. Add 5, then multiply it by 3.\n\n").input_ids
    step = tok(STEP, add_special_tokens=False).input_ids
    ids = torch.tensor([prefix + step])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    k = len(step)
    hidden = torch.stack([out.hidden_states[i][0, -k:] for i in spec.layer_ids])  # (L, k, D)
    logits = out.logits[0, -k - 1 : -1]  # predicting each step token

    def features():
        with torch.inference_mode():
            return probe_features(spec, [step], [hidden], [logits])

    x = features()

    def evict():
        with torch.no_grad():
            target(ids)

    costs = {"features_us": harness.median_seconds(features, before=evict) * 1e6, "step_tokens": k}
    for name in ("float32", "float16"):
        if name == "float16":
            probe.mlp.half()
        costs[f"mlp_{name}_warm_us"] = harness.median_seconds(lambda: probe.predict(x)) * 1e6
        costs[f"mlp_{name}_cold_us"] = harness.median_seconds(lambda: probe.predict(x), before=evict) * 1e6
    probe.mlp.float()
    return costs


def _compare(ref: list, other: list) -> dict:
    """Draft steps kept or refused alike (in order, per problem), the largest ``q`` difference, problems alike."""
    def steps(res):
        return [t for r in res for t in r.steps if t.writer == "draft"]

    pairs = list(zip(steps(ref), steps(other)))
    return {"draft_steps": len(pairs),
            "same_decision": sum(a.decision.kept == b.decision.kept for a, b in pairs),
            "max_abs_q_difference": max((abs(a.q - b.q) for a, b in pairs if a.q is not None and b.q is not None),
                                        default=0.0),
            "same_texts": sum(a.text == b.text for a, b in zip(ref, other))}


def main(argv=None) -> dict:
    args, problems = other_problems(__doc__, "probe-cost", 200, 40, 50_000, argv)
    n = args.n_problems
    world = models.load_world(None)
    decs = {k: shipped_decoder(world, ProbePolicy(top_k=top_k), dtype) for k, (dtype, top_k) in VARIANTS.items()}
    default = shipped_decoder(world)
    report = {"n_problems": n, "seed": args.seed, "call": call_costs(world, decs["float32"].target_probe),
              "default": next((k for k, (dtype, top_k) in VARIANTS.items()  # None: float32 with the fast path
                               if default.target_probe.mlp_dtype == getattr(torch, dtype)
                               and default.policy.top_k == top_k), None)}
    t0 = time.perf_counter()
    runs = versus_runs(decs, problems, args, "probe_cost")
    report["seconds"] = time.perf_counter() - t0
    report["decisions"] = {name: _compare(runs["float32"], runs[name]) for name in list(decs)[1:]}
    report["runs"] = {name: {k: summarize(res)[k] for k in ("probe_overhead", "wall_s", "probe_s", "steps")}
                      for name, res in runs.items()}
    c = report["call"]
    print(f"per call: features {c['features_us']:.0f} us; MLP float32 {c['mlp_float32_warm_us']:.0f} us warm, "
          f"{c['mlp_float32_cold_us']:.0f} us cold; float16 {c['mlp_float16_warm_us']:.0f} / "
          f"{c['mlp_float16_cold_us']:.0f} us")
    for name, d in report["decisions"].items():
        print(f"{name} against float32: {d['same_decision']} of {d['draft_steps']} draft steps kept or refused alike, "
              f"max |dq| {d['max_abs_q_difference']:.2e}, texts the same on {d['same_texts']} of {n} problems")
    for name, r in report["runs"].items():
        print(f"{name}: probe overhead {r['probe_overhead']:.2%} (goal 2%), wall {r['wall_s']:.1f} s"
              + (" (the decoder's default here)" if name == report["default"] else ""))
    harness.write(report, harness.results_path("probe-cost", args.quick, args.out))
    return report


if __name__ == "__main__":
    main()
