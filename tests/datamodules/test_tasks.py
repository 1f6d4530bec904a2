"""Tasks: the built-ins' extractors and checkers, a user's task by class_path, the callback on any task."""

import json
import threading
import time

import pytest

from arithmetic_world import task as world
from arithmetic_world.task import ArithmeticTask
from datamodules.tasks.math import BoxedMathTask, last_boxed, math_equal
from datamodules.tasks.choice import MultipleChoiceTask
from datamodules.tasks.base import Task


class YesNoTask(Task):
    """A user's task: problems made in code, answers ``yes``/``no`` after ``Verdict:``."""

    answer_marker = "Verdict:"

    def __init__(self, path: str | None = None, n_words: int = 2) -> None:
        super().__init__(path)
        self.n_words = n_words

    def generate(self, n: int, seed: int) -> list[dict]:
        return [{"problem": f"Is {i + seed} even?", "answer": "yes" if (i + seed) % 2 == 0 else "no"} for i in range(n)]

    def equal(self, got: str, answer) -> bool:
        return got.lower().startswith(str(answer))


# ------------------------------------------------------------------ boxed math


@pytest.mark.parametrize("text, content", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{1} first, then \\boxed{2}", "2"),
    ("nested \\boxed{\\sqrt{\\frac{a}{b}}} end", "\\sqrt{\\frac{a}{b}}"),
    ("\\fbox{7}", "7"),
    ("unbalanced \\boxed{\\frac{1}{2}", None),
    ("empty \\boxed{}", None),
    ("no box at all", None),
    ("", None),
])
def test_last_boxed(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize("got, answer", [
    ("1/2", "0.5"), ("\\frac{1}{2}", "0.5"), ("\\dfrac{2}{4}", "1/2"), ("\\frac12", "\\frac{1}{2}"),
    ("2x+1", "1+2x"), ("x^2 + 2x + 1", "(x+1)^2"), ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2"), ("3", "3.0"),
    ("1,000", "1000"), ("x = 5", "5"), ("$\\left( 3 \\right)$", "3"), ("50\\%", "50"), ("2^{10}", "1024"),
    ("2 \\cdot 3", "6"), ("\\text{12}", "12"), ("(1,2)", "(1, 2)"),
    # read as values since Math-Verify compares them (the hand-written normaliser missed each)
    (".5", "0.5"), ("\\sqrt3", "\\sqrt{3}"), ("\\$5", "5"), ("5 \\text{ cm}", "5"), ("0.1+0.2", "0.3"),
    ("10^{100}", "10^{100}"), ("10\\,000", "10000"), ("12\\,345\\,678", "12345678"),  # thin spaces between groups
])
def test_math_equal_accepts_the_same_value_written_differently(got, answer):
    assert math_equal(got, answer) and math_equal(answer, got)


@pytest.mark.parametrize("got, answer", [
    ("1/3", "0.33"), ("2x+1", "2x+2"), ("\\pi", "3.14"), ("(1,2)", "(2,1)"), ("", ""), ("x", "y"),
    ("\\frac{1}{2", "0.5"), ("five", "5"), ("1,2", "12"),
])
def test_math_equal_refuses_different_or_unreadable_answers(got, answer):
    assert not math_equal(got, answer)


def test_model_output_is_never_evaluated_and_answers_too_costly_to_compute_are_compared_as_text(tmp_path):
    marker = tmp_path / "ran"
    evil = f"__import__('pathlib').Path('{marker}').touch()"
    t0 = time.perf_counter()
    assert not math_equal(evil, "1")
    for huge in ("9^9^9^9", "9^{9^{9}}", "(10^{10})^{10^{10}}", "2^{10000000000}", "10000000!", "(10^{10})!",
                 "(" * 500 + "1" + ")" * 500, "+".join(["1"] * 5001)):
        assert not math_equal(huge, "1")
        assert math_equal(huge, huge)  # as text
    assert not marker.exists() and time.perf_counter() - t0 < 5


SAME_IN_ANY_THREAD = {("\\frac{1}{2}", "0.5"): True, ("x^2y^2", "y^2x^2"): True, ("2^3 3^2", "72"): True,
                      ("(x^2)(y^3)", "x^2y^3"): True, ("10000000!", "1"): False, ("9^{9^{9}}", "9^{9^{9}}"): True}


def test_math_equal_gives_the_same_verdicts_in_a_worker_thread():
    # Math-Verify's timer (signal.alarm) fails outside the main thread; a worker thread compared without it, hung
    # on 10000000! and read x^2y^2 as a power tower. No timer is used now, in any thread.
    assert {c: math_equal(*c) for c in SAME_IN_ANY_THREAD} == SAME_IN_ANY_THREAD
    out = {}
    worker = threading.Thread(target=lambda: out.update({c: math_equal(*c) for c in SAME_IN_ANY_THREAD}))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and out == SAME_IN_ANY_THREAD


def test_math_equal_leaves_the_callers_alarm_alone():
    import signal

    signal.alarm(30)  # a caller's watchdog; Math-Verify's timer used to cancel it
    try:
        assert math_equal("\\frac{1}{2}", "0.5")
        assert signal.alarm(0) > 0
    finally:
        signal.alarm(0)


def test_boxed_task_checks_and_never_raises():
    t = BoxedMathTask()
    assert t.check("We get \\boxed{\\frac{1}{2}}.", "0.5")
    assert t.check("We get \\boxed{0.5}.", "\\boxed{1/2}")  # the answer may be boxed too
    assert not t.check("We get \\boxed{0.6}.", "0.5")
    for text in ("We get \\boxed{0.5", "no box: 0.5", "", None, "\\boxed{}", "\\boxed{{{}", "\\boxed{)(}"):
        assert t.check(text, "0.5") is False


# ------------------------------------------------------------------ multiple choice


@pytest.mark.parametrize("text, letter", [
    ("... so the Answer: (B)", "B"), ("Therefore the answer is C.", "C"), ("The correct answer is **D**.", "D"),
    ("answer: A", "A"), ("Answer: (A) ... on reflection the answer is (C)", "C"), ("\\boxed{B}", "B"),
    ("The answer is a fraction", None), ("I pick B", None), ("Answer: E", None), ("", None),
    ("the answer is B ... checking again, \\boxed{C}", "C"), ("\\boxed{B}, so the answer is (D)", "D"),
    ("\\boxed{AB}", None), ("\\boxed{ABCD}", None),  # a box of several letters is no one choice
    ("\\boxed{\\text{D}}", "D"), ("\\boxed{\\textbf{(D)}}", "D"), ("\\boxed{D.}", "D"), ("Answers: B", "B"),
    ("Answer - B", "B"), ("The answer is option B", "B"), ("the answer is choice (C)", "C"),
    ("the answer is optional", None),
])
def test_multiple_choice_reads_the_last_stated_letter(text, letter):
    assert MultipleChoiceTask().extract(text) == letter


def test_multiple_choice_reads_a_long_run_of_whitespace_in_linear_time():
    """A degenerate output ("answer" and 20,000 spaces) took over 20 s (the pattern backtracked in cubic time); an alarm
    10 s away fails the test instead of hanging it."""
    import signal

    def too_slow(*_):
        raise TimeoutError("extract backtracks on a long run of whitespace")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(10)
    try:
        assert MultipleChoiceTask().extract("answer" + " " * 20_000 + "x") is None
        assert MultipleChoiceTask().extract("answer" + "\n" * 20_000 + "(C)") == "C"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_multiple_choice_check_and_letters():
    t = MultipleChoiceTask()
    assert t.check("the answer is (B)", "B") and t.check("the answer is (B)", "(b)") and not t.check("Answer: A", "B")
    assert MultipleChoiceTask(letters="ABCDE").check("Answer: E", "E")
    with pytest.raises(ValueError, match="letters='abc'"):
        MultipleChoiceTask(letters="abc")


# ------------------------------------------------------------------ the arithmetic world, unchanged


def test_arithmetic_task_is_the_world():
    problems = world.generate_problems(300, seed=11)
    assert ArithmeticTask().problems(300, seed=11) == [p.to_json() for p in problems]
    four = world.generate_problems(20, 3, world.TaskConfig(min_ops=4, max_ops=4))
    assert ArithmeticTask(min_ops=4, max_ops=4).problems(20, 3) == [p.to_json() for p in four]
    t, other = ArithmeticTask(), problems[1:] + problems[:1]
    for p, q in zip(problems, other):
        wrong = p.trace.replace(f"Answer: {p.answer}", f"Answer: {p.answer + 1}")
        for text in (p.trace, wrong, p.trace.split("\n\n")[0], q.trace, p.trace + "\n\nAnswer: -3", ""):
            assert t.check(text, p.answer) == world.check_answer(text, p.answer)
    assert t.check(problems[0].trace, problems[0].answer) and t.answer_marker == world.ANSWER_MARKER
    assert t.check("Answer: 3", "3") and not t.check("Answer: 3", "three") and not t.check(None, 3)


def test_problems_take_numpy_counts_and_refuse_a_seed_that_is_no_integer():
    """``seed=None`` gave other problems each run, ``[1]`` a TypeError from ``random``; NumPy counts were refused."""
    import numpy as np

    task = ArithmeticTask()
    assert task.problems(np.int64(3), seed=np.int64(5)) == task.problems(3, seed=5)
    for seed in (None, 1.5, [1], "a", -1):  # random.Random(-1) is random.Random(1): the same problems
        with pytest.raises(ValueError, match=r"seed=.*: expected an integer"):
            task.problems(2, seed=seed)
    with pytest.raises(ValueError, match=r"problem=None: expected the problem's text"):
        task.prompt_text(None, None)


def test_arithmetic_prompt_is_the_worlds(world_tokenizer):
    p = world.generate_problems(1, seed=0)[0]
    assert ArithmeticTask().prompt(world_tokenizer, p.problem) == world_tokenizer(p.problem + "\n\n")["input_ids"]


def test_default_build_records_its_problems_as_before():
    from datamodules.labels.config import BuildConfig, config_record, problems_provenance

    config = BuildConfig()
    assert problems_provenance(config) == {"source": "arithmetic", "n_problems": 200, "task_seed": 1,
                                           "prefix_source": "reference"}
    assert config_record(config)["task"] == {"class_path": "arithmetic_world.task.ArithmeticTask",
                                             "init_args": {}}
    json.dumps(config_record(config))
    with pytest.raises(ValueError, match="n_problems=0: the embedded world needs >= 1 problem"):
        BuildConfig(n_problems=0)
    with pytest.raises(ValueError, match="makes no problems in code; give init_args.path"):
        BuildConfig(task=BoxedMathTask())


def test_build_steps_default_to_the_tasks_delimiters():
    from datamodules.labels.config import BuildConfig
    from generation.specs import StepSpec

    class LineTask(YesNoTask):
        delimiters = ("\n",)

    assert BuildConfig(task=LineTask()).steps.delimiters == ("\n",)
    assert BuildConfig(task=LineTask(), steps=StepSpec(delimiters=[";"])).steps.delimiters == (";",)  # explicit wins
    assert BuildConfig().steps.delimiters == tuple(ArithmeticTask.delimiters)


def test_file_task_provenance_names_task_file_and_checksum(tmp_path):
    from datamodules.labels.config import BuildConfig, problems_provenance

    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    rec = problems_provenance(BuildConfig(task=BoxedMathTask(str(path)), n_problems=0))
    assert rec["task"] == {"class_path": "datamodules.tasks.math.BoxedMathTask", "init_args": {"path": str(path)}}
    assert rec["task_file"] == str(path) and len(rec["sha256"]) == 64 and rec["source"] == "file"
    assert BoxedMathTask(str(path)).problems() == [{"problem": "1+1?", "answer": "2", "line": 1}]


def test_problem_without_answer_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps({"problem": "Pick one",
                                "answer": "A"}) + "\n" + json.dumps({"problem": "No answer"}) + "\n")
    with pytest.raises(ValueError, match=r"mc\.jsonl:2: expected an object with a string 'problem' and an 'answer'"):
        MultipleChoiceTask(str(path)).problems()


def test_a_file_in_another_encoding_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"  # it raised a UnicodeDecodeError that named neither the file nor the line
    path.write_bytes(json.dumps({"problem": "1+1?", "answer": "2"}).encode() + b"\n"
                     + '{"problem": "caf\u00e9 costs?", "answer": "3"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8 \(byte 0xe9 at column 17\)"):
        BoxedMathTask(str(path)).problems()


def test_task_files_refuse_answers_no_task_can_check_and_read_past_a_byte_order_mark(tmp_path):
    path = tmp_path / "t.jsonl"
    for answer in ([], {"x": 1}, True, float("nan")):  # each was scored wrong for every method without a word
        path.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n"
                        + json.dumps({"problem": "2+2?", "answer": answer}) + "\n")
        with pytest.raises(ValueError, match=r"t\.jsonl:2: 'answer' is .*: expected a string or a finite number"):
            BoxedMathTask(str(path)).problems()
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"problem": "1+1?", "answer": "2"}).encode() + b"\n")
    assert BoxedMathTask(str(path)).problems() == [{"problem": "1+1?", "answer": "2", "line": 1}]  # was refused
    with pytest.raises(FileNotFoundError, match=f"task file {tmp_path} is a folder"):
        BoxedMathTask(str(tmp_path)).problems()
    path.write_text(json.dumps({"problem": "  ", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:1: 'problem' is blank"):
        BoxedMathTask(str(path)).problems()
    path.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    for n in (-1, "2", 1.5):  # -1 dropped the last record
        with pytest.raises(ValueError, match=r"n=.*: expected a number of problems >= 0"):
            BoxedMathTask(str(path)).problems(n)


# ------------------------------------------------------------------ a user's task by class_path


def test_custom_task_by_class_path_in_the_fit_yaml(capsys, tmp_path):
    import yaml

    from probes.fit import main

    cfg = tmp_path / "fit.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"build": {"task": {"class_path": "tests.datamodules.test_tasks.YesNoTask",
                                                                "init_args": {"n_words": 3}}}}}))
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(cfg), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["build"]["task"] == {"class_path": "tests.datamodules.test_tasks.YesNoTask",
                                                "init_args": {"path": None, "n_words": 3}}


def test_task_that_cannot_be_imported_is_refused_naming_it(capsys, tmp_path):
    from probes.fit import main

    with pytest.raises(SystemExit) as exit_:
        main(["--data.build.task", "my_tasks.NoSuchTask", "--trainer.logger", "false",
              "--trainer.default_root_dir", str(tmp_path)])
    assert exit_.value.code == 2 and "my_tasks.NoSuchTask" in capsys.readouterr().err


def test_custom_task_reaches_the_build_from_yaml(capsys, tmp_path):
    """The build instantiates the YAML's task and reads its problems before loading any model."""
    from datamodules.labels.build import main

    cfg = tmp_path / "build.yaml"
    cfg.write_text("data_dir: " + str(tmp_path / "data") + "\nbuild:\n  n_problems: 3\n  task:\n"
                   "    class_path: tests.datamodules.test_tasks.YesNoTask\n")
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(cfg)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "problem 1 of tests.datamodules.test_tasks.YesNoTask (and 2 more problems: [2, 3]) has no 'trace'" in err
    assert not (tmp_path / "data").exists()


# ------------------------------------------------------------------ the live callback on any task


class _StubDecoder:
    """Stands in for SemanticSpecDecoder: records calls; target-only gets slower on every run."""

    calls: list[tuple[str, list[str]]] = []
    answer_marker = None

    def __init__(self, *args, task=None, **kwargs) -> None:
        type(self).answer_marker, self.task = task.answer_marker, task

    def prompts(self, problems):  # as the decoder's, with a tokenizer without a chat template
        return [self.task.prompt_text(None, p) for p in problems]

    def generate(self, prompts, method="semanticspec", **kwargs):
        from semanticspec.results import DecodeResult, DecodeStats

        self.calls.append((method, list(prompts)))
        n_ref = sum(m == "target_only" for m, _ in self.calls)
        wall = float(n_ref) if method == "target_only" else 0.5
        return [DecodeResult(f"... Verdict: {'yes' if int(p.split()[1]) % 2 == 0 else 'no'}",
                             stats=DecodeStats(wall_s=wall, output_tokens=4)) for p in prompts]


def test_callback_decodes_a_custom_task_in_batches_and_retimes_target_only(monkeypatch):
    import torch

    import semanticspec.decoder
    from callbacks.speculative_validation import SpeculativeValidation

    monkeypatch.setattr(semanticspec.decoder, "SemanticSpecDecoder", _StubDecoder)
    _StubDecoder.calls = []
    cb = SpeculativeValidation(task=YesNoTask(), max_problems=5, batch_size=2, seed=4)
    assert [a for _, a in cb.problems] == ["yes", "no", "yes", "no", "yes"]
    cb._tokenizer = cb._draft_tokenizer = object()  # no chat template: prompt = problem + blank line

    class Module:
        probes = torch.nn.ModuleDict({r: torch.nn.Linear(2, 1) for r in ("target", "draft")})

    first = cb.decode(Module())
    # an untimed warm-up on one problem, then every batch by both methods, their order rotating
    assert [(m, len(p)) for m, p in _StubDecoder.calls] == [
        ("target_only", 1), ("semanticspec", 1), ("target_only", 2), ("semanticspec", 2), ("semanticspec", 2),
        ("target_only", 2), ("target_only", 1), ("semanticspec", 1)]
    assert _StubDecoder.calls[2][1] == ["Is 4 even?\n\n", "Is 5 even?\n\n"] and _StubDecoder.answer_marker == "Verdict:"
    assert first["accuracy"] == 1.0 and first["accuracy_delta"] == 0.0 and first["problems"] == 5
    # target-only walls (2, 3, 4 s per prompt in its batch: the warm-up was the 1st call) over SemanticSpec's 5 x 0.5 s
    assert first["speedup"] == pytest.approx((2 * 2 + 2 * 3 + 1 * 4) / 2.5)
    second = cb.decode(Module())
    assert sum(m == "target_only" for m, _ in _StubDecoder.calls) == 8  # decoded again, not cached
    assert second["speedup"] == pytest.approx((2 * 6 + 2 * 7 + 1 * 8) / 2.5)


def test_the_callback_says_when_its_speedup_is_unreliable(monkeypatch):
    """A speedup timed under load, or while the machine's speed changed, is flagged and warned."""
    import math

    import torch

    import callbacks.speculative_validation as sv
    import semanticspec.decoder
    from semanticspec.results import DecodeResult, DecodeStats
    from semanticspec.timing import rotation, timing_noise, unreliable_because

    assert rotation(["a", "b", "c"], 4) == ["b", "c", "a"] and rotation(["a", "b"], 0) == ["a", "b"]
    assert timing_noise([1.0, 2.0, 3.0], [10, 20, 30]) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(timing_noise([1.0], [10]))  # one chunk says nothing
    assert timing_noise([1.0, 3.0], [10, 10]) == pytest.approx(2 ** 0.5 / 2)
    assert unreliable_because(float("nan"), float("nan")) == [] and unreliable_because(0.5, 0.05) == []
    assert [r.split()[0] for r in unreliable_because(2.0, 0.5)] == ["load", "target-only"]

    class Steady(_StubDecoder):
        per_forward = [0.01]

        def generate(self, prompts, method="semanticspec", **kwargs):
            speed = self.per_forward[len(self.calls) % len(self.per_forward)]
            wall = (0.5 if method == "semanticspec" else 1.0) * speed
            self.calls.append((method, list(prompts)))
            return [DecodeResult("Verdict: yes", stats=DecodeStats(wall_s=wall, output_tokens=4, target_passes=4))
                    for _ in prompts]

    class Module:
        probes = torch.nn.ModuleDict({r: torch.nn.Linear(2, 1) for r in ("target", "draft")})

    monkeypatch.setattr(semanticspec.decoder, "SemanticSpecDecoder", Steady)
    cb = sv.SpeculativeValidation(task=YesNoTask(), max_problems=6, batch_size=1)
    cb._tokenizer = cb._draft_tokenizer = object()
    monkeypatch.setattr(sv, "load_per_core", lambda: 0.4)
    quiet = cb.decode(Module())
    assert (quiet["speedup"], quiet["speedup_reliable"], quiet["load_per_core"]) == (2.0, 1.0, 0.4)
    assert quiet["timing_noise"] == pytest.approx(0.0, abs=1e-12)
    monkeypatch.setattr(sv, "load_per_core", lambda: 3.0)
    with pytest.warns(UserWarning, match=r"spec/speedup=2.00 is not reliable: load average 3.00 per core"):
        busy = cb.decode(Module())
    assert (busy["speedup_reliable"], busy["load_per_core"]) == (0.0, 3.0)
    monkeypatch.setattr(sv, "load_per_core", lambda: 0.4)
    Steady.per_forward = [0.01, 0.01, 0.03]  # the machine's speed changes under the run
    with pytest.warns(UserWarning, match=r"target-only seconds per forward varied by \d+% across problems"):
        assert cb.decode(Module())["speedup_reliable"] == 0.0


def test_callback_refuses_bad_task_arguments(tmp_path):
    from callbacks.speculative_validation import SpeculativeValidation

    with pytest.raises(ValueError, match="batch_size=0"):
        SpeculativeValidation(batch_size=0)
    with pytest.raises(ValueError, match="makes no problems in code"):
        SpeculativeValidation(task=BoxedMathTask())


def test_a_task_file_given_as_a_path_records_as_text_and_a_utf16_file_is_named_so(tmp_path, monkeypatch):
    from pathlib import Path

    from datamodules.tasks.worlds import default_world

    file = tmp_path / "problems.jsonl"
    file.write_text('{"problem": "Start with 1. Add 2. What is the result?", "answer": 3}\n')
    json.dumps(ArithmeticTask(Path(file)).provenance(1, 0))  # "PosixPath is not JSON serializable"
    file.write_bytes(file.read_text().encode("utf-16"))
    with pytest.raises(ValueError, match="not UTF-8 .*iconv -f utf-16 -t utf-8"):  # said latin1
        ArithmeticTask(str(file)).problems(1, 0)
    with pytest.raises(ValueError, match="letters=5: expected upper-case letters"):
        MultipleChoiceTask(letters=5)  # an AttributeError
    monkeypatch.setenv("SEMANTICSPEC_DEFAULT_WORLD", "")  # set but empty: "no world ''"
    assert default_world().name == "arithmetic"


def test_letters_in_latex_math_and_a_box_with_a_space_are_read():
    """``Answer: $B$``, ``Answer: \\(B\\)`` and ``\\boxed {2}`` (LaTeX allows the space) read as no answer."""
    task = MultipleChoiceTask()
    assert [task.extract(t) for t in ("Answer: $B$", r"Answer: \(C\)", r"so \boxed {D}")] == ["B", "C", "D"]
    assert last_boxed(r"x = \boxed {2}") == "2" and BoxedMathTask().check(r"so \boxed {2}.", "2")
