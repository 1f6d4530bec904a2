"""Batch scaling of the decode benchmark, the batch cost model that explains it, and where the time goes.

:func:`batch_scaling` decodes the same problems at 1, 2, 4, 8 and 16 prompts per batch with target-only and
SemanticSpec, and reports per method and size: tokens per second, speedup over target-only at the same size,
accuracy and the problems decoded; the forwards each model ran and what they carried (rows fed, tokens fed,
positions computed: every forward computes all the batch's rows at its widest feed, padding included); the
cost model's prediction; and SemanticSpec's phases with its idle rows.

**Interleaving.** The problems are cut in chunks of the largest size (16); each chunk is decoded at every
size by both methods (their order rotates) before the next chunk. Load on the shared machine then hits both
methods of a size within seconds of each other, and every size alike, so the speedup at a size (a ratio of
two walls) and the scaling across sizes do not pick up drift; per-size runs (all problems with one method,
then the other) would put minutes between the two walls of a ratio. A chunk is a whole number of batches at
every size, so each size decodes the same batches it would decode on all problems at once. Each problem
samples from its own stream (the chunk's seed, its index), the same at every size, so a method's outputs
and accuracy are the same at every size (``tests/semanticspec/test_decoder.py`` checks batched = one by one): sizes
differ in time only.

**Cost model.** A forward of model ``m`` computing ``positions`` positions costs ``a_m + b_m * positions``
seconds, fitted by least squares on every forward timed during the decodes (all sizes and both methods
pooled, :func:`generation.cache.record_forwards`). A decode's predicted forward time is
``sum_m a_m * forwards_m + b_m * positions_m``; checked against its measured forward time per size, it
says whether forwards and positions explain the cost. Predicted tokens/s adds the decode's measured time
outside the forwards (sampling, probes, bookkeeping: ``other_s``), and ``predicted_speedup`` is the ratio of
predicted walls. ``positions_free_speedup`` is the same ratio with every forward costing only its ``a_m``: what
the speedup would be where a forward costs about the same for 8 positions as for 150 (an accelerator, for
models this small), on this machine's per-forward and loop costs. A projection, not a measurement.

**Repeats.** With ``repeats`` > 1 every chunk is decoded again at every size (the same texts, the methods' order
rotated once more): walls, forwards and seconds are over every pass, ``speedup`` is the ratio of the summed
walls, and ``speedup_repeats`` holds each pass's own, whose spread is what the machine's state does to the ratio.

**Phases** (seconds and shares of the loop's wall): ``first_step``, ``draft``, ``verify``, ``rewrite``,
``probe`` and ``other`` (the loop's own :class:`~semanticspec.results.DecodeStats`; target-only has no
phases, its steps are ``other``). Idle
rows are row-seconds: ``idle_rows`` counts, for every unfinished row, the forwards that ran without feeding
it (accepted rows while the target rewrites refused ones, rows whose step is written while others still
draft), ``done_rows`` the time from a row's end to its batch's end; their shares are of the batch's
row-seconds (rows x wall).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from benchmarks import harness
from generation.cache import ForwardRecord, record_forwards
from semanticspec.results import summarize
from semanticspec.timing import rotation

SIZES = (1, 2, 4, 8, 16)
"""Prompts per batch of the scaling section."""
METHODS = ("target_only", "semanticspec")
"""Methods of the scaling section; the first is the speedup's reference."""
MODELS = ("target", "draft")
PHASES = ("first_step", "draft", "verify", "rewrite", "probe")
"""SemanticSpec's phases in :class:`~semanticspec.results.DecodeStats` (``<phase>_s``); the rest is ``other``."""


class Run:
    """One method at one size, accumulated over chunks: results, generate wall and timed forwards."""

    def __init__(self) -> None:
        self.results: list = []
        self.wall = 0.0
        self.row_s = 0.0  # row-seconds: per batch, its rows x its loop wall
        self.records: list[ForwardRecord] = []

    @classmethod
    def merged(cls, runs: Sequence[Run]) -> Run:
        """One run of several passes over the same problems (every pass writes the same texts): results, walls,
        row-seconds and forwards of every pass."""
        out = cls()
        out.results = [x for r in runs for x in r.results]
        out.wall, out.row_s = sum(r.wall for r in runs), sum(r.row_s for r in runs)
        out.records = [x for r in runs for x in r.records]
        return out

    def add(self, results: list, wall: float, records: list[ForwardRecord], size: int) -> None:
        self.results += results
        self.wall += wall
        self.records += records
        for k in range(0, len(results), size):
            batch = results[k : k + size]
            self.row_s += len(batch) * sum(r.stats.wall_s for r in batch)


def batch_scaling(dec, problems: Sequence, args, prompt: Callable, check: Callable,
                  sizes: Sequence[int] = SIZES, methods: Sequence[str] = METHODS, repeats: int = 1) -> dict:
    """The scaling section: ``{"table": {method: {size: figures}}, "cost_model": {model: fit}, "phases": {...}}``.

    Args:
        dec: the decoder.
        problems: the problems every size decodes.
        args: the benchmark's arguments (``seed``, ``max_new_tokens``, ``temperature``, ``top_p``).
        prompt: ``prompt(problem) -> str``.
        check: ``check(text, problem) -> bool``, the answer checker.
        sizes: batch sizes; the chunk is their least common multiple.
        methods: methods decoded (the first is the speedup's reference).
        repeats: passes over all chunks (the same texts each time): a method's figures are over every pass, and
            ``speedup_repeats`` holds each pass's speedup (their spread is the run's timing noise).
    """
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats={repeats!r}: expected an integer >= 1 (passes over the problems)")
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
           "lookahead": 1}  # rows judge one step per pass unless they name a window
    chunk = math.lcm(*sizes)
    _warm_up(dec, [prompt(p) for p in problems[: max(sizes)]], sizes, methods, gen)
    passes = [{(m, b): Run() for m in methods for b in sizes} for _ in range(repeats)]
    for r, runs in enumerate(passes):
        for c, start in enumerate(range(0, len(problems), chunk)):
            prompts = [prompt(p) for p in problems[start : start + chunk]]
            for k, b in enumerate(sizes):
                for m in rotation(methods, c + k + r):
                    with record_forwards() as log:
                        t0 = time.perf_counter()
                        res = dec.generate(prompts, method=m, batch_size=b, seed=args.seed + c, **gen)
                        wall = time.perf_counter() - t0
                    runs[m, b].add(res, wall, log, b)
    runs = {key: Run.merged([p[key] for p in passes]) for key in passes[0]}
    roles = {id(dec.target): "target", id(dec.draft): "draft"}
    costs = fit_costs([r for run in runs.values() for r in run.records], roles)
    table = {m: {str(b): figures(runs[m, b], problems, check, costs, roles) for b in sizes} for m in methods}
    for m in methods:
        for b in map(str, sizes):
            row, ref = table[m][b], table[methods[0]][b]
            row["speedup"] = ref["wall_s"] / row["wall_s"]
            row["speedup_repeats"] = [p[methods[0], int(b)].wall / p[m, int(b)].wall for p in passes]
            row["predicted_speedup"] = ref["predicted_wall_s"] / row["predicted_wall_s"]
            row["positions_free_speedup"] = ref["positions_free_wall_s"] / row["positions_free_wall_s"]
            row["scaling"] = row["tokens_per_s"] / table[m][str(sizes[0])]["tokens_per_s"]
    phases = {m: {str(b): phase_breakdown(runs[m, b]) for b in sizes} for m in methods}
    return {"table": table, "cost_model": costs, "phases": phases, "chunk": chunk, "repeats": repeats}


def _warm_up(dec, prompts: list[str], sizes: Sequence[int], methods: Sequence[str], gen: dict) -> None:
    """Decode a short batch at every size with every method first: new shapes pay one-off costs."""
    for b in sizes:
        for m in methods:
            dec.generate(prompts[:b], method=m, batch_size=b, seed=0, **{**gen, "max_new_tokens": 16})


def fit_costs(records: Sequence[ForwardRecord], roles: dict[int, str]) -> dict[str, dict[str, float]]:
    """Per model, ``seconds = a + b * positions`` fitted by least squares on its timed forwards.

    Returns:
        ``{model: {"a": s, "b": s per position, "forwards": n, "r2": fit's R^2}}`` for each model that ran.
    """
    out = {}
    for role in MODELS:
        pts = [(r.positions, r.seconds) for r in records if roles.get(id(r.model)) == role]
        if len(pts) < 2:
            continue
        x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
        y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
        design = torch.stack([torch.ones_like(x), x], dim=1)
        a, b = torch.linalg.lstsq(design, y[:, None]).solution.flatten().tolist()
        resid = y - (a + b * x)
        r2 = 1 - float(resid.pow(2).sum()) / max(float((y - y.mean()).pow(2).sum()), 1e-30)
        out[role] = {"a": a, "b": b, "forwards": len(pts), "r2": r2}
    return out


def figures(run: Run, problems: Sequence, check: Callable, costs: dict, roles: dict[int, str]) -> dict:
    """One method at one size: throughput, accuracy, forwards per model and what they carried, the prediction."""
    n = len(problems)  # results of every pass in order; each pass writes the same texts
    tokens = sum(r.stats.output_tokens for r in run.results)  # over every pass, as the wall and the forwards are
    fig = {"tokens_per_s": tokens / run.wall, "wall_s": run.wall, "problems": n,
           "output_tokens": sum(r.stats.output_tokens for r in run.results[:n]),
           "accuracy": sum(bool(check(r.text, p)) for r, p in zip(run.results[:n], problems)) / n}
    forward_s = predicted = fixed = 0.0
    for role in MODELS:
        recs = [r for r in run.records if roles.get(id(r.model)) == role]
        n = max(len(recs), 1)
        positions = sum(r.positions for r in recs)
        fig[f"{role}_forwards"] = len(recs)
        fig[f"{role}_rows_per_forward"] = sum(r.rows for r in recs) / n
        fig[f"{role}_tokens_per_forward"] = sum(r.tokens for r in recs) / n
        fig[f"{role}_positions_per_forward"] = positions / n
        fig[f"{role}_forward_s"] = sum(r.seconds for r in recs)
        forward_s += fig[f"{role}_forward_s"]
        if recs and role in costs:
            per_forward = costs[role]["a"] * len(recs)
            fixed += per_forward
            predicted += per_forward + costs[role]["b"] * positions
    other = max(run.wall - forward_s, 0.0)
    fig.update({"forward_s": forward_s, "predicted_forward_s": predicted, "other_s": other,
                "predicted_wall_s": predicted + other, "predicted_tokens_per_s": tokens / (predicted + other),
                "positions_free_wall_s": fixed + other})
    return fig


def phase_breakdown(run: Run) -> dict:
    """Seconds and shares of wall per phase, and idle row-seconds with their shares of the batches' row-seconds."""
    s = summarize(run.results)
    wall = s["wall_s"]
    seconds = {p: s[f"{p}_s"] for p in PHASES}
    seconds["other"] = wall - sum(seconds.values())
    out = {"wall_s": wall, "seconds": seconds, "shares": {p: v / wall if wall else 0.0 for p, v in seconds.items()}}
    out.update({"idle_rows_s": s["idle_row_s"], "done_rows_s": s["done_idle_row_s"], "row_s": run.row_s,
                "idle_rows_share": s["idle_row_s"] / run.row_s if run.row_s else 0.0,
                "done_rows_share": s["done_idle_row_s"] / run.row_s if run.row_s else 0.0})
    return out


def _speedup(row: dict) -> str:
    """A row's speedup, with each pass's in brackets when there were several."""
    passes = row.get("speedup_repeats", [])
    return f"{row['speedup']:.2f}" + (f" ({', '.join(f'{x:.2f}' for x in passes)})" if len(passes) > 1 else "")


def markdown(section: dict) -> list[str]:
    """The section's tables: scaling with the cost model's check, the fitted costs, and the phases per size."""
    if not section:
        return []
    header = ["batch scaling", "batch", "tokens/s", "speedup", "accuracy", "problems",
              "target fwd (rows, positions / fwd)", "draft fwd (rows, positions / fwd)", "forward s (predicted) / wall",
              "predicted tokens/s", "predicted speedup", "speedup, positions free (projected)"]
    rows = [[method, b, f"{r['tokens_per_s']:.0f}", _speedup(r), f"{r['accuracy']:.3f}", str(r["problems"]),
             *(f"{r[f'{m}_forwards']} ({r[f'{m}_rows_per_forward']:.1f}, {r[f'{m}_positions_per_forward']:.1f})"
               for m in MODELS),
             f"{r['forward_s']:.2f} ({r['predicted_forward_s']:.2f}) / {r['wall_s']:.2f}",
             f"{r['predicted_tokens_per_s']:.0f}", f"{r['predicted_speedup']:.2f}",
             f"{r['positions_free_speedup']:.2f}"] for method, row in section["table"].items() for b, r in row.items()]
    costs = [[role, f"{c['a'] * 1e3:.3f}", f"{c['b'] * 1e6:.2f}", str(c["forwards"]), f"{c['r2']:.3f}"]
             for role, c in section["cost_model"].items()]
    lines = ["", harness.table(header, rows), "",
             harness.table(["forward cost model (s = a + b * positions)", "a (ms)", "b (us / position)", "forwards",
                            "R^2"], costs)]
    names = (*PHASES, "other")
    for method, per_size in section["phases"].items():
        rows = [[method, b, *(f"{ph['shares'][k]:.1%}" for k in names), f"{ph['idle_rows_share']:.1%}",
                 f"{ph['done_rows_share']:.1%}"] for b, ph in per_size.items()]
        lines += ["", harness.table([f"{method} phases (share of wall)", "batch", *names, "idle rows (share of row-s)",
                                     "done rows (share of row-s)"], rows)]
    return lines
