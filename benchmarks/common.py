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
from tqdm.auto import tqdm

from benchmarks import harness
from arithmetic_world import models, task
from arithmetic_world.task import ArithmeticTask
from semanticspec.decoder import SemanticSpecDecoder, summarize
from semanticspec.config import DecodeConfig
from semanticspec.evaluate import paired_delta
from semanticspec.policies import ProbePolicy
from semanticspec.timing import rotation
from probes.metrics import accuracy, speedup

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
    """Accuracy and the summary figures of one method's results."""
    s = summarize(results)
    acc = accuracy(TASK.check(r.text, p.answer) for r, p in zip(results, problems))
    fig = {"accuracy": acc, "wall_s": s["wall_s"], "speedup": speedup(wall_ref, s["wall_s"])}
    keys = ("step_acceptance", "draft_token_share", "target_passes_per_100_tokens", "probe_overhead",
            "output_tokens", "tokens_per_s", "target_passes", "draft_passes", "draft_steps_proposed",
            "draft_steps_accepted", "probe_s")
    fig.update({k: s[k] for k in keys})
    return fig


def other_problems(doc: str, name: str, n: int, quick_n: int, seed: int,
                   argv=None) -> tuple[argparse.Namespace, list]:
    """The arguments and problems of a script that decodes other problems than decode.py's with the shipped
    probes (``first_step``, ``rewrites``, ``probe_cost``).

    Declares ``--quick`` (``quick_n`` problems, ``<name>-quick.json``), ``--threads`` (1; set here),
    ``--n-problems`` (default ``n``), ``--seed`` (default ``seed``) and ``--max-new-tokens`` (96);
    ``args.n_problems`` is set to the number decoded.
    """
    ap = harness.parser(doc, quick=f"{quick_n} problems, writes {name}-quick.json", threads=1, name=name)
    ap.add_argument("--n-problems", type=int, default=None, help=f"problems (default {n}, quick {quick_n})")
    ap.add_argument("--seed", type=int, default=seed, help=f"problem seed (decode.py uses {PROBLEM_SEED:,})")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.n_problems = args.n_problems or (quick_n if args.quick else n)
    return args, task.generate_problems(args.n_problems, args.seed, task.TaskConfig(min_ops=4, max_ops=4))


def interleaved(decs: dict[str, SemanticSpecDecoder], problems: Sequence, args: argparse.Namespace, desc: str,
                batch: int = 1) -> tuple[dict[str, list], dict[str, float]]:
    """``{name: results}`` and ``{name: wall seconds}`` of each of ``decs`` (``target_only`` runs target-only, the
    others SemanticSpec; temperature 0.6, top-p 0.95, one step a pass) on ``problems``, ``batch`` at a time, in an
    order rotating from chunk to chunk, chunk ``c`` with seed ``args.seed + c`` (``first_step``, ``rewrites``, ...)."""
    runs, walls = {k: [] for k in decs}, dict.fromkeys(decs, 0.0)
    chunks = range(0, len(problems), batch)
    for c, start in enumerate(tqdm(chunks, desc=desc, unit="problem" if batch == 1 else "chunk")):
        prompts = [p.problem + task.STEP_DELIMITER for p in problems[start : start + batch]]
        for name in rotation(list(decs), c):
            method = "target_only" if name == "target_only" else "semanticspec"
            t0 = time.perf_counter()
            runs[name] += decs[name].generate(prompts, seed=args.seed + c, method=method,
                                              max_new_tokens=args.max_new_tokens, temperature=0.6, top_p=0.95,
                                              lookahead=1)
            walls[name] += time.perf_counter() - t0
    return runs, walls


def versus_target_only(runs: dict[str, list], problems: Sequence, walls: dict[str, float]) -> tuple[dict, dict]:
    """Each method's figures against ``target_only`` on the same problems (``first_step``, ``rewrites``).

    Args:
        runs: per method, its results in problem order (one method is ``target_only``).
        problems: the problems decoded (the world's answer checker reads them).
        walls: per method, its wall seconds.

    Returns:
        ``({method: {accuracy, wall_s, speedup, step_acceptance, accuracy_delta, accuracy_delta_ci95}},
        {method: [right per problem]})``; the deltas are paired by problem against target-only.
    """
    right = {k: [task.check_answer(r.text, p.answer) for r, p in zip(v, problems)] for k, v in runs.items()}
    methods = {name: {"accuracy": accuracy(right[name]), "wall_s": walls[name],
                      "speedup": speedup(walls["target_only"], walls[name]),
                      "step_acceptance": summarize(res)["step_acceptance"],
                      **paired_delta(right[name], right["target_only"])} for name, res in runs.items()}
    return methods, right


def print_versus(methods: dict, speedup_label: str = "speedup") -> None:
    """One line per method of :func:`versus_target_only`: accuracy with its paired interval, speedup, acceptance."""
    width = max(map(len, methods))
    for name, m in methods.items():
        lo, hi = m["accuracy_delta_ci95"]
        print(f"{name:{width}s} accuracy {m['accuracy']:.3f} (vs target-only {m['accuracy_delta']:+.3f}, 95% "
              f"[{lo:+.3f}, {hi:+.3f}])  {speedup_label} {m['speedup']:.2f}x  acceptance {m['step_acceptance']:.3f}")


def shipped_decoder(world: models.WorldModels, policy: ProbePolicy | None = None, probe_dtype: str = "auto",
                    **loop) -> SemanticSpecDecoder:
    """The world's pair with the shipped probes (:data:`PROBE_ROOT`) and the task (its answer marker); ``loop``: the
    loop settings of its default :class:`~semanticspec.config.DecodeConfig`."""
    return SemanticSpecDecoder(world.target, world.draft, world.tokenizer, target_probe=str(PROBE_ROOT / "target"),
                               draft_probe=str(PROBE_ROOT / "draft"), policy=policy, config=DecodeConfig(**loop),
                               probe_dtype=probe_dtype, task=TASK)
