"""What the scripts that decode the embedded world share: its held-out problems, their task and oracle, the
shipped decoder, and each method's figures against target-only on the same problems.

``benchmarks.decode``, the scripts that decode other problems with the shipped probes (``first_step``,
``rewrites``, ``probe_cost``) and the served benchmark (``served``) import these, so a figure means the same in
every table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from benchmarks import harness
from arithmetic_world import models, task
from arithmetic_world.task import ArithmeticTask
from semanticspec.decoder import SemanticSpecDecoder, summarize
from semanticspec.config import DecodeConfig
from semanticspec import evaluate
from semanticspec.policies import ProbePolicy

TASK = ArithmeticTask(min_ops=4, max_ops=4)
"""Held-out four-operation problems: their prompt format, answer marker and checker (the oracle is the world's)."""
REPO = harness.REPO
PROBE_ROOT = REPO / "checkpoints" / "arithmetic" / "probes"
"""The shipped probe pair (``target``, ``draft``)."""
PROBLEM_SEED = 30_000
"""Seed of the decode benchmark's problems (world.py uses 20,000; training validates on 10,000)."""


def oracle_for(problem: task.Problem):
    """``oracle(step, output_so_far)``: keep a step whose meaning is the problem's next correct operation,
    or an answer line with the right answer (:func:`arithmetic_world.task.step_oracle`)."""
    return task.step_oracle(problem.steps, problem.answer)


def figures(results, problems, wall_ref: float) -> dict:
    """One method's figures on the world's problems (:func:`semanticspec.evaluate.figures`: accuracy with its Wilson
    interval, speedup against ``wall_ref``, the decode summary)."""
    return evaluate.figures(results, [TASK.check(r.text, p.answer) for r, p in zip(results, problems)], wall_ref)


def other_problems(doc: str, name: str, n: int, quick_n: int, seed: int,
                   argv=None) -> tuple[argparse.Namespace, list]:
    """The arguments and problems of a script that decodes other problems than decode.py's with the shipped
    probes (``first_step``, ``rewrites``, ``probe_cost``).

    Declares ``--quick`` (``quick_n`` problems, ``<name>-quick.json``), ``--threads`` (1; set here),
    ``--n-problems`` (default ``n``), ``--seed`` (default ``seed``) and ``--max-new-tokens`` (96);
    ``args.n_problems`` is set to the number decoded.
    """
    ap = harness.parser(doc, quick=f"{quick_n} problems, writes {name}-quick.json", threads=1, name=name)
    ap.add_argument("--n-problems", type=harness.count, default=None, help=f"problems (default {n}, quick {quick_n})")
    ap.add_argument("--seed", type=harness.non_negative, default=seed,
                    help=f"problem seed (decode.py uses {PROBLEM_SEED:,})")
    ap.add_argument("--max-new-tokens", type=harness.count, default=96)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.n_problems = args.n_problems or (quick_n if args.quick else n)
    return args, task.generate_problems(args.n_problems, args.seed, task.TaskConfig(min_ops=4, max_ops=4))


def versus_runs(decs: dict[str, SemanticSpecDecoder], problems: Sequence, args: argparse.Namespace, desc: str,
                batch: int = 1) -> dict[str, list]:
    """``{name: results}`` of each of ``decs`` (``target_only`` runs target-only, the others SemanticSpec; temperature
    0.6, top-p 0.95, one step a pass) on ``problems``, through the evaluation's core
    (:func:`semanticspec.evaluate.interleaved`: ``batch`` problems a call, the order rotating, chunk ``c`` with seed
    ``args.seed + c``), for ``first_step``, ``rewrites`` and ``probe_cost``."""
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": 0.6, "top_p": 0.95, "lookahead": 1}
    arms = {name: evaluate.Arm(dec, {"method": "target_only" if name == "target_only" else "semanticspec", **gen})
            for name, dec in decs.items()}
    prompts = [p.problem + task.STEP_DELIMITER for p in problems]
    return evaluate.interleaved(arms, problems, prompts, args.seed, batch=batch, desc=desc)


def versus(doc: str, name: str, variants: dict[str, dict], n: int, quick_n: int, seed: int, argv=None,
           batch: int | None = None, speedup_label: str = "speedup") -> tuple[argparse.Namespace, dict, dict]:
    """A script that decodes ``variants`` of the shipped decoder against ``target_only`` on other problems than
    decode.py's (``first_step``, ``rewrites``): its arguments (:func:`other_problems`), its report and each method's
    right answers, after printing one line per method (accuracy with its paired interval, speedup, acceptance).

    Args:
        variants: ``{method: keywords of :func:`shipped_decoder`}``, one of them ``target_only``.
        batch: problems decoded at once (:func:`versus_runs`; None: one), reported as ``batch_size`` when given.

    Returns:
        ``(args, report, right)``: the report holds ``n_problems``, ``seed``, ``batch_size`` (given a batch),
        ``seconds`` and ``methods`` (``{method: {the figures of :func:`semanticspec.evaluate.figures`,
        accuracy_delta, accuracy_delta_ci95}}``, the deltas paired by problem against target-only); ``right`` is
        ``{method: [right per problem]}``.
    """
    args, problems = other_problems(doc, name, n, quick_n, seed, argv)
    world = models.load_world(None)
    decs = {k: shipped_decoder(world, **kw) for k, kw in variants.items()}
    t0 = time.perf_counter()
    runs = versus_runs(decs, problems, args, name.replace("-", "_"), batch=batch or 1)
    right = {k: [task.check_answer(r.text, p.answer) for r, p in zip(v, problems)] for k, v in runs.items()}
    ref = summarize(runs["target_only"])["wall_s"]
    methods = {name: {**evaluate.figures(res, right[name], ref),
                      **evaluate.paired_delta(right[name], right["target_only"])} for name, res in runs.items()}
    report = {"n_problems": args.n_problems, "seed": args.seed, **({"batch_size": batch} if batch else {}),
              "seconds": time.perf_counter() - t0, "methods": methods}
    width = max(map(len, methods))
    for method, m in methods.items():
        print(f"{method:{width}s} accuracy {m['accuracy']:.3f} (vs target-only {m['accuracy_delta']:+.3f}, "
              f"{interval(m)})  {speedup_label} {m['speedup']:.2f}x  acceptance {m['step_acceptance']:.3f}")
    return args, report, right


def interval(delta: dict) -> str:
    """``95% [lo, hi]`` of a paired difference (:func:`semanticspec.evaluate.paired_delta`)."""
    lo, hi = delta["accuracy_delta_ci95"]
    return f"95% [{lo:+.3f}, {hi:+.3f}]"


def shipped_decoder(world: models.WorldModels, policy: ProbePolicy | None = None, probe_dtype: str = "auto",
                    **loop) -> SemanticSpecDecoder:
    """The world's pair with the shipped probes (:data:`PROBE_ROOT`) and the task (its answer marker); ``loop``: the
    loop settings of its default :class:`~semanticspec.config.DecodeConfig`."""
    return SemanticSpecDecoder(world.target, world.draft, world.tokenizer, target_probe=str(PROBE_ROOT / "target"),
                               draft_probe=str(PROBE_ROOT / "draft"), policy=policy, config=DecodeConfig(**loop),
                               probe_dtype=probe_dtype, task=TASK)
