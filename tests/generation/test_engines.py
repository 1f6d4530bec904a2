"""Engine clients (generation.engines): requests and answer mapping against fakes of SGLang and vLLM written from
their documented schemas, capability refusals, malformed answers, dead servers; a slow test against a real
llama-cpp-python server and a ``gpu`` test against real SGLang / vLLM servers."""

import re
import socket

import pytest
import torch

from generation.engines import make_engine
from generation.engines.base import EngineError, MalformedAnswer, Unsupported
from generation.engines.checks import require
from generation.specs import FeatureSpec, SamplingSpec, StepSpec
from semanticspec.policies import RandomPolicy
from tests.fake_engines import (NEUTRAL, NEXT, FakeLlamaCpp, FakeSGLang, FakeVLLM, ids_of, own_logprob, tid,
                                top_entries, toy_continue, words)

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


def test_sglang_read_asks_from_one_position_earlier_and_drops_the_empty_first_entry(fakes):
    """SGLang answers the first position asked for with ``[null, id, text]`` and a null top-k (scheduler
    ``_process_input_token_logprobs``): a read asks from the step's first position - 1 and drops that entry; the
    radix cache then covers the context but its last token (``Req._compute_max_prefix_len``)."""
    fake = fakes(FakeSGLang)
    engine = _engine("sglang", fake)
    engine.write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=1)  # caches the context
    r = engine.read(CONTEXT, STEP, top_k=5, hidden=True, sampling=SamplingSpec(0.7, 0.9), seed=3)
    ids, start, own, top = _expected(5)
    assert fake.posts("/v1/tokenize") == [{"model": "toy", "prompt": [CONTEXT, CONTEXT + STEP]}]
    body = fake.posts("/generate")[-1]
    assert body["input_ids"] == ids and body["logprob_start_len"] == start - 1 == len(ids_of(CONTEXT)) - 1
    assert body["top_logprobs_num"] == 5 and body["return_logprob"] is True and body["return_hidden_states"] is True
    n = len(words(STEP))
    assert r.step.ids == ids[start:] and len(r.step.tokens) == n and r.step.tokens == words(STEP)
    torch.testing.assert_close(r.step.logprobs, own)
    torch.testing.assert_close(r.step.top, top)
    assert r.hidden.shape == (n, 3) and r.hidden[:, 0].tolist() == list(range(start, len(ids)))
    assert r.next_text == NEXT and r.next_eos is False
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens, r.usage.prefill_tokens) == \
        (len(ids), 2, start - 1, n + 1)  # two tokens drawn: SGLang tests the length limit before EOS
    assert engine.version == "0.5.23" and engine.model == "toy"  # from /server_info (SGLang has no /version)


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
    assert body["text"] == context + "4 * 2 = 8 .\n\n" and body["logprob_start_len"] == len(ids_of(context)) - 1
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
    fake = fakes(FakeSGLang)  # a first read: nothing cached
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


@pytest.mark.parametrize("version", ["0.5.2", "0.4.6", None])
def test_sglang_below_the_version_floor_is_refused_before_any_request(fakes, version):
    info = {"version": version} if version else {"version": None}
    fake = fakes(FakeSGLang, info=info)
    with pytest.raises(Unsupported) as e:
        _engine("sglang", fake)
    assert fake.root in str(e.value) and f"reports version {version or 'unknown'}" in str(e.value)
    assert "SGLang >= 0.5.4" in str(e.value) and not fake.posts("/generate") and not fake.posts("/v1/tokenize")


def test_sglang_reads_its_version_from_server_info_or_the_older_route(fakes):
    assert _engine("sglang", fakes(FakeSGLang, version="0.5.4", info_routes=("/get_server_info",))).version == "0.5.4"
    with pytest.raises(Unsupported, match="answers neither /server_info nor /get_server_info"):
        _engine("sglang", fakes(FakeSGLang, info_routes=()))


def test_vllm_below_the_version_floor_is_refused(fakes):
    fake = fakes(FakeVLLM, version="0.10.1")
    with pytest.raises(Unsupported, match=r"reports version 0.10.1; this client needs vLLM >= 0.11.1") as e:
        _engine("vllm", fake)
    assert fake.root in str(e.value) and not fake.posts("/v1/completions")


@pytest.mark.parametrize("info,flag", [
    ({"return_hidden_states_mode": "last"}, "--return-hidden-states-mode full"),
    ({"speculative_algorithm": "EAGLE3"}, "--speculative-algorithm EAGLE3"),
    ({"enable_return_aux_hidden_states": True}, "--enable-return-aux-hidden-states"),
])
def test_sglang_whose_rows_are_not_the_last_layer_is_refused_for_hidden(fakes, info, flag):
    fake = fakes(FakeSGLang, info=info)
    engine = _engine("sglang", fake)
    with pytest.raises(Unsupported, match=re.escape(flag)) as e:
        require(engine, FeatureSpec(groups=("hidden",)), "target")
    assert fake.root in str(e.value) and "can serve ['topk_stats']" in str(e.value)
    with pytest.raises(Unsupported, match=re.escape(flag)):
        engine.read(CONTEXT, STEP, top_k=2, hidden=True, sampling=GREEDY, seed=0)
    assert not fake.posts("/generate")


def test_sglang_serving_a_pre_norm_model_is_refused_for_a_final_norm_probe(fakes):
    engine = _engine("sglang", fakes(FakeSGLang, info={"model_path": "deepseek-ai/DeepSeek-V4-Flash"}))
    assert engine.capabilities().hidden_norm == "pre_norm"
    with pytest.raises(Unsupported, match=r"hidden_norm='final_norm'.*hidden_norm='pre_norm'"):
        require(engine, FeatureSpec(groups=("hidden",)), "target")


@pytest.mark.parametrize("original", [False, True])
def test_sglang_written_logprobs_are_read_back_raw_when_the_server_tempers_them(fakes, original):
    """SGLang returns written tokens' log-probs as log_softmax(logits / T) (raw only when greedy or with
    SGLANG_RETURN_ORIGINAL_LOGPROB=1, which no route reports): at 0 < T != 1 the client reads them back as prompt
    tokens, raw, in one more request; greedy needs no second request."""
    fake = fakes(FakeSGLang, original_logprob=original)
    engine = _engine("sglang", fake)
    step = StepSpec(("\n\n",), 8)
    w = engine.write(CONTEXT, step=step, max_tokens=8, sampling=SamplingSpec(0.5, 1.0), seed=4, top_k=3)
    ids = ids_of(CONTEXT) + list(w.tokens.ids)
    start = len(ids_of(CONTEXT))
    raw = torch.tensor([own_logprob(ids[:i], ids[i]) for i in range(start, len(ids))])
    torch.testing.assert_close(w.tokens.logprobs, raw)
    torch.testing.assert_close(w.tokens.top, torch.tensor([[v for v, _, _ in top_entries(ids[:i], 3)]
                                                           for i in range(start, len(ids))]))
    back = fake.posts("/generate")[-1]
    assert back["input_ids"] == ids and back["logprob_start_len"] == start - 1
    assert back["sampling_params"]["temperature"] == 0.0 and len(fake.posts("/generate")) == 2
    engine.write(CONTEXT, step=step, max_tokens=8, sampling=GREEDY, seed=4, top_k=3)
    assert len(fake.posts("/generate")) == 3  # greedy: written log-probs are raw, one request


def test_sglang_prefills_a_long_context_before_reading_its_hidden_rows(fakes):
    """SGLang returns a hidden row for every position it computes: a long context seen for the first time is
    prefilled in a request of its own, so the hidden read returns the step's rows and one more, not the context's."""
    from generation.engines.sglang import LONG_CONTEXT

    fake = fakes(FakeSGLang)
    engine = _engine("sglang", fake)
    context = "x " * (LONG_CONTEXT + 10) + "?\n\n"
    r = engine.read(context, STEP, top_k=2, hidden=True, sampling=GREEDY, seed=0)
    n, start = len(words(STEP)), len(ids_of(context))
    prefill, read = fake.posts("/generate")
    assert prefill["input_ids"] == ids_of(context) and "return_hidden_states" not in prefill
    assert len(fake.answers[-1][1]["meta_info"]["hidden_states"][0]) == n + 1  # not start + n
    assert r.hidden[:, 0].tolist() == list(range(start, start + n)) and r.usage.cached_tokens == start - 1
    engine.read(CONTEXT, STEP, top_k=2, hidden=True, sampling=GREEDY, seed=0)  # short: no prefill request
    assert len(fake.posts("/generate")) == 3


def test_sglang_write_cuts_text_kept_after_the_stop_string(fakes):
    """Before 0.5.23 (PR #25980) no_stop_trim could keep text after the matched stop string as well."""
    fake = fakes(FakeSGLang, version="0.5.22", tail_after_stop="c ")
    w = _engine("sglang", fake).write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=1)
    assert (w.text, w.stop) == ("a b\n\n", "delimiter")


def test_sglang_abort_sent_with_http_200_is_an_error_not_an_eos(fakes):
    fake = fakes(FakeSGLang, abort=True)
    with pytest.raises(EngineError, match=r"aborted a /generate request 1 time\(s\): aborted by the scheduler") as e:
        _engine("sglang", fake).write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=0)
    assert fake.root in str(e.value)


def test_sglang_nan_stop_is_an_error_not_a_delimiter_or_an_eos(fakes):
    """SGLang ends a request whose sampled id falls outside the vocabulary (NaN logits) with a finish shaped as a
    matched stop string, "NaN happened": it was written as a step ending at that "delimiter" (the string appended to
    the text), and read as EOS."""
    engine = _engine("sglang", fakes(FakeSGLang, nan=True))
    with pytest.raises(EngineError, match="outside the vocabulary .*'NaN happened'"):
        engine.write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=0)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.read(CONTEXT, STEP, top_k=2, hidden=False, sampling=GREEDY, seed=0)


def test_sglang_without_deterministic_inference_warns_that_it_ignores_seeds(fakes):
    """SGLang reads ``sampling_seed`` only with --enable-deterministic-inference: without it, two writes with one
    seed differ, and the client says so once, when it connects (it sent the seeds as if they held)."""
    from generation.engines.sglang import UnseededServer

    fake = fakes(FakeSGLang, deterministic=False)
    with pytest.warns(UnseededServer, match="without --enable-deterministic-inference, so it ignores sampling seeds"):
        engine = _engine("sglang", fake)
    hot = SamplingSpec(5.0, 1.0)
    texts = {engine.write(CONTEXT, step=None, max_tokens=8, sampling=hot, seed=3).text for _ in range(12)}
    assert len(texts) > 1 and not engine.seeded
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UnseededServer)
        seeded = _engine("sglang", fakes(FakeSGLang))
    assert seeded.seeded and len({seeded.write(CONTEXT, step=None, max_tokens=8, sampling=hot, seed=3).text
                                  for _ in range(4)}) == 1


def test_sglang_a_special_next_token_is_not_remembered_as_the_steps_continuation(fakes):
    """A read's next token that decodes to "" (a special token, not EOS) spells nothing of the text: remembering
    context + step + "" as ids ending in it made the next write of context + step read that token too."""
    fake = fakes(FakeSGLang, special_next=True)
    engine = _engine("sglang", fake)
    r = engine.read(CONTEXT, STEP, top_k=2, hidden=False, sampling=GREEDY, seed=0)
    assert (r.next_text, r.next_eos) == ("", False)
    engine.write(CONTEXT + STEP, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=0)
    sent = fake.posts("/generate")[-1]
    assert sent.get("input_ids", ids_of(CONTEXT + STEP)) == ids_of(CONTEXT + STEP), sent


def test_sglang_an_eos_after_the_step_is_read_as_eos_though_it_tests_the_length_limit_first(fakes):
    """A read asked for one token, and SGLang ends a request at its length limit before it looks for EOS
    (``Req.check_finished``): an EOS drawn after the step came back as ``length`` with no text, read as a special token
    that is not EOS, so a row served by SGLang never ended at its target's EOS. A read asks for two tokens now."""
    engine = _engine("sglang", fakes(FakeSGLang, eos_next=True))
    r = engine.read(CONTEXT, STEP, top_k=2, hidden=True, sampling=GREEDY, seed=0)
    assert (r.next_text, r.next_eos) == ("", True)
    assert r.hidden.shape == (len(words(STEP)), 3)  # the step's rows, whatever the tokens drawn after it
    plain = _engine("sglang", fakes(FakeSGLang)).read(CONTEXT, STEP, top_k=2, hidden=True, sampling=GREEDY, seed=0)
    assert (plain.next_text, plain.next_eos) == (NEXT, False)  # the first of the two tokens drawn


def test_sglang_requests_stay_below_its_context_which_refuses_a_request_that_reaches_it(fakes):
    """SGLang refuses input + max_new_tokens >= its context (``_validate_one_request``), one token short of vLLM's
    rule: a read after a step that filled the room the decoder left asked for exactly the context, a 400."""
    fake = fakes(FakeSGLang, context_len=64)
    engine = _engine("sglang", fake)
    assert engine.context_length == 64 - 2
    prompt = "x " * (engine.context_length - 3)  # with BOS: the most a prompt may hold to read one step of 1 token
    r = engine.read(prompt, "y ", top_k=2, hidden=False, sampling=GREEDY, seed=0)
    assert r.next_text == NEXT


def test_sglang_hidden_states_are_after_the_final_norm(fakes):
    caps = _engine("sglang", fakes(FakeSGLang)).capabilities()
    assert (caps.hidden, caps.hidden_norm) == (True, "final_norm")


# ---------------------------------------------------------------------------------------------
# vLLM /v1/completions


def test_vllm_abort_sent_with_http_200_is_asked_again_then_an_error_not_an_eos(fakes):
    """vLLM answers a request its engine aborted (a shutdown, /pause) with HTTP 200, the partial text and
    finish_reason "abort": it was read as a step that ended at EOS."""
    fake = fakes(FakeVLLM, abort=1)
    engine = make_engine("vllm", fake.root, api_key_env="", retries=2, timeout=10.0)
    w = engine.write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=0)
    assert (w.text, w.stop, len(fake.posts("/v1/completions"))) == ("a b\n\n", "delimiter", 2)
    fake.abort = 5
    with pytest.raises(EngineError, match=r"finish_reason 'abort' 2 time\(s\)"):
        engine.write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=0)
    with pytest.raises(EngineError, match="finish_reason 'abort'"):
        engine.read(CONTEXT, STEP, top_k=2, hidden=False, sampling=GREEDY, seed=0)


def test_vllm_requests_ask_for_token_texts_whatever_the_servers_flag(fakes):
    """A vLLM server started with --return-tokens-as-token-ids writes log-probs' tokens as "token_id:N" unless a
    request says otherwise, and the written tokens' text offsets then count those strings: every request says so."""
    fake = fakes(FakeVLLM)
    engine = _engine("vllm", fake)
    engine.read(CONTEXT, STEP, top_k=2, hidden=False, sampling=GREEDY, seed=0)
    engine.write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=0, top_k=2)
    bodies = fake.posts("/v1/completions")
    assert len(bodies) == 2 and all(b["return_tokens_as_token_ids"] is False for b in bodies)


def test_vllm_read_echoes_with_prompt_logprobs_and_maps_by_text_offsets(fakes):
    fake = fakes(FakeVLLM)
    engine = _engine("vllm", fake)
    assert engine.version == "0.11.1"
    r = engine.read(CONTEXT, STEP, top_k=4, hidden=False, sampling=SamplingSpec(0.6, 0.95), seed=7)
    (body,) = fake.posts("/v1/completions")
    assert body["prompt"] == CONTEXT + STEP and body["echo"] is True and body["max_tokens"] == 1
    assert body["logprobs"] == 4 and body["prompt_logprobs"] == 4 and body["seed"] == 7
    ids, start, own, top = _expected(4)
    assert r.step.tokens == words(STEP) and r.step.ids == ids[start:]
    torch.testing.assert_close(r.step.logprobs, own)
    torch.testing.assert_close(r.step.top, top)
    assert r.hidden is None and r.next_text == NEXT and not r.next_eos
    assert (r.usage.prompt_tokens, r.usage.cached_tokens, r.usage.prefill_tokens) == (len(ids), None, None)
    detailed = _engine("vllm", fakes(FakeVLLM, prompt_tokens_details=True))  # --enable-prompt-tokens-details
    r = detailed.read(CONTEXT, STEP, top_k=4, hidden=False, sampling=SamplingSpec(0.6, 0.95), seed=7)
    assert (r.usage.prompt_tokens, r.usage.cached_tokens, r.usage.prefill_tokens) == (len(ids), 2, len(ids) - 2)


def test_vllm_finds_the_step_by_ids_when_echoed_texts_do_not_add_up(fakes):
    """vLLM 0.11 decodes each echoed id alone (SentencePiece spaces, split UTF-8 characters): the step is found by
    prompt_token_ids against the context's ids from /tokenize."""
    fake = fakes(FakeVLLM, lone_texts=True)
    r = _engine("vllm", fake).read(CONTEXT, STEP, top_k=4, hidden=False, sampling=GREEDY, seed=7)
    ids, start, own, top = _expected(4)
    assert r.step.ids == ids[start:] and fake.posts("/tokenize") == [{"model": "toy", "prompt": CONTEXT}]
    torch.testing.assert_close(r.step.logprobs, own)
    torch.testing.assert_close(r.step.top, top)
    plain = fakes(FakeVLLM)
    _engine("vllm", plain).read(CONTEXT, STEP, top_k=4, hidden=False, sampling=GREEDY, seed=7)
    assert not plain.posts("/tokenize")  # texts that add up need no /tokenize


def test_vllm_write_keeps_the_stop_string(fakes):
    fake = fakes(FakeVLLM)
    w = _engine("vllm", fake).write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=2,
                                    top_k=3)
    (body,) = fake.posts("/v1/completions")
    assert body["stop"] == ["\n\n"] and body["include_stop_str_in_output"] is True and body["max_tokens"] == 8
    assert (w.text, w.stop) == ("a b\n\n", "delimiter") and w.tokens.tokens == ["a ", "b\n\n"]
    assert w.tokens.top.shape == (2, 3)


def test_greedy_samples_of_one_context_are_one_request_which_vllm_would_refuse_with_n(fakes):
    """Label sampling asks for n samples of a context in one request; at temperature 0 vLLM refuses n > 1 ("n must be
    1 when using greedy sampling", ``sampling_params.py`` ``_verify_greedy_sampling``), so a greedy build failed."""
    fake = fakes(FakeVLLM)
    ws = _engine("vllm", fake).write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=2,
                                     n=3)
    (body,) = fake.posts("/v1/completions")
    assert body.get("n") in (None, 1) and [w.text for w in ws] == ["a b\n\n"] * 3
    assert [w.usage.prompt_tokens > 0 for w in ws] == [True, False, False]  # one request's usage, on the first


def test_vllm_written_top_k_asks_one_more_and_flags_tokens_that_read_alike(fakes):
    """Written tokens' top_logprobs are keyed by text: two tokens that read alike share a key and one log-prob is lost.
    Asked for k + 1 entries, the client tells such a position from a full answer and counts it (it used to take k
    entries, and returned the wrong values unflagged)."""
    fake = fakes(FakeVLLM, twin_texts=True)
    engine = _engine("vllm", fake)
    w = engine.write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=2, top_k=3)
    assert fake.posts("/v1/completions")[0]["logprobs"] == 4 and engine.unsure_positions == len(w.tokens.tokens) == 2
    capped = _engine("vllm", fakes(FakeVLLM, max_logprobs=3), max_logprobs=3)
    capped.write(CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=2, top_k=3)  # at the cap


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


LEAKY = {"top_k": 1, "min_p": 0.5, "repetition_penalty": 1.3, "presence_penalty": 1.5}
"""Sampling fields a server fills into every field a request leaves out (vLLM: the model's generation_config.json;
SGLang's /generate: --preferred-sampling-params)."""


@pytest.mark.parametrize("kind,fake_cls,server", [("vllm", FakeVLLM, {"version": "0.34.0", "generation_config": LEAKY}),
                                                  ("vllm", FakeVLLM, {"version": "0.11.1", "generation_config": LEAKY}),
                                                  ("sglang", FakeSGLang, {"preferred": LEAKY})])
def test_writes_state_the_whole_distribution_so_server_defaults_do_not_leak(kind, fake_cls, server, fakes):
    """vLLM (--generation-config auto; both penalties from 0.31) and SGLang (--preferred-sampling-params) fill unset
    sampling fields: the served greedy step then differs from the in-process greedy step (the toy's penalties turn
    "a " into the runner-up). Every write states top_k, min_p, the repetition penalty and both penalties, so the two
    agree, sampled too."""
    fake = fakes(fake_cls, **server)
    engine = _engine(kind, fake)
    context, step = "Q: a a ?\n\n", StepSpec(("\n\n",), 8)
    for sampling, seed in ((GREEDY, 2), (SamplingSpec(1.0, 1.0), 5), (SamplingSpec(1.0, 1.0), 11)):
        in_process = toy_continue(ids_of(context), 8, ["\n\n"], True, {**sampling.to_dict(), **NEUTRAL}, seed)[1]
        served = engine.write(context, step=step, max_tokens=8, sampling=sampling, seed=seed)
        assert served.text == in_process
        assert fake.effective[-1] == {**sampling.to_dict(), **NEUTRAL}
    leaky = toy_continue(ids_of(context), 8, ["\n\n"], True, {**GREEDY.to_dict(), **LEAKY}, 2)[1]
    assert leaky != in_process_greedy(context)  # what the old client (temperature and top_p alone) was served


def in_process_greedy(context: str) -> str:
    return toy_continue(ids_of(context), 8, ["\n\n"], True, {**GREEDY.to_dict(), **NEUTRAL}, 2)[1]


def test_vllm_without_the_neutral_fields_samples_from_the_generation_config(fakes):
    """The fake fills unset fields as vLLM does: a request that sends only temperature and top_p (the old client's)
    is served from the generation config, greedy included."""
    fake = fakes(FakeVLLM, generation_config=LEAKY)
    engine = _engine("vllm", fake)
    context = "Q: a a ?\n\n"
    resp, _ = engine.conn.completions(model="toy", prompt=context, max_tokens=8, temperature=0.0, top_p=1.0, seed=2,
                                      stop=["\n\n"], extra_body={"include_stop_str_in_output": True})
    assert fake.effective[-1]["top_k"] == 1 and fake.effective[-1]["repetition_penalty"] == 1.3
    assert resp.choices[0].text != in_process_greedy(context)


# ---------------------------------------------------------------------------------------------
# llama.cpp capability checks (the real server is in the slow test below)


def test_cpp_llama_server_is_refused_for_reading(fakes):
    fake = fakes(FakeLlamaCpp, cpp=True)
    engine = _engine("llama.cpp", fake)
    with pytest.raises(EngineError, match=r"C\+\+ llama-server.*no echo.*llama_cpp.server.*can serve no probe group"
                       ) as e:
        require(engine, _spec("topk_stats"), "target")
    assert fake.root in str(e.value)


@pytest.mark.parametrize("kind, cls, named", [
    ("vllm", FakeLlamaCpp, "llama.cpp"), ("sglang", FakeLlamaCpp, "llama.cpp"), ("llama.cpp", FakeVLLM, "vllm"),
    ("llama.cpp", FakeSGLang, "sglang"), ("vllm", FakeSGLang, "sglang"), ("sglang", FakeVLLM, "vllm")])
def test_a_server_of_another_engine_is_named_not_told_to_upgrade(fakes, kind, cls, named):
    # a llama.cpp server given as vLLM was told "reports version unknown ... upgrade the server", and a vLLM one given
    # as llama.cpp "failed /extras/tokenize ...; check that the server is running"
    fake = fakes(cls)
    with pytest.raises(Unsupported, match=rf"{fake.root} answers as .* connect to it as '{re.escape(named)}'"):
        _engine(kind, fake).capabilities()


def test_a_key_refused_where_no_variable_was_named_says_to_name_one():
    # it said "refused the API key from $(none) ...; set $(no variable) to a key it accepts"
    from generation.engines.connection import Connection
    from tests.fake_openai import FakeServer

    server = FakeServer(None, None, status=401)  # answers every route 401, as a server started with --api_key
    try:
        with pytest.raises(EngineError) as e:
            Connection(server.url, api_key_env="", retries=1).models()
    finally:
        server.close()
    assert "refused a request without an API key" in str(e.value) and "(no variable)" not in str(e.value)
    assert "name an environment variable holding a key it accepts" in str(e.value)


def test_llama_cpp_python_without_bos_is_refused_for_reading(fakes):
    engine = _engine("llama.cpp", fakes(FakeLlamaCpp, bos=False))
    assert engine.capabilities().prompt_logprobs is False
    with pytest.raises(EngineError, match="adds no BOS"):
        engine.read(CONTEXT, STEP, top_k=2, hidden=False, sampling=GREEDY, seed=0)
    assert _engine("llama.cpp", fakes(FakeLlamaCpp, bos=True)).capabilities().prompt_logprobs is True


def test_engines_count_a_prompts_tokens_with_the_servers_tokenizer(fakes):
    """``prompt_tokens``: SGLang in one ``/v1/tokenize`` of every text, vLLM one ``/tokenize`` each (its ``count``);
    llama-cpp-python, which states no context, counts nothing."""
    texts = [CONTEXT, CONTEXT + STEP]
    sglang_fake, vllm_fake = fakes(FakeSGLang), fakes(FakeVLLM)
    want = [len(ids_of(t)) for t in texts]
    assert _engine("sglang", sglang_fake).prompt_tokens(texts) == want
    assert sglang_fake.posts("/v1/tokenize") == [{"model": "toy", "prompt": texts}]
    assert _engine("vllm", vllm_fake).prompt_tokens(texts) == want
    assert vllm_fake.posts("/tokenize") == [{"model": "toy", "prompt": t} for t in texts]
    assert _engine("llama.cpp", fakes(FakeLlamaCpp)).prompt_tokens(texts) is None


def test_engines_take_the_context_their_models_endpoint_states(fakes):
    """vLLM's and SGLang's ``/v1/models`` cards state ``max_model_len``, which becomes the engine's
    ``context_length`` (SGLang's less the two tokens its reads ask for past a request's input, which it refuses from
    the context on); llama-cpp-python's cards do not (``llama_cpp/server/app.py`` ``get_models``), so it is None
    unless its ``n_ctx`` is given.
    A served decoder over engines that state it refuses a window that cannot fit, naming the value."""
    from semanticspec.served import ServedDecoder

    vllm = _engine("vllm", fakes(FakeVLLM, max_model_len=80))
    assert vllm.context_length == 80
    assert _engine("sglang", fakes(FakeSGLang, context_len=96)).context_length == 96 - 2
    assert _engine("llama.cpp", fakes(FakeLlamaCpp)).context_length is None
    dec = ServedDecoder(vllm, _engine("vllm", fakes(FakeVLLM, max_model_len=64)))
    cap = dec.step.max_step_tokens
    assert dec.context_room() == 64 - 2  # a one-token prompt and the bonus token's room
    with pytest.raises(ValueError, match=rf"lookahead=2: a window of 2 steps of up to {cap} tokens .* 62 new tokens"):
        dec.generate(["x"], method=RandomPolicy(0.5), lookahead=2)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match=r"kind='tgi'.*'sglang', 'vllm', 'llama.cpp'"):
        make_engine("tgi", "http://127.0.0.1:1")


def test_llama_cpp_tells_a_cut_delimiter_after_a_character_split_over_tokens(fakes):
    """llama-cpp-python decodes each token alone with ``errors="ignore"`` (``llama.py`` ``_create_completion``, 0.3):
    the byte tokens of a split character read "", so the joined token texts fell short of the text and the cut
    ``\n\n`` was looked for one character too far on: a step that ended at the delimiter was taken for EOS. Its
    offsets (decoded over the whole prefix) place the cut tokens."""
    from types import SimpleNamespace

    engine = _engine("llama.cpp", fakes(FakeLlamaCpp))
    tokens, offsets = ["h", "", "", "llo", "\n\n"], [0, 1, 1, 2, 5]  # "é" in two byte tokens
    choice = SimpleNamespace(text="héllo", finish_reason="stop", logprobs={
        "tokens": tokens, "text_offset": [100 + o for o in offsets], "token_logprobs": [-0.1] * 5,
        "top_logprobs": [{}] * 5})
    assert engine._ending(choice, ["\n\n"]) == ("héllo\n\n", "delimiter")
    straddling = SimpleNamespace(text="a.", finish_reason="stop", logprobs={
        "tokens": ["a", ".\n\n"], "text_offset": [7, 8], "token_logprobs": [-0.1] * 2, "top_logprobs": [{}] * 2})
    assert engine._ending(straddling, ["\n\n"]) == ("a.\n\n", "delimiter")  # the stop string inside a token
    ended = SimpleNamespace(text="héllo", finish_reason="stop", logprobs={**choice.logprobs, "tokens": tokens[:4],
                                                                            "text_offset": offsets[:4]})
    assert engine._ending(ended, ["\n\n"]) == ("héllo", "eos")


def test_an_echoed_step_with_a_split_character_is_found_by_its_offsets():
    """llama-cpp-python reads the byte tokens of a split character as "" (each decoded alone), so the step's token
    texts did not spell it and the read was refused as malformed; the offsets (the prefix decoded whole) place every
    token. Texts that spell something else are still refused."""
    from generation.engines.base import MalformedAnswer
    from generation.engines.openai_compat import step_positions

    context, step = "Q: ", "h\u00e9llo\n\n"
    texts, offsets = ["<s>", "Q", ":", " ", "h", "", "", "llo", "\n\n"], [0, 3, 4, 5, 6, 7, 7, 8, 11]
    assert step_positions(offsets, texts, len(texts), context, step, "u") == [4, 5, 6, 7, 8]
    with pytest.raises(MalformedAnswer, match="spell 'hlXo"):
        step_positions(offsets, texts[:7] + ["lXo", "\n\n"], len(texts), context, step, "u")


@pytest.mark.parametrize("n_ctx", [0, 2.5, "256"])
def test_a_llama_cpp_context_that_is_no_count_is_refused_before_any_request(n_ctx):
    with pytest.raises(ValueError, match=rf"n_ctx={n_ctx!r}: expected the server's context in tokens"):
        make_engine("llama.cpp", "http://127.0.0.1:1", n_ctx=n_ctx)


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
    from arithmetic_world.serve import LlamaServer, server_available
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
    from arithmetic_world.models import world_root

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


def test_one_redaction_blanks_the_connection_key_and_key_like_variables(monkeypatch):
    from generation.engines.connection import redact

    monkeypatch.setenv("SOME_API_KEY", "sk-env-secret-42")
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to be a key: left alone
    msg = redact("sent sk-env-secret-42 and sk-given-77 with abc", "sk-given-77")
    assert msg == "sent *** and *** with abc"


@pytest.mark.slow
def test_a_real_llama_cpp_python_server_is_identified_and_accepts_the_neutral_fields(tmp_path):
    from arithmetic_world.serve import server_available, world_server
    from generation.engines import NEUTRAL_SAMPLING
    from generation.engines.connection import Connection, identify

    if not server_available():
        pytest.skip("llama-cpp-python[server] is not installed")
    with world_server("draft", 8873, log=tmp_path / "d.log") as s:
        conn = Connection(s.url, api_key_env="", retries=1)
        kind, version = identify(conn)
        assert kind == "llama.cpp" and version
        resp, _ = conn.completions(model="draft", prompt="Q: 2 + 3 =", max_tokens=4, temperature=0.0, top_p=1.0,
                                   seed=0, extra_body=NEUTRAL_SAMPLING["llama.cpp"])
        assert resp.choices and resp.usage.completion_tokens >= 1


@pytest.mark.parametrize("kind, cls", [("sglang", FakeSGLang), ("vllm", FakeVLLM), ("llama.cpp", FakeLlamaCpp)])
def test_an_engine_whose_server_serves_another_model_is_refused_before_any_request(fakes, kind, cls):
    """Bad input: an engine given a URL that answers with another model is refused when it is made (before
    the first prompt), naming the URL and both model names; only the model list was asked for."""
    fake = fakes(cls)
    with pytest.raises(Unsupported) as e:
        _engine(kind, fake, model="world-target")
    msg = str(e.value)
    assert fake.root in msg and "'world-target'" in msg and "['toy']" in msg, msg
    assert not fake.requests  # no POST: nothing was sampled, read or tokenized


def test_vllm_leaves_presence_penalty_to_the_generation_config_from_0_31():
    """The fake fills the penalties as vLLM does: from the generation config only from 0.31 on."""
    from tests.fake_engines import FakeVLLM as F

    assert F(version="0.34.0", generation_config=LEAKY)._params({})["presence_penalty"] == 1.5
    assert F(version="0.11.1", generation_config=LEAKY)._params({})["presence_penalty"] == 0.0


def test_vllm_read_ending_at_an_end_of_turn_id_is_the_end(fakes):
    """An end-of-turn id listed only in the generation config's eos_token_id becomes a stop token id: vLLM answers
    finish_reason "stop" with stop_reason = that id (an int), which ends the row as EOS does."""
    r = _engine("vllm", fakes(FakeVLLM, end_of_turn=True)).read(CONTEXT, STEP, top_k=2, hidden=False,
                                                                 sampling=GREEDY, seed=0)
    assert (r.next_eos, r.next_text) == (True, "")


@pytest.mark.parametrize("version", ["0.5.4", "0.5.16"])
def test_sglang_before_0_5_17_is_refused_for_hidden_naming_the_version(fakes, version):
    """Before 0.5.17 a batched prefill with a cached prefix gives a request another request's hidden rows: refused
    where the probe's groups are checked and at a hidden read, before any /generate request; top-k reads still
    serve."""
    fake = fakes(FakeSGLang, version=version)
    engine = _engine("sglang", fake)
    with pytest.raises(Unsupported, match=rf"runs {version}.*SGLang >= 0.5.17") as e:
        require(engine, FeatureSpec(groups=("hidden",)), "target")
    assert fake.root in str(e.value) and "can serve ['topk_stats']" in str(e.value)
    with pytest.raises(Unsupported, match="0.5.17"):
        engine.read(CONTEXT, STEP, top_k=2, hidden=True, sampling=GREEDY, seed=0)
    assert not fake.posts("/generate")
    assert engine.read(CONTEXT, STEP, top_k=2, hidden=False, sampling=GREEDY, seed=0).step.ids
    assert _engine("sglang", fakes(FakeSGLang, version="0.5.17")).capabilities().hidden


def test_sglang_preferred_sampling_params_that_fill_unstated_fields_are_refused(fakes):
    """--preferred-sampling-params fills every field a /generate request leaves unset: a preferred stop string or
    ignore_eos would change every written step, so such a server is refused when the client is made, naming the flag
    and the fields; preferred values of fields every request states are overridden and accepted."""
    fake = fakes(FakeSGLang, preferred={"temperature": 0.6, "stop": ["Answer"], "ignore_eos": True})
    with pytest.raises(Unsupported, match=r"--preferred-sampling-params with \['ignore_eos', 'stop'\]") as e:
        _engine("sglang", fake)
    assert fake.root in str(e.value) and not fake.posts("/generate") and not fake.posts("/v1/tokenize")
    _engine("sglang", fakes(FakeSGLang, preferred={"temperature": 0.6, "top_k": 20}))


def test_sglang_server_info_is_asked_again_when_the_server_is_busy(fakes):
    """A busy server that answers /server_info late (or 503) is asked again with the connection's retries, not
    refused as "not SGLang" after one quick attempt."""
    fake = fakes(FakeSGLang, busy=1)
    assert make_engine("sglang", fake.root, api_key_env="", retries=2, timeout=10.0).version == "0.5.23"


@pytest.mark.parametrize("finish", [{"type": "length", "length": 2}, {"type": "stop", "matched": 2}])
def test_sglang_a_read_whose_drawn_token_comes_before_eos_is_read(fakes, finish):
    """SGLang decodes each logprob row's id with its special tokens (``tokenizer_manager.py``
    ``detokenize_logprob_tokens``: ``batch_decode``, ``skip_special_tokens`` False, 0.5.4 to 0.5.23) and the text
    without them: a read that drew its token, then EOS, ended at ``length`` (before 0.5.18) or ``stop`` (after) with
    rows ``" B"``, ``"</s>"`` and text ``" B"``, which was refused as token texts that do not spell the text."""
    engine = _engine("sglang", fakes(FakeSGLang))
    meta = {"finish_reason": finish, "completion_tokens": 2,
            "output_token_logprobs": [[-0.1, 104, " B"], [-0.2, 2, "</s>"]]}
    assert engine._next_token(meta, " B") == (False, " B", 104)


@pytest.mark.parametrize("version, stop", [("0.5.17", "eos"), ("0.5.23", "length")])
def test_sglang_a_write_whose_last_allowed_token_is_eos_ends_at_eos(fakes, version, stop):
    """Before 0.5.18 SGLang tests the length limit before EOS (``schedule_batch.py`` ``Req.check_finished``): a write
    whose last allowed token is EOS ends at ``length``, its EOS row read ``"</s>"``; it was a cut step holding an EOS
    row the text lacks. From 0.5.18 such a write ends at ``stop``, so a last row the text skips is some other special
    token, and the step stays cut at its length."""
    engine = _engine("sglang", fakes(FakeSGLang, version=version, hidden=False))
    got = {"text": " a b"}
    meta = {"finish_reason": {"type": "length", "length": 3}, "completion_tokens": 3, "prompt_tokens": 4,
            "output_token_logprobs": [[-0.1, 5, " a"], [-0.1, 6, " b"], [-0.1, 2, "</s>"]]}
    w = engine._written(got, meta, 0.0, CONTEXT, None, StepSpec(("\n\n",), 3), None, False, 0)
    assert (w.text, w.stop) == (" a b", stop)


def test_sglang_abort_is_asked_again_before_it_is_an_error(fakes):
    """SGLang answers an aborted request with HTTP 200 and finish_reason abort: a transient abort is asked again."""
    fake = fakes(FakeSGLang, abort=1)
    w = make_engine("sglang", fake.root, api_key_env="", retries=2, timeout=10.0).write(
        CONTEXT, step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=0)
    assert (w.text, w.stop, len(fake.posts("/generate"))) == ("a b\n\n", "delimiter", 2)
