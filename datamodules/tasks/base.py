"""Tasks: where problems come from, how they are prompted, where a step ends and how answers are checked.

A :class:`Task` is what the label build, the live callback, the benchmarks and the decoder examples
take. Built-ins:

- :class:`~arithmetic_world.task.ArithmeticTask`: the embedded world, which registers itself
  (:mod:`datamodules.tasks.worlds`);
- :class:`~datamodules.tasks.math.BoxedMathTask`: a JSONL file whose answers are written ``\\boxed{...}`` and compared
  as math by Hugging Face's Math-Verify (numbers, fractions, expressions, intervals, sets);
- :class:`~datamodules.tasks.choice.MultipleChoiceTask`: a JSONL file whose answers are letters (GPQA style).

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
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from generation.specs import is_int
from generation.steps import DEFAULT_DELIMITERS


class Task:
    """A task: its problems (a JSONL file, or made in code), their prompt and the checker of an answer.

    As it is, problems are read from a JSONL file and the text after :attr:`answer_marker` is compared with the answer
    as a string. Subclasses override :meth:`generate` (problems made in code), :meth:`extract` and :meth:`equal`
    (the checker), or the class attributes below. Keep every ``__init__`` argument as an attribute of
    the same name: the manifest records them (:meth:`spec`).

    Args:
        path: JSONL of ``{"problem", "answer", "trace"?}`` lines; None = :meth:`generate` them.
    """

    answer_marker: str = "Answer:"
    """Where the final answer starts; the decoder stops once a newline follows an occurrence of it."""
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
            ValueError: a malformed line (named ``file:line``), an empty file, or a bad ``n`` or ``seed``.
            FileNotFoundError: ``path`` does not exist.
        """
        if not is_int(n) or n < 0:
            raise ValueError(f"n={n!r}: expected a number of problems >= 0 (0: every problem of the file)")
        if not is_int(seed) or seed < 0:  # random.Random(-s) is random.Random(s): -1 gave seed 1's problems
            raise ValueError(f"seed={seed!r}: expected an integer >= 0 (the same seed gives the same problems)")
        n, seed = int(n), int(seed)  # random.Random takes no NumPy integer
        if self.path is None:
            errors = self.errors(n)
            if errors:
                raise ValueError("; ".join(errors))
            return self.generate(n, seed)
        records = list(read_records(self.path, with_line=True))[: n or None]  # every line checked, first n kept
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
            from generation.fingerprints import sha256_file

            out.update(task_file=str(self.path), sha256=sha256_file(self.path) if Path(self.path).is_file() else None)
        return {**out, "n_problems": n} if self.path else {**out, "n_problems": n, "task_seed": seed}

    def spec(self) -> dict[str, Any]:
        """``{"class_path", "init_args"}``: how YAML names this task (arguments left at their default are omitted)."""
        cls = type(self)
        args = {name: os.fspath(v) if isinstance(v := getattr(self, name), os.PathLike) else v  # JSON, YAML: text
                for name, p in inspect.signature(cls.__init__).parameters.items()
                if name != "self" and hasattr(self, name) and getattr(self, name) != p.default}
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": args}

    # ------------------------------------------------------------------ prompt

    def prompt_text(self, tokenizer, problem: str) -> str:
        """The prompt as text: the tokenizer's chat template with the problem as the user turn when it
        has one, else ``problem + prompt_suffix`` (also with no tokenizer: None). The decoders' ``prompts``
        format problems with it."""
        if not isinstance(problem, str):
            raise ValueError(f"problem={problem!r}: expected the problem's text")
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template([{"role": "user", "content": problem}], add_generation_prompt=True,
                                                 tokenize=False)
        return problem + self.prompt_suffix

    def prompt(self, tokenizer, problem: str) -> list[int]:
        """Token ids of a problem's prompt (``<bos>`` first when the tokenizer adds one; a chat
        template writes its own special tokens)."""
        chat = bool(getattr(tokenizer, "chat_template", None))
        return list(tokenizer(self.prompt_text(tokenizer, problem), add_special_tokens=not chat)["input_ids"])

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

    def step_judge(self, problem: dict) -> Callable[[str, str], bool] | None:
        """``judge(step, output so far)``: whether ``step`` is a right next step of ``problem``, or None (here) when
        the task cannot judge steps; ``python -m semanticspec.evaluate`` then reports no decision counts."""
        return None

    def check(self, text: str, answer: Any) -> bool:
        """Whether ``text`` ends with the right answer; a missing or malformed answer is wrong, never an error."""
        try:
            got = self.extract(text)
            return got is not None and bool(self.equal(got, answer))
        except Exception:  # a checker must not stop a decode run; what cannot be read is not correct
            return False


def read_records(path: str | Path, with_line: bool = False) -> Iterator[dict]:
    """``{"problem", "trace"?, "answer"}`` records of a JSONL file, naming the file and line of a bad one
    (``with_line``: each with the ``line`` it came from)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} {'is a folder' if path.is_dir() else 'does not exist'}")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark is read past
            except UnicodeDecodeError as e:
                source = "utf-16" if lineno == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "latin1"
                raise ValueError(f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 f"JSONL is UTF-8: convert the file, e.g. with iconv -f {source} -t utf-8") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("problem"), str) or "answer" not in rec:
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'problem' and an 'answer'")
            if not rec["problem"].strip():
                raise ValueError(f"{path}:{lineno}: 'problem' is blank: expected the problem's text")
            if (answer := rec["answer"]) is not None and not _is_answer(answer):
                raise ValueError(f"{path}:{lineno}: 'answer' is {answer!r}: expected a string or a finite number "
                                 "(null or \"\" where the problem has no answer to check)")
            yield {**rec, "line": lineno} if with_line else rec


def _is_answer(answer: Any) -> bool:
    """An answer a task can check: a string (blank: no answer), or a finite number."""
    if isinstance(answer, str):
        return True
    return isinstance(answer, (int, float)) and not isinstance(answer, bool) and abs(answer) < float("inf")
