"""The embedded arithmetic world: problem generator, paraphrase templates, semantic oracle, checker.

A problem is a chain of operations on a running value ("Start with 7. Add 5, then multiply it by
3. What is the result?"). Its reference trace writes one operation per step, steps separated by a
blank line, and ends with a checkable answer line (``Answer: 36``). Every step is phrased with one
of several paraphrase templates that mean exactly the same, so the world has an exact oracle for
the *meaning* of a step: ``meaning(step) -> (op, a, b, result)``.

The oracle audits labels and scores answers; the label pipeline never uses it.
"""

from __future__ import annotations

import operator
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

from datamodules.tasks.base import Task
from generation.specs import is_int

OPS = ("add", "sub", "mul")
_OPERATORS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}

# Paraphrase templates per operation; index i is "template i" in every distribution we report.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "{a} + {b} = {r}.",
        "Adding {b} to {a} gives {r}.",
        "{r} is what we get from {a} plus {b}.",
        "{a} plus {b} equals {r}.",
    ),
    "sub": (
        "{a} - {b} = {r}.",
        "Subtracting {b} from {a} gives {r}.",
        "{r} is what we get from {a} minus {b}.",
        "{a} minus {b} equals {r}.",
    ),
    "mul": (
        "{a} * {b} = {r}.",
        "Multiplying {a} by {b} gives {r}.",
        "{r} is what we get from {a} times {b}.",
        "{a} times {b} equals {r}.",
    ),
}
N_TEMPLATES = 4

# How the problem statement names each operation (first clause capitalised by the generator).
PROBLEM_OPS = {"add": "add {b}", "sub": "subtract {b}", "mul": "multiply it by {b}"}
PROBLEM_OPENERS = ("Start with {x}.", "Begin with {x}.", "Take {x}.")
PROBLEM_QUESTIONS = ("What is the result?", "What number do you get?", "What is the final value?")

ANSWER_MARKER = "Answer:"
STEP_DELIMITER = "\n\n"


class Meaning(NamedTuple):
    """Canonical meaning of one step: ``result = a <op> b``."""

    op: str
    a: int
    b: int
    result: int


def apply_op(op: str, a: int, b: int) -> int:
    """Return ``a <op> b`` for one of :data:`OPS`."""
    if op not in _OPERATORS:
        raise ValueError(f"unknown operation {op!r}; expected one of {OPS}")
    return _OPERATORS[op](a, b)


def render_step(m: Meaning, template: int) -> str:
    """Write the step ``m`` with paraphrase template ``template`` (0..3)."""
    return TEMPLATES[m.op][template].format(a=m.a, b=m.b, r=m.result)


def _template_regex(t: str) -> re.Pattern:
    pattern = re.escape(t)
    for name in ("a", "b", "r"):
        pattern = pattern.replace(re.escape("{" + name + "}"), rf"(?P<{name}>-?\d+)")
    return re.compile(r"\s*" + pattern + r"\s*")


_PARSERS = [(op, i, _template_regex(t)) for op, ts in TEMPLATES.items() for i, t in enumerate(ts)]


def parse_step(text: object) -> Optional[tuple[Meaning, int]]:
    """Return ``(meaning, template index)`` of a well-formed step, or None. Never raises."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(text, str) or len(text) > 200:
        return None
    for op, i, rx in _PARSERS:
        m = rx.fullmatch(text)
        if m is not None:
            return Meaning(op, int(m["a"]), int(m["b"]), int(m["r"])), i
    return None


def meaning(text: object) -> Optional[Meaning]:
    """The oracle: canonical meaning ``(op, a, b, result)`` of a step, or None if malformed.

    Two steps mean the same exactly when their meanings are equal; a step whose stated result is
    wrong still has a meaning (the one it states) and ``is_correct`` tells whether it holds.
    """
    parsed = parse_step(text)
    return None if parsed is None else parsed[0]


def is_correct(m: Optional[Meaning]) -> bool:
    """Whether a parsed meaning states a true equation."""
    return m is not None and m.op in OPS and apply_op(m.op, m.a, m.b) == m.result


_ANSWER_RX = re.compile(re.escape(ANSWER_MARKER) + r"\s*(-?\d+)")


def extract_answer(text: str) -> Optional[int]:
    """The integer after the last answer marker in ``text``, or None."""
    found = _ANSWER_RX.findall(text or "")
    return int(found[-1]) if found else None


def check_answer(text: str, answer: int) -> bool:
    """The world's answer checker: does ``text`` end its reasoning with the right answer?"""
    return extract_answer(text) == int(answer)


@dataclass
class TaskConfig:
    """Knobs of the problem generator. Every field is checked in ``__post_init__``."""

    min_ops: int = 2
    """Fewest operations per problem."""
    max_ops: int = 5
    """Most operations per problem (at most 6)."""
    start_range: tuple[int, int] = (1, 20)
    """Inclusive range of the starting value."""
    addsub_range: tuple[int, int] = (1, 9)
    """Inclusive range of operands for add and subtract."""
    mul_range: tuple[int, int] = (2, 3)
    """Inclusive range of multipliers."""
    result_range: tuple[int, int] = (0, 199)
    """Every intermediate result stays in this inclusive range."""
    ops: tuple[str, ...] = OPS
    """Operations the generator may use."""
    template_weights: dict[str, Sequence[float]] = field(
        default_factory=lambda: {op: (1.0,) * N_TEMPLATES for op in OPS}
    )
    """Per operation, the weight of each paraphrase template in reference traces."""

    def __post_init__(self) -> None:
        errors = self._type_errors()
        if not errors:  # the bounds are compared only once they are numbers
            errors = self._bound_errors()
            errors += self._reach_errors(others=bool(errors))
            errors += self._weight_errors()
        if errors:
            raise ValueError("invalid TaskConfig: " + "; ".join(errors))

    def _ops_known(self) -> bool:
        """Whether ``ops`` is a non-empty subset of :data:`OPS`."""
        return bool(self.ops) and all(op in OPS for op in self.ops)

    def _type_errors(self) -> list[str]:
        """Fields of the wrong type: the counts integers, the ranges pairs of integers, ``ops`` a list of names."""
        errors = [f"{name}={getattr(self, name)!r}: expected an integer" for name in ("min_ops", "max_ops")
                  if not is_int(getattr(self, name))]
        for name in ("start_range", "addsub_range", "mul_range", "result_range"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 2 or not all(
                    is_int(x) for x in value):
                errors.append(f"{name}={value!r}: expected a pair of integers [low, high]")
        if isinstance(self.ops, str) or not isinstance(self.ops, Sequence):
            errors.append(f"ops={self.ops!r}: expected a list from {OPS}")
        if not isinstance(self.template_weights, dict) or not all(
                isinstance(w, Sequence) and all(isinstance(x, (int, float)) for x in w)
                for w in self.template_weights.values()):
            errors.append(f"template_weights={self.template_weights!r}: expected {{operation: [weights]}}")
        return errors

    def _bound_errors(self) -> list[str]:
        """What is wrong with the operation counts, the ranges and ``ops`` taken one by one."""
        errors = []
        if not 1 <= self.min_ops <= self.max_ops <= 6:
            errors.append(f"min_ops={self.min_ops}, max_ops={self.max_ops}: need 1 <= min_ops <= max_ops <= 6")
        for name in ("start_range", "addsub_range", "mul_range", "result_range"):
            lo, hi = getattr(self, name)
            if lo > hi:
                errors.append(f"{name}={getattr(self, name)}: low end above high end")
        if self.addsub_range[0] < 1:
            errors.append(f"addsub_range={self.addsub_range}: operands must be >= 1")
        if self.mul_range[0] < 2:
            errors.append(f"mul_range={self.mul_range}: multipliers must be >= 2")
        if not self._ops_known():
            errors.append(f"ops={self.ops}: expected a non-empty subset of {OPS}")
        return errors

    def _reach_errors(self, others: bool) -> list[str]:
        """Whether result_range can be reached from start_range (by one operation; by min_ops of them, checked
        only when nothing else is wrong, given as ``others``)."""
        lo, hi = self.result_range
        if not (set(range(self.start_range[0], self.start_range[1] + 1)) & set(range(lo, hi + 1))):
            return [f"result_range={self.result_range}: no start value in start_range={self.start_range} lies in it"]
        if self._ops_known() and not self._some_op_fits():
            return [f"result_range={self.result_range}: no operation in {self.ops} keeps a value from "
                    f"start_range={self.start_range} inside it"]
        if self._ops_known() and not others and not self._chain_fits():
            return [f"result_range={self.result_range}: no chain of min_ops={self.min_ops} operations from "
                    f"{self.ops} keeps a value from start_range={self.start_range} inside it"]
        return []

    def _weight_errors(self) -> list[str]:
        """What is wrong with ``template_weights``: bad weights, or an operation of ``ops`` without any."""
        errors = [f"template_weights[{op!r}]={tuple(w)}: need {N_TEMPLATES} non-negative weights, not all zero"
                  for op, w in self.template_weights.items()
                  if op not in OPS or len(w) != N_TEMPLATES or min(w) < 0 or sum(w) <= 0]
        missing = [op for op in self.ops if op in OPS and op not in self.template_weights]
        if missing:
            errors.append(f"template_weights lacks {missing}: give {N_TEMPLATES} weights for every operation "
                          f"in ops={self.ops}")
        return errors

    def _operands(self, op: str) -> range:
        r = self.mul_range if op == "mul" else self.addsub_range
        return range(r[0], r[1] + 1)

    def _some_op_fits(self) -> bool:
        lo, hi = self.result_range
        starts = range(max(lo, self.start_range[0]), min(hi, self.start_range[1]) + 1)
        return any(lo <= apply_op(op, x, b) <= hi for x in starts for op in self.ops for b in self._operands(op))

    def _chain_fits(self) -> bool:
        # Values from which k more operations stay inside result_range, for k = 0 .. min_ops (dynamic
        # programming over the range). Wide ranges always admit chains, so they skip the check.
        lo, hi = self.result_range
        if hi - lo > 10_000:
            return True
        ok = set(range(lo, hi + 1))
        for _ in range(self.min_ops):
            ok = {x for x in range(lo, hi + 1)
                  if any(apply_op(op, x, b) in ok for op in self.ops for b in self._operands(op))}
        return any(x in ok for x in range(self.start_range[0], self.start_range[1] + 1))


def step_oracle(steps: Sequence[Meaning], answer: Any) -> Callable[[str, str], bool]:
    """``oracle(step, output_so_far)``: a step is right when its meaning is the next of a problem's ``steps`` after the
    output so far, or when it is the answer line with the right ``answer`` after every operation."""
    from generation.steps import split_steps

    def oracle(step: str, prefix: str) -> bool:
        done = sum(meaning(s.strip()) is not None for s in split_steps(prefix))
        m = meaning(step.strip())
        if m is None:
            return step.strip().startswith(ANSWER_MARKER) and check_answer(step, answer) and done == len(steps)
        return done < len(steps) and m == steps[done]

    return oracle


@dataclass
class Problem:
    """One problem with its reference trace; ``to_json`` gives the JSONL shape real data has."""

    problem: str
    trace: str
    answer: int
    steps: list[Meaning]

    def to_json(self) -> dict:
        return {"problem": self.problem, "trace": self.trace, "answer": self.answer}


def _sample_chain(rng: random.Random, cfg: TaskConfig) -> list[Meaning]:
    lo, hi = cfg.result_range
    for _ in range(1000):
        n = rng.randint(cfg.min_ops, cfg.max_ops)
        x = rng.randint(max(lo, cfg.start_range[0]), min(hi, cfg.start_range[1]))
        chain: list[Meaning] = []
        while len(chain) < n:
            choices = [(op, b) for op in cfg.ops for b in cfg._operands(op) if lo <= apply_op(op, x, b) <= hi]
            if not choices:
                break
            op = rng.choice([op for op in cfg.ops if any(o == op for o, _ in choices)])
            b = rng.choice([bb for o, bb in choices if o == op])
            r = apply_op(op, x, b)
            chain.append(Meaning(op, x, b, r))
            x = r
        if len(chain) == n:
            return chain
    raise ValueError(f"result_range={cfg.result_range}: could not build a chain of {cfg.min_ops}+ "
                     f"operations in 1000 tries")


def problem_text(start: int, chain: Sequence[Meaning], rng: random.Random) -> str:
    """The problem statement for a chain, with a randomly chosen opener and question."""
    clauses = [PROBLEM_OPS[m.op].format(b=m.b) for m in chain]
    clauses[0] = clauses[0][0].upper() + clauses[0][1:]
    body = ", then ".join(clauses) + "."
    return f"{rng.choice(PROBLEM_OPENERS).format(x=start)} {body} {rng.choice(PROBLEM_QUESTIONS)}"


def answer_line(answer: int) -> str:
    return f"{ANSWER_MARKER} {answer}"


def make_problem(rng: random.Random, cfg: TaskConfig) -> Problem:
    """Draw one problem and its reference trace from ``rng``."""
    chain = _sample_chain(rng, cfg)
    text = problem_text(chain[0].a, chain, rng)
    steps = [render_step(m, rng.choices(range(N_TEMPLATES), weights=cfg.template_weights[m.op])[0]) for m in chain]
    answer = chain[-1].result
    trace = STEP_DELIMITER.join(steps + [answer_line(answer)])
    return Problem(text, trace, answer, chain)


def generate_problems(n: int, seed: int, cfg: Optional[TaskConfig] = None) -> list[Problem]:
    """``n`` problems, deterministic in ``seed`` and ``cfg``."""
    cfg = cfg or TaskConfig()
    rng = random.Random(seed)
    return [make_problem(rng, cfg) for _ in range(n)]


class ArithmeticTask(Task):
    """The embedded arithmetic world: generated problems with reference traces, ``Answer: <int>``.

    Args:
        path: JSONL of world problems; None (default) generates them.
        min_ops: fewest operations per generated problem.
        max_ops: most operations per generated problem.
    """

    answer_marker = ANSWER_MARKER
    prompt_suffix = STEP_DELIMITER

    def __init__(self, path: str | None = None, min_ops: int = 2, max_ops: int = 5) -> None:
        super().__init__(path)
        self.min_ops, self.max_ops = min_ops, max_ops
        self.config = TaskConfig(min_ops=min_ops, max_ops=max_ops)  # checked now, not at the first problem

    def generate(self, n: int, seed: int) -> list[dict]:
        return [p.to_json() for p in generate_problems(n, seed, self.config)]

    def errors(self, n: int) -> list[str]:
        return [f"n_problems={n}: the embedded world needs >= 1 problem"] if self.path is None and n < 1 else []

    def provenance(self, n: int, seed: int) -> dict[str, Any]:
        if self.path or (self.min_ops, self.max_ops) != (2, 5):
            return super().provenance(n, seed)
        return {"source": "arithmetic", "n_problems": n, "task_seed": seed}  # as builds before tasks recorded it

    def extract(self, text: str) -> str | None:
        got = extract_answer(text)
        return None if got is None else str(got)

    def step_judge(self, problem: dict) -> Callable[[str, str], bool]:
        """The world's oracle (:func:`step_oracle`) for ``problem``, a record with its reference ``trace``."""
        from generation.steps import split_steps

        steps = [m for s in split_steps(problem["trace"]) if (m := meaning(s.strip())) is not None]
        return step_oracle(steps, problem["answer"])

    def check(self, text: str, answer: Any) -> bool:
        try:
            return check_answer(text, answer)  # the world's own checker, so labels and benchmarks stay as they were
        except (TypeError, ValueError):  # an answer that is no integer: nothing matches it
            return False
