"""Prefixes: a problem's prompt plus its first k reasoning steps, where the label pipeline samples.

A task (:mod:`datamodules.tasks`) gives problems with reference traces, or the target writes its
own traces. Every trace is cut after each step delimiter, so a problem with S steps gives S
prefixes (0 .. S-1 steps written). The prompt is the task's (:meth:`~datamodules.tasks.base.Task.prompt`:
the tokenizer's chat template when it has one, else ``problem + "\\n\\n"`` after ``<bos>``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from datamodules.tasks.base import Task
from datamodules.tasks.worlds import default_world
from generation.steps import DEFAULT_DELIMITERS, split_steps


@dataclass
class Prefix:
    """One place to sample a step: ``prompt_ids + tokens of steps[:k]``."""

    problem_id: int
    """Index of the problem in the task (stable: the split by problem uses it)."""
    prefix_id: int
    """Global index of this prefix in the build (0..n_prefixes-1)."""
    step_index: int
    """How many steps the prefix already holds (k)."""
    text: str
    """The reasoning written so far (steps[:k] joined), without the prompt."""
    token_ids: list[int]
    """Prompt plus written steps in the target's tokenization."""
    draft_token_ids: list[int] | None = None
    """The same in the draft's tokenization when it has its own tokenizer (None: it shares the target's)."""


def make_prefixes(
    records: Sequence[dict],
    tokenizer,
    delimiters: Sequence[str] = DEFAULT_DELIMITERS,
    source: str = "reference",
    draft_tokenizer=None,
    task: Task | None = None,
) -> list[Prefix]:
    """Cut every trace at each step delimiter.

    Args:
        records: problems from :meth:`Task.problems <datamodules.tasks.base.Task.problems>`; with ``source="target"``
            their ``trace`` must already hold the target's generation (see :func:`target_traces`).
        tokenizer: the target's tokenizer.
        delimiters: step delimiters.
        source: where traces come from, only used in messages.
        draft_tokenizer: the draft's tokenizer when it differs from the target's: each prefix then
            also holds its text in the draft's tokenization (``draft_token_ids``).
        task: whose prompt format to use (None = the embedded world's,
            :class:`~arithmetic_world.task.ArithmeticTask`).

    Raises:
        ValueError: a record has no trace (named by file and line when read from a file) or the
            records give no prefix at all.
    """
    task = task or default_world().task()
    prefixes: list[Prefix] = []
    for pid, rec in enumerate(records):
        trace = rec.get("trace")
        if not isinstance(trace, str) or not trace.strip():
            where = f"line {rec['line']}" if "line" in rec else f"problem {pid}"
            raise ValueError(f"{where} has no {source} trace (a non-empty string 'trace' is needed to cut prefixes)")
        steps = split_steps(trace, delimiters)
        for k in range(len(steps)):
            text = "".join(steps[:k])
            ids = prefix_ids(task, tokenizer, rec["problem"], text)
            dids = None if draft_tokenizer is None else prefix_ids(task, draft_tokenizer, rec["problem"], text)
            prefixes.append(Prefix(pid, len(prefixes), k, text, ids, dids))
    if not prefixes:
        raise ValueError("the problems give no prefix; check the task's problems or n_problems")
    return prefixes


def prefix_ids(task: Task, tokenizer, problem: str, text: str) -> list[int]:
    """Prompt plus the written steps, in one model's tokenization."""
    return task.prompt(tokenizer, problem) + (list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text
                                              else [])


def target_traces(sampler, records: Sequence[dict], *, max_new_tokens: int, seed: int,
                  task: Task | None = None) -> list[dict]:
    """Replace each record's trace by one the target writes itself (``source="target"``), prompted as ``task`` asks.

    Args:
        sampler: the target's :class:`~datamodules.labels.samplers.StepSampler` (the build's backend: the package's
            own sampler, a server or vLLM), which writes one continuation per prompt.
        records: the task's problems.
        max_new_tokens: longest trace in tokens.
        seed: seed of the traces.
        task: whose prompt format to use (None = the embedded world's).
    """
    task = task or default_world().task()
    prompts = [task.prompt(sampler.tokenizer, r["problem"]) for r in records]
    texts = sampler.complete(prompts, max_new_tokens, seed)
    return [{**r, "trace": t} for r, t in zip(records, texts)]
