"""Served SemanticSpec against real llama-cpp-python servers; slow, run by ``.ci/run``.

The embedded world's target and draft are served from their f32 GGUFs with an f32 KV cache
(:func:`arithmetic_world.serve.world_server`, ports 8851/8852: ``configs/served.yaml``'s), and the real
pretrained pair (Gemma-3-270m target, SmolLM2-135M draft) from their PyPI GGUFs on 8853/8854. Servers
start once per module (the real pair only when its test runs) and are killed by pid at the end.
Without llama-cpp-python the module is skipped; under ``CI=1`` (``.ci/run`` installs it) that fails.
"""

import json
import re
import time
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch

from arithmetic_world.serve import LlamaServer, world_server
from semanticspec.results import summarize
from semanticspec.served import ServedDecoder
from tests.conftest import DRAFT, TARGET, gguf_or_skip, need_server
from semanticspec.policies import RandomPolicy

pytestmark = pytest.mark.slow
PORTS = {"target": 8851, "draft": 8852}
"""The world's servers, on ``configs/served.yaml``'s ports (its label build is run against them)."""
REAL_PORTS = {"target": 8853, "draft": 8854}
MARKER = SimpleNamespace(answer_marker="Answer:")  # a task: its answer marker ends every decode
TOPK_TOLERANCE = 5e-5
"""Served top-k statistics vs in-process ones, max |Δ| over every statistic of every step read (f32 weights and
KV cache on the server, float32 log-softmax in-process); measured 1.5e-5: see the test's docstring."""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The world's two servers, clients of both (LlamaCppEngine), its in-process models, tokenizer and task."""
    from arithmetic_world.models import load_model, load_tokenizer
    from arithmetic_world.task import ArithmeticTask
    from generation.engines import make_engine

    need_server()
    logs = tmp_path_factory.mktemp("world-servers")
    with world_server("target", PORTS["target"], log=logs / "target.log") as t, \
            world_server("draft", PORTS["draft"], log=logs / "draft.log") as d:
        engines = {r: make_engine("llama.cpp", s.url, r, api_key_env="") for r, s in (("target", t), ("draft", d))}
        yield {"servers": {"target": t, "draft": d}, "engines": engines, "tok": load_tokenizer(),
               "models": {r: load_model(r) for r in ("target", "draft")}, "task": ArithmeticTask(), "logs": logs}


def _prompts(world, n: int, seed: int) -> tuple[list[str], list[dict]]:
    problems = world["task"].problems(n, seed)
    return [world["task"].prompt_text(world["tok"], p["problem"]) for p in problems], problems


# --------------------------------------------------------------------------- 1. equivalence


def test_served_greedy_always_reject_equals_served_target_only(world):
    t0 = time.perf_counter()
    prompts, _ = _prompts(world, 8, 11)
    dec = ServedDecoder(world["engines"]["target"], world["engines"]["draft"], task=MARKER)
    kw = {"temperature": 0.0, "max_new_tokens": 96}
    spec = dec.generate(prompts, method="always_reject", **kw)
    ref = dec.generate(prompts, method="target_only", **kw)
    assert all(r.ok for r in spec + ref), [r.error for r in spec + ref if not r.ok]
    assert [r.text for r in spec] == [r.text for r in ref]
    assert all(r.text.strip() for r in ref)  # something was written, for every problem
    assert [r.stop_reason for r in spec] == [r.stop_reason for r in ref]
    assert [r.stats.output_tokens for r in spec] == [r.stats.output_tokens for r in ref]
    s = summarize(spec)
    assert s["draft_steps_proposed"] >= 8 and s["step_acceptance"] == 0
    assert all(r.stats.requests == 2 * r.stats.draft_steps_proposed for r in spec)  # draft write + target write
    assert all(r.stats.requests == 1 for r in ref)
    print(f"[timing] always_reject == target_only, 8 problems: {time.perf_counter() - t0:.1f} s")


def test_given_the_servers_context_a_row_near_its_end_stops_there_instead_of_failing(world):
    """llama-cpp-python states no context: a row near its end asked for a step past it, and the server's 400 ended
    the row with ``error`` (the whole-output baseline's truncated answer read as ``context``). Given ``n_ctx``, the
    client counts prompts with the server's own tokenizer and the decoder stops every method at the room."""
    from generation.engines import make_engine

    n_ctx = world["servers"]["target"].n_ctx
    engines = [make_engine("llama.cpp", world["servers"][r].url, r, api_key_env="", n_ctx=n_ctx)
               for r in ("target", "draft")]
    prompt = "Take 6. Add 3, then add 3. " * 22 + "Add 1, then add 1. What number do you get?\n\n"
    assert engines[0].prompt_tokens([prompt]) == [len(world["tok"](prompt).input_ids)]  # BOS included, as served
    kw = dict(temperature=0.0, max_new_tokens=200)
    (unknown,) = ServedDecoder(world["engines"]["target"], world["engines"]["draft"]).generate(
        [prompt], method="always_reject", **kw)
    assert unknown.stop_reason == "error" and "maximum context length" in unknown.error  # the context not given
    for method in ("always_reject", "always_accept", "target_only"):
        (known,) = ServedDecoder(*engines).generate([prompt], method=method, **kw)
        assert known.ok and known.stop_reason in ("context", "eos"), (method, known.error)


# --------------------------------------------------------------------------- 2. served vs in-process features


def _wrong(step: str) -> str:
    """The step with its last number off by one: a step the model finds unlikely (ranks past top-1)."""
    nums = list(re.finditer(r"\d+", step))
    if not nums:
        return step
    m = nums[-1]
    return step[: m.start()] + str(int(m.group()) + 1) + step[m.end() :]


def _world_steps(world, n_problems: int, seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Prefixes (prompt + the first j reference steps, BOS first) and after each the reference step j and a wrong
    copy."""
    tok, delim = world["tok"], "\n\n"
    prompts, problems = _prompts(world, n_problems, seed)
    prefixes, steps = [], []
    for prompt, p in zip(prompts, problems):
        ref = p["trace"].split(delim)
        for j in range(len(ref)):
            context = prompt + "".join(s + delim for s in ref[:j])
            ids = tok(context).input_ids
            options = [ref[j] + delim, _wrong(ref[j]) + delim]
            step_ids = [tok(context + s).input_ids[len(ids) :] for s in options]
            assert all(tok(context + s).input_ids[: len(ids)] == ids for s in options)  # steps start at a boundary
            prefixes.append(ids)
            steps.append(step_ids)
    return prefixes, steps


@pytest.mark.parametrize("role", ["target", "draft"])
def test_served_topk_features_equal_in_process_within_the_measured_tolerance(world, role):
    """``read_steps_served`` through a world server vs in-process ``read_steps`` on the same weights.

    Measured (llama-cpp-python 0.3.36, f32 GGUF and KV cache, 6 problems: 28 prefixes x 2 steps = 56 rows):
    max |Δ| over all ten statistics 1.53e-5 (target) and 1.00e-5 (draft), all in ``min_logprob``; the rank and
    membership statistics agree exactly; the lead measured 7.6e-6 on 18 steps. The tolerance
    :data:`TOPK_TOLERANCE` (5e-5) is ~3x the worst measured; with llama.cpp's default f16 KV cache log-probs
    alone differ by up to 5e-2 (tests/arithmetic_world/test_world_gguf.py).
    """
    from datamodules.labels.engine_reading import read_steps_served
    from datamodules.labels.reading import read_steps
    from generation.features import FeatureSpec
    from generation.specs import TOPK_STATS

    t0 = time.perf_counter()
    prefixes, steps = _world_steps(world, 6, 21)
    tok = world["tok"]
    served = read_steps_served(world["engines"][role], tok, prefixes, steps,
                               FeatureSpec(("topk_stats",), source="llama.cpp"))["topk_stats"]
    local = read_steps(world["models"][role], prefixes, steps, FeatureSpec(("topk_stats",)),
                       pad_token_id=tok.pad_token_id)["topk_stats"]
    rows = sum(len(s) for s in steps)
    assert served.shape == local.shape == (rows, len(TOPK_STATS)) and rows >= 40
    assert torch.isfinite(served).all() and torch.isfinite(local).all()
    diff = (served.float() - local.float()).abs()
    worst = {name: float(diff[:, i].max()) for i, name in enumerate(TOPK_STATS)}
    print(f"[measured] {role}: {rows} steps, max |served - in-process| {diff.max().item():.2e}; per statistic {worst}")
    assert diff.max().item() <= TOPK_TOLERANCE, worst
    # the comparison has teeth: the wrong copies leave the top-1 on some tokens, the right steps on fewer
    not_top1 = local[:, TOPK_STATS.index("not_top1_share")]
    assert not_top1[1::2].mean() > not_top1[0::2].mean()
    print(f"[timing] topk features {role}: {time.perf_counter() - t0:.1f} s")


# --------------------------------------------------------------------------- 3. engine-read labels -> probes -> served
# decode


def test_engine_read_label_build_trains_probes_that_decode_the_served_world(world, tmp_path, monkeypatch):
    """``configs/served.yaml`` reduced (10 problems, 3 samples, 3 epochs): the servers sample and read the labels,
    no target or draft weights load in this process, and the exported pair decodes the served world."""
    import llama_cpp
    import yaml
    from transformers import AutoModelForCausalLM

    import datamodules.labels.shard as shard_mod
    from generation.paths import REPO_ROOT
    from probes.fit import main

    t0 = time.perf_counter()
    cfg = yaml.safe_load((REPO_ROOT / "configs" / "served.yaml").read_text())
    assert cfg["data"]["build"]["sampling"]["openai"]["target"]["urls"] == [world["servers"]["target"].url]
    cfg["trainer"].update(max_epochs=3, default_root_dir=str(tmp_path / "runs"), enable_progress_bar=False)
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
    cfg["data"].update(data_dir=str(tmp_path / "data"), val_fraction=0.2, test_fraction=0.2)
    cfg["data"]["build"].update(n_problems=10, shard_size=8)
    cfg["data"]["build"]["sampling"]["n_samples"] = 3
    cfg["model"]["probe"]["hidden_dims"] = [32]
    cfg["export_dir"] = str(tmp_path / "export")
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump(cfg))

    def refuse(*args, **kwargs):
        raise AssertionError(f"an engine-read build loaded a model in-process: load_model{args}")

    monkeypatch.setattr(shard_mod, "load_model", refuse)  # (the build imports it from there when it needs it)
    loaded, original = [], AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda name, *a, **k: (loaded.append(str(name)), original(name, *a, **k))[1])
    result = main(["--config", str(path)])
    t_fit = time.perf_counter() - t0
    assert [p for p in loaded if p.rstrip("/").endswith(("/target", "/draft"))] == []  # only the judge loads
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    reader = manifest["reader"]
    assert reader["backend"] == "engine" and reader["engine"] == "llama.cpp" and reader["loaded"] == []
    assert reader["version"] == {r: f"llama-cpp-python {llama_cpp.__version__}" for r in ("target", "draft")}
    assert reader["urls"] == {r: world["servers"][r].url.removesuffix("/v1") for r in ("target", "draft")}
    assert manifest["build"]["reader"] == "engine" and manifest["build"]["source"] == "llama.cpp"
    assert manifest["build"]["feature_groups"] == ["topk_stats"] and manifest["roles"]["target"]["rows"] > 100

    prompts, _ = _prompts(world, 8, 99)  # problems the build did not see (task seed 1)
    dec = ServedDecoder(world["engines"]["target"], world["engines"]["draft"], result["export"]["target"],
                        result["export"]["draft"], task=MARKER)
    out = dec.generate(prompts, max_new_tokens=96, seed=3)
    assert all(r.ok for r in out), [r.error for r in out if not r.ok]
    s = summarize(out)
    assert s["draft_steps_accepted"] >= 1 and s["draft_steps_proposed"] > s["draft_steps_accepted"] - 1
    assert all(st.q is not None for r in out for st in r.steps if st.decision in ("accept", "reject"))
    print(f"[timing] build + fit {t_fit:.1f} s, decode {time.perf_counter() - t0 - t_fit:.1f} s; "
          f"step_acceptance {s['step_acceptance']:.2f}")


# --------------------------------------------------------------------------- 4. the real pair through two servers


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    """Gemma-3-270m (target: it adds BOS, so its server can read) and SmolLM2-135M (draft: no BOS, it only writes)."""
    from generation.engines import make_engine

    need_server()
    gguf_or_skip(TARGET), gguf_or_skip(DRAFT)
    logs = tmp_path_factory.mktemp("real-servers")
    with LlamaServer(f"pypi:{TARGET}", REAL_PORTS["target"], "gemma3", n_threads=1, log=logs / "target.log") as t, \
            LlamaServer(f"pypi:{DRAFT}", REAL_PORTS["draft"], "smollm2", n_threads=1, log=logs / "draft.log") as d:
        yield make_engine("llama.cpp", t.url, "gemma3", api_key_env=""), make_engine("llama.cpp", d.url, "smollm2",
                                                                                    api_key_env="")


REAL_PROMPTS = ["Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nLet's think "
                "step by step.\n\n",
                "Question: What is 12 times 5, minus 7?\nLet's think step by step.\n\n"]


def _untrained_topk_probe():
    from generation.specs import FeatureSpec
    from probes.config import ProbeConfig
    from probes.model import SemanticProbe

    torch.manual_seed(0)
    cfg = ProbeConfig(hidden_size=640, features=FeatureSpec(["topk_stats"], source="llama.cpp"), role="target")
    return SemanticProbe(cfg).eval()


def test_the_real_pair_decodes_through_two_servers(real_pair):
    import llama_cpp

    from semanticspec.policies import ProbePolicy

    t0 = time.perf_counter()
    target, draft = real_pair
    assert target.capabilities().prompt_logprobs and not draft.capabilities().prompt_logprobs  # SmolLM2: no BOS
    assert target.version == draft.version == f"llama-cpp-python {llama_cpp.__version__}"
    # llama-cpp-python builds each echoed position's top log-probs by sorting the whole vocabulary in Python (Gemma:
    # 262k entries), so a read costs seconds here: two prompts for the greedy pair, one for the rest, short budgets
    greedy = {"temperature": 0.0, "max_new_tokens": 32}
    dec = ServedDecoder(target, draft, concurrency=1)  # one slot per server: prompts in turn keep its prefix
    spec, ref = dec.generate(REAL_PROMPTS, method="always_reject", **greedy), dec.generate(REAL_PROMPTS,
                                                                                           method="target_only",
                                                                                           **greedy)
    assert all(r.ok for r in spec + ref), [r.error for r in spec + ref if not r.ok]
    assert all(r.text.strip() for r in spec + ref)
    assert all(r.stats.requests == 2 * r.stats.draft_steps_proposed > 0 for r in spec)
    # Not asserted: with Q4 GGUFs a step-by-step decode (prefix kept in the slot, a request a step) and one long write
    # compute the target's logits in different batches, and on a near-tie the greedy token differs (seen 2026-12:
    # 'Tom has 4 more apples' vs '3 more'); the world's f32 pair asserts the equality (first test above).
    if [r.text for r in spec] != [r.text for r in ref]:
        print(f"[real pair] greedy always_reject != target_only: {[r.text for r in spec]} vs {[r.text for r in ref]}")

    mixed = dec.generate(REAL_PROMPTS[:1], method=RandomPolicy(0.5), seed=1, **greedy)
    assert all(r.ok for r in mixed), [r.error for r in mixed if not r.ok]
    s = summarize(mixed)
    assert s["draft_steps_proposed"] >= 1 and all(r.stats.requests >= r.stats.draft_steps_proposed for r in mixed)

    probe = ServedDecoder(target, draft, _untrained_topk_probe(), policy=ProbePolicy(rule="threshold"), concurrency=1)
    out = probe.generate(REAL_PROMPTS[:1], seed=2, **greedy)
    assert all(r.ok for r in out), [r.error for r in out if not r.ok]
    scored = [st.q for r in out for st in r.steps if st.decision in ("accept", "reject")]
    assert scored and all(0 <= q <= 1 for q in scored)  # the target server's top-k fed the probe on every step
    assert all(r.stats.requests >= 2 * r.stats.draft_steps_proposed for r in out)
    print(f"[timing] real pair: {time.perf_counter() - t0:.1f} s; texts {[r.text[:60] for r in ref]}")



# --------------------------------------------------------------------------- the evaluation through the servers


def test_the_evaluation_runs_through_the_worlds_servers(world, tmp_path):
    """``python -m semanticspec.evaluate --target_url --draft_url``: the same evaluation through the two
    servers, with the served probe pair; every problem decoded by both methods, nothing failed."""
    from semanticspec.evaluate import main

    root = Path(__file__).resolve().parents[2]
    report = main(["--config", str(root / "configs" / "arithmetic.yaml"),
                   "--probes", str(root / "checkpoints" / "arithmetic" / "probes-topk"),
                   "--target_url", world["servers"]["target"].url, "--draft_url", world["servers"]["draft"].url,
                   "--n_problems", "3", "--thresholds", "[0.5]", "--write_threshold", "false", "--progress", "false",
                   "--out_dir", str(tmp_path)])
    assert report["settings"]["where"]["mode"] == "served" and not report["failed"]
    assert set(report["methods"]) == {"target_only", "semanticspec"} and report["n_evaluated"] == 3
    assert report["methods"]["semanticspec"]["step_acceptance"] > 0.5
