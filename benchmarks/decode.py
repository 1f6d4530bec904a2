"""Decoding benchmark on the embedded world: SemanticSpec against every baseline, in one run.

    python -m benchmarks.decode            # 400 problems (benchmarks/results/decode.json, .md, .png)
    python -m benchmarks.decode --quick    # 40 problems, same code path (decode-quick.*), about 4.5 min
    python -m benchmarks.decode --target-probe DIR --draft-probe DIR
    python -m benchmarks.decode --only-batch-scaling --device cuda   # batch scaling with the models on a GPU

What it measures ("Benchmark figures" in docs/design.md):

- every method of :class:`~semanticspec.decoder.SemanticSpecDecoder` on the same fixed 4-operation
  problems (``task.generate_problems(n, seed)``), the same seeds and the same generation code,
  methods interleaved per problem (their order rotates from problem to problem) so machine load
  hits all of them alike;
- **speedup** = target-only wall time / the method's wall time; token-level speculative decoding
  (transformers assisted generation with the same draft) is divided by transformers' own
  target-only ``generate`` time instead, and both times are reported;
- ``random_accept`` accepts at SemanticSpec's acceptance rate so far (the running rate, since
  methods are interleaved); ``oracle_accept`` keeps exactly the steps whose meaning is the
  problem's next correct operation (the world's oracle);
- **decisions** of every method that drafts, judged by the oracle on the rows where decisions
  happen (each proposed draft step): ``right_kept``, ``wrong_kept``, ``right_refused``,
  ``wrong_refused`` and ``wrong_kept_fast_path``;
- **sweeps** of each method's acceptance knob, one accuracy-vs-speedup curve each: SemanticSpec's
  ratio scale (ratio rule) or ``tau`` (threshold rule); random acceptance's rate; the oracle's
  ``keep_right`` (right steps kept with that probability, wrong ones never: the ideal frontier);
- **ablations** with the same decoder, each pair deciding alone (no fast path, so every draft step has a q):
  the paper's probe (pooled hidden states only), ``token_stats`` only, and both (the shipped pair, from
  ``semanticspec[no_fast_path]``), with each probe pair's **draft-step AUROC**: q against the oracle's
  right/wrong on every draft step it judged on these held-out problems;
- the decoder's probe-call defaults toggled: the gated top-1 fast path (``semanticspec[no_fast_path]``) and the
  probes' MLP precision (``semanticspec[probe_dtype=float32]`` where ``auto`` picks float16), each with its
  **probe overhead** (probe seconds over wall seconds);
- **lookahead windows**: SemanticSpec and the oracle judging windows of 2, 3 and 4 drafted steps per
  target forward, and the shipped adaptive window, each with its steps and thrown-away draft tokens per window
  and the AUROC of the draft's confidence against the target's decision; and **window_cost**, the cost model
  ``a_m + b_m * positions`` per forward of each model, fitted on every forward of the one-step loop and windows
  of 2 (:func:`window_cost`) and checked on the other rows' forward seconds and speedups;
- **batch_scaling**: target-only and SemanticSpec at 1, 2, 4, 8 and 16 prompts per batch on the same
  ``--scaling-problems`` problems (64; quick 16), methods interleaved per chunk of 16 problems: tokens per
  second, speedup over target-only at the same size, accuracy, forwards per model and what they carry, the
  batch cost model's prediction, and SemanticSpec's phases with its idle rows (:mod:`benchmarks.batching`).
  ``--only-batch-scaling`` runs this section alone (``decode-scaling[-quick].json``); ``--scaling-repeats N``
  makes N passes over its problems and reports each pass's speedup (``speedup_repeats``) beside the overall one.
  ``--device`` puts the world's models (and the probes, which follow them) on another torch device, such as a
  GPU; the loop and the figures are the same (draws then come from the rows' streams on that device).

Probes default to ``checkpoints/arithmetic/probes/{target,draft}`` (hybrid) and
``checkpoints/arithmetic/probes-ablation/{hidden,token_stats}/{target,draft}``; when the default
pair is missing the benchmark says so and uses untrained probes of the right widths (the figures
are then not the method's). The problems, the oracle and the figures shared with the other scripts are in
:mod:`benchmarks.common`; the tables and the plot in :mod:`benchmarks.decode_report`.
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torchmetrics.functional.classification import binary_auroc

from benchmarks import batching, harness
from benchmarks.common import PROBE_ROOT, PROBLEM_SEED, REPO, TASK, figures, oracle_for
from benchmarks.decode_report import markdown, plot, scaling_markdown
from arithmetic_world import models, task
from generation.cache import record_forwards
from generation.loading import device_problem
from generation.paths import portable_paths
from semanticspec.decoder import SemanticSpecDecoder, summarize
from semanticspec.evaluate import Arm, decision_counts, interleaved, paired_delta
from semanticspec.parts import SHIPPED_WINDOW
from semanticspec.policies import OraclePolicy, ProbePolicy, RandomPolicy, default_policy
from probes.model import PROBE_DTYPES, resolve_probe_dtype
from semanticspec.timing import rotation
from semanticspec.results import speedup

ABLATION_ROOT = REPO / "checkpoints" / "arithmetic" / "probes-ablation"
ABLATIONS = ("hidden", "token_stats")
"""Probe pairs decoded beside the default (hybrid) one: the paper's pooled states only, token statistics only."""
CHECKS = ("always_reject", "always_accept")
"""Methods of the table that are equivalence checks (tests hold them), not methods to compare."""
POLICIES = {"random_accept": RandomPolicy, "oracle_accept": OraclePolicy}
"""Methods named by their policy's class (``method=RandomPolicy(rate)``), with the argument each problem gives them:
random acceptance at SemanticSpec's running rate, the world's oracle for the problem."""
METHODS = ("target_only", "semanticspec", "draft_only", "random_accept", "oracle_accept", "specreason",
           "hf_target_only", "token_sd")
"""Every method of the decoder's table but the checks, and the two policy methods, in the benchmark's order."""
REFERENCE = {"token_sd": "hf_target_only"}
"""The method whose wall time a method's speedup is measured against, where it is not ``target_only``: a baseline
that runs in another library's loop is divided by that library's own target-only time
(docs/design.md "Benchmark figures")."""
GOALS = {"speedup": 2.0, "accuracy_drop": 0.02, "vs_token_sd": 1.3, "random_accuracy_gap": 0.10, "probe_overhead": 0.02,
         "draft_step_auroc": 0.97, "batch8_speedup": 1.8, "shipped_window_speedup": 2.9,
         "shipped_window_accuracy_drop": 0.01}
DRAFTING = ("semanticspec", "random_accept", "oracle_accept", "specreason")
"""Methods whose draft steps a policy decides: their decisions are judged (decision tables)."""
LOOPS = ("semanticspec[target_first_step]", "semanticspec[no_token_sd]", "semanticspec[paper_loop]",
         "semanticspec[rewrite_phase]")
"""SemanticSpec with the loop's defaults undone: the target writes the first step, no token-level speculation, both."""
LOOKAHEADS = (2, 3, 4)
"""Windows of drafted steps judged per target forward, beside the default one-step loop."""
ADAPTIVE = (SHIPPED_WINDOW.size, SHIPPED_WINDOW.min_logprob)
"""The adaptive window's row, SemanticSpec's shipped window (``DecodeConfig.lookahead=None``): up to 4 steps, the next
one drafted only after a step whose every token the draft drew at probability >= 0.5. The threshold was read off 40
other problems (``generate_problems(40, 777)``, windows of 4): 26% of judged steps fell below it and the target kept
52% of those, against 93% above it (AUROC 0.84). The other rows judge one step per target pass unless they name a
window."""
ADAPTIVE_ROW = f"semanticspec[lookahead={ADAPTIVE[0]} adaptive]"


def noisy_oracle(problem: task.Problem, keep_right: float, seed: int):
    """The oracle that keeps a right step only with probability ``keep_right`` (never a wrong one)."""
    exact, rng = oracle_for(problem), random.Random(seed)
    return lambda step, prefix: exact(step, prefix) and rng.random() < keep_right


def decisions(results, problems) -> tuple[dict[str, int], list[tuple[float, bool]]]:
    """Oracle-judged decision counts over the proposed draft steps, and ``(q, right)`` of the judged ones
    (:func:`semanticspec.evaluate.decision_counts` with the world's oracle of each problem, :func:`oracle_for`)."""
    return decision_counts(results, [oracle_for(p) for p in problems])


def phases_and_cost(results, reference) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per phase of a drafting method, and the cost model built from them.

    Costs are in units of ``c_T``, target-only seconds per output token (``reference``). The model
    predicts the method's wall time as ``c_T`` per token the target writes step by step (bonus tokens
    excluded) at the measured cost of a target-written token (about 1 c_T, less with token-level
    speculation), plus the measured draft cost per drafted token and verification cost per proposal;
    ``predicted_speedup`` against the measured one shows what probes and bookkeeping add.
    """
    s = summarize(results)
    ref = summarize(reference)
    c_t = ref["wall_s"] / max(ref["output_tokens"], 1)
    named = ("first_step_s", "draft_s", "verify_s", "probe_s", "rewrite_s")
    phases = {k[:-2]: s[k] for k in named}
    phases["other"] = s["wall_s"] - sum(phases.values())
    drafted, proposals = max(s["drafted_tokens"], 1), max(s["draft_steps_proposed"], 1)
    draft_per_token = s["draft_s"] / drafted / c_t
    verify_per_proposal = s["verify_s"] / proposals / c_t
    # tokens the target wrote step by step; the bonus token after each kept step comes with its verification
    target_tokens = s["output_tokens"] - s["draft_tokens"] - s["draft_steps_accepted"]
    # what a target-written token cost here: about 1 c_T when the target writes alone, less with token-level
    # speculation (the draft proposes, the target checks several tokens per pass)
    target_step_per_token = (s["first_step_s"] + s["rewrite_s"]) / max(target_tokens, 1) / c_t
    predicted = c_t * (target_step_per_token * target_tokens + draft_per_token * s["drafted_tokens"]
                       + verify_per_proposal * s["draft_steps_proposed"])
    cost = {
        "target_step_over_target_per_token": target_step_per_token,
        "draft_over_target_per_token": draft_per_token,
        "verify_over_target_per_token": s["verify_s"] / drafted / c_t,
        "verify_over_target_per_proposal": verify_per_proposal,
        "predicted_speedup": speedup(ref["wall_s"], predicted),
        "measured_speedup": speedup(ref["wall_s"], s["wall_s"]),
    }
    return phases, cost


def auroc(scored: list[tuple[float, bool]]) -> float:
    """AUROC of q for right vs wrong draft steps (NaN when one class is missing)."""
    if not scored or len({r for _, r in scored}) < 2:
        return math.nan
    q = torch.tensor([s for s, _ in scored])
    return float(binary_auroc(q, torch.tensor([int(r) for _, r in scored])))


def run_methods(dec: SemanticSpecDecoder, variants: dict, problems: Sequence[task.Problem], args) -> tuple[dict, dict]:
    """Every method and SemanticSpec variant on every problem, interleaved (:func:`semanticspec.evaluate.interleaved`,
    the evaluation's core); returns ``{name: [DecodeResult]}`` and ``{name: [ForwardRecord]}``, every forward each
    method ran (:func:`generation.cache.record_forwards`)."""
    names = list(METHODS) + list(variants)
    forwards: dict[str, list] = {n: [] for n in names}
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
           "lookahead": 1}  # rows judge one step per pass unless they name a window

    def arm(name: str) -> Arm:
        dec_v, kw = variants.get(name, (dec, {"method": name}))  # a method of the table, or a variant

        def keywords(k: int, p: task.Problem, so_far: dict) -> dict:
            if "keep_right" in kw:
                return {**gen, "method": OraclePolicy(noisy_oracle(p, kw["keep_right"], args.seed + k))}
            if kw.get("method") == "oracle_accept":
                return {**gen, **kw, "method": OraclePolicy(oracle_for(p))}
            if name == "random_accept":  # SemanticSpec's running rate (it runs just before, on every problem)
                return {**gen, **kw, "method": RandomPolicy(summarize(so_far["semanticspec"])["step_acceptance"])}
            return {**gen, **kw}

        return Arm(dec_v, keywords)

    def order(names: list[str], k: int) -> list[str]:
        out = [n for n in rotation(names, k) if n != "random_accept"]
        out.insert(out.index("semanticspec") + 1, "random_accept")  # needs semanticspec's running rate
        return out

    @contextmanager
    def recorded(name: str):
        with record_forwards() as log:
            yield
        forwards[name] += log

    prompts = [TASK.prompt_text(dec.tokenizer, p.problem) for p in problems]
    runs = interleaved({n: arm(n) for n in names}, problems, prompts, args.seed, order=order, around=recorded)
    return runs, forwards


def scaling_section(dec: SemanticSpecDecoder, args: argparse.Namespace) -> dict:
    """:func:`benchmarks.batching.batch_scaling` on the first ``--scaling-problems`` problems with this task's prompts
    and answer checker (empty when skipped)."""
    if args.no_batch_scaling:
        return {}
    n = args.scaling_problems or (16 if args.quick else 64)
    problems = task.generate_problems(n, args.seed, task.TaskConfig(min_ops=4, max_ops=4))
    return batching.batch_scaling(dec, problems, args, lambda p: TASK.prompt_text(dec.tokenizer, p.problem),
                                  lambda text, p: TASK.check(text, p.answer), tuple(args.batch_sizes or batching.SIZES),
                                  repeats=args.scaling_repeats)


def goals(methods: dict, probes: dict, scaling: dict | None = None) -> dict:
    """Each goal of the benchmark with its measured value and whether it is met (batch 8: when scaled; the
    shipped window's: when its row ran)."""
    s, t = methods["semanticspec"], methods["target_only"]
    tsd = methods["token_sd"]["speedup"]
    auc = probes.get("hybrid", {}).get("draft_step_auroc", math.nan)
    return {
        **speed_and_accuracy(("speedup_at_least_2x", "accuracy_within_2_points"), s, t, GOALS["speedup"],
                             GOALS["accuracy_drop"]),
        "speedup_vs_token_sd_at_least_1.3": {
            "value": s["speedup"] / tsd if tsd > 0 else math.nan,
            "met": s["speedup"] >= GOALS["vs_token_sd"] * tsd,
        },
        "random_accept_10_points_less_accurate": {
            "value": s["accuracy"] - methods["random_accept"]["accuracy"],
            "met": methods["random_accept"]["accuracy"] <= s["accuracy"] - GOALS["random_accuracy_gap"],
        },
        "probe_overhead_at_most_2pct": {
            "value": s["probe_overhead"],
            "met": s["probe_overhead"] <= GOALS["probe_overhead"],
        },
        "draft_step_auroc_at_least_0.97": {"value": auc, "met": bool(auc >= GOALS["draft_step_auroc"])},
        **window_goals(methods),
        **batch_goals(scaling or {}),
    }


def speed_and_accuracy(names: tuple[str, str], m: dict, ref: dict, min_speedup: float, max_drop: float) -> dict:
    """The goals ``names``: ``m``'s speedup at least ``min_speedup``, and its accuracy at most ``max_drop`` below
    ``ref``'s (the value: the difference)."""
    return {names[0]: {"value": m["speedup"], "met": m["speedup"] >= min_speedup},
            names[1]: {"value": m["accuracy"] - ref["accuracy"], "met": m["accuracy"] >= ref["accuracy"] - max_drop}}


def window_goals(methods: dict) -> dict:
    """The windows' in-process goal: the shipped window at 2.9x target-only or more, within 1 point of its accuracy."""
    if ADAPTIVE_ROW not in methods:
        return {}
    return speed_and_accuracy(("shipped_window_at_least_2.9x", "shipped_window_accuracy_within_1_point"),
                              methods[ADAPTIVE_ROW], methods["target_only"], GOALS["shipped_window_speedup"],
                              GOALS["shipped_window_accuracy_drop"])


def batch_goals(scaling: dict) -> dict:
    """The batch-8 goal: SemanticSpec's speedup over target-only at 8 prompts, within 2 points of accuracy."""
    table = scaling.get("table", {})
    if "8" not in table.get("semanticspec", {}):
        return {}
    return speed_and_accuracy(("batch8_speedup_at_least_1.8", "batch8_accuracy_within_2_points"),
                              table["semanticspec"]["8"], table["target_only"]["8"], GOALS["batch8_speedup"],
                              GOALS["accuracy_drop"])


def arguments() -> argparse.ArgumentParser:
    """The benchmark's command line (the harness's ``--quick`` and ``--threads``, then its own options)."""
    ap = harness.parser(__doc__, quick="reduced run (about 4.5 min on 2 CPU cores), writes decode-quick.*", threads=1,
                        name="decode", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-problems", type=harness.count, default=None, help="problems (default 400, quick 40)")
    ap.add_argument("--seed", type=harness.non_negative, default=PROBLEM_SEED)
    ap.add_argument("--max-new-tokens", type=harness.count, default=96)
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature (default: the probes' label sampling, else 0.6)")
    ap.add_argument("--top-p", type=float, default=None, help="nucleus mass (default: the probes', else 0.95)")
    ap.add_argument("--rule", choices=("ratio", "threshold"), default="threshold",
                    help="SemanticSpec's rule (the decoder's default)")
    ap.add_argument("--tau", type=float, default=0.5, help="threshold of the threshold rule")
    ap.add_argument("--ratio-scale", type=float, default=1.0, help="ratio rule: accept with probability min(1, s*q/p)")
    ap.add_argument("--top-k", type=harness.non_negative, default=None,
                    help="fast path top-k (default: the decoder's, 1 = the gated top-1 fast path; 0 = off)")
    ap.add_argument("--probe-dtype", choices=PROBE_DTYPES, default="auto",
                    help="dtype of the probes' MLPs (default: the decoder's, auto = float16 where it is fast)")
    ap.add_argument("--fast-path-min-logprob", type=float, default=math.log(0.5),
                    help="fast path: least target log-probability of every drafted token")
    ap.add_argument(
        "--sweep",
        type=float,
        nargs="*",
        default=None,
        help="ratio scales (ratio rule) or tau values (threshold rule) for the SemanticSpec sweep",
    )
    ap.add_argument("--random-sweep", type=float, nargs="*", default=None,
                    help="accept rates of the random-acceptance sweep")
    ap.add_argument("--oracle-sweep", type=float, nargs="*", default=None,
                    help="keep_right values of the oracle sweep (right steps kept with this probability, wrong never)")
    ap.add_argument("--ablation-root", default=str(ABLATION_ROOT),
                    help="folder of the ablation probe pairs <variant>/{target,draft} (variants: hidden, token_stats)")
    ap.add_argument("--target-probe", default=str(PROBE_ROOT / "target"))
    ap.add_argument("--draft-probe", default=str(PROBE_ROOT / "draft"))
    ap.add_argument(
        "--world", default=None, help="world model folder (default $SEMANTICSPEC_WORLD or checkpoints/arithmetic)"
    )
    ap.add_argument("--device", default="cpu",
                    help="where the world's models and probes run (default cpu; e.g. cuda: the same loop on a GPU, "
                         "where a forward costs about the same for 8 positions as for 80)")
    ap.add_argument("--no-batch-scaling", action="store_true")
    ap.add_argument("--only-batch-scaling", action="store_true",
                    help="run the batch-scaling section alone (writes decode-scaling[-quick].json and .md)")
    ap.add_argument("--scaling-problems", type=harness.count, default=None,
                    help="problems decoded at every batch size (default 64, quick 16)")
    ap.add_argument("--batch-sizes", type=harness.count, nargs="*", default=None,
                    help="batch sizes of the scaling section (default 1 2 4 8 16)")
    ap.add_argument("--scaling-repeats", type=harness.count, default=1,
                    help="passes of the scaling section over its problems (the same texts each time); figures are "
                         "over every pass and speedup_repeats holds each pass's speedup, the run's timing noise")
    ap.add_argument(
        "--no-lazy-p",
        action="store_true",
        help="compute p for every judged step (default: only when q alone does not accept)",
    )
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed command line, with each sweep not given set to its default (fewer values for ``--quick``)."""
    ap = arguments()
    args = ap.parse_args(argv)
    if problem := device_problem(args.device):
        ap.error(f"--device {problem}")
    if args.only_batch_scaling and args.no_batch_scaling:
        ap.error("--only-batch-scaling with --no-batch-scaling: nothing would be measured; give one of them")
    if problem := value_problem(args, ap):
        ap.error(problem)
    if args.sweep is None:
        args.sweep = (
            ([0.5, 4.0] if args.quick else [0.25, 0.5, 2.0, 4.0, 16.0])
            if args.rule == "ratio"
            else ([0.3, 0.7] if args.quick else [0.1, 0.3, 0.7, 0.9])
        )
    if args.random_sweep is None:
        args.random_sweep = [0.5, 0.9] if args.quick else [0.25, 0.5, 0.75, 0.9]
    if args.oracle_sweep is None:
        args.oracle_sweep = [0.5] if args.quick else [0.25, 0.5, 0.75]
    return args


def value_problem(args: argparse.Namespace, ap: argparse.ArgumentParser) -> str | None:
    """What is wrong with the values the run would refuse only after loading the world (or not at all): the policy,
    the sampling and each swept value as the decoder checks them, a ``--world`` that is not a folder, and probe folders
    given that hold no exported probe (the defaults, when missing, run untrained probes with a warning)."""
    from generation.specs import SamplingSpec

    if args.world is not None and not Path(args.world).is_dir():
        return f"--world {args.world}: no such folder (a world's target/, draft/ and tokenizer)"
    for option in ("target_probe", "draft_probe"):
        value = getattr(args, option)
        if value != ap.get_default(option) and not Path(value, "config.json").is_file():
            return f"--{option.replace('_', '-')} {value}: no exported probe there (config.json + model.safetensors)"
    knob = "ratio_scale" if args.rule == "ratio" else "tau"
    try:
        policy = ProbePolicy(rule=args.rule, tau=args.tau, ratio_scale=args.ratio_scale, top_k=args.top_k or 0,
                             fast_path_min_logprob=args.fast_path_min_logprob)
    except ValueError as e:
        return str(e)
    for option, values, make in (("--sweep", args.sweep, lambda v: replace(policy, **{knob: v})),
                                 ("--random-sweep", args.random_sweep, RandomPolicy)):
        for value in values or ():
            try:
                make(value)
            except ValueError as e:
                return f"{option} {value}: {e}"
    problems = SamplingSpec.errors(SamplingSpec.temperature if args.temperature is None else args.temperature,
                                   SamplingSpec.top_p if args.top_p is None else args.top_p)
    problems += [f"--oracle-sweep {v}: expected a share in [0, 1]" for v in args.oracle_sweep or () if not 0 <= v <= 1]
    return "; ".join(problems + sampling_mismatches(args)) or None


def sampling_mismatches(args: argparse.Namespace) -> list[str]:
    """A ``--temperature`` or ``--top-p`` other than the probes' label sampling (read from their configs): every
    method samples as the probes' labels were sampled, and SemanticSpec refuses another value."""
    from types import SimpleNamespace

    from probes.model import labelled_with, probe_config

    paths = [p for p in (args.target_probe, args.draft_probe) if Path(p, "config.json").is_file()]
    try:
        seen = labelled_with([SimpleNamespace(config=probe_config(p)) for p in paths])
    except (OSError, ValueError) as e:
        return [f"--target-probe/--draft-probe: {e}"]
    return [f"--{key.replace('_', '-')} {given}: the {who}'s labels were sampled at {key}={seen[key][0]}; leave "
            f"--{key.replace('_', '-')} unset to decode as they were, or give probes trained at {given}"
            for key, given, who in ((k, getattr(args, k), seen.get(k, (None, ""))[1]) for k in ("temperature", "top_p"))
            if given is not None and key in seen and given != seen[key][0]]


def probes_or_untrained(args: argparse.Namespace, world: models.WorldModels) -> tempfile.TemporaryDirectory | None:
    """Point ``args`` at untrained probes of the right widths (seeded) when the trained pair is missing.

    Returns:
        The temporary folder holding the untrained probes (clean it up after the run), or None when the trained
        pair exists.
    """
    if Path(args.target_probe, "config.json").is_file() and Path(args.draft_probe, "config.json").is_file():
        return None
    from generation.fingerprints import model_fingerprint
    from probes.config import ProbeConfig
    from probes.model import SemanticProbe, export_probe

    tmp = tempfile.TemporaryDirectory()
    torch.manual_seed(0)
    for role, model in (("target", world.target), ("draft", world.draft)):
        cfg = ProbeConfig(hidden_size=model.config.hidden_size, role=role,
                          reads=model_fingerprint(model, world.tokenizer))
        setattr(args, f"{role}_probe", str(export_probe(SemanticProbe(cfg).eval(), Path(tmp.name) / role)))
    print(
        f"WARNING: trained probes not found; using UNTRAINED probes of the right widths ({args.target_probe}). "
        "The figures below are not SemanticSpec's."
    )
    return tmp


Decoder = Callable[..., SemanticSpecDecoder]
"""``decoder(policy=..., probes=..., probe_dtype=...)``: a decoder like the main one with the given parts replaced."""


@dataclass
class Plan:
    """What one benchmark run decodes: the main decoder and every variant beside the methods."""

    dec: SemanticSpecDecoder
    """The decoder of every method of the table (and of the random and oracle sweeps)."""
    variants: dict[str, tuple[SemanticSpecDecoder, dict]]
    """``{name: (decoder, generate keywords)}`` decoded beside the methods, in this order."""
    beside: tuple[str, ...]
    """Variants reported beside the methods: the loop variants, the other rule, the fast path and the ablations."""
    ablations: tuple[str, ...]
    """Names of the ablation variants that were found (``semanticspec[<ablation>]``)."""
    ablation_paths: dict[str, dict[str, str]]
    """``{ablation: {"target": folder, "draft": folder}}`` of the ablations found."""
    knobs: dict[str, tuple[str, list, float | None]]
    """Per swept method: its knob, the swept values, and the value of its main run (random: SemanticSpec's rate)."""


def build_plan(args: argparse.Namespace, world: models.WorldModels) -> Plan:
    """Build the decoders of the run; fixes ``args.temperature`` and ``args.top_p`` to the probes' sampling."""
    if args.top_k is None:  # the decoder's default (the world's models share a tokenizer)
        args.top_k = default_policy().top_k
    policy = ProbePolicy(rule=args.rule, tau=args.tau, ratio_scale=args.ratio_scale, top_k=args.top_k,
                         fast_path_min_logprob=args.fast_path_min_logprob,
                         lazy_p=not args.no_lazy_p)  # same decisions, p only where q alone does not accept
    def decoder(policy=policy, probes=(args.target_probe, args.draft_probe),
                probe_dtype=args.probe_dtype) -> SemanticSpecDecoder:
        return SemanticSpecDecoder(world.target, world.draft, world.tokenizer, None, *probes, policy=policy,
                                   probe_dtype=probe_dtype, task=TASK)

    dec = decoder()
    # every method samples as the probes' labels were sampled (a different value is refused for semanticspec)
    spec = dec.sampling(args.temperature, args.top_p)  # the probes' label sampling unless given; another is refused
    args.temperature, args.top_p = spec.temperature, spec.top_p
    knobs, sweeps = sweep_variants(args, dec, decoder, policy)
    ablations, ablation_paths = ablation_variants(args, decoder, policy)
    loops = {**loop_variants(args, dec, decoder, policy), **lookahead_variants(dec)}
    # the variants' order is their order in each problem's interleaved runs
    return Plan(dec=dec, variants={**loops, **ablations, **sweeps}, beside=(*loops, *ablations),
                ablations=tuple(ablations), ablation_paths=ablation_paths, knobs=knobs)


def sweep_variants(args: argparse.Namespace, dec: SemanticSpecDecoder, decoder: Decoder,
                   policy: ProbePolicy) -> tuple[dict, dict]:
    """The swept methods' knobs (see :attr:`Plan.knobs`) and one variant per swept value, method by method."""
    knob = "ratio_scale" if args.rule == "ratio" else "tau"
    knobs = {"semanticspec": (knob, list(args.sweep), args.tau if knob == "tau" else args.ratio_scale),
             "random_accept": ("accept_rate", list(args.random_sweep), None),
             "oracle_accept": ("keep_right", list(args.oracle_sweep), 1.0)}
    swept = {"semanticspec": lambda v: (decoder(policy=replace(policy, **{knob: v})), {}),
             "random_accept": lambda v: (dec, {"method": RandomPolicy(v)}),
             "oracle_accept": lambda v: (dec, {"keep_right": v})}
    sweeps = {f"{m}[{k}={v}]": swept[m](v) for m, (k, values, _) in knobs.items() for v in values}
    return knobs, sweeps


def ablation_variants(args: argparse.Namespace, decoder: Decoder, policy: ProbePolicy) -> tuple[dict, dict]:
    """``semanticspec[<ablation>]`` for each ablation probe pair found, and the pairs' folders; warns of the others.

    The ablations decide with their probes alone (no fast path), as :data:`PROBE_ALONE` does with the shipped pair:
    every draft step then has a ``q``, and the AUROCs and decision tables compare the probes."""
    ablations, ablation_paths = {}, {}
    for name in ABLATIONS:
        t_dir, d_dir = Path(args.ablation_root, name, "target"), Path(args.ablation_root, name, "draft")
        if (t_dir / "config.json").is_file() and (d_dir / "config.json").is_file():
            ablations[f"semanticspec[{name}]"] = (decoder(policy=replace(policy, top_k=0),
                                                          probes=(str(t_dir), str(d_dir))), {})
            ablation_paths[name] = {"target": str(t_dir), "draft": str(d_dir)}
        else:
            print(f"WARNING: ablation probes {t_dir.parent} not found; row semanticspec[{name}] is skipped")
    return ablations, ablation_paths


def loop_variants(args: argparse.Namespace, dec: SemanticSpecDecoder, decoder: Decoder, policy: ProbePolicy) -> dict:
    """SemanticSpec with the loop's defaults undone (:data:`LOOPS`), with the other rule, and with the fast path."""
    other = "ratio" if args.rule == "threshold" else "threshold"
    return {
        # the defaults (draft writes the first step, token-level speculation in the target's steps) one at a time
        # undone, and both: the paper's loop; and refused steps rewritten in a phase of their own (the old way)
        LOOPS[0]: (dec, {"target_first_step": True}),
        LOOPS[1]: (dec, {"token_sd": False}),
        LOOPS[2]: (dec, {"target_first_step": True, "token_sd": False}),
        LOOPS[3]: (dec, {"rewrite_in_rounds": False}),
        f"semanticspec[rule={other}]": (decoder(policy=replace(policy, rule=other)), {}),
        # the gated fast path (top-1 and the log-prob floor) toggled: the probe alone when it is on (the default;
        # the shipped pair's AUROC comes from that run, where every draft step has a q), with it when it is off
        fast_path_variant(args.top_k): (decoder(policy=replace(policy, top_k=0 if args.top_k else 1)), {}),
        # the probes' MLPs in the other precision (float32 when auto picks float16): its probe overhead
        f"semanticspec[probe_dtype={other_dtype(args.probe_dtype)}]":
            (decoder(probe_dtype=other_dtype(args.probe_dtype)), {}),
    }


def lookahead_variants(dec: SemanticSpecDecoder) -> dict:
    """SemanticSpec and the oracle (the ceiling) judging windows of :data:`LOOKAHEADS` drafted steps per target
    forward, each step as the step-by-step loop would (``DecodeConfig.lookahead``)."""
    out = {}
    for k in LOOKAHEADS:
        out[f"semanticspec[lookahead={k}]"] = (dec, {"lookahead": k})
        out[f"oracle_accept[lookahead={k}]"] = (dec, {"method": "oracle_accept", "lookahead": k})
    out[ADAPTIVE_ROW] = (dec, {"lookahead": ADAPTIVE[0], "window_min_logprob": ADAPTIVE[1]})
    return out


def window_cost(methods: dict, forwards: dict, roles: dict[int, str]) -> dict:
    """The cost model of a target forward that carries a window, checked before anything is tuned on it.

    Every forward of model ``m`` costs ``a_m + b_m * positions`` seconds (:func:`benchmarks.batching.fit_costs`,
    least squares on each forward the one-step loop and windows of 2 ran: verify, rewrite and first-step forwards
    alike, and the draft's). The model then predicts every other row's forward seconds from its own forwards and
    positions, and its speedup with the seconds outside the forwards as measured. ``machine`` gives the fitted costs
    in milliseconds beside target-only's seconds per token: the units in which the speedups move with the machine.
    """
    fit_on = ["semanticspec", f"semanticspec[lookahead={LOOKAHEADS[0]}]"]
    rows = [n for n in ["target_only", *fit_on, *(f"semanticspec[lookahead={k}]" for k in LOOKAHEADS[1:]),
                        ADAPTIVE_ROW] if n in methods and forwards.get(n)]
    if not {"target_only", *fit_on} <= set(rows) or len(rows) < 4:
        return {}
    costs = batching.fit_costs([r for n in fit_on for r in forwards[n]], roles)
    ref = methods["target_only"]["wall_s"]
    out = {"costs": costs, "fitted_on": fit_on, "rows": {}, "machine": {
        **{f"{m}_{k}_ms": 1000 * costs[m][k] for m in costs for k in ("a", "b")},
        "target_only_ms_per_token": 1000 * ref / max(methods["target_only"]["output_tokens"], 1)}}
    for n in rows:
        measured = predicted = 0.0
        for r in forwards[n]:
            fit = costs.get(roles.get(id(r.model)))
            measured += r.seconds
            predicted += fit["a"] + fit["b"] * r.positions if fit else r.seconds
        wall = methods[n]["wall_s"] - measured + predicted
        out["rows"][n] = {"forward_s": measured, "predicted_forward_s": predicted, "speedup": methods[n]["speedup"],
                          "predicted_speedup": ref / wall}
    return out


def window_figures(methods: dict, runs: dict) -> None:
    """Add to each windowed row how well the draft-side signal predicts the target's decision (AUROC of the draft's
    least token log-probability in a judged step against the step being kept), the draft tokens thrown away per
    window (refused steps and the unjudged steps after them) and its speedup over the same method's one-step row of
    the same run (``speedup_over_one_step``: what windows gain on this machine, which moves less with the machine's
    state than the speedups do)."""
    for name in [n for n in methods if "lookahead=" in n] + ["semanticspec"]:
        steps = [s for r in runs[name] for s in r.steps if s.writer == "draft" and s.confidence is not None]
        s = summarize(runs[name])
        m = methods[name]
        m["wasted_draft_tokens_per_window"] = (s["drafted_tokens"] - s["draft_tokens"]) / max(s["windows"], 1)
        m["steps_per_window"] = s["draft_steps_proposed"] / max(s["windows"], 1)
        one = methods.get(name.split("[")[0])  # the same method judging one step per pass, in the same run
        m["speedup_over_one_step"] = m["speedup"] / one["speedup"] if one and one["speedup"] > 0 else math.nan
        m["confidence_auroc"] = auroc([(t.confidence, t.decision.kept) for t in steps])


PROBE_ALONE = "semanticspec[no_fast_path]"
"""The variant that decides with the shipped probes alone when the main run has the fast path."""


def fast_path_variant(top_k: int) -> str:
    """The name of the variant that toggles the main run's fast path."""
    return PROBE_ALONE if top_k else "semanticspec[fast_path top_k=1]"


def other_dtype(probe_dtype: str) -> str:
    """The probes' MLP dtype of the precision variant: float32 unless the main run is float32 on this machine."""
    return "float16" if resolve_probe_dtype(probe_dtype, torch.device("cpu")) == torch.float32 else "float32"


def warm_up(dec: SemanticSpecDecoder, args: argparse.Namespace) -> None:
    """Decode two other problems with every method: first calls pay one-off costs (kernels, generation config)."""
    warm = [TASK.prompt_text(dec.tokenizer, p.problem) for p in task.generate_problems(2, args.seed - 1)]
    args = {"random_accept": 0.5, "oracle_accept": lambda s, p: True}
    for m in METHODS:
        dec.generate(warm, method=POLICIES[m](args[m]) if m in POLICIES else m, max_new_tokens=16, batch_size=1)


def method_figures(runs: dict, problems, beside: Sequence[str]) -> dict:
    """Figures of every method and of the variants beside them, with accuracy against each one's reference."""
    ref = {name: REFERENCE.get(name, "target_only") for name in [*METHODS, *beside]}  # variants: target-only
    walls = {name: sum(r.stats.wall_s for r in runs[name]) for name in set(ref.values())}
    methods = {name: figures(runs[name], problems, walls[ref[name]]) for name in ref}
    right = {n: [TASK.check(r.text, p.answer) for r, p in zip(runs[n], problems)] for n in methods}
    for name in methods:  # accuracy against target-only on the same problems, with its sampling noise
        methods[name].update(paired_delta(right[name], right[ref[name]]))
    return methods


def judge_decisions(methods: dict, runs: dict, problems, plan: Plan) -> dict:
    """Add each drafting method's and variant's decisions to ``methods``; returns each probe pair's AUROC figures."""
    probe_scores = {}
    for name in [*DRAFTING, *plan.beside]:
        counts, scored = decisions(runs[name], problems)
        methods[name]["decisions"] = counts
        hybrid = PROBE_ALONE if PROBE_ALONE in runs else "semanticspec"  # the shipped pair deciding alone
        if name == hybrid or name in plan.ablations:
            variant = "hybrid" if name == hybrid else name[len("semanticspec[") : -1]
            probe_scores[variant] = {"draft_step_auroc": auroc(scored), "n_judged": len(scored),
                                     "n_wrong": sum(not r for _, r in scored), "method": name}
    return probe_scores


def phases_and_costs(runs: dict) -> tuple[dict, dict]:
    """:func:`phases_and_cost` of each drafting method (but specreason) and of each loop variant."""
    phases, cost = {}, {}
    windows = [f"semanticspec[lookahead={k}]" for k in LOOKAHEADS] + [ADAPTIVE_ROW]
    for name in [n for n in DRAFTING if n != "specreason"] + list(LOOPS) + windows:
        phases[name], cost[name] = phases_and_cost(runs[name], runs["target_only"])
    return phases, cost


def add_references(methods: dict) -> None:
    """Add token_sd's reference time and accepted tokens per verification, and random_accept's target rate."""
    methods["token_sd"]["reference_wall_s"] = methods["hf_target_only"]["wall_s"]
    methods["token_sd"]["mean_accepted_tokens_per_verification"] = (
        methods["token_sd"]["output_tokens"] / max(methods["token_sd"]["target_passes"], 1) - 1
    )
    methods["random_accept"]["target_acceptance"] = methods["semanticspec"]["step_acceptance"]


def sweep_curves(methods: dict, runs: dict, problems, knobs: dict) -> dict:
    """Per swept method, its accuracy-vs-speedup curve: the swept values and its main run, sorted by knob value."""
    ref_wall = sum(r.stats.wall_s for r in runs["target_only"])
    sweep = {}
    for method, (k, values, main) in knobs.items():
        if method == "random_accept":
            main = round(methods["semanticspec"]["step_acceptance"], 4)  # the main run follows SemanticSpec's rate
        rows = []
        for name, v in [*((f"{method}[{k}={v}]", v) for v in values), (method, main)]:
            f = figures(runs[name], problems, ref_wall)
            rows.append({"knob": k, "value": v,
                         **{x: f[x] for x in ("accuracy", "speedup", "step_acceptance", "wall_s")}})
        sweep[method] = sorted(rows, key=lambda r: r["value"])
    return sweep


def build_report(args: argparse.Namespace, plan: Plan, runs: dict, forwards: dict, problems, untrained: bool,
                 t0: float) -> dict:
    """The benchmark's figures (``seconds`` counts from ``t0`` and includes batch scaling); ``forwards``: every
    method's timed forwards (:func:`run_methods`)."""
    methods = method_figures(runs, problems, plan.beside)
    probe_scores = judge_decisions(methods, runs, problems, plan)
    phases, cost = phases_and_costs(runs)
    add_references(methods)
    window_figures(methods, runs)
    windows = window_cost(methods, forwards, {id(plan.dec.target): "target", id(plan.dec.draft): "draft"})
    sweep = sweep_curves(methods, runs, problems, plan.knobs)
    scaling = scaling_section(plan.dec, args)
    probe_paths = {
        "hybrid": None if untrained else {"target": args.target_probe, "draft": args.draft_probe},
        **plan.ablation_paths,
    }
    return {
        "methods": methods,
        "batch_scaling": scaling,
        "sweep": sweep,
        "phases": phases,
        "cost": cost,
        "window_cost": windows,
        "probes": probe_scores,
        "n_problems": len(problems),
        "seed": args.seed,
        "goals": goals(methods, probe_scores, scaling),
        "untrained_probes": untrained,
        "probe_paths": portable_paths(probe_paths),  # results are shared: no machine's folders
        "config": {
            k: getattr(args, k)
            for k in ("max_new_tokens", "temperature", "top_p", "rule", "tau", "ratio_scale", "top_k", "probe_dtype",
                      "fast_path_min_logprob", "threads", "device", "quick", "no_lazy_p")
        },
        "seconds": time.perf_counter() - t0,
    }


def save(report: dict, args: argparse.Namespace) -> None:
    """Write the JSON, its markdown table and the plot; say whether probes were untrained and which goals were
    missed."""
    out = harness.results_path("decode", args.quick, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(report, out.with_suffix(".png"))
    harness.write(report, out, markdown(report), save_table=True, also=[out.with_suffix(".png")])
    missed = [k for k, g in report["goals"].items() if not g["met"]]
    if report["untrained_probes"]:
        print("WARNING: untrained probes; rerun once checkpoints/arithmetic/probes/{target,draft} exist.")
    if missed:
        print("goals MISSED: " + ", ".join(missed))


def scaling_only(plan: Plan, args: argparse.Namespace, untrained: bool) -> dict:
    """The batch-scaling section alone, written to ``decode-scaling[-quick].json`` (and its tables)."""
    t0 = time.perf_counter()
    scaling = scaling_section(plan.dec, args)
    report = {"batch_scaling": scaling, "goals": batch_goals(scaling), "untrained_probes": untrained,
              "seconds": time.perf_counter() - t0,
              "config": {k: getattr(args, k) for k in ("max_new_tokens", "temperature", "top_p", "threads", "device",
                                                       "quick",
                                                       "scaling_problems", "batch_sizes", "seed")}}
    harness.write(report, harness.results_path("decode-scaling", args.quick, args.out), scaling_markdown(report),
                  save_table=True)
    return report


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring) and write its figures; returns the report."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    n = args.n_problems or (40 if args.quick else 400)
    world = models.load_world(args.world, device=args.device)
    tmp = probes_or_untrained(args, world)
    try:
        plan = build_plan(args, world)
        problems = task.generate_problems(n, args.seed, task.TaskConfig(min_ops=4, max_ops=4))
        warm_up(plan.dec, args)
        if args.only_batch_scaling:
            return scaling_only(plan, args, untrained=tmp is not None)
        t0 = time.perf_counter()
        runs, forwards = run_methods(plan.dec, plan.variants, problems, args)
        report = build_report(args, plan, runs, forwards, problems, untrained=tmp is not None, t0=t0)
        save(report, args)
        return report
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
