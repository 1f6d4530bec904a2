"""Engine clients (generation.engines): requests and answer mapping against fakes of SGLang and vLLM written from
their documented schemas, capability refusals, malformed answers, dead servers; a slow test against a real
llama-cpp-python server and a ``gpu`` test against real SGLang / vLLM servers."""

import socket

import pytest
import torch

from generation.engines import make_engine
from generation.engines.base import EngineError, MalformedAnswer
from generation.engines.checks import require
from generation.specs import FeatureSpec, SamplingSpec, StepSpec
from tests.fake_engines import (NEXT, FakeLlamaCpp, FakeSGLang, FakeVLLM, ids_of, own_logprob, tid, top_entries,
                                words)

CONTEXT, STEP = "Q: 2 + 3 ?\n\n", "2 + 3 = 5 .\n\n"
GREEDY = SamplingSpec(0.0, 1.0)
KEY = "sk-test-secret-4711"


@pytest.fixture()
def fakes():
    made = []

    def start(cls, **kw):
        made.append(cls(**kw))
        return made[-1]

    yield start
    for f in made:
        f.close()


def _engine(kind, fake, **kw):
    return make_engine(kind, fake.root, api_key_env="", retries=1, timeout=10.0, **kw)


def _expected(k):
    """The toy model's step log-probs and top-k for CONTEXT + STEP."""
    ids = ids_of(CONTEXT + STEP)
    start = len(ids_of(CONTEXT))
    own = [own_logprob(ids[:i], ids[i]) for i in range(start, len(ids))]
    top = [[v for v, _, _ in top_entries(ids[:i], k)] for i in range(start, len(ids))]
    return ids, start, torch.tensor(own), torch.tensor(top)


def _spec(*groups, **kw):
    spec = FeatureSpec(groups=tuple(g for g in groups if g != "topk_stats") or ("hidden",))
    if "topk_stats" in groups and not hasattr(spec, "needs_topk"):  # before the topk branch is merged
        return type("Spec", (), {"groups": groups, "needs_topk": True, "top_k": kw.get("top_k", 20)})()
    return FeatureSpec(groups=groups, **kw) if "topk_stats" in groups else spec


# ---------------------------------------------------------------------------------------------
# SGLang /generate


def test_sglang_read_sends_the_step_start_and_maps_the_answer(fakes):
    fake = fakes(FakeSGLang)
    engine = _engine("sglang", fake)
    assert engine.version == "0.5.0" and engine.model == "toy"
    r = engine.read(CONTEXT, STEP, top_k=5, hidden=True, sampling=SamplingSpec(0.7, 0.9), seed=3)
    ids, start, own, top = _expected(5)
    assert fake.posts("/v1/tokenize") == [{"model": "toy", "prompt": [CONTEXT, CONTEXT + STEP]}]
    (body,) = fake.posts("/generate")
    assert body["input_ids"] == ids and body["logprob_start_len"] == start == len(ids_of(CONTEXT))
    assert body["top_logprobs_num"] == 5 and body["return_logprob"] is True and body["return_hidden_states"] is True
    assert body["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.7, "top_p": 0.9, "sampling_seed": 3}
    n = len(words(STEP))
    assert r.step.ids == ids[start:] and len(r.step.tokens) == n
    torch.testing.assert_close(r.step.logprobs, own)
    torch.testing.assert_close(r.step.top, top)
    assert r.hidden.shape == (n, 3) and r.hidden[:, 0].tolist() == list(range(start, len(ids)))
    assert r.next_text == NEXT and r.next_eos is False
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens, r.usage.prefill_tokens) == \
        (len(ids), 1, start, n)


def test_sglang_reads_after_a_seen_context_without_a_tokenize_request(fakes):
    """A step read after the previous step + its bonus token, or after a step the server wrote, costs one request:
    the context's ids are known from the earlier answer (2 requests per kept step, 3 per refused one)."""
    fake = fakes(FakeSGLang)
    engine = _engine("sglang", fake)
    first = engine.read(CONTEXT, STEP, top_k=3, hidden=False, sampling=GREEDY, seed=0)
    assert engine._known[CONTEXT + STEP + first.next_text] == ids_of(CONTEXT + STEP) + [tid(NEXT)]  # + bonus token
    context = CONTEXT + STEP  # (the toy's bonus word would merge with any next step, so continue without it)
    second = engine.read(context, "4 * 2 = 8 .\n\n", top_k=3, hidden=False, sampling=GREEDY, seed=0)
    assert len(fake.posts("/v1/tokenize")) == 1 and len(fake.posts("/generate")) == 2
    body = fake.posts("/generate")[1]
    assert body["text"] == context + "4 * 2 = 8 .\n\n" and body["logprob_start_len"] == len(ids_of(context))
    assert second.step.ids == ids_of(context + "4 * 2 = 8 .\n\n")[len(ids_of(context)):]
    written = engine.write(context, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=1)
    assert fake.posts("/generate")[2]["input_ids"] == ids_of(context)  # the known ids, not the text
    engine.read(context + written.text, "7 .\n\n", top_k=3, hidden=False, sampling=GREEDY, seed=0)
    assert len(fake.posts("/v1/tokenize")) == 1
    engine.read("Another prompt ?\n\n", STEP, top_k=3, hidden=False, sampling=GREEDY, seed=0)
    assert len(fake.posts("/v1/tokenize")) == 2  # an unseen context is tokenized first


def test_sglang_falls_back_to_tokenizing_when_the_rows_do_not_spell_the_step(fakes, monkeypatch):
    fake = fakes(FakeSGLang)
    engine = _engine("sglang", fake)
    engine.read(CONTEXT, STEP, top_k=3, hidden=False, sampling=GREEDY, seed=0)
    context = CONTEXT + STEP
    engine._known[context] = engine._known[context][:-1]  # as if the server had split the boundary elsewhere
    r = engine.read(context, "9 .\n\n", top_k=3, hidden=False, sampling=GREEDY, seed=0)
    assert len(fake.posts("/v1/tokenize")) == 2 and r.step.ids == ids_of(context + "9 .\n\n")[len(ids_of(context)):]


def test_sglang_takes_the_step_rows_from_a_prefill_that_was_not_cached(fakes):
    fake = fakes(FakeSGLang, cached=0)
    r = _engine("sglang", fake).read(CONTEXT, STEP, top_k=3, hidden=True, sampling=GREEDY, seed=0)
    ids, start, _, _ = _expected(3)
    assert r.hidden[:, 0].tolist() == list(range(start, len(ids))) and r.usage.prefill_tokens == len(ids)


def test_sglang_write_stops_at_a_delimiter_and_returns_the_written_logprobs(fakes):
    fake = fakes(FakeSGLang)
    w = _engine("sglang", fake).write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=1,
                                      top_k=4)
    (body,) = fake.posts("/generate")
    assert body["text"] == CONTEXT and body["sampling_params"]["stop"] == ["\n\n"]
    assert body["sampling_params"]["no_stop_trim"] is True and body["top_logprobs_num"] == 4
    assert (w.text, w.stop) == ("a b\n\n", "delimiter")
    assert w.tokens.top.shape == (2, 4) and w.tokens.ids == [tid("a "), tid("b\n\n")]
    short = _engine("sglang", fake).write(CONTEXT, step=None, max_tokens=3, sampling=GREEDY, seed=1)
    assert (short.text, short.stop, short.tokens) == ("a b\n\nc ", "length", None)  # no stop strings sent


def test_sglang_short_answers_are_refused_with_counts(fakes):
    with pytest.raises(MalformedAnswer, match=r"returned 3 top-k entries at step token 0; asked for 5"):
        _engine("sglang", fakes(FakeSGLang, short_top=3)).read(CONTEXT, STEP, top_k=5, hidden=False,
                                                               sampling=GREEDY, seed=0)
    n = len(words(STEP))
    with pytest.raises(MalformedAnswer, match=rf"returned {n - 1} step log-prob rows .*expected {n}"):
        _engine("sglang", fakes(FakeSGLang, drop_rows=1)).read(CONTEXT, STEP, top_k=2, hidden=False,
                                                               sampling=GREEDY, seed=0)


def test_sglang_without_hidden_states_is_refused_naming_the_flag(fakes):
    fake = fakes(FakeSGLang, hidden=False)
    engine = _engine("sglang", fake)
    assert engine.capabilities().hidden is False
    with pytest.raises(EngineError, match="--enable-return-hidden-states") as e:
        require(engine, FeatureSpec(groups=("hidden",)), "target")
    assert fake.root in str(e.value) and "can serve ['topk_stats']" in str(e.value)
    assert not fake.posts("/generate")  # refused before any request that reads


def test_sglang_hidden_states_are_after_the_final_norm(fakes):
    caps = _engine("sglang", fakes(FakeSGLang)).capabilities()
    assert (caps.hidden, caps.hidden_norm, caps.prefix_cache_on_read) == (True, "final_norm", True)


# ---------------------------------------------------------------------------------------------
# vLLM /v1/completions


def test_vllm_read_echoes_with_prompt_logprobs_and_maps_by_text_offsets(fakes):
    fake = fakes(FakeVLLM)
    engine = _engine("vllm", fake)
    assert engine.version == "0.11.0"
    r = engine.read(CONTEXT, STEP, top_k=4, hidden=False, sampling=SamplingSpec(0.6, 0.95), seed=7)
    (body,) = fake.posts("/v1/completions")
    assert body["prompt"] == CONTEXT + STEP and body["echo"] is True and body["max_tokens"] == 1
    assert body["logprobs"] == 4 and body["prompt_logprobs"] == 4 and body["seed"] == 7
    ids, start, own, top = _expected(4)
    assert r.step.tokens == words(STEP) and r.step.ids == ids[start:]
    torch.testing.assert_close(r.step.logprobs, own)
    torch.testing.assert_close(r.step.top, top)
    assert r.hidden is None and r.next_text == NEXT and not r.next_eos
    assert (r.usage.prompt_tokens, r.usage.cached_tokens, r.usage.prefill_tokens) == (len(ids), 2, len(ids) - 2)


def test_vllm_write_keeps_the_stop_string(fakes):
    fake = fakes(FakeVLLM)
    w = _engine("vllm", fake).write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=2,
                                    top_k=3)
    (body,) = fake.posts("/v1/completions")
    assert body["stop"] == ["\n\n"] and body["include_stop_str_in_output"] is True and body["max_tokens"] == 8
    assert (w.text, w.stop) == ("a b\n\n", "delimiter") and w.tokens.tokens == ["a ", "b\n\n"]
    assert w.tokens.top.shape == (2, 3)


def test_vllm_top_k_above_max_logprobs_is_refused(fakes):
    fake = fakes(FakeVLLM, max_logprobs=20)
    engine = _engine("vllm", fake)
    with pytest.raises(EngineError, match=r"top_k=30 log-probs per position, above the server's cap of 20; restart "
                                          r"vllm serve with --max-logprobs 30") as e:
        require(engine, _spec("topk_stats", top_k=30), "target")
    assert fake.root in str(e.value)
    # a server started with a lower cap than the client was told says so, and the error names the fix
    with pytest.raises(EngineError, match=r"greater than max allowed: 5.*--max-logprobs >= 10"):
        _engine("vllm", fakes(FakeVLLM, max_logprobs=5)).read(CONTEXT, STEP, top_k=10, hidden=False,
                                                              sampling=GREEDY, seed=0)


def test_vllm_cannot_serve_hidden_or_full_vocabulary_statistics(fakes):
    engine = _engine("vllm", fakes(FakeVLLM))
    with pytest.raises(EngineError) as e:
        require(engine, FeatureSpec(groups=("hidden", "token_stats")), "target")
    msg = str(e.value)
    assert "vllm returns none over HTTP" in msg and "full-vocabulary" in msg and "can serve ['topk_stats']" in msg
    with pytest.raises(EngineError, match="no hidden states"):
        engine.read(CONTEXT, STEP, top_k=2, hidden=True, sampling=GREEDY, seed=0)


def test_vllm_short_top_k_is_refused_with_counts(fakes):
    engine = _engine("vllm", fakes(FakeVLLM, short_top=2))
    with pytest.raises(MalformedAnswer, match=r"returned 3 top-k entries at step token 0; asked for 5"):
        engine.read(CONTEXT, STEP, top_k=5, hidden=False, sampling=GREEDY, seed=0)  # 2 + the prompt token


# ---------------------------------------------------------------------------------------------
# llama.cpp capability checks (the real server is in the slow test below)


def test_cpp_llama_server_is_refused_for_reading(fakes):
    fake = fakes(FakeLlamaCpp, cpp=True)
    engine = _engine("llama.cpp", fake)
    with pytest.raises(EngineError, match=r"C\+\+ llama-server.*no echo.*llama_cpp.server.*can serve no probe group"
                       ) as e:
        require(engine, _spec("topk_stats"), "target")
    assert fake.root in str(e.value)


def test_llama_cpp_python_without_bos_is_refused_for_reading(fakes):
    engine = _engine("llama.cpp", fakes(FakeLlamaCpp, bos=False))
    assert engine.capabilities().prompt_logprobs is False
    with pytest.raises(EngineError, match="adds no BOS"):
        engine.read(CONTEXT, STEP, top_k=2, hidden=False, sampling=GREEDY, seed=0)
    assert _engine("llama.cpp", fakes(FakeLlamaCpp, bos=True)).capabilities().prompt_logprobs is True


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match=r"kind='tgi'.*'sglang', 'vllm', 'llama.cpp'"):
        make_engine("tgi", "http://127.0.0.1:1")


# ---------------------------------------------------------------------------------------------
# Dead servers and keys


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("kind", ["sglang", "vllm", "llama.cpp"])
def test_a_dead_server_gives_engine_error_with_the_url_and_without_the_key(kind, monkeypatch):
    monkeypatch.setenv("ENGINE_TEST_KEY", KEY)
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(EngineError) as e:
        make_engine(kind, url, api_key_env="ENGINE_TEST_KEY", retries=2, timeout=2.0)
    assert url in str(e.value) and e.value.url == url and KEY not in str(e.value) and "2 attempt(s)" in str(e.value)


def test_a_server_that_dies_mid_run_gives_engine_error(fakes, monkeypatch):
    monkeypatch.setenv("ENGINE_TEST_KEY", KEY)
    fake = fakes(FakeSGLang)
    engine = make_engine("sglang", fake.root, api_key_env="ENGINE_TEST_KEY", retries=2, timeout=2.0)
    engine.read(CONTEXT, STEP, top_k=2, hidden=False, sampling=GREEDY, seed=0)
    assert fake.requests[0][1]["authorization"] == f"Bearer {KEY}"  # the key is sent ...
    fake.close()
    with pytest.raises(EngineError) as e:
        engine.read(CONTEXT, STEP, top_k=2, hidden=False, sampling=GREEDY, seed=0)
    assert fake.root in str(e.value) and KEY not in str(e.value)  # ... and never shown


def test_a_server_that_echoes_the_key_has_it_blanked(fakes, monkeypatch):
    monkeypatch.setenv("ENGINE_TEST_KEY", KEY)
    fake = fakes(FakeVLLM, status=500)
    engine = make_engine("vllm", fake.root, api_key_env="ENGINE_TEST_KEY", retries=2, timeout=5.0)
    with pytest.raises(EngineError) as e:
        engine.read(CONTEXT, STEP, top_k=2, hidden=False, sampling=GREEDY, seed=0)
    assert len(fake.posts("/v1/completions")) == 2  # retried once, then refused
    assert "refused: Bearer ***" in str(e.value) and KEY not in str(e.value) and fake.root in str(e.value)


# ---------------------------------------------------------------------------------------------
# Real servers


@pytest.mark.slow
def test_llama_cpp_python_read_equals_its_full_echo_and_write_stops_at_the_delimiter(tmp_path):
    from datamodules.arithmetic.serve import LlamaServer, server_available
    from tests.conftest import DRAFT, TARGET, gguf_or_skip

    if not server_available():
        pytest.skip("llama-cpp-python[server] is not installed")
    gguf_or_skip(DRAFT), gguf_or_skip(TARGET)
    context, step = "Question: what is 12 + 30?\n\nFirst, add the tens.\n\n", "12 + 30 = 42.\n\n"
    with LlamaServer(f"pypi:{TARGET}", 8821, "gemma3", n_threads=1, log=tmp_path / "t.log") as t, \
            LlamaServer(f"pypi:{DRAFT}", 8822, "smollm2", n_threads=1, log=tmp_path / "d.log") as d:
        engine = make_engine("llama.cpp", t.url, api_key_env="")
        r = engine.read(context, step, top_k=5, hidden=False, sampling=GREEDY, seed=0)
        assert "".join(r.step.tokens) == step and r.step.top.shape == (len(r.step.tokens), 5)
        full = engine.conn.client.completions.create(model="gemma3", prompt=context + step, max_tokens=1, echo=True,
                                                     logprobs=5, temperature=0.0).choices[0].logprobs
        n = len(r.step.tokens)
        want = torch.tensor(full.token_logprobs[-n - 1:-1], dtype=torch.float32)  # the last entry: the drawn token
        assert full.tokens[-n - 1:-1] == r.step.tokens
        torch.testing.assert_close(r.step.logprobs, want, atol=1e-3, rtol=0)
        assert (r.step.top[:, 0] >= r.step.logprobs - 1e-6).all()
        w = engine.write(context, step=StepSpec(("\n\n",), 24), max_tokens=24, sampling=GREEDY, seed=0)
        assert w.stop in ("delimiter", "eos", "length") and (w.stop != "delimiter" or w.text.endswith("\n\n"))
        assert "\n\n" not in w.text[:-2]
        # SmolLM2 adds no BOS: llama-cpp-python's echo is one position off for it, so reading is refused
        small = make_engine("llama.cpp", d.url, api_key_env="")
        with pytest.raises(EngineError, match="adds no BOS"):
            require(small, _spec("topk_stats"), "draft")
        w = small.write("Count: 1, 2, 3,", step=StepSpec((",",), 8), max_tokens=8, sampling=GREEDY, seed=0, top_k=3)
        assert (w.stop, w.text.endswith(",")) == ("delimiter", True) and "".join(w.tokens.tokens).startswith(w.text)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_real_gpu_engine_reads_and_writes(kind, tmp_path):
    import importlib.util
    import subprocess
    import sys
    import time

    if not torch.cuda.is_available() or importlib.util.find_spec(kind) is None:
        pytest.skip(f"needs CUDA and {kind} installed")
    from datamodules.arithmetic.models import world_root

    model, port = str(world_root() / "target"), 8830 + (kind == "vllm")
    cmd = ([sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
            "--enable-return-hidden-states"] if kind == "sglang" else
           [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)])
    proc = subprocess.Popen(cmd, stdout=open(tmp_path / "log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        engine, deadline = None, time.monotonic() + 600
        while engine is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                engine = make_engine(kind, f"http://127.0.0.1:{port}", api_key_env="", retries=1, timeout=30)
            except EngineError:
                time.sleep(2)
        assert engine is not None, (tmp_path / "log").read_text()[-3000:]
        context, step = "Q: 2 + 3 =\n\n", "2 + 3 = 5\n\n"
        r = engine.read(context, step, top_k=5, hidden=kind == "sglang", sampling=GREEDY, seed=0)
        assert "".join(r.step.tokens) == step and r.step.top.shape == (len(r.step.tokens), 5)
        assert (r.step.top[:, 0] >= r.step.logprobs - 1e-4).all()
        assert kind != "sglang" or r.hidden.shape[0] == len(r.step.tokens)
        w = engine.write(context, step=StepSpec(("\n\n",), 16), max_tokens=16, sampling=GREEDY, seed=0, top_k=3)
        assert w.stop != "delimiter" or w.text.endswith("\n\n")
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def test_text_keyed_top_k_is_exact_flagged_or_refused():
    """llama-cpp-python keys top_logprobs by text: tokens that read the same ("" for control tokens) share one key.
    Asked for k + 1 entries, the k largest are exact unless an entry may have been lost (then flagged)."""
    from generation.engines.openai_compat import text_keyed_top

    top = {"a": -0.1, "b": -2.0, "c": -3.0, "d": -4.0}
    assert text_keyed_top(top, "a", -0.1, 3, "u", "w") == ([-0.1, -2.0, -3.0], False)  # own inside: k + 1, exact
    assert text_keyed_top(top, "d", -4.0, 3, "u", "w") == ([-0.1, -2.0, -3.0], False)  # own ranked k + 1: exact
    assert text_keyed_top({**top, "z": -9.0}, "z", -9.0, 3, "u", "w") == ([-0.1, -2.0, -3.0], False)  # own added
    assert text_keyed_top({**top, "": -0.5}, "a", -0.1, 3, "u", "w") == ([-0.1, -0.5, -2.0], False)  # "" alone
    with pytest.raises(MalformedAnswer, match=r"returned 3 top-k entries at w; asked for 4: .*token text"):
        text_keyed_top({"": -2.5, "a": -0.1, "b": -3.0}, "a", -0.1, 3, "u", "w")  # two control tokens collided
    # lost one + own added, or own ranked k + 1 beside a "" entry: cannot tell, flagged
    assert text_keyed_top({"": -2.5, "a": -0.1, "b": -3.0, "z": -9.0}, "z", -9.0, 3, "u", "w") == \
        ([-0.1, -2.5, -3.0], True)
    assert text_keyed_top(top, "c", -3.0, 3, "u", "w", slack=0) == ([-0.1, -2.0, -3.0], False)  # vLLM: no slack
