"""Tests of the embedded arithmetic world: generator, oracle, tokenizer, and the shipped models."""

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from datamodules.tasks.base import read_records
from arithmetic_world import card, models, task
from arithmetic_world.tokenizer import JUDGE_TEMPLATE, MAX_NUMBER
from tests.conftest import tiny_llama

# A few meanings per operation, with edge numbers (0, the largest token, negative results, multi-digit).
MEANINGS = [
    task.Meaning("add", 7, 5, 12),
    task.Meaning("add", 0, 9, 9),
    task.Meaning("add", 190, 9, 199),
    task.Meaning("sub", 12, 5, 7),
    task.Meaning("sub", 3, 9, -6),
    task.Meaning("sub", 100, 1, 99),
    task.Meaning("mul", 7, 3, 21),
    task.Meaning("mul", 0, 2, 0),
    task.Meaning("mul", 66, 3, 198),
]
ALL_STEPS = [(m, i, task.render_step(m, i)) for m in MEANINGS for i in range(task.N_TEMPLATES)]
TEST_SEED = 4242  # not a training (0, 1) or evaluation (10_000) seed


# --- generator -------------------------------------------------------------------------------------


def test_generator_is_deterministic_by_seed():
    a = [p.to_json() for p in task.generate_problems(30, seed=7)]
    b = [p.to_json() for p in task.generate_problems(30, seed=7)]
    c = [p.to_json() for p in task.generate_problems(30, seed=8)]
    assert a == b
    assert a != c


def test_generated_traces_agree_with_the_oracle_and_the_knobs():
    cfg = task.TaskConfig(
        min_ops=3, max_ops=4, result_range=(0, 99), template_weights={op: (0, 0, 1, 0) for op in task.OPS}
    )
    for p in task.generate_problems(50, seed=TEST_SEED, cfg=cfg):
        *steps, answer = p.trace.split(task.STEP_DELIMITER)
        assert 3 <= len(steps) <= 4 and len(steps) == len(p.steps)
        for text, m in zip(steps, p.steps):
            parsed = task.parse_step(text)
            assert parsed == (m, 2)  # only template 2 has weight
            assert task.is_correct(m) and 0 <= m.result <= 99
        assert [m.a for m in p.steps[1:]] == [m.result for m in p.steps[:-1]]  # a chain on a running value
        assert task.extract_answer(answer) == p.answer == p.steps[-1].result
        assert task.check_answer(p.trace, p.answer) and not task.check_answer(p.trace, p.answer + 1)
        assert any(p.problem.startswith(o.format(x=p.steps[0].a)) for o in task.PROBLEM_OPENERS)


def test_jsonl_round_trip_and_bad_lines_name_file_and_line(tmp_path):
    problems = task.generate_problems(5, seed=TEST_SEED)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p.to_json()) + "\n" for p in problems))
    assert list(read_records(path)) == [p.to_json() for p in problems]
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:6"):
        list(read_records(path))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        list(read_records(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize(
    "knobs, named",
    [
        ({"result_range": (500, 600)}, "result_range"),  # no start value can lie in it
        ({"ops": ("mul",), "result_range": (0, 20), "min_ops": 6, "max_ops": 6}, "result_range"),  # no 6-chain fits
        ({"min_ops": 4, "max_ops": 3}, "min_ops"),
        ({"max_ops": 7}, "max_ops"),
        ({"addsub_range": (9, 1)}, "addsub_range"),
        ({"addsub_range": (0, 9)}, "addsub_range"),
        ({"mul_range": (1, 3)}, "mul_range"),
        ({"start_range": (30, 10)}, "start_range"),
        ({"ops": ("div",)}, "ops"),
        ({"ops": ()}, "ops"),
        ({"template_weights": {op: (0, 0, 0, 0) for op in task.OPS}}, "template_weights"),
        ({"template_weights": {op: (1, 1) for op in task.OPS}}, "template_weights"),
        ({"template_weights": {"add": (1, 1, 1, 1)}}, "template_weights"),  # sub and mul lack weights
        # of the wrong type: a TypeError naming no knob, or (2.0, True) accepted and failing at the first problem
        ({"min_ops": "2"}, r"min_ops='2': expected an integer"),
        ({"min_ops": 2.0}, r"min_ops=2.0: expected an integer"),
        ({"max_ops": True}, r"max_ops=True: expected an integer"),
        ({"start_range": 5}, r"start_range=5: expected a pair of integers"),
        ({"ops": 5}, r"ops=5: expected a list"),
        ({"template_weights": 3}, r"template_weights=3: expected"),
    ],
)
def test_impossible_generator_knobs_raise_naming_the_knob(knobs, named):
    with pytest.raises(ValueError, match=named):
        task.TaskConfig(**knobs)


# --- oracle ----------------------------------------------------------------------------------------


def test_oracle_parses_every_template_of_every_operation():
    assert {op for op, *_ in MEANINGS} == set(task.OPS)
    for m, i, text in ALL_STEPS:
        assert task.parse_step(text) == (m, i), text
        assert task.meaning(text) == m
        assert task.meaning(text + task.STEP_DELIMITER) == m  # a step keeps its delimiter
        assert task.meaning(text.encode()) == m
        assert task.is_correct(m)
    # Paraphrases of one meaning agree; a wrong result keeps its (stated) meaning but is not correct.
    wrong = task.Meaning("add", 7, 5, 13)
    assert len({task.meaning(task.render_step(wrong, i)) for i in range(task.N_TEMPLATES)}) == 1
    assert not task.is_correct(task.meaning(task.render_step(wrong, 2)))


def test_oracle_returns_none_on_truncated_and_malformed_text():
    for _, _, text in ALL_STEPS:
        for cut in range(len(text)):  # every proper prefix is truncated (all templates end with ".")
            assert task.meaning(text[:cut]) is None, text[:cut]
    malformed = [
        "",
        " ",
        "\n\n",
        "7 + = 12.",
        "seven plus five equals twelve.",
        "Adding 5 to 7 equals 12.",
        "7 + 5 = 12. 3 + 4 = 7.",
        "7 + 5 = 12.5.",
        "7 +5 = 12!",
        "Answer: 12",
        "12 is what we get from 7 plus.",
        "7 + 5 = " + "1" * 300 + ".",
    ]
    for text in malformed:
        assert task.meaning(text) is None, text
    for junk in (None, 12, 3.5, ["7 + 5 = 12."], b"\xff\xfe\x00", object()):
        assert task.meaning(junk) is None


def test_oracle_never_raises_on_random_bytes():
    rng = random.Random(TEST_SEED)
    for _ in range(500):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80)))
        assert task.meaning(raw) is None
        assert task.meaning(raw.decode("latin-1")) is None
        assert task.extract_answer(raw.decode("latin-1")) is None  # no answer marker in random bytes


# --- tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_round_trips_every_template(world_tokenizer):
    tok = world_tokenizer
    problem = task.generate_problems(1, seed=TEST_SEED)[0]
    texts = [text for _, _, text in ALL_STEPS]
    texts += [problem.problem + task.STEP_DELIMITER + problem.trace, task.answer_line(-6)]
    texts += [JUDGE_TEMPLATE.format(a=ALL_STEPS[0][2], b=ALL_STEPS[5][2]) + " yes"]
    texts += [task.STEP_DELIMITER.join(texts[:12])]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids, text
        assert tok.decode(ids) == text
        with_bos = tok(text)["input_ids"]
        assert with_bos == [tok.bos_token_id] + ids  # like Llama tokenizers, encoding adds <bos>
        assert tok.decode(with_bos, skip_special_tokens=True) == text
    assert tok(task.STEP_DELIMITER, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids("\n\n")]
    for n in range(MAX_NUMBER + 1):  # every number is one token, with or without a leading space
        assert len(tok(str(n), add_special_tokens=False)["input_ids"]) == 1
        assert len(tok(f" {n}", add_special_tokens=False)["input_ids"]) == 1
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2, 3)


# --- loader: bad input -----------------------------------------------------------------------------


def test_missing_model_folder_raises_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "target"))):
        models.load_model("target", root=tmp_path)
    with pytest.raises(ValueError, match="'oracle'.*target"):
        models.load_model("oracle", root=tmp_path)


def test_partial_model_folder_raises_naming_folder_and_missing_file(tmp_path):
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as err:
        models.load_model("draft", root=tmp_path)
    assert str(folder) in str(err.value) and "model.safetensors" in str(err.value)
    assert "config.json" not in str(err.value)  # only what is missing is named


# --- shipped models --------------------------------------------------------------------------------

def _floor(measured: float, n: int, z: float = 3.0) -> float:
    """``measured`` minus ``z`` standard errors of an accuracy over ``n`` items: a retrained model that is as
    good stays above it (a one-sided 3-sigma margin, about 1 in 700), a broken one falls below."""
    return measured - z * math.sqrt(measured * (1 - measured) / n)


# Measured by benchmarks/world.py (benchmarks/results/world.json, docs/benchmarks.md "World"): the target answers 0.965
# and
# the draft 0.455 of 200 held-out problems; the judge agrees with the oracle on 0.970 of 1,000 held-out pairs.
# The tests below score 40 problems and 200 pairs, so their floors are 3 standard errors at those sizes.
ACCURACY_FLOORS = {"target": _floor(0.965, 40), "draft": _floor(0.455, 40)}  # 0.878, 0.219
JUDGE_FLOOR = _floor(0.970, 200)  # 0.934; an always-"no" judge scores 0.555 on these pairs


def _shipped(role: str):
    folder = models.world_root() / role
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent: train it with `python -m arithmetic_world.train --which {role}`")
    return folder


@pytest.mark.parametrize("role", models.ROLES)
def test_shipped_model_loads_offline_with_the_world_tokenizer(role, world_tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    folder = _shipped(role)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(world_tokenizer)
    tok = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    assert tok.get_vocab() == world_tokenizer.get_vocab()
    text = task.generate_problems(1, seed=TEST_SEED)[0].problem
    assert tok(text)["input_ids"] == world_tokenizer(text)["input_ids"]  # same ids, <bos> included
    if folder.parent == models.DEFAULT_ROOT:  # shipped folders carry their card and training facts
        assert (folder / "README.md").is_file() and (folder / "training.json").is_file()
        assert json.loads((folder / "training.json").read_text())["which"] == role


def test_shipped_weights_stay_under_60_mb():
    root = models.world_root()
    if not root.is_dir() or not any((root / r).is_dir() for r in models.ROLES):
        pytest.skip(f"{root} holds no world models yet")
    total = sum(f.stat().st_size for f in root.rglob("*.safetensors"))
    assert total < 60e6, f"{root} weights take {total / 1e6:.1f} MB; the issue allows 60 MB"


@pytest.mark.integration
@pytest.mark.parametrize("role", ["target", "draft"])
def test_shipped_solver_stays_above_accuracy_floor(role):
    from arithmetic_world.train import eval_solver

    _shipped(role)
    model, tok = models.load_model(role), models.load_tokenizer(role=role)
    problems = task.generate_problems(40, seed=TEST_SEED, cfg=task.TaskConfig(min_ops=4, max_ops=4))
    accuracy = eval_solver(model, tok, problems, temperature=0.6, top_p=0.95, seed=0)
    assert accuracy >= ACCURACY_FLOORS[role], (
        f"{role} answered {accuracy:.2f} of 40 problems, floor {ACCURACY_FLOORS[role]}"
    )


@pytest.mark.integration
def test_shipped_judge_stays_above_accuracy_floor():
    from arithmetic_world.train import judge_pair, judge_yes_prob

    _shipped("judge")
    model, tok = models.load_model("judge"), models.load_tokenizer(role="judge")
    rng = random.Random(TEST_SEED)
    pairs = [judge_pair(rng)[:2] for _ in range(200)]
    truth = torch.tensor([task.meaning(a) == task.meaning(b) for a, b in pairs])  # labels from the oracle
    accuracy = float(((judge_yes_prob(model, tok, pairs) > 0.5) == truth).float().mean())
    assert accuracy >= JUDGE_FLOOR, (f"judge agreed with the oracle on {accuracy:.3f} of 200 pairs, "
                                     f"floor {JUDGE_FLOOR:.3f}")
    constant = max(truth.float().mean().item(), 1 - truth.float().mean().item())  # always "yes" or always "no"
    assert JUDGE_FLOOR > constant + 0.2, f"a constant judge ({constant:.3f}) would pass the floor"


@pytest.mark.parametrize("role", models.ROLES)
def test_shipped_model_card_is_what_the_card_command_writes_and_reproduces_its_training(role):
    folder = _shipped(role)
    facts = json.loads((folder / "training.json").read_text())
    command = card.train_command(role, facts)
    if "--init-from" not in command:  # the card's command builds the shipped shape (the target has 18 layers)
        assert facts["spec"]["layers"] == card.SPECS[role].layers or f"--layers {facts['spec']['layers']}" in command
    assert f"`{command}`" in (folder / "README.md").read_text()
    # the shipped cards had kept an older template's text; stale, they fail here: `python -m arithmetic_world.card`
    results = json.loads(card.RESULTS.read_text())
    assert (folder / "README.md").read_text() == card.card_text(role, folder, results)


# --- publishing and model cards -------------------------------------------------------------------


def _trained_folder(root, role, world_tokenizer, with_facts=True):
    folder = root / role
    tiny_llama(len(world_tokenizer)).save_pretrained(folder)
    world_tokenizer.save_pretrained(folder)
    if with_facts:
        history = [{"step": 100, "minutes": 1.5, "loss": 0.5, "accuracy": 0.42}]
        facts = {
            "which": role,
            "seed": 3,
            "parameters": 1234,
            "saved_at": history[-1],
            "history": history,
            "spec": {
                "layers": 2,
                "hidden": 32,
                "heads": 4,
                "steps": 100,
                "batch": 8,
                "lr": 1e-3,
                "max_minutes": 5,
                "style": [0.1, 0.2, 0.3, 0.4],
                "eval_every": 100,
                "stop_accuracy": None,
                "accuracy_band": [0.4, 0.7],
                "extra": {},
            },
        }
        (folder / "training.json").write_text(json.dumps(facts))
    return folder


def test_publish_copies_a_finished_model_with_the_current_tokenizer(tmp_path, world_tokenizer):
    _trained_folder(tmp_path / "train", "draft", world_tokenizer)
    dst = card.publish("draft", tmp_path / "train", tmp_path / "ship")
    assert {p.name for p in dst.iterdir()} >= {"config.json", "model.safetensors", "training.json", "tokenizer.json"}
    model, tok = models.load_model("draft", tmp_path / "ship"), models.load_tokenizer(tmp_path / "ship", role="draft")
    assert model.config.vocab_size == len(tok) and tok("7 + 5 = 12.")["input_ids"][0] == tok.bos_token_id
    _trained_folder(tmp_path / "train", "target", world_tokenizer, with_facts=False)
    with pytest.raises(FileNotFoundError, match="training.json"):  # training not finished: nothing is published
        card.publish("target", tmp_path / "train", tmp_path / "ship")
    assert not (tmp_path / "ship" / "target").exists()


def test_model_card_reports_training_facts_and_measured_numbers(tmp_path, world_tokenizer):
    folder = _trained_folder(tmp_path, "draft", world_tokenizer)
    solver = {
        "accuracy": 0.4321,
        "accuracy_ci95": [0.36, 0.5],
        "ms_per_token": 0.777,
        "prefill_ms": 1.0,
        "reference_step_share": 0.7,
        "timing_prompts": 4,
        "timing_new_tokens": 32,
        "example_trace": "7 + 5 = 12.",
    }
    shares = {
        "shares": [0.1, 0.2, 0.3, 0.4],
        "by_op": {op: [0.25] * 4 for op in task.OPS},
        "steps": 10,
        "malformed_share": 0.0,
        "correct_step_share": 0.9,
    }
    results = {
        "n_problems": 200,
        "problem_seed": 20000,
        "temperature": 0.6,
        "top_p": 0.95,
        "torch_threads": 1,
        "target": {**solver, "accuracy": 0.9654, "ms_per_token": 3.1},
        "draft": solver,
        "cost_ratio": 0.2506,
        "template_distribution": {"target": shares, "draft": shares, "style_distance": 0.5},
        "judge_accuracy": 0.9876,
        "judge_pairs": 1000,
        "judge_seed": 20001,
        "judge_confusion": {"true_yes": 1, "false_yes": 2, "true_no": 3, "false_no": 4},
        "goals": {"cost_ratio <= 0.2": False, "target_accuracy >= 0.95": True},
    }
    text = card.write_card("draft", tmp_path, results).read_text()
    for expected in (
        "0.432",
        "0.777",
        "0.251",
        "0.988",
        "0.10 / 0.20 / 0.30 / 0.40",
        "step 100",
        "1.5 minutes",
        "seed 3",
        "--which draft",
        "missed: cost_ratio <= 0.2",
    ):
        assert expected in text, expected
    front = ModelCard.load(tmp_path / "draft" / "README.md").data  # Hub metadata: the model's own accuracy
    assert front.library_name == "transformers" and front.pipeline_tag == "text-generation"
    assert [(e.metric_type, e.metric_value) for e in front.eval_results] == [("accuracy", 0.4321)]
    assert "Not measured yet" in card.card_text("draft", folder, None)
    assert ModelCard(card.card_text("draft", folder, None)).data.eval_results is None


@pytest.mark.parametrize("args, says", [
    (["--which", "draft"], "the following arguments are required: out"),  # it trained over checkpoints/arithmetic
    (["--steps", "0"], "--steps 0: expected an integer >= 1"), (["--threads", "0"], "--threads 0: expected an integer"),
    (["--lr", "-1"], "--lr -1.0: expected a number > 0"), (["--init-from", "/nonexistent"], "--init-from /nonexistent"),
    # failed at the first save, after minutes of training, in a traceback
    (["--which", "draft", "--out", f"{__file__}/w"], f"--out {__file__}/w: no folder can be made in {__file__}"),
    # the judge trained with the saved model's layers, without a word
    (["--layers", "3", "--init-from", str(Path(__file__).parents[2] / "checkpoints" / "arithmetic" / "target")],
     "--layers 3 with --init-from"),
    (["--seed", str(10**20)], f"--seed {10**20}: expected an integer from 0 to 2**63 - 1"),  # an OverflowError
    # the draft became a copy of the target, without a word
    (["--which", "draft", "judge", "--out", "/tmp/never-written", "--init-from",
      str(Path(__file__).parents[2] / "checkpoints" / "arithmetic" / "target")], "with --which draft judge: it starts "
                                                                                 "one model"),
])
def test_train_refuses_bad_options_in_one_line_before_writing(capsys, tmp_path, args, says):
    from arithmetic_world.train import main

    out = [] if "--which" in args else ["--which", "draft", "--out", str(tmp_path / "w")]
    with pytest.raises(SystemExit) as e:
        main(args + out)  # each was a traceback, --steps -1 after writing a random model
    assert e.value.code == 2 and says in capsys.readouterr().err and not (tmp_path / "w").exists()


def test_card_and_gguf_refuse_a_missing_world_or_results_in_one_line(capsys, tmp_path):
    from arithmetic_world import gguf

    bad, empty = tmp_path / "bad.json", tmp_path / "empty.json"
    bad.write_text("{bad")
    empty.write_text("{}")  # valid JSON, not the benchmark's: it said "error: 'n_problems'"
    for main, args, says in ((card.main, ["--root", str(tmp_path / "none")], "world model folder"),
                             (card.main, ["--results", str(bad)], "not valid JSON"),
                             (card.main, ["--results", str(tmp_path / "missing.json")], "no such file"),
                             (card.main, ["--results", str(tmp_path)], "is a folder"),
                             (card.main, ["--results", str(empty)], "not the output of `python -m benchmarks.world`"),
                             (gguf.main, ["--cache_dir", str(bad)], f"--cache_dir {bad}: is a file"),
                             (gguf.main, ["--root", str(tmp_path / "none"), "--cache_dir", str(tmp_path / "g")],
                              "world model folder")):
        with pytest.raises(SystemExit) as e:
            main(args)  # tracebacks, and a --results that is not there was silently left out
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_the_worlds_models_missing_are_named_with_where_they_ship(monkeypatch, tmp_path):
    """A world folder that does not exist (a wheel, whose site-packages holds no checkpoints/) is named, with where
    the models ship and the variable that points at them: a build's model paths, before a tokenizer is asked for it
    (which read an absolute path as a hub repo id, "Repo id must be in the form ...")."""
    from arithmetic_world.models import load_world
    from datamodules.labels.config import BuildConfig

    monkeypatch.setenv("SEMANTICSPEC_WORLD", str(tmp_path / "nowhere"))
    for call in (lambda: BuildConfig().model_path("target"), load_world):
        with pytest.raises(FileNotFoundError, match="nowhere does not exist: the embedded world's models ship in a "
                                                    "clone .*; set SEMANTICSPEC_WORLD to a folder"):
            call()


def test_a_damaged_world_model_is_named_not_a_safetensors_traceback(tmp_path):
    """A cut model.safetensors ended the endpoint (and every command loading the world) with a traceback and exit
    status 1; it is a ValueError naming the file, which the commands print as one line."""
    import shutil

    from arithmetic_world.models import load_model, world_root

    shutil.copytree(world_root() / "draft", tmp_path / "draft")
    weights = tmp_path / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"draft/model.safetensors is damaged \(.*header.*\); restore it"):
        load_model("draft", tmp_path)


def _world_copy(tmp_path: Path, roles=("draft",)) -> Path:
    """The shipped world's ``roles``, copied into ``tmp_path/world``."""
    import shutil

    for role in roles:
        shutil.copytree(Path(models.DEFAULT_ROOT) / role, tmp_path / "world" / role)
    return tmp_path / "world"


def test_the_card_names_a_models_damaged_json_and_what_results_lack(tmp_path, capsys):
    """A model's training.json that is not JSON was blamed on --results; results without a model's figures were
    "error: 'draft'"."""
    world = _world_copy(tmp_path)
    (world / "draft" / "training.json").write_text("{")
    with pytest.raises(SystemExit) as e:
        card.main(["--root", str(world), "--roles", "draft"])
    assert e.value.code == 2 and f"{world / 'draft' / 'training.json'}: not valid JSON" in capsys.readouterr().err
    results = json.loads(card.RESULTS.read_text())
    del results["draft"]
    (tmp_path / "r.json").write_text(json.dumps(results))
    with pytest.raises(SystemExit):
        card.main(["--root", str(world), "--roles", "draft", "--results", str(tmp_path / "r.json")])
    assert f"--results {tmp_path / 'r.json'}: not the output of" in capsys.readouterr().err


def test_gguf_of_a_cut_weights_file_or_without_the_gguf_package_is_one_line(tmp_path, capsys, monkeypatch):
    """A cut model.safetensors was a SafetensorError traceback, a missing gguf package a ModuleNotFoundError one."""
    import sys

    from arithmetic_world.gguf import main

    world = _world_copy(tmp_path)
    weights = world / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    args = ["--roles", "draft", "--root", str(world), "--cache_dir", str(tmp_path / "gguf")]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and "model.safetensors cannot be read" in capsys.readouterr().err
    weights.write_bytes((Path(models.DEFAULT_ROOT) / "draft" / "model.safetensors").read_bytes())
    config = json.loads((world / "draft" / "config.json").read_text())
    del config["rms_norm_eps"]  # transformers fills in a default; the export read it: a KeyError traceback
    (world / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and "config.json or tokenizer.json has no 'rms_norm_eps'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "gguf", None)  # an install without the [server] extra
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and "pip install" in capsys.readouterr().err


@pytest.mark.parametrize("init", ["probe", "cut"])
def test_training_refuses_an_init_from_that_is_no_world_model_before_training(tmp_path, capsys, monkeypatch, init):
    """A probe's export has a config.json too: transformers filled in a default 32-layer Llama and trained it; a cut
    weights file was a SafetensorError traceback."""
    import arithmetic_world.train as train

    if init == "probe":
        folder = Path(models.DEFAULT_ROOT).parent / "arithmetic" / "probes" / "target"
    else:
        folder = _world_copy(tmp_path) / "draft"
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    monkeypatch.setattr(train, "train", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(SystemExit) as e:
        train.main(["--which", "draft", "--out", str(tmp_path / "out"), "--init-from", str(folder)])
    assert e.value.code == 2 and f"--init-from {folder}: " in capsys.readouterr().err


def test_a_card_states_figures_measured_on_its_weights_wherever_they_lie_and_not_another_models(tmp_path, capsys):
    """The figures of ``benchmarks/results/world.json`` are stated on a card whose models have the weights they were
    measured on (a copy of the shipped world too), not on a model retrained in place; results that record no weights
    are matched by the folder they were measured in, so another world's cards did not state the shipped figures."""
    world = _world_copy(tmp_path, roles=("target", "draft"))
    results = json.loads(card.RESULTS.read_text())
    card.main(["--root", str(world), "--roles", "draft"])
    assert f"{results['draft']['accuracy']:.3f}" in (world / "draft" / "README.md").read_text()
    weights = world / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")  # retrained in place: other weights, same folder
    card.main(["--root", str(world), "--roles", "draft"])
    text = (world / "draft" / "README.md").read_text()
    assert "Not measured yet" in text and f"{results['draft']['accuracy']:.3f}" not in text
    assert "measured other weights of the draft" in capsys.readouterr().err
    del results["weights"]  # recorded before the weights were: by the folder
    (tmp_path / "r.json").write_text(json.dumps(results))
    card.main(["--root", str(world), "--roles", "draft", "--results", str(tmp_path / "r.json")])
    assert "measured the models in checkpoints/arithmetic" in capsys.readouterr().err


def test_publishing_checks_every_model_first_and_does_not_state_the_replaced_models_figures(tmp_path, capsys,
                                                                                           world_tokenizer):
    """A publish of target and draft where the draft had not finished replaced the target, then failed; a bad
    training.json was "error: 'spec'" after the copy; and the figures measured on the models a publish replaced
    were stated as the new models'."""
    from generation.paths import portable_paths

    world = _world_copy(tmp_path, roles=("target", "draft"))
    before = (world / "target" / "model.safetensors").read_bytes()
    _trained_folder(tmp_path / "train", "target", world_tokenizer)
    with pytest.raises(SystemExit) as e:
        card.main(["--root", str(world), "--publish", str(tmp_path / "train"), "--roles", "target", "draft"])
    assert e.value.code == 2 and "train/draft is missing" in capsys.readouterr().err
    assert (world / "target" / "model.safetensors").read_bytes() == before  # nothing published
    _trained_folder(tmp_path / "train", "draft", world_tokenizer)
    (tmp_path / "train" / "draft" / "training.json").write_text("{}")
    with pytest.raises(SystemExit):
        card.main(["--root", str(world), "--publish", str(tmp_path / "train"), "--roles", "target", "draft"])
    assert "training.json: no record of a training" in capsys.readouterr().err
    assert (world / "target" / "model.safetensors").read_bytes() == before
    results = {**json.loads(card.RESULTS.read_text()), "root": portable_paths(str(world.resolve()))}
    (tmp_path / "r.json").write_text(json.dumps(results))  # measured on the models about to be replaced
    card.main(["--root", str(world), "--publish", str(tmp_path / "train"), "--roles", "target",
               "--results", str(tmp_path / "r.json")])
    assert "Not measured yet" in (world / "target" / "README.md").read_text()
    assert "measured other weights of the target" in capsys.readouterr().err
    del results["weights"]  # results that record no weights: by the folder they were measured in
    (tmp_path / "r.json").write_text(json.dumps(results))
    card.main(["--root", str(world), "--publish", str(tmp_path / "train"), "--roles", "target",
               "--results", str(tmp_path / "r.json")])
    assert f"measured the models in {results['root']}" in capsys.readouterr().err


@pytest.mark.slow  # 3 s on 2 cores (a model trained): in CI's slow set, out of the README's 5-minute command
def test_a_retrain_stopped_by_ctrl_c_leaves_no_record_of_the_run_before(tmp_path, capsys, monkeypatch):
    """New weights were left beside the previous run's training.json (which --publish then put on the card), and the
    stop was a KeyboardInterrupt traceback."""
    import arithmetic_world.train as train

    stale = tmp_path / "draft" / "training.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"spec": {"steps": 2}}))
    saved = train.save

    def save_then_stop(*args):
        saved(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "save", save_then_stop)
    with pytest.raises(SystemExit) as e:
        train.main(["--which", "draft", "--out", str(tmp_path), "--steps", "1", "--layers", "1"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert e.value.code == 130 and last.startswith("python -m arithmetic_world.train: interrupted while training the "
                                                   "draft") and "Traceback" not in last
    assert (tmp_path / "draft" / "model.safetensors").is_file() and not stale.exists()
