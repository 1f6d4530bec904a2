"""The OpenAI-compatible endpoint: real clients (the ``openai`` package, sync and async, and curl), its
bad-input answers, its faults (a client that leaves, a full queue, a wrong key, SIGTERM), and requests that join a
running loop decoding as they would alone. The embedded world in-process; the served world in test_endpoint_served."""

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from arithmetic_world.task import ArithmeticTask
from semanticspec.config import DecodeConfig
from tests.conftest import Running, free_port

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
TASK = ArithmeticTask()
LONG = "Start with 1. " + "Add 1, then " * 10 + "add 1. What is the result?\n\n"
"""A prompt the target answers in 55 tokens, about 6 steps (0.6 s on 2 cores): a request that is still decoding."""


@pytest.fixture(scope="module")
def world_decoder():
    from semanticspec.serve.cli import ServeOptions, build

    app = build(ServeOptions())
    yield app.state.scheduler.dec, app
    app.state.scheduler.stop(0)


@pytest.fixture(scope="module")
def endpoint(world_decoder):
    running = Running(world_decoder[1])
    yield running
    running.stop()


def _problem(k: int) -> str:
    return TASK.problems(k + 1, seed=11)[k]["problem"]


def _alone(dec, prompt, seed: int, max_tokens: int = 96) -> str:
    """The text the Python API decodes for ``prompt`` alone (its steps joined, as the endpoint sends them)."""
    *_, end = dec.stream([prompt], DecodeConfig(max_new_tokens=max_tokens, seed=seed))
    return end.text


def test_the_openai_client_sync_and_async_streaming_and_not_gets_the_python_apis_text(endpoint, world_decoder):
    dec = world_decoder[0]
    prompt = TASK.prompt_text(dec.tokenizer, _problem(0))
    want = _alone(dec, prompt, seed=7)
    c = endpoint.client()
    full = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7)
    assert full.choices[0].text == want and full.choices[0].finish_reason == "stop"
    u = full.usage.model_dump()
    assert u["completion_tokens"] > 0 and u["prompt_tokens"] == len(dec.tokenizer(prompt).input_ids)
    spec = u["semanticspec"]
    assert 0 <= spec["draft_steps_accepted"] <= spec["draft_steps_proposed"] and 0 <= spec["draft_token_share"] <= 1
    chunks = list(c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == u["completion_tokens"]

    async def both():
        a = openai.AsyncOpenAI(base_url=endpoint.url, api_key="none", max_retries=0)
        one = await a.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7)
        streamed = await a.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7, stream=True)
        return one.choices[0].text, "".join([ch.choices[0].text async for ch in streamed if ch.choices])

    assert asyncio.run(both()) == (want, want)


def test_chat_formats_with_the_template_and_a_model_without_one_gets_a_400(endpoint, world_decoder):
    from semanticspec.serve.app import Settings, build_app

    dec, problem = world_decoder[0], _problem(1)
    want = _alone(dec, TASK.prompt_text(dec.tokenizer, problem), seed=3)
    c = endpoint.client()
    got = c.chat.completions.create(model="semanticspec", messages=[{"role": "user", "content": problem}],
                                    max_tokens=96, seed=3)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    stream = list(c.chat.completions.create(model="semanticspec", messages=[{"role": "user", "content": problem}],
                                            max_tokens=96, seed=3, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == want
    # vLLM's and OpenAI's opening chunk: the role with empty content, alone; no later chunk repeats the role
    deltas = [ch.choices[0].delta.model_dump(exclude_none=True) for ch in stream]
    assert deltas[0] == {"role": "assistant", "content": ""} and all("role" not in d for d in deltas[1:])
    bare = Running(build_app(dec, Settings()))  # the world's tokenizer has no template of its own
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template") as e:
            bare.client().chat.completions.create(model="semanticspec", messages=[{"role": "user", "content": "1"}])
        assert e.value.body["param"] == "messages"
    finally:
        bare.stop()
        bare.app.state.scheduler.stop(0)


def test_a_template_that_fails_on_the_messages_values_is_a_bad_request_not_a_500(world_decoder):
    """A ``TypeError`` inside a chat template (here adding a number to the content) was a 500; vLLM's serving_chat
    answers it, as a template's own ``raise_exception``, with a 400."""
    from semanticspec.serve.app import chat_prompt
    from semanticspec.serve.cli import check_template

    dec, template = world_decoder[0], "{{ messages[0]['content'] + 1 }}"
    with pytest.raises(ValueError, match=r"^messages: the chat template cannot format them: can only concatenate"):
        chat_prompt(dec, dec.tokenizer, [{"role": "user", "content": "1"}], template)
    with pytest.raises(ValueError, match=r"^--chat_template: the target tokenizer cannot format a chat with it "
                                         r"\(TypeError: can only concatenate"):  # at start-up: it was a traceback
        check_template(dec.tokenizer, template)


def test_a_chats_turns_are_lines_and_an_assistant_turn_the_world_cannot_continue_gets_a_400(endpoint):
    """The world's chat format reads every turn, one per line: two user turns read as one message holding both, and
    a system (or developer) turn is read before the problem, not dropped; an assistant turn is refused, naming it,
    since the world's models answer one problem and cannot continue a conversation."""
    c = endpoint.client()

    def used(messages):
        return c.chat.completions.create(model="semanticspec", messages=messages, max_tokens=2, seed=0).usage

    one = used([{"role": "user", "content": "Start with 7.\nAdd 5."}]).prompt_tokens
    assert used([{"role": "user", "content": "Start with 7."}, {"role": "user", "content": "Add 5."}]).prompt_tokens \
        == one
    for role in ("system", "developer"):
        assert used([{"role": role, "content": "Start with 7."}, {"role": "user", "content": "Add 5."}]).prompt_tokens \
            == one, role
    with pytest.raises(openai.BadRequestError) as e:
        used([{"role": "user", "content": "Start with 7."}, {"role": "assistant", "content": "7."}])
    err = e.value.body
    assert err["param"] == "messages" and "message 1 is an assistant message" in err["message"], err


def test_null_means_not_given_and_a_message_passed_back_whole_is_read(endpoint):
    """A field OpenAI lets be null takes its default at null (an SDK sends an argument given as None so), and a
    message with OpenAI's own fields at null (``message.model_dump()`` of an answer) is read as its text; those fields
    set to something are refused by name."""
    c = endpoint.client()
    nulls = dict(n=None, stream=None, stream_options=None, temperature=None, stop=None, seed=0, max_tokens=3)
    plain = c.completions.create(model="semanticspec", prompt="Start with 2.", max_tokens=3, seed=0)
    assert c.completions.create(model="semanticspec", prompt="Start with 2.", **nulls).choices[0].text \
        == plain.choices[0].text
    empty = {**nulls, "stream_options": {}}  # sets nothing: vLLM takes it without a stream (validate_stream_options)
    assert c.completions.create(model="semanticspec", prompt="Start with 2.", **empty).choices[0].text \
        == plain.choices[0].text
    extra = {"method": None, "allow_sampling_mismatch": None}
    assert c.completions.create(model="semanticspec", prompt="Start with 2.", max_tokens=3, seed=0,
                                extra_body=extra).choices[0].text == plain.choices[0].text
    turn = {"role": "user", "content": "Start with 2.", "refusal": None, "tool_calls": None, "function_call": None,
            "audio": None, "annotations": None, "name": None}
    said = c.chat.completions.create(model="semanticspec", messages=[turn], max_tokens=3, seed=0)
    assert said.choices[0].message.content == c.chat.completions.create(
        model="semanticspec", messages=[{"role": "user", "content": "Start with 2."}], max_tokens=3,
        seed=0).choices[0].message.content
    chunks = list(c.completions.create(model="semanticspec", prompt="Start with 2.", max_tokens=3, seed=0,
                                       stream=True, stream_options={"include_usage": None}))
    assert "".join(x.choices[0].text for x in chunks if x.choices) == plain.choices[0].text
    assert all(x.usage is None for x in chunks)  # include_usage at null: not asked
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="semanticspec", max_tokens=3,
                                  messages=[{**turn, "tool_calls": [{"id": "1", "type": "function"}]}])
    err = e.value.body
    assert err["param"] == "messages.0.tool_calls" and "not supported by this endpoint" in err["message"], err



def test_openais_current_chat_fields_are_read_and_other_content_parts_refused_by_type(endpoint):
    """Fields the ``openai`` package (3.63) sends on chat requests were refused as "not OpenAI's": the caller and cache
    hints (``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``) are ignored as ``user`` is,
    ``verbosity`` and ``include_obfuscation`` read at their neutral values; an image part was refused as "not a valid
    string"."""
    c, turn = endpoint.client(), [{"role": "user", "content": "Start with 2."}]
    plain = c.chat.completions.create(model="semanticspec", messages=turn, max_tokens=3, seed=0)
    hints = dict(safety_identifier="u1", prompt_cache_key="k", prompt_cache_retention="in_memory", verbosity="medium")
    hinted = c.chat.completions.create(model="semanticspec", messages=turn, max_tokens=3, seed=0, **hints)
    assert hinted.choices[0].message.content == plain.choices[0].message.content
    chunks = list(c.chat.completions.create(model="semanticspec", messages=turn, max_tokens=3, seed=0, stream=True,
                                            stream_options={"include_obfuscation": False}))
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == plain.choices[0].message.content
    for kw, param, says in ((dict(verbosity="high"), "verbosity", "not supported by this endpoint"),
                            (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
                                "url": "data:,"}}]}]), "messages.0.content", "type 'image_url' is not supported")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{"model": "semanticspec", "messages": turn, "max_tokens": 3, **kw})
        assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body


BAD = [
    ('{"prompt": "1 + 1"', None, "malformed JSON"),
    ({"prompt": "x", "colour": 1}, "colour", "unknown field"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens", "integer"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens=0"),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens", "max_tokens=100000"),
    ({"prompt": "x", "max_tokens": 250}, "max_tokens", "the decoder keeps 7 positions free"),
    ({"prompt": "x", "max_tokens": 250}, "max_tokens", "at most 247 new tokens fit after the prompt's 2 tokens"),
    ({"prompt": "x", "max_completion_tokens": 250}, "max_completion_tokens",
     "max_completion_tokens=250: too large; at most 247 new tokens fit after the prompt's 2 tokens in the models' "
     "context, of which the decoder keeps 7 positions free"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only with stream=true"),
    ({"prompt": "x", "stream_options": {"include_usage": False}}, "stream_options", "only with stream=true"),
    ({"prompt": "x", "stop": ["\n", ""]}, "stop", "stop: holds an empty string"),
    ({"prompt": "3 " * 250}, "prompt", "prompt: the prompt has 252 tokens, which leave no room"),
    ({"prompt": "x", "n": 2}, "n", "n=2"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": "3 " * 3000}, "prompt", "context"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature=-1"),
    ({"prompt": "x", "method": "fastest"}, "method", "method='fastest'"),
    ({"prompt": "x", "lookahead": 0}, "lookahead", "lookahead=0"),
    ({"prompt": "x", "lookahead": 1000}, "lookahead", "cannot fit"),
    ({"prompt": "x", "seed": 2**64}, "seed", "less than or equal to 9223372036854775807"),
    ({"prompt": [1, 2, 3]}, "prompt", "prompt: token ids are not supported by this endpoint"),
    ({"prompt": "x", "stop": ["\n", 1]}, "stop.1", "stop.1: Input should be a valid string"),  # not "stop: ..."
    ('{"prompt": "x", "\\ud800": 1}', None, "a field's name holds a lone UTF-16 surrogate"),
]


@pytest.mark.parametrize("content,says", [("3 " * 3000, r"has \d+ tokens but the target model's context"),
                                           ("3 " * 246, r"has 2\d\d tokens, which leave no room")],
                         ids=["past-context", "no-room"])
def test_a_chat_too_long_gets_a_400_naming_messages(endpoint, content, says):
    """A chat's prompt is its messages in the chat template: a refusal of it names ``messages``, never the
    ``prompt`` a chat request has no field for, nor the decoder's index of it in a batch."""
    with pytest.raises(openai.BadRequestError) as e:
        endpoint.client().chat.completions.create(model="semanticspec", max_tokens=4,
                                                  messages=[{"role": "user", "content": content}])
    err = e.value.body
    assert err["param"] == "messages" and re.match("messages: the chat in its template " + says, err["message"])


def test_a_chat_of_many_empty_turns_is_refused_before_its_template_runs(endpoint):
    """Empty messages counted no characters, so 300,000 of them passed the length check and held the decode thread
    (and every request in it) for seconds in the chat template; every turn counts now. Sent as raw HTTP: the openai
    client itself spends seconds building a body of 20,000 messages."""
    import urllib.request

    body = {"model": "semanticspec", "max_tokens": 1, "messages": [{"role": "user", "content": ""}] * 20000}
    req = urllib.request.Request(endpoint.url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and err["param"] == "messages" and "20000 characters" in err["message"]


@pytest.mark.parametrize("body,param,says", BAD, ids=[b[2] for b in BAD])
def test_bad_input_gets_a_400_naming_the_field_and_the_server_goes_on(endpoint, body, param, says):
    import urllib.request

    data = body if isinstance(body, str) else json.dumps(body)
    req = urllib.request.Request(endpoint.url + "/completions", data=data.encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    err = json.loads(e.value.read())["error"]
    assert err["param"] == param and says in err["message"] and err["type"] == "invalid_request_error"
    ok = endpoint.client().completions.create(model="semanticspec", prompt="Start with 2.", max_tokens=4, seed=1)
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_server_sent_events_ending_with_done(endpoint, world_decoder):
    dec = world_decoder[0]
    prompt = TASK.prompt_text(dec.tokenizer, _problem(2))
    body = json.dumps({"model": "semanticspec", "prompt": prompt, "max_tokens": 96, "seed": 5, "stream": True})
    out = subprocess.run(["curl", "-sN", endpoint.url + "/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=120, check=True).stdout
    events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == _alone(dec, prompt, seed=5)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and all(c["object"] == "text_completion" for c in chunks)
    assert not any("usage" in c for c in chunks)
    usage_asked = json.dumps({**json.loads(body), "stream_options": {"include_usage": True}})
    out = subprocess.run(["curl", "-sN", endpoint.url + "/completions", "-H", "Content-Type: application/json",
                          "-d", usage_asked], capture_output=True, text=True, timeout=120, check=True).stdout
    with_usage = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("data: {")]
    # OpenAI: "All other chunks will also include a usage field, but with a null value"
    assert all(c["usage"] is None for c in with_usage[:-1]) and with_usage[-1]["usage"]["completion_tokens"] > 0
    assert with_usage[-1]["choices"] == []
    models = json.loads(subprocess.run(["curl", "-s", endpoint.url + "/models"], capture_output=True, text=True,
                                       timeout=30, check=True).stdout)
    assert [m["id"] for m in models["data"]] == ["semanticspec"] and models["data"][0]["created"] > 1.7e9
    version = json.loads(subprocess.run(["curl", "-s", endpoint.url[:-3] + "/version"], capture_output=True,
                                        text=True, timeout=30, check=True).stdout)
    assert version["version"] not in ("", None)
    metrics = subprocess.run(["curl", "-s", endpoint.url[:-3] + "/metrics"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    for name in ("semanticspec_requests_total", "semanticspec_tokens_total", "semanticspec_steps_total",
                 "semanticspec_step_seconds_bucket", "semanticspec_queue_length", "semanticspec_running_rows"):
        assert name in metrics


def test_stop_strings_cut_the_text_and_the_extra_body_sets_semanticspecs_options(endpoint, world_decoder):
    """``stop`` ends the answer before the stop string (OpenAI's rule), streamed or not; ``threshold`` replaces the
    policy's tau for the request (0: every judged step is kept) and ``method`` picks the method."""
    dec = world_decoder[0]
    prompt = TASK.prompt_text(dec.tokenizer, _problem(0))
    whole = _alone(dec, prompt, seed=7)
    stop = whole[whole.index("\n\n") + 2 :][:4]  # the start of the second step
    c = endpoint.client()
    got = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7, stop=[stop])
    assert got.choices[0].text == whole[: whole.index(stop)] and got.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == got.choices[0].text
    kept = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7,
                                extra_body={"threshold": 0.0}).usage.model_extra["semanticspec"]
    assert kept["draft_steps_accepted"] == kept["draft_steps_proposed"] > 0
    target = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7,
                                  extra_body={"method": "target_only"}).usage.model_extra["semanticspec"]
    assert target["draft_steps_proposed"] == 0 and target["draft_token_share"] == 0.0
    with pytest.raises(openai.BadRequestError, match="threshold"):
        c.completions.create(model="semanticspec", prompt=prompt, extra_body={"method": "target_only",
                                                                               "threshold": 0.5})


def test_target_first_step_rides_in_the_extra_body_as_the_python_api_reads_it(endpoint, world_decoder):
    """The README recommends ``target_first_step=True`` for a draft far from its target; the endpoint refused the field
    as unknown. It decodes as the Python API does with it, and a value that is not a boolean is a 400 naming it."""
    dec = world_decoder[0]
    prompt = TASK.prompt_text(dec.tokenizer, _problem(2))
    *_, want = dec.stream([prompt], DecodeConfig(max_new_tokens=64, seed=9, target_first_step=True))
    assert want.result.steps[0].writer == "target"
    c = endpoint.client()
    got = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=64, seed=9,
                               extra_body={"target_first_step": True})
    assert got.choices[0].text == want.text
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="semanticspec", prompt=prompt, max_tokens=4, extra_body={"target_first_step": "yes"})
    assert e.value.body["param"] == "target_first_step"


def test_a_temperature_too_small_to_divide_by_is_greedy_as_vllm_reads_it(endpoint, world_decoder):
    """``temperature: 1e-40`` overflowed the tempered softmax: a 500 (``probability tensor contains inf``) for the
    speculative methods, and for the others a 200 with an empty text and 8 tokens counted. vLLM's sampler reads a
    temperature below 1e-5 as greedy (``_SAMPLING_EPS``), so it answers as temperature 0."""
    dec = world_decoder[0]
    prompt = TASK.prompt_text(dec.tokenizer, _problem(1))
    c = endpoint.client()
    for method in ("semanticspec", "target_only", "always_reject"):
        tiny, zero = (c.completions.create(model="semanticspec", prompt=prompt, max_tokens=24, seed=3, temperature=t,
                                           extra_body={"method": method, "allow_sampling_mismatch": True})
                      for t in (1e-40, 0.0))
        assert tiny.choices[0].text == zero.choices[0].text != "", method
        assert tiny.usage.completion_tokens == zero.usage.completion_tokens, method


def test_a_wrong_api_key_gets_a_401_and_the_key_is_never_logged(world_decoder, capfd):
    from semanticspec.serve.app import Settings, build_app

    run = Running(build_app(world_decoder[0], Settings(api_key="sk-right-key-123")))
    try:
        with pytest.raises(openai.AuthenticationError):
            run.client(api_key="sk-wrong").completions.create(model="semanticspec", prompt="Start with 1.",
                                                              max_tokens=4)
        ok = run.client(api_key="sk-right-key-123").completions.create(model="semanticspec", prompt="Start with 1.",
                                                                       max_tokens=4, seed=0)
        assert ok.choices[0].text is not None
    finally:
        run.stop()
        run.app.state.scheduler.stop(0)
    out, err = capfd.readouterr()
    assert "sk-right-key-123" not in out + err


def test_metrics_count_requests_by_route_never_by_the_path_a_client_sent(world_decoder):
    """A path anyone may request (a 404, a 401 before routing) is counted as ``other``: one series per invented path
    would grow /metrics without bound. Every answer is counted, FastAPI's own (its OpenAPI schema, a trailing slash's
    redirect) too: those had been counted by no handler."""
    import re

    import httpx2

    from semanticspec.serve.app import Settings, build_app

    run, auth = Running(build_app(world_decoder[0], Settings(api_key="sk-k"))), {"Authorization": "Bearer sk-k"}
    try:
        for i in range(3):
            assert httpx2.get(f"{run.url[:-3]}/random-{i}").status_code == 404
            assert httpx2.get(f"{run.url}/nope-{i}").status_code == 401  # the key check, before routing
            assert httpx2.get(f"{run.url}/nope-{i}", headers=auth).status_code == 404
            assert httpx2.get(f"{run.url}/models/model-{i}", headers=auth).status_code == 404
        assert httpx2.delete(f"{run.url}/completions", headers=auth).status_code == 405
        for _ in range(2):  # the answered GETs count too
            assert httpx2.get(f"{run.url}/models", headers=auth).status_code == 200
        assert httpx2.get(f"{run.url}/models/semanticspec", headers=auth).status_code == 200
        assert httpx2.get(f"{run.url[:-3]}/health").status_code == 200
        assert httpx2.get(f"{run.url[:-3]}/openapi.json").status_code == 200
        assert httpx2.get(f"{run.url[:-3]}/health/", follow_redirects=False).status_code == 307
        text = httpx2.get(f"{run.url[:-3]}/metrics").text
    finally:
        run.stop()
        run.app.state.scheduler.stop(0)
    routes = set(re.findall(r'semanticspec_requests_total\{route="([^"]*)"', text))
    assert routes == {"other", "/v1/models", "/v1/models/{model:path}", "/v1/completions", "/health",
                      "/metrics", "/openapi.json"}, routes
    for series, n in (('route="other",status="404"', 6), ('route="other",status="401"', 3),
                      ('route="/v1/models/{model:path}",status="404"', 3), ('route="/v1/completions",status="405"', 1),
                      ('route="/v1/models",status="200"', 2), ('route="/v1/models/{model:path}",status="200"', 1),
                      ('route="/health",status="200"', 1), ('route="/metrics",status="200"', 1),
                      ('route="/openapi.json",status="200"', 1), ('route="other",status="307"', 1)):
        assert f"semanticspec_requests_total{{{series}}} {n:.1f}" in text, series


def test_metrics_count_each_finish_reason_and_time_every_request_to_its_end(world_decoder):
    """As vLLM's request_success, e2e latency and time-to-first-token metrics: a request that ends (streamed or not)
    is counted by its finish reason, a row that failed as ``error`` (its stream's status went out as 200), and each
    is timed from its arrival; the time to first text only where there was text."""
    import httpx2

    from semanticspec.serve.app import Settings, build_app

    dec = world_decoder[0]
    run, step_loop = Running(build_app(dec, Settings())), dec.step_loop

    def failing(*a):
        dec.step_loop = step_loop
        raise RuntimeError("injected fault")

    body = {"model": "semanticspec", "prompt": TASK.prompt_text(dec.tokenizer, _problem(1)), "seed": 0}
    try:
        short = httpx2.post(run.url + "/completions", json={**body, "max_tokens": 2}, timeout=60).json()
        with httpx2.stream("POST", run.url + "/completions", timeout=60,
                           json={**body, "max_tokens": 200, "stream": True,
                                 "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        dec.step_loop = failing
        failed = httpx2.post(run.url + "/completions", json={**body, "max_tokens": 4}, timeout=60)
        text = httpx2.get(run.url[:-3] + "/metrics").text
    finally:
        dec.step_loop = step_loop
        run.stop()
        run.app.state.scheduler.stop(0)
    assert short["choices"][0]["finish_reason"] == "length" and failed.status_code == 500, failed.text
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    for reason in ("length", "stop", "error"):
        assert f'semanticspec_requests_finished_total{{finished_reason="{reason}"}} 1.0' in text, reason
    figure = {m[0]: float(m[1]) for m in re.findall(r"^(semanticspec_\w+) (\S+)$", text, re.M)}
    assert figure["semanticspec_e2e_request_latency_seconds_count"] == 3
    assert figure["semanticspec_time_to_first_token_seconds_count"] == 2  # the failed row wrote nothing
    first, whole = (figure[f"semanticspec_{k}_seconds_sum"] for k in ("time_to_first_token", "e2e_request_latency"))
    assert 0 < first < whole
    completion = short["usage"]["completion_tokens"] + events[-1]["usage"]["completion_tokens"]
    assert f'semanticspec_tokens_total{{kind="completion"}} {completion:.1f}' in text


def test_health_is_503_while_a_backend_is_marked_gone(endpoint, world_decoder):
    """A backend found gone is not asked again for a while (its requests refused at once): /health says so until
    then, though the server may answer a health check already, so that it never says "ok" while requests fail."""
    import httpx2

    class Gone:
        root = "http://127.0.0.1:9"

        def down(self):
            return f"{self.root} is not asked for 12 s more: it failed /v1/completions after 3 attempt(s)"

    target = world_decoder[0].target
    assert httpx2.get(endpoint.url[:-3] + "/health").status_code == 200
    target.conn = Gone()
    body = {"model": "semanticspec", "prompt": "Start with 1.", "max_tokens": 4}
    try:
        r = httpx2.get(endpoint.url[:-3] + "/health")
        answers = [httpx2.post(endpoint.url + "/completions", json={**body, "stream": stream})
                   for stream in (False, True)]
    finally:
        del target.conn
    assert r.status_code == 503 and r.json()["backends_down"] == [Gone.root]
    assert "is not asked for 12 s more" in r.json()["reason"]
    for a in answers:  # a stream got a 200 and an error event: its headers went before its first step failed
        assert a.status_code == 502 and a.json()["error"]["message"].startswith(f"backend down: {Gone.root} is not")


def test_a_full_queue_gets_a_429_with_retry_after(world_decoder):
    from semanticspec.serve.app import Settings, build_app

    run = Running(build_app(world_decoder[0], Settings(max_rows=1, max_queue=1)))
    try:
        first = run.client().completions.create(model="semanticspec", prompt=LONG, max_tokens=150, seed=0,
                                                stream=True, extra_body={"method": "target_only"})
        next(iter(first))  # the first request is decoding (about 0.6 s of target steps)
        with pytest.raises(openai.RateLimitError) as e:
            run.client().completions.create(model="semanticspec", prompt="Start with 1.", max_tokens=4)
        assert e.value.response.headers["retry-after"] == "1" and "max_queue=1" in e.value.message
        assert "".join(ch.choices[0].text for ch in first)  # the first one finishes
        ok = run.client().completions.create(model="semanticspec", prompt="Start with 1.", max_tokens=4, seed=0)
        assert ok.choices[0].finish_reason in ("stop", "length")
    finally:
        run.stop()
        run.app.state.scheduler.stop(0)


def test_a_client_that_disconnects_frees_its_row_at_the_next_round(endpoint, world_decoder):
    sched = world_decoder[1].state.scheduler
    cancelled = sched.cancelled
    stream = endpoint.client().completions.create(model="semanticspec", prompt=LONG, max_tokens=150, seed=0,
                                                  stream=True, extra_body={"method": "target_only"})
    next(iter(stream))
    assert sched.pending == 1
    stream.response.close()
    t0 = time.time()
    while sched.pending and time.time() - t0 < 20:
        time.sleep(0.05)
    assert sched.pending == 0 and sched.running == 0
    assert sched.cancelled == cancelled + 1  # its row left the loop before its end


@pytest.mark.slow  # a second process loading the world: 10 s on 2 cores
def test_sigterm_finishes_requests_in_flight_and_exits_0(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "semanticspec.serve", "--port", str(port), "--shutdown_timeout",
                             "20"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert "SemanticSpec endpoint on" in proc.stdout.readline()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        for _ in range(200):
            try:
                c.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.05)
        stream = c.completions.create(model="semanticspec", prompt="Start with 7. Add 5, then multiply it by 3. "
                                      "What is the result?\n\n", max_tokens=96, seed=7, stream=True)
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = [ch.choices[0] for ch in stream if ch.choices]
        assert rest and rest[-1].finish_reason in ("stop", "length")  # the request in flight finished
        assert first.choices[0].text + "".join(r.text for r in rest)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


ROWS_BODY = {"prompt": "Start with 1. " + "Add 1, then " * 20 + "add 1. What is the result?\n\n", "max_tokens": 150,
             "method": "target_only", "lookahead": 1}
"""A request that decodes for about 0.8 s on 2 cores."""


def _serve_until_healthy(log: Path, shutdown_timeout: str):
    """``python -m semanticspec.serve`` in a process of its own, its output into ``log``, once its /health answers:
    the process and the root URL."""
    import httpx2

    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "semanticspec.serve", "--port", str(port), "--shutdown_timeout",
                                 shutdown_timeout], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    root = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            httpx2.get(root + "/health", timeout=5)
            break
        except httpx2.TransportError:
            time.sleep(0.05)
    return proc, root


@pytest.mark.slow  # a second process loading the world: 15 s on 2 cores
def test_sigterm_past_the_shutdown_timeout_ends_requests_with_a_503_not_a_cut(tmp_path):
    """Two requests decode when SIGTERM comes with --shutdown_timeout 1.5: each row still decoding half a second
    later ends with a 503 (a stream: an error event, then [DONE]) before uvicorn cancels its handler, and the
    process exits 0 without a storm of tracebacks. Both rows together take about 1.6 s on 2 cores, so the timeout
    cuts at least one of them."""
    import httpx2

    log = tmp_path / "serve.log"
    proc, root = _serve_until_healthy(log, "1.5")
    body, got = ROWS_BODY, {}

    def whole():  # the non-streaming request: a 200 or a JSON 503, never a plain-text 500 or a dropped connection
        try:
            r = httpx2.post(root + "/v1/completions", json=body, timeout=60)
            got["whole"] = (r.status_code, r.json())
        except (httpx2.HTTPError, ValueError) as e:
            got["whole"] = (None, repr(e))

    try:
        t = threading.Thread(target=whole)
        t.start()
        with httpx2.stream("POST", root + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            for _ in range(500):  # until both decode
                if "semanticspec_running_rows 2.0" in httpx2.get(root + "/metrics").text:
                    break
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data: ")]
        t.join(60)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "data: [DONE]"  # never cut
    last = json.loads(events[-2][6:])
    if "error" in last:
        assert last["error"]["type"] == "server_error" and "shut" in last["error"]["message"]
    else:
        assert last["choices"][0]["finish_reason"] in ("stop", "length")
    status, answer = got["whole"]
    assert status in (200, 503), answer
    if status == 503:
        assert answer["error"]["type"] == "server_error" and "shut" in answer["error"]["message"]
    assert status == 503 or "error" in last  # the timeout cut at least one of them
    output = log.read_text()
    assert sum("CancelledError" in line or "Traceback" in line for line in output.splitlines()) < 20, output


@pytest.mark.slow  # a second process loading the world: 15 s on 2 cores
def test_a_second_ctrl_c_ends_the_requests_left_at_once_and_exits_0_without_tracebacks(tmp_path):
    """uvicorn's rule: a second Ctrl-C quits without waiting. The endpoint waited for its requests all the same (up to
    --shutdown_timeout, 30 s here), and then printed the lifespan's CancelledError traceback. Now the requests left
    end with an error event and [DONE] at once, and the log stays clean."""
    import httpx2

    log = tmp_path / "serve.log"
    proc, root = _serve_until_healthy(log, "30")
    body, events, started = {**ROWS_BODY, "stream": True}, {}, threading.Semaphore(0)

    def stream(k):
        with httpx2.stream("POST", root + "/v1/completions", json={**body, "seed": k}, timeout=60) as r:
            events[k] = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[k].append(line)
                    if len(events[k]) == 1:
                        started.release()

    try:
        threads = [threading.Thread(target=stream, args=(k,)) for k in range(12)]
        for t in threads:
            t.start()
        assert started.acquire(timeout=60)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(events) == 12 and all(e[-1] == "data: [DONE]" for e in events.values())
    ended = [json.loads(e[-2][6:]) for e in events.values()]
    assert any("second Ctrl-C" in (x.get("error") or {}).get("message", "") for x in ended), ended
    output = log.read_text()
    assert "Traceback" not in output and "CancelledError" not in output, output


@pytest.mark.slow
def test_64_requests_arriving_at_random_times_each_decode_as_alone(endpoint, world_decoder):
    """The load goal: 64 seeded requests (a quarter target-only, so two loops take turns) arrive over about
    three seconds and join the running loops between rounds; every stream's chunks, and every non-streaming answer
    of a second wave, equal the prompt decoded alone through the Python API with the same seed."""
    import random

    dec, sched = world_decoder
    dec, sched = dec, sched.state.scheduler
    problems = TASK.problems(64, seed=21)
    jobs = [(TASK.prompt_text(dec.tokenizer, p["problem"]), 100 + k, "target_only" if k % 4 == 3 else "semanticspec")
            for k, p in enumerate(problems)]
    want = [_alone_with(dec, prompt, seed, method) for prompt, seed, method in jobs]
    rng = random.Random(0)
    delays = sorted(rng.uniform(0, 3) for _ in jobs)

    async def wave(stream: bool):
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="none", max_retries=0, timeout=300)

        async def one(k):
            prompt, seed, method = jobs[k]
            await asyncio.sleep(delays[k])
            kw = dict(model="semanticspec", prompt=prompt, max_tokens=96, seed=seed, extra_body={"method": method})
            if not stream:
                return (await client.completions.create(**kw)).choices[0].text
            chunks = await client.completions.create(**kw, stream=True)
            return "".join([ch.choices[0].text async for ch in chunks if ch.choices])

        return await asyncio.gather(*(one(k) for k in range(len(jobs))))

    joined = sched.joined
    streamed = asyncio.run(wave(True))
    assert sched.joined - joined >= 16  # requests joined running loops between rounds
    assert [k for k in range(64) if streamed[k] != want[k]] == []
    whole = asyncio.run(wave(False))
    assert [k for k in range(64) if whole[k] != want[k]] == []
    assert sched.pending == 0


def _alone_with(dec, prompt, seed: int, method: str) -> str:
    *_, end = dec.stream([prompt], DecodeConfig(max_new_tokens=96, seed=seed, method=method))
    return end.text


@pytest.mark.parametrize("args,says", [(["--max_rows", "0"], "--max_rows=0"),
                                       (["--prot", "1"], "--prot 1; did you mean --port?"),
                                       (["--target_url", "http://127.0.0.1:9"], "--draft_url"),
                                       (["--shutdown_timeout", "-1"], "--shutdown_timeout=-1.0"),
                                       pytest.param(["--target_url", "http://127.0.0.1:9", "--draft_url",
                                                     "http://127.0.0.1:9", "--port", "{free}"], "http://127.0.0.1:9",
                                                    marks=pytest.mark.slow),  # no backend: 5 s of retries
                                       (["--port", "{busy}"], "--port={busy}"),
                                       (["--port", "99999"], "--port=99999: expected a port from 1 to 65535"),
                                       (["--host", "999.1.1.1"], "--host=999.1.1.1: not an address of this machine"),
                                       (["--tokenizer", "/no/tok", "--concurrency", "2"],  # served the world, silently
                                        "--concurrency=2, --tokenizer=/no/tok: options of a served endpoint"),
                                       # each refused after the models loaded or the servers were asked
                                       (["--threshold", "1.5"], "--threshold=1.5: expected a number in [0, 1]"),
                                       (["--target_url", "http://127.0.0.1:9", "--draft_url", "http://127.0.0.1:9",
                                         "--tokenizer", "/no/tok"], "--tokenizer=/no/tok: no such directory"),
                                       pytest.param(["--chat_template", "/no/such/chat.jinja", "--port", "{free}"],
                                                    "--chat_template='/no/such/chat.jinja': no readable file",
                                                    marks=pytest.mark.slow),  # the world loads: 3.5 s
                                       pytest.param(["--chat_template", "{{% if messages %}}{{{{ messages[0].content ",
                                                     "--port", "{free}"], "--chat_template: the target tokenizer "
                                                    "cannot format a chat with it (TemplateSyntaxError",
                                                    marks=pytest.mark.slow)])  # the world loads: 3.3 s
def test_the_command_refuses_bad_options_in_one_line_with_status_2(args, says):
    import socket

    with socket.socket() as busy:  # a port another server listens on
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = {"free": free_port(), "busy": busy.getsockname()[1]}
        out = subprocess.run([sys.executable, "-m", "semanticspec.serve", *(a.format(**ports) for a in args)],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and says.format(**ports) in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "SemanticSpec endpoint on" not in out.stdout  # refused before the banner


def test_the_port_is_listened_on_before_the_models_load():
    """The socket was bound, not listened on, until uvicorn ran: a second endpoint on the port passed the check,
    loaded its models, printed its banner and crashed with a traceback."""
    import socket

    from semanticspec.serve.cli import _bind

    sock = _bind("127.0.0.1", free_port())
    try:
        socket.create_connection(sock.getsockname(), timeout=2).close()  # refused by a socket that does not listen
    finally:
        sock.close()


def test_a_stop_while_starting_is_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C while the models loaded or the servers were asked was a traceback; SIGTERM ended it without a word."""
    import os
    import signal

    from semanticspec.serve import cli

    def stopped(opts):
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler stops a job

    def found(*_):
        raise AssertionError("SIGTERM was left to the handler it found")

    monkeypatch.setattr(cli, "build", stopped)
    before = signal.signal(signal.SIGTERM, found)  # the test's own: without it, SIGTERM would end pytest
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(["--port", str(free_port())])
        assert signal.getsignal(signal.SIGTERM) is found
    finally:
        signal.signal(signal.SIGTERM, before)
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == f"{cli.PROG}: stopped while starting; nothing was served"


@pytest.mark.slow  # a subprocess that loads the world: 6.7 s
def test_in_process_probes_of_other_models_are_refused_pointing_to_the_servers(tmp_path):
    # the endpoint serves the world's models in-process; the refusal did not say how to serve other models
    probe = tmp_path / "target"
    shutil.copytree(Path(__file__).resolve().parents[2] / "checkpoints/arithmetic/probes/target", probe)
    config = json.loads((probe / "config.json").read_text())
    config["reads"] = {**config["reads"], "name_or_path": "google/gemma-3-270m", "num_layers": 26}
    (probe / "config.json").write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "semanticspec.serve", "--target_probe", str(probe), "--port",
                          str(free_port())], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "exported for another model" in out.stderr
    assert "serve probes of other models in front of their two servers (--target_url, --draft_url)" in out.stderr


def test_a_served_endpoint_ends_at_the_worlds_answer_marker_only_for_the_worlds_probes_or_a_task_given(tmp_path):
    """In front of two servers the world's task ended every decode at its "Answer:" line, whatever models the probes
    read; now only for probes of the world's target, else none unless --task names one (served only)."""
    from datamodules.tasks.base import Task
    from datamodules.tasks.worlds import default_world
    from semanticspec.serve.cli import ServeOptions, _parser, _reads_with, _served_only, _served_task

    world = default_world()
    root = world.model_root()
    topk, tok = root / "probes-topk" / "target", world.load_tokenizer(root)
    assert type(_served_task(None, _reads_with(str(topk), tok), world)) is ArithmeticTask
    other = tmp_path / "target"
    shutil.copytree(topk, other)
    config = json.loads((other / "config.json").read_text())
    config["reads"]["tokenizer_hash"] = "0" * 16  # a probe of another model's
    (other / "config.json").write_text(json.dumps(config))
    assert _served_task(None, _reads_with(str(other), tok), world) is None
    parser = _parser()
    given = parser.instantiate(parser.parse_args(["--task", "datamodules.tasks.base.Task", "--task.init_args.path",
                                                  str(tmp_path / "problems.jsonl")])).task
    assert type(given) is Task and _served_task(given, _reads_with(str(other), tok), world) is given
    assert _served_only(ServeOptions(task=given)) == ["--task=datamodules.tasks.base.Task"]


def test_the_serve_config_parses_to_the_commands_defaults(capsys):
    """configs/serve/default.yaml holds every option of the command, each at its default (a fit config's test reads
    configs/*.yaml; this one is the serve command's)."""
    from pathlib import Path

    from semanticspec.serve.cli import ServeOptions, main

    path = Path(__file__).resolve().parents[2] / "configs" / "serve" / "default.yaml"
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(path), "--print_config"])
    assert exit_.value.code in (0, None)
    import dataclasses

    import yaml

    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == {f.name: f.default for f in dataclasses.fields(ServeOptions)}


@pytest.mark.parametrize("content,says", [(b"\xff\xfeport: 1\n", "not UTF-8 text"),
                                          (b"port: [1\n", "invalid YAML at line 2")])
def test_a_config_file_that_is_not_yaml_is_one_line_naming_it(tmp_path, capsys, content, says):
    """It was a UnicodeDecodeError traceback (not UTF-8), or jsonargparse's words naming no file."""
    from semanticspec.serve.cli import main

    bad = tmp_path / "serve.yaml"
    bad.write_bytes(content)
    for args in (["--config", str(bad)], [f"-c={bad}"]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"{args[0].split('=')[0]} {bad}: {says}" in err and len(err.splitlines()) == 1


def test_the_readmes_endpoint_example_runs(endpoint, capsys):
    """The README's endpoint example, pointed at this test's endpoint, prints the answer and SemanticSpec's usage."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text[text.index("### An OpenAI-compatible endpoint"):text.index("## Configs")]
    example = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    assert "http://127.0.0.1:8000/v1" in example
    exec(compile(example.replace("http://127.0.0.1:8000/v1", endpoint.url), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "Answer:" in out and "draft_steps_proposed" in out


def test_a_fault_while_planning_ends_that_request_and_the_decode_thread_goes_on():
    """A request whose planning fails other than by a refusal (a bug, a tokenizer that raises) gets an error, and the
    next request is served: one request's fault never leaves another hanging."""
    from semanticspec.serve.scheduler import Job, Scheduler

    class Broken:
        def plan(self, prompts, config):
            if prompts == ["bad"]:
                raise TypeError("'tuple' object is not callable")
            raise ValueError(f"prompt 0 is {prompts[0]!r}: refused")

    sched = Scheduler(Broken())
    got = []
    for prompt in ("bad", "refused"):
        done = threading.Event()
        sched.submit(Job(prompt, DecodeConfig(), lambda u, d=done: (got.append(u), d.set())))
        assert done.wait(10)
    assert [(u.finish, u.error) for u in got] == [("error", "TypeError: 'tuple' object is not callable"),
                                                 ("invalid", "prompt 0 is 'refused': refused")]
    assert sched.failure is None and sched.pending == 0
    sched.stop(1)


def test_a_loop_admits_rows_per_loop_rows_then_a_fresh_loop_takes_the_next_requests(tiny_pair):
    """Under steady traffic one loop never grows past ``rows_per_loop`` rows (its finished rows' state and the scans
    over them stay bounded): the next requests start a fresh loop while it drains, and every request still decodes as
    it would alone with its seed."""
    from semanticspec.serve.scheduler import Job, Scheduler
    from tests.conftest import PROMPTS
    from tests.semanticspec.conftest import stub_decoder

    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=lambda x: (x.flatten(1)[:, 3] > 0).float())
    loops, step_loop = [], dec.step_loop
    dec.step_loop = lambda *a: loops.append(step_loop(*a)) or loops[-1]
    with pytest.raises(ValueError, match="rows_per_loop=2: expected at least max_rows=3"):
        Scheduler(dec, max_rows=3, rows_per_loop=2)
    sched = Scheduler(dec, max_rows=2, rows_per_loop=3)
    cfg = dict(max_new_tokens=24, temperature=0.8, allow_sampling_mismatch=True)
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(10)]
    got, done = {}, threading.Semaphore(0)
    for k, p in enumerate(prompts):
        sched.submit(Job(p, DecodeConfig(seed=k, **cfg), lambda u, k=k: (u.finish and (got.update({k: u}),
                                                                                       done.release()))))
    for _ in prompts:
        assert done.acquire(timeout=60)
    sched.stop(5)
    assert all(got[k].finish in ("stop", "length") for k in got), {k: got[k].error for k in got}
    alone = [dec.generate([p], seed=k, **cfg)[0].text for k, p in enumerate(prompts)]
    assert [got[k].result.text for k in range(len(prompts))] == alone
    assert sched.loops >= 4 and all(len(loop.rows) <= 3 for loop in loops) and sched.joined > 0


@pytest.mark.parametrize("module", ["semanticspec.serve", "semanticspec.serve.cli"])
def test_the_command_and_its_module_print_the_same_help(module):
    """``python -m semanticspec.serve.cli --help`` printed nothing and exited 0: the module ran no ``main``."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                         cwd=Path(__file__).parents[2], timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m semanticspec.serve "), out.stderr
