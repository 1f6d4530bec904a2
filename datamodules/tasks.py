"""Tasks: where problems come from, how they are prompted, where a step ends and how answers are checked.

A :class:`Task` is what the label build, the live callback, the benchmarks and the decoder examples
take. Built-ins:

- :class:`ArithmeticTask`: the embedded world (:mod:`datamodules.arithmetic.task`), unchanged;
- :class:`BoxedMathTask`: a JSONL file whose answers are written ``\\boxed{...}`` and compared as
  math (numbers, fractions, simple expressions, with sympy);
- :class:`MultipleChoiceTask`: a JSONL file whose answers are letters (GPQA style).

A user's own task subclasses :class:`Task` (overriding :meth:`~Task.extract` and
:meth:`~Task.equal`, or :meth:`~Task.generate`) and plugs in by import path in YAML::

    build:
      task:
        class_path: my_package.MyTask
        init_args: {path: data/problems.jsonl}

Problems are records ``{"problem": str, "answer": ..., "trace"?: str, "line"?: int}`` (the JSONL
shape; ``line`` names the file line a record came from).
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

from datamodules.arithmetic import task as world
from generation.steps import DEFAULT_DELIMITERS


class Task:
    """Problems read from a JSONL file, answers after :attr:`answer_marker` compared as strings.

    Subclasses override :meth:`generate` (problems made in code), :meth:`extract` and :meth:`equal`
    (the checker), or the class attributes below. Keep every ``__init__`` argument as an attribute of
    the same name: the manifest records them (:meth:`spec`).

    Args:
        path: JSONL of ``{"problem", "answer", "trace"?}`` lines; None = :meth:`generate` them.
    """

    answer_marker: str = "Answer:"
    """Where the final answer starts; the decoder stops once a line starting with it is complete."""
    delimiters: tuple[str, ...] = tuple(DEFAULT_DELIMITERS)
    """Step delimiters of the task's traces (a build's ``steps.delimiters`` default to them)."""
    prompt_suffix: str = "\n\n"
    """Written after the problem when the tokenizer has no chat template (the first step starts after it)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path

    # ------------------------------------------------------------------ problems

    def problems(self, n: int = 0, seed: int = 0) -> list[dict]:
        """The task's problems: the file's first ``n`` records (0 = all), or ``n`` generated from ``seed``.

        Raises:
            ValueError: a malformed line (named ``file:line``), an empty file, or a bad ``n``.
            FileNotFoundError: ``path`` does not exist.
        """
        if self.path is None:
            errors = self.errors(n)
            if errors:
                raise ValueError("; ".join(errors))
            return self.generate(n, seed)
        records = []
        for rec in read_jsonl(self.path):
            records.append(rec)
            if n and len(records) >= n:
                break
        if not records:
            raise ValueError(f"task file {self.path} holds no problems; "
                             "expected JSONL lines {\"problem\", \"trace\", \"answer\"}")
        return records

    def generate(self, n: int, seed: int) -> list[dict]:
        """``n`` problems made in code, deterministic in ``seed`` (tasks without a file override it)."""
        raise NotImplementedError(f"{type(self).__name__} makes no problems in code; give it a path")

    def errors(self, n: int) -> list[str]:
        """What is wrong with asking this task for ``n`` problems (checked when a build config is made)."""
        if self.path is None and type(self).generate is Task.generate:
            return [f"task={self.spec()['class_path']}: path=None, but this task makes no problems in code; "
                    "give init_args.path (a JSONL file)"]
        return []

    def provenance(self, n: int, seed: int) -> dict[str, Any]:
        """Where a build's problems came from (the manifest's ``problems`` entry)."""
        out: dict[str, Any] = {"source": "file" if self.path else "generated", "task": self.spec()}
        if self.path:
            from datamodules.shards import sha256_file

            out.update(task_file=str(self.path), sha256=sha256_file(self.path) if Path(self.path).is_file() else None)
        return {**out, "n_problems": n} if self.path else {**out, "n_problems": n, "task_seed": seed}

    def spec(self) -> dict[str, Any]:
        """``{"class_path", "init_args"}``: how YAML names this task (arguments left at their default are omitted)."""
        cls = type(self)
        args = {}
        for name, p in inspect.signature(cls.__init__).parameters.items():
            if name != "self" and hasattr(self, name) and getattr(self, name) != p.default:
                args[name] = getattr(self, name)
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": args}

    # ------------------------------------------------------------------ prompt

    def prompt_text(self, tokenizer, problem: str) -> str:
        """The prompt as text: the tokenizer's chat template with the problem as the user turn when it
        has one, else ``problem + prompt_suffix``."""
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template([{"role": "user", "content": problem}], add_generation_prompt=True,
                                                 tokenize=False)
        return problem + self.prompt_suffix

    def prompt(self, tokenizer, problem: str) -> list[int]:
        """Token ids of a problem's prompt (``<bos>`` first when the tokenizer adds one; a chat
        template writes its own special tokens)."""
        chat = bool(getattr(tokenizer, "chat_template", None))
        return list(tokenizer(self.prompt_text(tokenizer, problem), add_special_tokens=not chat)["input_ids"])

    def decoder_prompt(self, tokenizer, problem: str, draft_tokenizer=None):
        """The prompt as ``SemanticSpecDecoder.generate`` takes it: text when there is no chat template and
        one tokenizer (the decoder adds BOS), else each model's own token ids (a ``(target, draft)`` pair
        when the draft has its own tokenizer)."""
        if draft_tokenizer is None or draft_tokenizer is tokenizer:
            if not getattr(tokenizer, "chat_template", None):
                return self.prompt_text(tokenizer, problem)
            return self.prompt(tokenizer, problem)
        return self.prompt(tokenizer, problem), self.prompt(draft_tokenizer, problem)

    # ------------------------------------------------------------------ answers

    def extract(self, text: str) -> str | None:
        """The final answer in ``text`` (here: the rest of the line after the last marker), or None."""
        k = (text or "").rfind(self.answer_marker)
        if k < 0:
            return None
        got = text[k + len(self.answer_marker):].strip().split("\n")[0].strip()
        return got or None

    def equal(self, got: str, answer: Any) -> bool:
        """Whether an extracted answer means ``answer`` (here: the same string, spaces aside)."""
        return got.strip() == str(answer).strip()

    def check(self, text: str, answer: Any) -> bool:
        """Whether ``text`` ends with the right answer; a missing or malformed answer is wrong, never an error."""
        try:
            got = self.extract(text)
            return got is not None and bool(self.equal(got, answer))
        except Exception:  # a checker must not stop a decode run; what cannot be read is not correct
            return False


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a task file with the line each came from, naming ``file:line`` of a bad one."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    return [{**rec, "line": line} for rec, line in zip(world.read_jsonl(path), _record_lines(Path(path)))]


def _record_lines(path: Path) -> list[int]:
    """Line numbers of the non-blank lines (the records ``world.read_jsonl`` yields, in order)."""
    with open(path) as f:
        return [i for i, line in enumerate(f, 1) if line.strip()]


class ArithmeticTask(Task):
    """The embedded arithmetic world: generated problems with reference traces, ``Answer: <int>``.

    Args:
        path: JSONL of world problems; None (default) generates them.
        min_ops: fewest operations per generated problem.
        max_ops: most operations per generated problem.
    """

    answer_marker = world.ANSWER_MARKER
    prompt_suffix = world.STEP_DELIMITER

    def __init__(self, path: str | None = None, min_ops: int = 2, max_ops: int = 5) -> None:
        super().__init__(path)
        self.min_ops, self.max_ops = min_ops, max_ops
        self.config = world.TaskConfig(min_ops=min_ops, max_ops=max_ops)  # checked now, not at the first problem

    def generate(self, n: int, seed: int) -> list[dict]:
        return [p.to_json() for p in world.generate_problems(n, seed, self.config)]

    def errors(self, n: int) -> list[str]:
        return [f"n_problems={n}: the embedded world needs >= 1 problem"] if self.path is None and n < 1 else []

    def provenance(self, n: int, seed: int) -> dict[str, Any]:
        if self.path or (self.min_ops, self.max_ops) != (2, 5):
            return super().provenance(n, seed)
        return {"source": "arithmetic", "n_problems": n, "task_seed": seed}  # as builds before tasks recorded it

    def extract(self, text: str) -> str | None:
        got = world.extract_answer(text)
        return None if got is None else str(got)

    def check(self, text: str, answer: Any) -> bool:
        try:
            return world.check_answer(text, answer)  # the world's own checker, so labels and benchmarks stay as they were
        except (TypeError, ValueError):  # an answer that is no integer: nothing matches it
            return False


class BoxedMathTask(Task):
    """Math problems from a JSONL file; the answer is the last ``\\boxed{...}``, compared as math.

    ``1/2``, ``0.5``, ``\\frac{1}{2}`` and ``\\dfrac{2}{4}`` are equal; so are ``2x+1`` and ``1+2x``
    (:func:`~datamodules.math_equal.math_equal`). A missing or unbalanced box is wrong, never an error.

    Args:
        path: JSONL of ``{"problem", "answer", "trace"?}`` lines (``answer`` with or without ``\\boxed``).
    """

    answer_marker = "\\boxed"

    def __init__(self, path: str | None = None) -> None:
        super().__init__(path)

    def extract(self, text: str) -> str | None:
        return last_boxed(text)

    def equal(self, got: str, answer: Any) -> bool:
        from datamodules.math_equal import math_equal

        return math_equal(got, last_boxed(str(answer)) or str(answer))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    text = text or ""
    k = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if k < 0:
        return None
    start = text.index("{", k) + 1
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip() or None
    return None  # the box never closes


class MultipleChoiceTask(Task):
    """Multiple-choice problems (GPQA style) from a JSONL file; answers are letters.

    The answer is read from the last "Answer: (B)", "the answer is B", "answer: **C**" or ``\\boxed{D}``.

    Args:
        path: JSONL of ``{"problem", "answer", "trace"?}`` lines (``problem`` lists the choices).
        letters: the choice letters.
    """

    def __init__(self, path: str | None = None, letters: str = "ABCD") -> None:
        super().__init__(path)
        if not letters or not letters.isalpha() or not letters.isupper():
            raise ValueError(f"letters={letters!r}: expected upper-case letters, e.g. 'ABCD'")
        self.letters = letters
        self._rx = re.compile(r"(?i:answer)(?:\s+(?i:is))?\s*[:=]?\s*[(*\[\s]*([" + letters + r"])(?![A-Za-z])")

    def extract(self, text: str) -> str | None:
        found = self._rx.findall(text or "")
        if found:
            return found[-1]
        boxed = last_boxed(text)
        return boxed.strip("() ") if boxed and boxed.strip("() ") in self.letters else None

    def equal(self, got: str, answer: Any) -> bool:
        return got.upper() == str(answer).strip().strip("()").upper()

