"""``python -m semanticspec.evaluate``: judge exported probes on their own pair and task.

Target-only against SemanticSpec (and token-level speculative decoding where the two models share a tokenizer) on
held-out problems, methods interleaved per problem, each problem with its own seed; a threshold sweep and the
threshold a stated rule picks, written beside the probes (``threshold.json``) for the decoders and the endpoint to
use by default::

    python -m semanticspec.evaluate --config configs/arithmetic.yaml          # the newest run's export
    python -m semanticspec.evaluate --config runs/arithmetic/fit/version_0    # a run folder
    python -m semanticspec.evaluate --probes checkpoints/arithmetic/probes --n_problems 40
    python -m semanticspec.evaluate --probes checkpoints/arithmetic/probes-topk \\
        --target_url http://127.0.0.1:8851/v1 --draft_url http://127.0.0.1:8852/v1    # two servers, the same loop

The evaluation belongs to the decoder's wing: ``semanticspec`` imports ``probes`` (the probe, its training, its
export), so a ``probes.evaluate`` that imports the decoder would close an import circle between the two packages.

The module holds the evaluation core, which the benchmarks (``benchmarks/decode.py``, ``benchmarks/real.py``) call
too (:class:`Arm`, :func:`decode_one`, :func:`interleaved`, :func:`decision_counts`, :func:`paired_delta`,
:func:`wilson`), the resumable run (:class:`Evaluation`: one JSON line per problem, method and threshold in
``records.jsonl``), and the command (:class:`EvaluateOptions`, :func:`main`). The tables and the plot are
:mod:`semanticspec.evaluation_report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from generation.cli import fail, one_line_parser, sigterm_interrupts
from generation.paths import folder_problem
from semanticspec.timing import rotation

PROG = "python -m semanticspec.evaluate"
FORMAT_VERSION = 1
"""Format version of ``records.jsonl`` and ``evaluation.json``."""
RULE = "the fastest threshold whose accuracy is within max_accuracy_drop of target-only's on the same problems"
"""The rule that picks the threshold (as R2R picks its router's: a stated rule on held-out data)."""
Z95 = 1.959963984540054
"""The standard normal's 97.5% quantile: 95% intervals."""

# --------------------------------------------------------------------------- the core: one way to measure a decode


@dataclass(frozen=True)
class Arm:
    """One method as the evaluation decodes it: a decoder and its ``generate`` keywords.

    Attributes:
        decoder: a :class:`~semanticspec.decoder.SemanticSpecDecoder` or :class:`~semanticspec.served.ServedDecoder`.
        keywords: ``generate`` keywords (``method``, budget, sampling, window), or a function of ``(k, problem,
            results so far per arm)`` returning them (a method whose argument depends on the problem or on the run).
        reference: the arm whose wall time this one's speedup divides (transformers' own loops: its target-only).
    """

    decoder: Any
    keywords: dict | Callable[[int, Any, dict], dict] = field(default_factory=dict)
    reference: str = "target_only"


def decode_one(arm: Arm, k: int, problem, prompt, seed: int, so_far: dict | None = None):
    """Problem ``k`` (its ``prompt``) decoded by ``arm`` with ``seed``: the :class:`~semanticspec.results.DecodeResult`.
    Timing is the decoder's own (``result.stats.wall_s``), so nothing outside the decode is counted."""
    kw = arm.keywords(k, problem, so_far or {}) if callable(arm.keywords) else arm.keywords
    return arm.decoder.generate([prompt], seed=seed, **kw)[0]


def interleaved(arms: dict[str, Arm], problems: Sequence, prompts: Sequence, seed: int, *, batch: int = 1,
                order: Callable[[list[str], int], list[str]] = rotation,
                around: Callable[[str], contextlib.AbstractContextManager] | None = None,
                desc: str = "decode") -> dict[str, list]:
    """Every arm on every problem, interleaved per problem, problem ``k`` decoded with seed ``seed + k``.

    Args:
        arms: ``{name: Arm}``.
        problems: the problems (handed to callable keywords).
        prompts: each problem's prompt as the decoders read it (``decoder.prompts``).
        seed: problem ``k``'s decodes use ``seed + k`` (a prompt decodes the same alone or beside others).
        batch: problems decoded at once by one ``generate`` call; chunk ``c`` of ``batch`` problems is decoded with
            seed ``seed + c`` (each prompt from its own streams: :func:`~generation.sampling.stream_keys`), and the
            arms' order rotates from chunk to chunk. Arms with callable keywords decode one problem at a time.
        order: the arms' order on problem (chunk) ``k`` (default :func:`~semanticspec.timing.rotation`: each takes
            every place in turn, so machine load hits all alike).
        around: a context manager per decode, by arm name (a benchmark records the forwards there).
        desc: the progress bar's label.

    Returns:
        ``{name: [DecodeResult per problem]}``.

    Raises:
        ValueError: ``batch`` below 1, or above 1 with an arm whose keywords are a function of the problem.
    """
    from tqdm.auto import tqdm

    if batch < 1 or (batch > 1 and any(callable(a.keywords) for a in arms.values())):
        raise ValueError(f"batch={batch}: expected 1, or more with every arm's keywords a dict")
    out: dict[str, list] = {n: [] for n in arms}
    chunks = range(0, len(problems), batch)
    for c, k in enumerate(tqdm(chunks, desc=desc, unit="problem" if batch == 1 else "chunk")):
        for name in order(list(arms), c):
            with around(name) if around is not None else contextlib.nullcontext():
                if batch == 1:
                    out[name].append(decode_one(arms[name], k, problems[k], prompts[k], seed + k, out))
                else:
                    out[name] += arms[name].decoder.generate(list(prompts[k : k + batch]), seed=seed + c,
                                                             **arms[name].keywords)
    return out


def decision_counts(results: Sequence, oracles: Sequence[Callable[[str, str], bool]]) -> tuple[dict[str, int], list]:
    """Oracle-judged decision counts over the proposed draft steps, and ``(q, right)`` of the probe-judged ones.

    A step is right when ``oracle(step, output so far)`` accepts it. Once a wrong step is committed (by either model)
    nothing after it can be right, so later proposals are counted apart as ``after_error`` and left out of the four
    cells. ``wrong_kept_fast_path`` counts wrong steps the fast path kept (they are in ``wrong_kept`` too).
    """
    from semanticspec.results import Decision

    keys = ("right_kept", "wrong_kept", "right_refused", "wrong_refused", "wrong_kept_fast_path", "after_error")
    counts = dict.fromkeys(keys, 0)
    scored = []
    for r, oracle in zip(results, oracles):
        prefix, on_track = "", True
        for st in r.steps:
            right = on_track and oracle(st.text, prefix)
            if st.writer == "draft" or st.decision == Decision.REJECT:
                if not on_track:
                    counts["after_error"] += 1
                else:
                    kept = st.decision.kept
                    counts[f"{'right' if right else 'wrong'}_{'kept' if kept else 'refused'}"] += 1
                    counts["wrong_kept_fast_path"] += int(not right and st.decision == Decision.ACCEPT_FAST)
                    if st.q is not None:
                        scored.append((st.q, right))
            if st.decision != Decision.REJECT:
                on_track = right
                prefix += st.text
    return counts, scored


def wilson(right: int, n: int, z: float = Z95) -> list[float]:
    """Wilson score interval of a share ``right / n`` (95% by default); NaNs for ``n = 0``."""
    if n == 0:
        return [math.nan, math.nan]
    p, z2 = right / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return [0.0 if right == 0 else max(0.0, centre - half), 1.0 if right == n else min(1.0, centre + half)]


def paired_delta(right: Sequence[bool], ref: Sequence[bool]) -> dict:
    """Accuracy minus the reference's on the same problems, and its 95% interval for matched pairs: Agresti and Min's
    adjusted Wald interval (Statistics in Medicine 24:729, 2005), which adds half a problem to each cell of the two
    methods' right/wrong table, kept within [-1, 1]. The plain normal interval of the per-problem differences has no
    width when every difference is the same (both right or both wrong on every problem, as on a few problems is
    common); this one keeps a width of about ``2 * 1.96 / (n + 2)`` then."""
    n = len(right)
    if n == 0:
        return {"accuracy_delta": math.nan, "accuracy_delta_ci95": [math.nan, math.nan]}
    gained = sum(bool(a) and not bool(b) for a, b in zip(right, ref))  # right here only
    lost = sum(bool(b) and not bool(a) for a, b in zip(right, ref))  # right in the reference only
    centre = (gained - lost) / (n + 2)
    half = Z95 * math.sqrt(gained + lost + 1 - (gained - lost) ** 2 / (n + 2)) / (n + 2)
    return {"accuracy_delta": (gained - lost) / n,
            "accuracy_delta_ci95": [max(-1.0, centre - half), min(1.0, centre + half)]}


def same_decisions(result, tau: float, other: float) -> bool:
    """Whether a threshold-rule decode at ``tau`` decides every step as one at ``other`` would: no step it judged
    with the probe (kept or refused by ``q``; the fast path's steps were not judged by ``q``) has a ``q`` on which
    the two thresholds disagree. Then the decode at ``other`` is this one, step for step (same seed, same draws)."""
    from semanticspec.results import Decision

    judged = (Decision.ACCEPT, Decision.REJECT)
    return all((s.q >= tau) == (s.q >= other) for s in result.steps if s.q is not None and s.decision in judged)


def figures(results: Sequence, right: Sequence[bool], reference_wall: float) -> dict:
    """One method's figures over its results: accuracy with its Wilson interval, speedup against
    ``reference_wall`` (the reference's wall seconds on the same problems) and the decode summary."""
    from semanticspec.results import accuracy, speedup, summarize

    s, n = summarize(results), len(right)
    wall = s["wall_s"]
    keys = ("tokens_per_s", "step_acceptance", "draft_token_share", "target_passes_per_100_tokens", "output_tokens",
            "draft_steps_proposed", "draft_steps_accepted", "target_passes", "draft_passes",
            "probe_overhead", "probe_s")
    return {"accuracy": accuracy(right), "accuracy_ci95": wilson(sum(right), n),
            "wall_s": wall, "speedup": speedup(reference_wall, wall), "n_problems": n,
            **{k: s[k] for k in keys}}


# --------------------------------------------------------------------------- records: one JSON line per decode


def result_of(data: dict):
    """The :class:`~semanticspec.results.DecodeResult` a record holds as JSON (``dataclasses.asdict``)."""
    from semanticspec.results import Decision, DecodeResult, DecodeStats, StepTrace

    steps = [StepTrace(**{**s, "decision": Decision(s["decision"])}) for s in data["steps"]]
    return DecodeResult(**{**data, "steps": steps, "stats": DecodeStats(**data["stats"])})


class Records:
    """``records.jsonl``: a header line (the settings every decode depends on), then one line per decode.

    A rerun reads what is recorded and skips it; a line cut short by a kill is dropped. A header that differs from
    the run's settings is refused, naming the first differing field.
    """

    def __init__(self, path: Path, header: dict) -> None:
        from filelock import FileLock, Timeout

        self.path, self.header = Path(path), json.loads(json.dumps(header))  # as a rerun reads it back (tuples: lists)
        self.lines: dict[tuple, dict] = {}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(self.path.with_name(f".{self.path.name}.lock"))  # released by close(), or the OS
        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            raise ValueError(f"another evaluation is writing {self.path} (it holds {self.lock.lock_file}); let it "
                             "finish, or give this one another --out_dir") from None
        try:
            if self.path.is_file():
                self._read()
            else:
                self._append({"header": header})
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        raw = self.path.read_bytes()
        whole = raw[: raw.rfind(b"\n") + 1]  # a line cut short by a kill is dropped (and cut from the file)
        if len(whole) < len(raw):
            with open(self.path, "r+b") as f:
                f.truncate(len(whole))
        rows = self._rows(whole)
        if not rows:
            self._append({"header": self.header})
            return
        n, first = rows[0]
        if not isinstance(first, dict) or not isinstance(first.get("header"), dict):
            raise ValueError(f"{self.path}:{n} is not the records' header (the settings its decodes were made with); "
                             "give another --out_dir, or delete the file to start over")
        had = first["header"]
        for key in sorted(set(had) | set(self.header)):
            if had.get(key) != self.header.get(key):
                raise ValueError(f"{self.path} records decodes with {key}={had.get(key)!r}, this run has "
                                 f"{self.header.get(key)!r}; give another --out_dir, or delete the file to start over")
        for n, row in rows[1:]:
            if not (isinstance(row, dict) and {"problem", "method"} <= set(row) and ({"result", "failed"} & set(row))):
                raise ValueError(f"{self.path}:{n}: not a decode's record (problem, method, and its result or "
                                 "failure); give another --out_dir, or delete the file to start over")
            self.lines[key_of(row)] = row

    def _rows(self, whole: bytes) -> list[tuple[int, Any]]:
        """The file's lines as JSON with their line numbers, a bad one named by file and line."""
        rows = []
        for n, line in enumerate(whole.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                rows.append((n, json.loads(line.decode())))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path}:{n}: not a JSON record ({e}); give another --out_dir, or delete the "
                                 "file to start over") from None
        return rows

    def _append(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def get(self, problem: int, method: str, threshold: float | None = None) -> dict | None:
        """The recorded line of a decode, or None."""
        return self.lines.get((problem, method, threshold))

    def add(self, row: dict) -> None:
        """Append ``row`` (``problem``, ``method``, ``threshold`` and its result or failure) and keep it."""
        self._append(row)
        self.lines[key_of(row)] = row

    def close(self) -> None:
        """Let another evaluation write this file."""
        self.lock.release()


def key_of(row: dict) -> tuple:
    """A record's key: ``(problem, method, threshold)``."""
    return row["problem"], row["method"], row.get("threshold")


# --------------------------------------------------------------------------- the run


@dataclass
class Setup:
    """What an evaluation decodes: its arms, problems, prompts, task and the SemanticSpec decoders by threshold."""

    arms: dict[str, Arm]
    """The methods beside the sweep (``target_only``, ``semanticspec`` at ``tau``, ``hf_target_only`` and
    ``token_sd`` where they run)."""
    problems: list[dict]
    prompts: list
    task: Any
    tau: float
    """SemanticSpec's main threshold (its row in the methods' table)."""
    semanticspec_at: Callable[[float], Arm]
    """SemanticSpec's arm at another threshold (the sweep)."""
    seed: int
    header: dict
    """The settings every decode depends on (the records' header)."""


class Evaluation:
    """The resumable evaluation of :class:`Setup` into ``out_dir``: decodes what ``records.jsonl`` lacks, then
    computes every figure from the records alone, so a resumed run ends with the same JSON as an uninterrupted one
    (timings aside)."""

    def __init__(self, setup: Setup, out_dir: Path, thresholds: Sequence[float], max_accuracy_drop: float,
                 progress: bool = True) -> None:
        self.s, self.out_dir = setup, Path(out_dir)
        self.thresholds = sorted({float(t) for t in thresholds} | {setup.tau})
        self.max_accuracy_drop, self.progress = max_accuracy_drop, progress
        self.records = Records(self.out_dir / "records.jsonl", setup.header)
        self._arms_at: dict[float, Arm] = {setup.tau: setup.arms["semanticspec"]}

    def run(self) -> dict:
        """Decode every problem (what is recorded is skipped) and return the report."""
        from tqdm.auto import tqdm

        bar = tqdm(range(len(self.s.problems)), desc="evaluate", unit="problem", disable=not self.progress)
        for k in bar:
            self._problem(k)
            bar.set_postfix(self._running(k + 1), refresh=False)
        return self.report()

    def _problem(self, k: int) -> None:
        """Problem ``k``: the arms interleaved (order rotating), then the sweep's thresholds."""
        p, prompt, seed = self.s.problems[k], self.s.prompts[k], self.s.seed + k
        for name in rotation(list(self.s.arms), k):
            tau = self.s.tau if name == "semanticspec" else None
            if self._missing(k, name, tau):
                self._decode(k, name, tau, self.s.arms[name], p, prompt, seed)
        for tau in self.thresholds:
            if self._missing(k, "semanticspec", tau):
                self._sweep(k, tau, p, prompt, seed)

    def _missing(self, k: int, name: str, tau: float | None) -> bool:
        """Not recorded, or recorded as failed (a rerun tries a failed decode again; its new line replaces it)."""
        row = self.records.get(k, name, tau)
        return row is None or "failed" in row

    def _decode(self, k: int, name: str, tau: float | None, arm: Arm, p, prompt, seed: int) -> None:
        row = {"problem": k, "method": name, "threshold": tau, "seed": seed}
        try:
            r = decode_one(arm, k, p, prompt, seed)
        except Exception as e:  # a problem that fails is recorded with its reason; the run goes on
            self.records.add({**row, "failed": f"{type(e).__name__}: {e}"})
            return
        if not r.ok:
            row["failed"] = r.error or f"stop_reason={r.stop_reason}"
        self.records.add({**row, "right": bool(self.s.task.check(r.text, p["answer"])), "result": asdict(r)})

    def _sweep(self, k: int, tau: float, p, prompt, seed: int) -> None:
        """SemanticSpec at ``tau`` on problem ``k``: a recorded decode at another threshold that decides every step
        the same is this decode (recorded with ``reused_from``); otherwise it is decoded."""
        for other in self.thresholds:
            row = self.records.get(k, "semanticspec", other)
            if row is None or "result" not in row or "reused_from" in row or "failed" in row:
                continue
            if same_decisions(result_of(row["result"]), other, tau):
                self.records.add({**row, "threshold": tau, "reused_from": other})
                return
        if tau not in self._arms_at:
            self._arms_at[tau] = self.s.semanticspec_at(tau)
        self._decode(k, "semanticspec", tau, self._arms_at[tau], p, prompt, seed)

    def _running(self, n: int) -> dict:
        """The progress bar's running figures over the first ``n`` problems."""
        rows = {m: [self.records.get(k, m, self.s.tau if m == "semanticspec" else None) for k in range(n)]
                for m in ("target_only", "semanticspec")}
        ok = [k for k in range(n) if all(r is not None and "result" in r for r in (rows["target_only"][k],
                                                                                   rows["semanticspec"][k]))]
        if not ok:
            return {}
        acc = {m: sum(rows[m][k]["right"] for k in ok) / len(ok) for m in rows}
        wall = {m: sum(rows[m][k]["result"]["stats"]["wall_s"] for k in ok) for m in rows}
        return {"acc_target": f"{acc['target_only']:.3f}", "acc_semanticspec": f"{acc['semanticspec']:.3f}",
                "speedup": f"{wall['target_only'] / max(wall['semanticspec'], 1e-9):.2f}x"}

    # ----------------------------------------------------------------------- figures, from the records alone

    def report(self) -> dict:
        """The figures of everything recorded for this run's problems: per method, the sweep, the pick."""
        n = len(self.s.problems)
        names = list(self.s.arms)
        main = {m: [self.records.get(k, m, self.s.tau if m == "semanticspec" else None) for k in range(n)]
                for m in names}
        sweep = {t: [self.records.get(k, "semanticspec", t) for k in range(n)] for t in self.thresholds}
        columns = [*main.values(), *sweep.values()]  # every decode a problem needs: the methods', the sweep's
        failed = sorted({k for rows in columns for k, r in enumerate(rows) if r is None or "failed" in r})
        ok = [k for k in range(n) if k not in failed]
        methods = {m: self._figures(main[m], main[self.s.arms[m].reference], main["target_only"], ok) for m in names}
        judge = getattr(self.s.task, "step_judge", None)
        if judge is not None and ok and judge(self.s.problems[ok[0]]) is not None:
            counts, _ = decision_counts([result_of(main["semanticspec"][k]["result"]) for k in ok],
                                        [judge(self.s.problems[k]) for k in ok])
            methods["semanticspec"]["decisions"] = counts
        curve = [{"threshold": t, **self._figures(sweep[t], main["target_only"], main["target_only"], ok),
                  "reused": sum("reused_from" in sweep[t][k] for k in ok)} for t in self.thresholds]
        return {
            "format_version": FORMAT_VERSION,
            "n_problems": n, "n_evaluated": len(ok), "seed": self.s.seed, "tau": self.s.tau,
            "settings": self.s.header,
            "methods": methods,
            "sweep": curve,
            "pick": pick(curve, methods["target_only"], self.max_accuracy_drop, evaluated=len(ok)),
            "failed": [{"problem": k, "method": r["method"], "threshold": r.get("threshold"), "reason": r["failed"]}
                       for k in failed for rows in columns if (r := rows[k]) is not None and "failed" in r],
            "missing": [k for k in failed if any(rows[k] is None for rows in columns)],
        }

    def _figures(self, rows: list, ref_rows: list, target_rows: list, ok: list[int]) -> dict:
        results = [result_of(rows[k]["result"]) for k in ok]
        right = [rows[k]["right"] for k in ok]
        ref_wall = sum(ref_rows[k]["result"]["stats"]["wall_s"] for k in ok)
        return {**figures(results, right, ref_wall), **paired_delta(right, [target_rows[k]["right"] for k in ok])}


def pick(curve: list[dict], target_only: dict, max_drop: float, evaluated: int | None = None) -> dict:
    """The rule's threshold (:data:`RULE`) on the sweep ``curve``, with its figures and intervals; ``tau`` None when
    no threshold is within ``max_drop`` of target-only's accuracy, or when no problem was evaluated (``evaluated``:
    problems every decode of which succeeded; None: not counted)."""
    floor = target_only["accuracy"] - max_drop
    within = [r for r in curve if r["accuracy"] >= floor - 1e-12]
    out = {"rule": RULE, "max_accuracy_drop": max_drop, "target_only_accuracy": target_only["accuracy"],
           "target_only_accuracy_ci95": target_only["accuracy_ci95"]}
    if evaluated == 0:
        return {**out, "tau": None, "why": "no problem was evaluated (every one has a failed decode)"}
    if not within:
        return {**out, "tau": None, "why": f"no threshold reached accuracy >= {floor:.4f}"}
    # equal speedups come from one decode reused at several thresholds: the one nearest the default (0.5) is kept
    best = max(within, key=lambda r: (r["speedup"], -abs(r["threshold"] - 0.5)))
    keys = ("accuracy", "accuracy_ci95", "accuracy_delta", "accuracy_delta_ci95", "speedup", "step_acceptance")
    return {**out, "tau": best["threshold"], **{k: best[k] for k in keys}}


def better_pick(probes: Path, n: int) -> str | None:
    """Why the ``threshold.json`` beside ``probes`` stays, or None: it was picked for these target probe weights on
    more problems than ``n`` (a quick check must not replace a careful pick)."""
    from generation.fingerprints import sha256_file
    from semanticspec.policies import THRESHOLD_FILE

    path = probes / THRESHOLD_FILE
    try:
        old = json.loads(path.read_text())
        more = old["n_problems"] > n and old["target_probe_sha256"] == sha256_file(probes / "target" /
                                                                                    "model.safetensors")
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one this version wrote: replaced
        return None
    return (f"kept {path}: its pick (tau {old['tau']}) was made on {old['n_problems']} problems, this run evaluated "
            f"{n}; delete it to write this run's pick") if more else None


def write_threshold(probes: Path, report: dict, command: str) -> Path | None:
    """Write the pick as ``threshold.json`` beside the probes (:data:`semanticspec.policies.THRESHOLD_FILE`); None when
    the rule picked nothing."""
    from generation.fingerprints import sha256_file
    from generation.paths import atomic_path, strict_json
    from semanticspec.policies import THRESHOLD_FILE, THRESHOLD_FORMAT

    p = report["pick"]
    if p["tau"] is None:
        return None
    data = {"format_version": THRESHOLD_FORMAT, "tau": p["tau"], "rule": RULE,
            "max_accuracy_drop": p["max_accuracy_drop"],
            "target_probe_sha256": sha256_file(probes / "target" / "model.safetensors"),
            "figures": {k: v for k, v in p.items() if k not in ("rule", "tau", "max_accuracy_drop")},
            "n_problems": report["n_evaluated"], "seed": report["seed"], "command": command}
    path = probes / THRESHOLD_FILE
    with atomic_path(path) as tmp:
        tmp.write_text(strict_json(data))  # a figure no problem measured: null, not NaN
    return path


# --------------------------------------------------------------------------- the command


@dataclass
class EvaluateOptions:
    """What python -m semanticspec.evaluate decodes and where it writes."""

    config: str | None = None
    """The fit's config (the YAML given to `python -m probes.fit --config`) or a run folder holding its config.yaml:
    the models, the task, the label build (whose problems are not evaluated) and where the run exports. None: the
    clone's configs/arithmetic.yaml, the one `python -m probes.fit` reads without --config (a wheel has none)."""
    probes: str | None = None
    """Export folder holding target/ and draft/ (None: the run's newest export, <log dir>/version_N/export)."""
    out_dir: str | None = None
    """Where records.jsonl, evaluation.json, .md and .png go (None: <probes>/evaluation). A rerun resumes there."""
    task: Any = None
    """Another task to evaluate on (class_path and init_args, e.g. a test file); None: the label build's task."""
    n_problems: int = 40
    """Held-out problems to decode."""
    seed: int = 30_000
    """Seed of a generated task's problems; problem k also decodes with seed + k."""
    skip: int | None = None
    """A file task: lines skipped at its start (None: the lines the label build used, when it is the build's file)."""
    max_new_tokens: int = 96
    """Token budget of every decode."""
    tau: float | None = None
    """SemanticSpec's threshold in the methods' table (None: the probes' threshold.json, else 0.5)."""
    thresholds: list[float] = field(default_factory=lambda: [0.3, 0.4, 0.5, 0.6, 0.7])
    """The sweep's thresholds, each in [0, 1]; a decode that decides as at another is not redone."""
    max_accuracy_drop: float = 0.01
    """The rule: the fastest threshold whose accuracy is at most this below target-only's (0.01 = one point)."""
    write_threshold: bool = True
    """Write the rule's pick beside the probes (threshold.json), the decoders' and the endpoint's default tau; a pick
    there for the same target probe made on more problems is kept."""
    token_sd: bool = True
    """In-process with one tokenizer: also token-level speculative decoding (transformers' assisted generation,
    timed against transformers' own target-only loop)."""
    target_device: str | None = None
    """In-process: the target's torch device (None: the build config's device)."""
    draft_device: str | None = None
    """In-process: the draft's torch device (None: the target's)."""
    target_url: str | None = None
    """The target's server (with --draft_url): decode through two servers with the same loop."""
    draft_url: str | None = None
    """The draft's server."""
    engine: Literal["llama.cpp", "vllm", "sglang"] = "llama.cpp"
    """Kind of the two servers."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the servers' API key (unset or empty: none)."""
    threads: int | None = None
    """torch CPU threads (None: OMP_NUM_THREADS, else the cores)."""
    progress: bool = True
    """Show the progress bar (running accuracy and speedup)."""


def option_errors(opts: EvaluateOptions) -> list[str]:
    """What is wrong with the options alone (before anything loads), each naming the value."""
    errors = [f"--thresholds: {t!r} is outside [0, 1]" for t in opts.thresholds
              if not (isinstance(t, (int, float)) and 0 <= t <= 1)]
    if not opts.thresholds:
        errors.append("--thresholds: expected at least one value in [0, 1]")
    if opts.tau is not None and not 0 <= opts.tau <= 1:
        errors.append(f"--tau={opts.tau}: expected a threshold in [0, 1]")
    if not 0 <= opts.max_accuracy_drop <= 1:
        errors.append(f"--max_accuracy_drop={opts.max_accuracy_drop}: expected a share in [0, 1] (0.01 = 1 point)")
    for name in ("n_problems", "max_new_tokens"):
        if getattr(opts, name) < 1:
            errors.append(f"--{name}={getattr(opts, name)}: expected an integer >= 1")
    if opts.skip is not None and opts.skip < 0:
        errors.append(f"--skip={opts.skip}: expected an integer >= 0")
    if opts.seed < 0:  # a generated task's problems from -s are those from s: -1 gave the label build's own
        errors.append(f"--seed={opts.seed}: expected an integer >= 0")
    if (opts.target_url is None) != (opts.draft_url is None):
        errors.append("--target_url and --draft_url go together: give both servers, or neither to decode in-process")
    return errors


@dataclass
class FitRun:
    """What the evaluation reads from the fit's config: its label build and where the run exports."""

    build: Any
    """The label build's :class:`~datamodules.labels.config.BuildConfig`."""
    data_dir: Path
    exports: list[Path]
    """Export folders of the run, newest first."""
    looked: str = ""
    """Where they are looked for (named when there are none)."""


FIT_SECTIONS = {"data", "model", "trainer"}
"""A fit config holds at least one of these."""


def read_fit(config: str) -> FitRun:
    """The label build and the run's exports of a fit config (a YAML, or a run folder holding ``config.yaml``).

    Raises:
        ValueError: no such file or folder, or a ``data.build`` section the build refuses.
    """
    from argparse import ArgumentError

    import yaml

    from datamodules.labels.build import build_parser

    path = Path(config)
    run = path if path.is_dir() else None
    if run is not None:
        path = run / "config.yaml"
    if not path.is_file():
        what = "holds no config.yaml" if run is not None else "no such file or folder"
        raise ValueError(f"--config {config}: {what}; expected a `python -m probes.fit` YAML or a run folder holding "
                         "config.yaml")
    try:
        fit = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: not a readable YAML file ({str(e).splitlines()[0]})") from None
    if not isinstance(fit, dict) or not set(fit) & FIT_SECTIONS or not isinstance(fit.get("data") or {}, dict):
        raise ValueError(f"--config {path}: expected a `python -m probes.fit` config (a mapping with a data: section, "
                         "or trainer: or model:), or a run folder holding its config.yaml")
    data = fit.get("data") or {}
    section = {"data_dir": data.get("data_dir", "data/arithmetic"), "build": data.get("build", {})}
    if section["build"] is None:  # the fit read labels built on their own (--data.build null): the build they record
        section["build"] = recorded_build(Path(section["data_dir"]), path)
    parser = build_parser()
    parser.exit_on_error = False  # its errors are this command's, naming the config
    try:
        build = parser.instantiate(parser.parse_args(["--config", yaml.safe_dump(section)])).build
    except (ArgumentError, ValueError, TypeError) as e:
        raise ValueError(f"--config {path}: its data.build section is refused: {e}") from None
    runs = runs_root(fit)
    if fit.get("export_dir"):  # the fit exported there (--export_dir), not into its run folder
        exports = [Path(fit["export_dir"])]
    else:  # newest first
        exports = [run / "export"] if run is not None else sorted(runs.glob("version_*/export"), key=_version,
                                                                   reverse=True)
    looked = str(exports[0]) if exports else str(runs / "version_*" / "export")
    return FitRun(build, Path(section["data_dir"]), exports, looked)


def recorded_build(data_dir: Path, config: Path) -> dict:
    """The build config the labels in ``data_dir`` record (their ``manifest.json``'s ``config``): what a fit with
    ``data.build: null`` trained on.

    Raises:
        ValueError: ``data_dir`` holds no manifest recording one (naming the fit config).
    """
    from datamodules.labels.shards import read_manifest

    manifest = read_manifest(data_dir) if data_dir.is_dir() else None
    if not isinstance((manifest or {}).get("config"), dict):
        what = "no manifest.json" if manifest is None else "a manifest.json that records no build config"
        raise ValueError(f"--config {config}: its data.build is null (labels built on their own) but {data_dir} holds "
                         f"{what}; run from the folder the fit ran in, or give a fit config with a data.build "
                         "section")
    return manifest["config"]


def runs_root(fit: dict) -> Path:
    """Where a fit config's runs go, ``<save_dir>/<name>``; each exports into its ``version_N/export``."""
    trainer = fit.get("trainer") or {}
    logger = trainer.get("logger") or {}
    args = logger.get("init_args", {}) if isinstance(logger, dict) else {}
    return Path(args.get("save_dir") or trainer.get("default_root_dir") or ".") / (args.get("name") or
                                                                                   "lightning_logs")


def _version(export: Path) -> int:
    """N of a run's ``version_N/export`` (-1 when its folder is named otherwise)."""
    tail = export.parent.name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def probe_dir(opts: EvaluateOptions, fit: FitRun) -> Path:
    """The export folder to evaluate, checked to hold a target and a draft probe in their roles."""
    if opts.probes is None:
        found = [p for p in fit.exports if (p / "target" / "config.json").is_file()]
        if not found:
            given = Path(opts.config)
            fit_config = given / "config.yaml" if given.is_dir() else given
            raise ValueError(f"--probes: the run of --config {opts.config} has exported no probes yet (looked in "
                             f"{fit.looked}); train with `python -m probes.fit --config {fit_config}`, or give "
                             "--probes DIR (e.g. checkpoints/arithmetic/probes)")
        return found[0]
    from probes.model import probe_config

    root = Path(opts.probes)
    for role in ("target", "draft"):
        try:
            probe_config(root / role, role)
        except (OSError, ValueError) as e:
            raise ValueError(f"--probes {root}: expected an export folder holding target/ and draft/; {e}") from None
    return root


def held_out(opts: EvaluateOptions, fit: FitRun) -> tuple[Any, list[dict], int]:
    """The task, its held-out problems (none of them among the label build's, every one with an answer) and the
    file lines skipped before them."""
    from datamodules.labels.shards import read_manifest

    build_task = fit.build.resolved_task()
    task = opts.task if opts.task is not None else build_task
    manifest = read_manifest(fit.data_dir) if fit.data_dir.is_dir() else None
    used = (manifest or {}).get("build", {}).get("problems") or {}
    build_n, build_seed = used.get("n_problems", fit.build.n_problems), used.get("task_seed", fit.build.task_seed)
    same_file = task.path is not None and build_task.path is not None and Path(task.path) == Path(build_task.path)
    skip = opts.skip if opts.skip is not None else (build_n if same_file and build_n else 0)
    problems = task.problems(skip + opts.n_problems, opts.seed)[skip:]
    if len(problems) < opts.n_problems:
        raise ValueError(f"--n_problems={opts.n_problems}: the task holds {len(problems)} problems after the "
                         f"{skip} skipped (--skip)")
    no_answer = [k for k, p in enumerate(problems) if p.get("answer") is None or not str(p["answer"]).strip()]
    if no_answer:
        first = problems[no_answer[0]]["problem"][:60]
        raise ValueError(f"task {task.spec()['class_path']}: problem {no_answer[0]} ({first!r}) has no answer to "
                         f"check; {len(no_answer)} of {len(problems)} lack one")
    seen = fit.build.labelled_problems(build_n, build_seed)
    overlap = [k for k, p in enumerate(problems) if p["problem"] in seen]
    if overlap:
        raise ValueError(f"--seed={opts.seed} --skip={skip}: {len(overlap)} of the {len(problems)} problems are among "
                         f"the label build's ({build_n} from task_seed {build_seed}), e.g. problem {overlap[0]}; "
                         "choose another --seed, --skip or --task")
    return task, problems, skip


def make_setup(opts: EvaluateOptions, fit: FitRun, probes: Path, task, problems: list[dict], skip: int,
               resumed: float | None = None) -> Setup:
    """The decoders (in-process or served) and the arms of the evaluation; servers and models are checked here.
    SemanticSpec's main threshold is ``--tau``, else the one of the run it resumes (``resumed``: a rerun does not move
    to the pick its first run wrote), else the probes' ``threshold.json``, else 0.5."""
    import torch

    from generation.fingerprints import sha256_file
    from semanticspec.policies import stored_tau

    tau = next((t for t in (opts.tau, resumed, stored_tau(probes / "target")) if t is not None), 0.5)
    tp, dp = str(probes / "target"), str(probes / "draft")
    if opts.target_url is not None:
        dec, shared, make, where = served_decoder(opts, tp, dp, task, tau)
    else:
        dec, shared, make, where = local_decoder(opts, fit.build, tp, dp, task, tau)
    # every method samples as the probes' labels were sampled (as the decode benchmark does)
    spec = dec.sampling()
    gen = {"max_new_tokens": opts.max_new_tokens, "temperature": spec.temperature, "top_p": spec.top_p}
    one = {**gen, "lookahead": 1}

    def semanticspec_at(t: float) -> Arm:
        d = dec if t == tau else make(dataclasses.replace(dec.policy, tau=t))
        return Arm(d, {**gen, "method": "semanticspec"})  # lookahead None: the shipped window

    arms = {"target_only": Arm(dec, {**one, "method": "target_only"}), "semanticspec": semanticspec_at(tau)}
    if opts.token_sd and shared and opts.target_url is None:
        arms["hf_target_only"] = Arm(dec, {**one, "method": "hf_target_only"}, reference="hf_target_only")
        arms["token_sd"] = Arm(dec, {**one, "method": "token_sd"}, reference="hf_target_only")
    header = {"format_version": FORMAT_VERSION, "where": where, "task": task.spec(), "seed": opts.seed,
              "max_new_tokens": opts.max_new_tokens, "temperature": spec.temperature, "top_p": spec.top_p, "tau": tau,
              "probes": {r: sha256_file(probes / r / "model.safetensors") for r in ("target", "draft")},
              "skip": skip, "threads": torch.get_num_threads() if opts.target_url is None else None}  # timings' pace
    return Setup(arms, problems, dec.prompts([p["problem"] for p in problems]), task, tau, semanticspec_at,
                 opts.seed, header)


def local_decoder(opts: EvaluateOptions, build, tp: str, dp: str, task, tau: float):
    """The in-process decoder of the build's models (on ``--target_device`` / ``--draft_device``), a maker of the same
    decoder with another policy, whether the two share a tokenizer, and the models' description."""
    from datamodules.labels.shard import load_model, load_tokenizers
    from generation.loading import device_problem
    from semanticspec.decoder import SemanticSpecDecoder
    from semanticspec.policies import default_policy

    for name, device in (("target_device", opts.target_device), ("draft_device", opts.draft_device)):
        if device is not None and (problem := device_problem(device)):
            raise ValueError(f"--{name} {problem}")
    tok, dtok = load_tokenizers(build)
    for role, probe, t in (("target", tp, tok), ("draft", dp, dtok or tok)):
        check_before_loading(probe, build.model_path(role), t, role)
    target, draft = load_model(build, "target"), load_model(build, "draft")
    if opts.target_device is not None:
        target = target.to(opts.target_device)
    if opts.draft_device is not None or opts.target_device is not None:
        draft = draft.to(opts.draft_device or opts.target_device)

    dec = SemanticSpecDecoder(target, draft, tok, dtok, tp, dp, default_policy(fast_path=dtok is None, tau=tau),
                              task=task)

    def make(policy):  # the same decoder at another policy, on the probes loaded once
        return SemanticSpecDecoder(target, draft, tok, dtok, dec.target_probe, dec.draft_probe, policy, task=task)

    where = {"mode": "in-process", **{role: _identity(m, t) for role, m, t in (("target", target, tok),
                                                                               ("draft", draft, dtok or tok))}}
    return dec, dtok is None, make, where


def _identity(model, tokenizer) -> dict:
    """A model as the records' header names it: its fingerprint without its path, so a moved checkout resumes."""
    from generation.fingerprints import model_fingerprint

    return {k: v for k, v in model_fingerprint(model, tokenizer).items() if k != "name_or_path"}


def check_before_loading(probe_dir: str, model_dir: str, tokenizer, role: str) -> None:
    """Refuse a probe exported for another model from the model's config and tokenizer alone, before its weights
    load (the decoder checks the loaded model again).

    Raises:
        ValueError: naming each differing fingerprint field (:func:`probes.model.check_probe_matches`).
    """
    from types import SimpleNamespace

    from transformers import AutoConfig

    from probes.model import check_probe_matches, probe_config

    config = probe_config(probe_dir, role)
    model = SimpleNamespace(config=AutoConfig.from_pretrained(model_dir, local_files_only=True))
    check_probe_matches(config, model, tokenizer, where=f"--probes {Path(probe_dir).parent}: {role}/")


def served_decoder(opts: EvaluateOptions, tp: str, dp: str, task, tau: float):
    """The served decoder of two servers (each checked to answer before any decoding), a maker of the same decoder
    with another policy, False (no in-process token-level SD), and the servers' description."""
    from generation.engines import make_engine
    from semanticspec.policies import default_policy
    from semanticspec.served import ServedDecoder

    engines = [make_engine(opts.engine, url, None, api_key_env=opts.api_key_env, retries=1, timeout=30.0)
               for url in (opts.target_url, opts.draft_url)]

    dec = ServedDecoder(*engines, tp, dp, default_policy(tau=tau), task=task, concurrency=1)
    dec.check_servers()  # probes the servers cannot serve (hidden rows from llama.cpp): refused before target_only runs

    def make(policy):  # the same decoder at another policy, on the probes loaded once
        return ServedDecoder(*engines, dec.target_probe, dec.draft_probe, policy, task=task, concurrency=1)

    where = {"mode": "served", "engine": opts.engine, "target": opts.target_url, "draft": opts.draft_url}
    return dec, False, make, where


def parser():
    """The command's parser: the options of :class:`EvaluateOptions`, their docstrings as ``--help``."""
    from jsonargparse import set_parsing_settings

    from datamodules.tasks.base import Task

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    description = __doc__.split("\n\n")[1].replace("\n", " ").replace("``", "").removesuffix("::") + "."
    p = one_line_parser(PROG, description=description, allow_abbrev=False)
    p.add_class_arguments(EvaluateOptions, as_positional=False, skip={"task"})
    p.add_subclass_arguments(Task, "task", required=False, default=None,
                             help="Another task to evaluate on (class_path and init_args); default: the label build's")
    return p


def main(argv: list[str] | None = None, *, echo: bool = True) -> dict:
    """Parse the options, refuse bad input before any decoding (one line, exit 2), evaluate, write the JSON, the
    markdown table, the plot and the pick; returns the report. Ctrl-C (or SIGTERM) stops it with exit status 130,
    naming what was kept and the command that resumes.

    ``echo=False`` is for a command that runs this one inside its own (a benchmark): the table and the paths written
    are not printed, and Ctrl-C is raised as ``KeyboardInterrupt`` for that command to report."""
    from generation.cli import normalise_args

    given = normalise_args(list(sys.argv[1:] if argv is None else argv))
    try:
        with sigterm_interrupts():
            return _evaluate(given, echo)
    except KeyboardInterrupt:  # while the models load, or while the report is written
        if not echo:
            raise
        print(f"{PROG}: interrupted; resume with: {PROG} {shlex.join(given)}", file=sys.stderr)
        raise SystemExit(130) from None


def _evaluate(given: list[str], echo: bool = True) -> dict:
    from generation.engines.base import EngineError
    from generation.threads import apply_threads, set_wait_policy

    set_wait_policy()
    if "--task" not in given and any(a.startswith("--task.") and a.split("=")[0] != "--task.help" for a in given):
        # before jsonargparse's union message; --task.help CLASS names its class
        fail(PROG, "--task.* given without --task: name the task's class too, e.g. --task "
                   "datamodules.tasks.math.BoxedMathTask --task.path FILE")
    p = parser()
    ns = p.parse_args(given)
    try:
        task = p.instantiate(ns).task if ns.task is not None else None
    except (ValueError, TypeError) as e:
        fail(PROG, f"--task: {e}")
    opts = EvaluateOptions(**{**{k: v for k, v in vars(ns).items() if k in EvaluateOptions.__dataclass_fields__},
                              "task": task})
    if errors := option_errors(opts):
        fail(PROG, "; ".join(errors))
    if opts.config is None:
        from generation.paths import DEFAULT_CONFIG

        if not DEFAULT_CONFIG.is_file():
            fail(PROG, f"no --config given, and the default {DEFAULT_CONFIG} does not exist (a wheel ships no "
                       "configs/): give --config FILE, or a run folder")
        opts = dataclasses.replace(opts, config=str(DEFAULT_CONFIG))
    try:
        fit = read_fit(opts.config)
        probes = probe_dir(opts, fit)
        out_dir = Path(opts.out_dir).expanduser() if opts.out_dir is not None else probes / "evaluation"
        if problem := folder_problem(out_dir if opts.out_dir is None else opts.out_dir, "--out_dir"):
            raise ValueError(problem)  # before the models load
        if opts.write_threshold and (problem := folder_problem(probes, "--probes")):
            raise ValueError(f"{problem}: the pick is written there (threshold.json); give --write_threshold false "
                             "to evaluate without writing it")
        task, problems, skip = held_out(opts, fit)
        apply_threads(opts.threads, log=None)
        setup = make_setup(opts, fit, probes, task, problems, skip, recorded_tau(out_dir))
        evaluation = Evaluation(setup, out_dir, opts.thresholds, opts.max_accuracy_drop, progress=opts.progress)
    except (ValueError, OSError, EngineError) as e:
        fail(PROG, str(e))
    try:
        report = evaluation.run()
    except KeyboardInterrupt:
        if not echo:
            raise
        print(f"{PROG}: interrupted; {len(evaluation.records.lines)} decodes kept in {evaluation.records.path}. "
              f"Resume with: {PROG} {shlex.join(given)}", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        evaluation.records.close()
    return _written(report, opts, probes, out_dir, evaluation.records.path, f"{PROG} {shlex.join(given)}", echo)


def _written(report: dict, opts: EvaluateOptions, probes: Path, out_dir: Path, records: Path, command: str,
             echo: bool = True) -> dict:
    """Save the report in ``out_dir``, then write the pick beside ``probes`` (as ``opts`` says); exit 1, naming the
    first failure, when no problem was evaluated."""
    from semanticspec.policies import THRESHOLD_FILE

    report["probes"] = str(probes)
    picked = opts.write_threshold and report["n_evaluated"] and report["pick"]["tau"] is not None
    if picked and (kept := better_pick(probes, report["n_evaluated"])):
        print(f"{PROG}: {kept}", file=sys.stderr)
        picked = False
    report["threshold_file"] = str(probes / THRESHOLD_FILE) if picked else None
    save(report, out_dir, echo)  # the report first: an interrupted write leaves the old threshold beside a stale report
    if picked:
        try:
            write_threshold(probes, report, command)
        except OSError as e:  # the folder changed while the problems decoded: the report is saved
            fail(PROG, f"--probes {probes}: the pick could not be written ({e}); the report is in {out_dir}")
    if not report["n_evaluated"]:
        first = report["failed"][0] if report["failed"] else {"problem": 0, "method": "?", "reason": "not decoded"}
        print(f"{PROG}: no problem was evaluated: every one has a failed decode (first: problem {first['problem']}, "
              f"{first['method']}: {first['reason']}); see {records}", file=sys.stderr)
        raise SystemExit(1)
    return report


def save(report: dict, out_dir: Path, echo: bool = True) -> None:
    """``evaluation.png``, ``evaluation.md`` and, last, ``evaluation.json`` in ``out_dir`` (a figure no problem
    measured is null there, not NaN, so strict JSON readers read it); the table is printed (``echo``)."""
    from generation.paths import strict_json

    from semanticspec.evaluation_report import markdown, plot

    table = markdown(report)
    plot(report, out_dir / "evaluation.png")
    (out_dir / "evaluation.md").write_text(table + "\n")
    (out_dir / "evaluation.json").write_text(strict_json(report))
    if not echo:
        return
    print(table)
    where = report.get("threshold_file")
    print(f"wrote {out_dir / 'evaluation.json'}, .md, .png"
          + (f"; threshold {report['pick']['tau']} in {where}" if where else ""))


def recorded_tau(out_dir: Path) -> float | None:
    """SemanticSpec's main threshold in the header of ``out_dir``'s ``records.jsonl``, or None (no records yet)."""
    try:
        with open(Path(out_dir) / "records.jsonl") as f:
            return json.loads(f.readline())["header"].get("tau")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def iter_records(path: str | os.PathLike) -> Iterator[dict]:
    """The decode lines of a ``records.jsonl`` (the header left out)."""
    with open(path) as f:
        for line in f:
            if line.strip() and "header" not in (row := json.loads(line)):
                yield row


if __name__ == "__main__":
    main()
