"""Prefixes from task files and traces; sampling N steps per prefix from one shared prefill."""

import json

import pytest
import torch

from arithmetic_world import task
from datamodules.labels.prefixes import make_prefixes
from arithmetic_world.task import ArithmeticTask
from datamodules.tasks.base import Task
from generation.sampling import generate
from generation.steps import split_steps
from generation.specs import SamplingSpec
from tests.conftest import tiny_llama


def test_prefixes_cut_at_every_step(world_tokenizer):
    records = ArithmeticTask().problems(3, seed=5)
    prefixes = make_prefixes(records, world_tokenizer)
    n_steps = [len(split_steps(r["trace"])) for r in records]
    assert len(prefixes) == sum(n_steps)
    assert [p.prefix_id for p in prefixes] == list(range(len(prefixes)))
    for p in prefixes:
        rec = records[p.problem_id]
        steps = split_steps(rec["trace"])
        assert p.text == "".join(steps[: p.step_index])
        prompt = ArithmeticTask().prompt(world_tokenizer, rec["problem"])
        assert p.token_ids[: len(prompt)] == prompt and p.token_ids[0] == world_tokenizer.bos_token_id
        assert world_tokenizer.decode(p.token_ids[len(prompt) :]) == p.text


def test_prefixes_from_task_file(world_tokenizer, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(p.to_json()) + "\n" for p in task.generate_problems(4, seed=2)))
    records = Task(str(path)).problems(2)
    assert len(records) == 2 and records[0]["line"] == 1
    assert make_prefixes(records, world_tokenizer)


def test_malformed_task_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps(task.generate_problems(1, seed=0)[0].to_json())
    path.write_text(good + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        Task(str(path)).problems()


def test_empty_task_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl holds no problems"):
        Task(str(path)).problems()
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        Task(str(tmp_path / "missing.jsonl")).problems()


def test_record_without_trace_names_its_line(world_tokenizer, tmp_path):
    path = tmp_path / "notrace.jsonl"
    path.write_text(json.dumps({"problem": "Take 3. Add 1. What is the result?", "answer": 4}) + "\n")
    with pytest.raises(ValueError, match="line 1 has no reference trace"):
        make_prefixes(Task(str(path)).problems(), world_tokenizer)


def test_chat_template_is_applied_when_present(world_tokenizer):
    import copy

    tok = copy.deepcopy(world_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ bos_token }}Step {{ m['content'] }}{% endfor %}"
    ids = Task().prompt(tok, "Take 3.")
    assert ids != Task().prompt(world_tokenizer, "Take 3.")
    assert tok.decode(ids).startswith("<bos>Step Take 3.")
    rendered = tok.apply_chat_template([{"role": "user", "content": "Take 3."}], add_generation_prompt=True,
                                       tokenize=True)
    # exactly what the template gives
    assert ids == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def test_num_samples_shares_one_prefill(world_tokenizer):
    model = tiny_llama(len(world_tokenizer))
    prompts = [world_tokenizer("Take 3.\n\n")["input_ids"], world_tokenizer("Start with 12. Add 4.\n\n")["input_ids"]]
    shared = generate(model, prompts, max_new_tokens=5, sampling=SamplingSpec(0, 1.0), num_samples=3)
    repeated = generate(model, [p for p in prompts for _ in range(3)], max_new_tokens=5, sampling=SamplingSpec(0, 1.0))
    assert shared == repeated and len(shared) == 6
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a = generate(model, prompts, max_new_tokens=5, sampling=SamplingSpec(1.0, 1.0), generator=g1, num_samples=4)
    b = generate(model, prompts, max_new_tokens=5, sampling=SamplingSpec(1.0, 1.0), generator=g2, num_samples=4)
    assert a == b  # seeded and reproducible
    with pytest.raises(ValueError, match="num_samples=0"):
        generate(model, prompts, max_new_tokens=2, num_samples=0)
