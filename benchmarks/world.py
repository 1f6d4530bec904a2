"""Benchmark of the embedded world's models: accuracy, decode cost, judge agreement, template styles.

    python -m benchmarks.world            # 200 problems, 1,000 judge pairs (benchmarks/results/world.json)
    python -m benchmarks.world --quick    # reduced run, same code path (world-quick.json)

What it measures ("The embedded world" in docs/design.md):

- **accuracy** of the target and the draft on held-out 4-operation problems, each sampling its own
  trace at temperature 0.6, top-p 0.95 with the one sampler (:func:`generation.sampling.generate`);
- **ms_per_token**: per-token decode cost at batch 1 with the same generation code, the models
  interleaved; steady-state decode, ``(t(T tokens) - t(1 token)) / (T - 1)``, so the prompt's prefill
  is not counted (it is reported apart), and ``cost_ratio = draft / target`` (goal: at most 1/5);
  a fit of cost against depth over the three models says how deep a target would meet that goal;
- **judge_accuracy** and its confusion matrix against the oracle on held-out step pairs, half of
  them hard negatives (same numbers with another operation, result off by one, swapped or shifted
  operands), as :func:`arithmetic_world.train.judge_pair` draws them, from another seed;
- **template_distribution**: which paraphrase template each model actually writes, read from its
  sampled steps with :func:`arithmetic_world.task.parse_step`.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from benchmarks import harness
from arithmetic_world import models, task
from arithmetic_world.train import DRAFT_STYLE, EVAL_SEED, TARGET_STYLE, judge_pair, judge_yes_prob, lm_example
from arithmetic_world.task import ArithmeticTask
from generation.fingerprints import weights_stamp
from generation.paths import portable_paths
from generation.specs import SamplingSpec
from generation.sampling import generate
from semanticspec.results import accuracy
from semanticspec.evaluate import wilson

PROBLEM_SEED = 20_000
"""Seed of the benchmark's problems; training validates on ``EVAL_SEED`` (10,000)."""
JUDGE_SEED = 20_001
"""Seed of the benchmark's judge pairs; training draws pairs from seed + 1 and validates on ``EVAL_SEED``."""
TEMPERATURE, TOP_P = 0.6, 0.95
GOALS = {"target_accuracy": 0.95, "draft_accuracy": (0.40, 0.80), "cost_ratio": 0.2, "judge_accuracy": 0.95}
SOLVERS = ("target", "draft")


def prompt_ids(tok, problem: task.Problem) -> list[int]:
    """``<bos>`` + problem + blank line: the prompt every world model answers."""
    ids, start = lm_example(tok, problem)
    return ids[:start]


def _sample(model, prompts: list[list[int]], new_tokens: int, g: torch.Generator, eos: int | None, pad: int) -> list:
    """:func:`generate` at the benchmark's sampling (:data:`TEMPERATURE`, :data:`TOP_P`)."""
    return generate(model, prompts, max_new_tokens=new_tokens, sampling=SamplingSpec(TEMPERATURE, TOP_P), generator=g,
                    eos_token_id=eos, pad_token_id=pad)


def solve(model, tok, problems: Sequence[task.Problem], seed: int, batch_size: int = 50) -> list[str]:
    """Sample a trace for each problem (batched, seeded); returns the decoded traces."""
    g = torch.Generator().manual_seed(seed)
    traces = []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        outs = _sample(model, [prompt_ids(tok, p) for p in chunk], 160, g, tok.eos_token_id, tok.pad_token_id)
        traces += [tok.decode(o, skip_special_tokens=True) for o in outs]
    return traces


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``k / n`` (:func:`semanticspec.evaluate.wilson`), to 4 digits."""
    lo, hi = wilson(k, n, z)
    return (round(lo, 4), round(hi, 4))


def template_distribution(traces: Sequence[str]) -> dict:
    """Shares of the paraphrase templates in the steps of ``traces`` (overall and per operation).

    Returns ``{"shares": [4 floats], "by_op": {op: [4 floats]}, "steps", "malformed_share",
    "correct_step_share"}``; a step is every blank-line-separated piece but the answer line.
    """
    counts: Counter = Counter()
    malformed = correct = steps = 0
    for trace in traces:
        for piece in trace.split(task.STEP_DELIMITER):
            if not piece.strip() or piece.strip().startswith(task.ANSWER_MARKER):
                continue
            steps += 1
            parsed = task.parse_step(piece)
            if parsed is None:
                malformed += 1
                continue
            counts[(parsed[0].op, parsed[1])] += 1
            correct += task.is_correct(parsed[0])

    def shares(keys) -> list[float]:
        total = sum(counts[k] for k in keys)
        return [
            round(sum(counts[k] for k in keys if k[1] == i) / total, 4) if total else 0.0
            for i in range(task.N_TEMPLATES)
        ]

    every = [(op, i) for op in task.OPS for i in range(task.N_TEMPLATES)]
    return {
        "shares": shares(every),
        "by_op": {op: shares([(op, i) for i in range(task.N_TEMPLATES)]) for op in task.OPS},
        "steps": steps,
        "malformed_share": round(malformed / steps, 4) if steps else 0.0,
        "correct_step_share": round(correct / steps, 4) if steps else 0.0,
    }


def solver_accuracy(model, tok, problems: Sequence[task.Problem], seed: int) -> tuple[dict, list[str]]:
    """Accuracy (with a 95% interval) of one model on ``problems``, and its traces."""
    traces = solve(model, tok, problems, seed)
    # the task's checker, as decoding uses
    right = [ArithmeticTask().check(t, p.answer) for t, p in zip(traces, problems)]
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in traces]
    # A step can be a true equation and still not the problem's next operation; count agreement with the reference.
    agree = [
        task.meaning(s) == m for t, p in zip(traces, problems) for s, m in zip(t.split(task.STEP_DELIMITER), p.steps)
    ]
    return {
        "accuracy": round(accuracy(right), 4),
        "accuracy_ci95": wilson_interval(sum(right), len(problems)),
        "n_problems": len(problems),
        "mean_trace_tokens": round(statistics.mean(lengths), 1),
        "reference_step_share": round(sum(agree) / max(1, sum(len(p.steps) for p in problems)), 4),
    }, traces


def _time_generate(model, prompt: list[int], new_tokens: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    out = _sample(model, [prompt], new_tokens, g, None, 0)  # no EOS: every call writes exactly new_tokens tokens
    elapsed = time.perf_counter() - t0
    assert len(out[0]) == new_tokens
    return elapsed


def decode_cost(named_models: dict, tok, problems: Sequence[task.Problem], new_tokens: int) -> dict:
    """Per-token decode cost of each model at batch 1 with :func:`generate`, models interleaved.

    For every prompt and model it times a call writing ``new_tokens`` tokens and one writing 1
    token; decode cost is their difference over ``new_tokens - 1`` (the prefill cancels) and the
    figure is the median over prompts, robust to other work on the machine.
    """
    prompts = [prompt_ids(tok, p) for p in problems]
    for m in named_models.values():  # warm-up: allocator, kernels, caches
        _time_generate(m, prompts[0], new_tokens, 0)
    decode: dict[str, list[float]] = {n: [] for n in named_models}
    prefill: dict[str, list[float]] = {n: [] for n in named_models}
    order = list(named_models)
    for i, prompt in enumerate(tqdm(prompts, desc="decode cost", mininterval=5)):
        for name in order if i % 2 == 0 else order[::-1]:  # alternate who goes first
            t_full = _time_generate(named_models[name], prompt, new_tokens, i)
            t_one = _time_generate(named_models[name], prompt, 1, i)
            decode[name].append(1000 * (t_full - t_one) / (new_tokens - 1))
            prefill[name].append(1000 * t_one)
    return {
        n: {
            "ms_per_token": round(statistics.median(decode[n]), 4),
            "prefill_ms": round(statistics.median(prefill[n]), 3),
            "ms_per_token_spread": [round(min(decode[n]), 4), round(max(decode[n]), 4)],
            "timing_prompts": len(prompts),
            "timing_new_tokens": new_tokens,
        }
        for n in named_models
    }


def layer_cost_fit(layers: dict[str, int], ms: dict[str, float], goal: float = GOALS["cost_ratio"]) -> dict:
    """Fit ``ms_per_token = fixed + per_layer * layers`` over the world's models (least squares).

    At these widths a decode step costs a fixed overhead (embedding, masks, head, sampling, Python)
    plus a roughly constant cost per layer, so the fit says how deep a target would have to be for
    the draft to cost at most ``goal`` of it (the world's cost-ratio goal).
    """
    xs, ys = [layers[n] for n in ms], [ms[n] for n in ms]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    per_layer = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")
    fixed = my - per_layer * mx
    need = math.ceil((ms["draft"] / goal - fixed) / per_layer) if per_layer > 0 else None
    return {
        "fixed_ms": round(fixed, 4),
        "per_layer_ms": round(per_layer, 4),
        "layers": layers,
        "target_layers_for_goal": need,
    }


def pair_kind(m1: task.Meaning, m2: task.Meaning) -> str:
    """Which kind of pair ``judge_pair`` drew: same meaning, or which hard negative."""
    if m1 == m2:
        return "same"
    if m1.op != m2.op:
        return "other_op"
    if (m1.a, m1.b) == (m2.a, m2.b):
        return "result_off_by_one" if abs(m1.result - m2.result) == 1 else "other_result"
    if (m1.a, m1.b) == (m2.b, m2.a):
        return "swapped_operands"
    return "other_operand"


def judge_accuracy(judge, tok, n_pairs: int, seed: int = JUDGE_SEED, seen: Optional[set] = None) -> dict:
    """The judge's agreement with the oracle on ``n_pairs`` held-out pairs, with confusion and per-kind accuracy."""
    rng = random.Random(seed)
    pairs = [judge_pair(rng)[:2] for _ in range(n_pairs)]
    meanings = [(task.meaning(a), task.meaning(b)) for a, b in pairs]
    truth = [m1 == m2 for m1, m2 in meanings]  # the oracle, not judge_pair's own flag
    said = torch.cat([judge_yes_prob(judge, tok, pairs[i : i + 250]) for i in range(0, n_pairs, 250)]) > 0.5
    said = said.tolist()
    confusion = {"true_yes": 0, "false_yes": 0, "true_no": 0, "false_no": 0}
    by_kind: dict[str, list[int]] = {}
    for (m1, m2), t, s in zip(meanings, truth, said):
        confusion[f"{'true' if t == s else 'false'}_{'yes' if s else 'no'}"] += 1
        by_kind.setdefault(pair_kind(m1, m2), []).append(int(t == s))
    out = {
        "judge_accuracy": round(sum(t == s for t, s in zip(truth, said)) / n_pairs, 4),
        "judge_confusion": confusion,
        "judge_accuracy_by_kind": {
            k: {"accuracy": round(sum(v) / len(v), 4), "n": len(v)} for k, v in sorted(by_kind.items())
        },
        "judge_pairs": n_pairs,
    }
    if seen is not None:
        out["judge_pairs_seen_in_training"] = round(sum(p in seen for p in pairs) / n_pairs, 4)
    return out


def judge_on_model_steps(judge, tok, target_traces: Sequence[str], draft_traces: Sequence[str]) -> dict:
    """The judge's agreement with the oracle on the pairs the label pipeline meets: the target's and
    the draft's step at the same position of the same problem (both well-formed), in sampled traces."""
    pairs = [
        (a, b)
        for ta, tb in zip(target_traces, draft_traces)
        for a, b in zip(ta.split(task.STEP_DELIMITER), tb.split(task.STEP_DELIMITER))
        if task.meaning(a) is not None and task.meaning(b) is not None
    ]
    if not pairs:
        return {"accuracy": None, "pairs": 0, "same_share": None}
    truth = torch.tensor([task.meaning(a) == task.meaning(b) for a, b in pairs])
    said = torch.cat([judge_yes_prob(judge, tok, pairs[i : i + 250]) for i in range(0, len(pairs), 250)]) > 0.5
    return {
        "accuracy": round(float((said == truth).float().mean()), 4),
        "pairs": len(pairs),
        "same_share": round(float(truth.float().mean()), 4),
        "accuracy_on_same": round(float(said[truth].float().mean()), 4) if truth.any() else None,
        "accuracy_on_different": round(float((~said[~truth]).float().mean()), 4) if (~truth).any() else None,
    }


def judge_training_pairs(root: Path) -> Optional[set]:
    """Replay the judge's training stream from its ``training.json`` (seed, steps, batch); None if absent."""
    path = root / "judge" / "training.json"
    if not path.is_file():
        return None
    facts = json.loads(path.read_text())
    rng = random.Random(facts["seed"] + 1)  # train.train draws judge pairs from Random(seed + 1)
    n = facts["saved_at"]["step"] * facts["spec"]["batch"]
    return {judge_pair(rng)[:2] for _ in range(n)}


def run(quick: bool = False, root: Optional[Path] = None, seed: int = 0) -> dict:
    """Run the benchmark on the world at ``root`` and return its figures."""
    root = models.world_root(root)
    t0 = time.time()
    tok = models.load_tokenizer(root)
    n_problems, n_pairs, n_timing, new_tokens = (50, 300, 8, 32) if quick else (200, 1000, 40, 64)
    problems = task.generate_problems(n_problems, PROBLEM_SEED, task.TaskConfig(min_ops=4, max_ops=4))
    results: dict = {
        "n_problems": n_problems,
        "problem_seed": PROBLEM_SEED,
        "sampling_seed": seed,
        "training_eval_seed": EVAL_SEED,
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "root": portable_paths(str(root)),
        "weights": {role: weights_stamp(models.model_dir(role, root)) for role in (*SOLVERS, "judge")},
        "quick": quick,
        "torch_threads": torch.get_num_threads(),
        "template_distribution": {},
    }
    solvers = {name: models.load_model(name, root) for name in SOLVERS}
    traces = {}
    for name, model in solvers.items():
        results[name], traces[name] = solver_accuracy(model, tok, problems, seed)
        results["template_distribution"][name] = template_distribution(traces[name])
        results[name]["example_trace"] = traces[name][0]
    judge = models.load_model("judge", root)
    costs = decode_cost({**solvers, "judge": judge}, tok, problems[:n_timing], new_tokens)
    for name in SOLVERS:
        results[name].update(costs[name])
    results["judge_decode"] = costs["judge"]  # the judge reads one token per answer; timed for its card
    results["cost_ratio"] = round(results["draft"]["ms_per_token"] / results["target"]["ms_per_token"], 4)
    depth = {"target": solvers["target"], "draft": solvers["draft"], "judge": judge}
    results["layer_cost_fit"] = layer_cost_fit(
        {n: m.config.num_hidden_layers for n, m in depth.items()}, {n: costs[n]["ms_per_token"] for n in depth}
    )
    dist = results["template_distribution"]
    dist["target_corpus"], dist["draft_corpus"] = list(TARGET_STYLE), list(DRAFT_STYLE)
    # Total variation distance between the two models' template shares: 0 = same style, 1 = disjoint.
    dist["style_distance"] = round(
        0.5 * sum(abs(a - b) for a, b in zip(dist["target"]["shares"], dist["draft"]["shares"])), 4
    )
    results.update(judge_accuracy(judge, tok, n_pairs, JUDGE_SEED, seen=judge_training_pairs(root)))
    results["judge_seed"] = JUDGE_SEED
    results["judge_on_model_steps"] = judge_on_model_steps(judge, tok, traces["target"], traces["draft"])
    results["goals"] = goals(results)
    results["wall_s"] = round(time.time() - t0, 1)
    return results


def goals(r: dict) -> dict:
    """Each of the world's goals with the measured value and whether it is met."""
    lo, hi = GOALS["draft_accuracy"]
    return {
        "target_accuracy >= 0.95": r["target"]["accuracy"] >= GOALS["target_accuracy"],
        "draft_accuracy in [0.40, 0.80]": lo <= r["draft"]["accuracy"] <= hi,
        "cost_ratio <= 0.2": r["cost_ratio"] <= GOALS["cost_ratio"],
        "judge_accuracy >= 0.95": r["judge_accuracy"] >= GOALS["judge_accuracy"],
    }


def markdown(r: dict) -> str:
    """The benchmark's figures as markdown tables, goals last."""
    dist = r["template_distribution"]
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [
        f"World benchmark ({'quick, ' if r['quick'] else ''}{r['n_problems']} four-operation problems, "
        f"T={r['temperature']}, top-p={r['top_p']}; models from {r['root']})",
        "",
        harness.table(
            ["model", "accuracy (95% CI)", "ms/token (decode)", "prefill ms", "templates 0/1/2/3", "malformed steps",
             "true steps", "steps as reference"],
            ([name, f"{m['accuracy']:.3f} ({m['accuracy_ci95'][0]:.2f}-{m['accuracy_ci95'][1]:.2f})",
              f"{m['ms_per_token']:.3f}", f"{m['prefill_ms']:.2f}", fmt(d["shares"]), f"{d['malformed_share']:.3f}",
              f"{d['correct_step_share']:.3f}", f"{m['reference_step_share']:.3f}"]
             for name in SOLVERS for m, d in [(r[name], dist[name])]),
        ),
    ]
    c, fit = r["judge_confusion"], r["layer_cost_fit"]
    lines += [
        "",
        f"cost ratio draft/target: **{r['cost_ratio']:.3f}** (goal <= 0.2) · "
        f"style distance (TV): {dist['style_distance']:.2f} · "
        f"training corpora: target {fmt(dist['target_corpus'])}, draft {fmt(dist['draft_corpus'])}",
        f"decode cost fit over the three models: {fit['fixed_ms']:.3f} ms fixed + "
        f"{fit['per_layer_ms']:.3f} ms per layer "
        f"(layers {fit['layers']}); a target of {fit['target_layers_for_goal']} layers would meet the 1/5 goal",
        "",
        harness.table([f"judge ({r['judge_pairs']} pairs)", "oracle: same", "oracle: different"],
                      [["judge says yes", str(c["true_yes"]), str(c["false_yes"])],
                       ["judge says no", str(c["false_no"]), str(c["true_no"])]]),
        "",
        f"judge accuracy: **{r['judge_accuracy']:.3f}** · by kind: "
        + ", ".join(f"{k} {v['accuracy']:.3f} (n={v['n']})" for k, v in r["judge_accuracy_by_kind"].items()),
    ]
    ms = r["judge_on_model_steps"]
    if ms["pairs"]:
        lines.append(
            f"judge on the models' own steps (target vs draft step at the same position, {ms['pairs']} pairs, "
            f"{ms['same_share']:.0%} same): accuracy {ms['accuracy']:.3f} (same {ms['accuracy_on_same']}, "
            f"different {ms['accuracy_on_different']})"
        )
    if "judge_pairs_seen_in_training" in r:
        lines.append(
            "(share of benchmark pairs that also occur in the judge's training stream: "
            f"{r['judge_pairs_seen_in_training']:.2f})"
        )
    lines += ["", "Goals:"] + [f"- {'met' if ok else 'MISSED'}: {g}" for g, ok in r["goals"].items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    ap = harness.parser(__doc__, quick="reduced run (50 problems, 300 pairs), at most ~3 minutes", threads=1,
                        name="world")
    ap.add_argument(
        "--root", type=Path, default=None, help="world folder (default $SEMANTICSPEC_WORLD or checkpoints/arithmetic)"
    )
    ap.add_argument("--seed", type=harness.non_negative, default=0, help="sampling seed")
    args = ap.parse_args(argv)
    if args.root is not None and not args.root.is_dir():
        ap.error(f"--root {args.root}: no such folder (a world's target/, draft/ and tokenizer)")
    torch.set_num_threads(args.threads)
    results = run(args.quick, args.root, args.seed)
    harness.write(results, harness.results_path("world", args.quick, args.out), markdown(results))
    return results


if __name__ == "__main__":
    main()
