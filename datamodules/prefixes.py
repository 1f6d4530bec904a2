"""Prefixes: a problem's prompt plus its first k reasoning steps, where the label pipeline samples.

A task gives problems with reference traces (JSONL ``{"problem", "trace", "answer"}``; the
embedded world writes this shape), or the target writes its own traces. Every trace is cut after
each step delimiter, so a problem with S steps gives S prefixes (0 .. S-1 steps written). The
prompt is ``tokenizer(problem + "\\n\\n")`` (``<bos>`` first, as Llama tokenizers add it), or the
tokenizer's chat template with the problem as the user turn when it has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from datamodules.arithmetic import task
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


def load_problems(task_file: str | None = None, n_problems: int = 0, seed: int = 0) -> list[dict]:
    """Problems as ``{"problem", "trace"?, "answer", "line"?}`` records.

    Args:
        task_file: JSONL path; None generates ``n_problems`` from the embedded world.
        n_problems: how many world problems to generate (ignored with ``task_file``), or at most
            how many to read from the file (0 = all).
        seed: seed of the world's problem generator.

    Raises:
        ValueError: the file has a malformed line (named ``file:line``) or no problem at all, or
            ``n_problems < 1`` for the world.
    """
    if task_file is None:
        if n_problems < 1:
            raise ValueError(f"n_problems={n_problems}; the embedded world needs at least 1 problem")
        return [p.to_json() for p in task.generate_problems(n_problems, seed)]
    path = Path(task_file)
    records = []
    line_numbers = _record_lines(path)
    for rec, line in zip(task.read_jsonl(path), line_numbers):
        records.append({**rec, "line": line})
        if n_problems and len(records) >= n_problems:
            break
    if not records:
        raise ValueError(f"task file {path} holds no problems; expected JSONL lines {{\"problem\", \"trace\", \"answer\"}}")
    return records


def _record_lines(path: Path) -> list[int]:
    """Line numbers of the non-blank lines (the records ``read_jsonl`` yields, in order)."""
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    with open(path) as f:
        return [i for i, line in enumerate(f, 1) if line.strip()]


def prompt_ids(tokenizer, problem: str) -> list[int]:
    """Token ids of a problem's prompt; the tokenizer's chat template is used when it has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": problem}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(problem + task.STEP_DELIMITER)["input_ids"])


def make_prefixes(
    records: Sequence[dict],
    tokenizer,
    delimiters: Sequence[str] = DEFAULT_DELIMITERS,
    source: str = "reference",
    draft_tokenizer=None,
) -> list[Prefix]:
    """Cut every trace at each step delimiter.

    Args:
        records: problems from :func:`load_problems`; with ``source="target"`` their ``trace``
            must already hold the target's generation (see :func:`target_traces`).
        tokenizer: the target's tokenizer.
        delimiters: step delimiters.
        source: where traces come from, only used in messages.
        draft_tokenizer: the draft's tokenizer when it differs from the target's: each prefix then
            also holds its text in the draft's tokenization (``draft_token_ids``).

    Raises:
        ValueError: a record has no trace (named by file and line when read from a file) or the
            records give no prefix at all.
    """
    prefixes: list[Prefix] = []
    for pid, rec in enumerate(records):
        trace = rec.get("trace")
        if not isinstance(trace, str) or not trace.strip():
            where = f"line {rec['line']}" if "line" in rec else f"problem {pid}"
            raise ValueError(f"{where} has no {source} trace (a non-empty string 'trace' is needed to cut prefixes)")
        steps = split_steps(trace, delimiters)
        for k in range(len(steps)):
            text = "".join(steps[:k])
            ids = _ids(tokenizer, rec["problem"], text)
            dids = None if draft_tokenizer is None else _ids(draft_tokenizer, rec["problem"], text)
            prefixes.append(Prefix(pid, len(prefixes), k, text, ids, dids))
    if not prefixes:
        raise ValueError("the problems give no prefix; check the task file or n_problems")
    return prefixes


def _ids(tokenizer, problem: str, text: str) -> list[int]:
    """Prompt plus the written steps, in one model's tokenization."""
    return prompt_ids(tokenizer, problem) + (list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else [])


def target_traces(
    model, tokenizer, records: Sequence[dict], *, max_new_tokens: int, temperature: float, top_p: float, seed: int,
    batch_size: int = 64,
) -> list[dict]:
    """Replace each record's trace by one the target samples itself (``source="target"``)."""
    from generation.writer import generate

    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    out = []
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        new = generate(model, [prompt_ids(tokenizer, r["problem"]) for r in chunk], max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, generator=g, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id or 0)
        out += [{**r, "trace": tokenizer.decode(n, skip_special_tokens=True)} for r, n in zip(chunk, new)]
    return out
