"""The endpoint under real clients' input: one bad request never takes it down, plain OpenAI calls work, abandoned
requests free their rows, and every answer to a fuzzed body is an OpenAI error or a completion. The embedded world
in-process; the same in front of the world's servers in test_endpoint_served."""

import json
import re
import threading
import time

import pytest

from arithmetic_world.task import ArithmeticTask
from semanticspec.config import DecodeConfig
from tests.conftest import Running

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # the HTTP client openai and starlette use (httpx before them)
TASK = ArithmeticTask()
LONG = "Start with 1. " + "Add 1, then " * 10 + "add 1. What is the result?\n\n"
LONGER = "Start with 1. " + "Add 1, then " * 20 + "add 1. What is the result?\n\n"
"""About 22 target steps (2 s on 2 cores): a request a client gives up on after 0.3 s is still decoding."""


@pytest.fixture(scope="module")
def world():
    from semanticspec.serve.cli import ServeOptions, build

    app = build(ServeOptions())
    running = Running(app)
    yield running
    running.stop()
    app.state.scheduler.stop(0)


def _post(client, url: str, body) -> httpx2.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post(url, content=data, headers={"Content-Type": "application/json"}, timeout=60)


def _ok_after(client, world) -> None:
    """The same connection's next, valid request is served (the server kept the keep-alive connection)."""
    r = _post(client, world.url + "/completions", {"prompt": "Start with 2.", "max_tokens": 4, "seed": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("route,field", [("/completions", "prompt"), ("/chat/completions", "messages")])
def test_a_prompt_longer_than_any_that_fits_is_refused_before_it_is_tokenized(world, route, field):
    """A 2 MB prompt was tokenized in the decode thread, holding every other request for seconds (15 s for 10 MB on
    2 cores), only to be refused for its length; it is refused by its characters, which bound its tokens."""
    text = "Add 1, then " * 200_000
    body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    with httpx2.Client() as c:
        r = _post(c, world.url + route, json.dumps({**body, "max_tokens": 4}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        chars = 2_400_000 + (field == "messages")  # a chat's turn counts a character beside its text
        assert re.match(rf"{field}: {chars} characters; a prompt that fits the target's context of 256 tokens holds "
                        r"fewer \(its tokenizer's longest token has \d+ characters\)", r.json()["error"]["message"])
        _ok_after(c, world)


@pytest.mark.parametrize("route,body,param", [
    ("/completions", '{"prompt": "hi \\ud800", "max_tokens": 4}', "prompt"),
    ("/completions", '{"prompt": ["Start with 2. \\udfff"]}', "prompt.0"),
    ("/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages.0.content"),
    ("/completions", '{"prompt": "Start with 2.", "stop": ["\\ud83d"]}', "stop.0"),
], ids=["prompt", "prompt-list", "chat", "stop"])
def test_a_lone_surrogate_gets_a_400_naming_the_field_and_the_next_request_is_served(world, route, body, param):
    with httpx2.Client() as c:
        r = _post(c, world.url + route, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert "surrogate" in r.json()["error"]["message"]
        _ok_after(c, world)
    with httpx2.Client() as c:
        assert c.get(world.url[:-3] + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("value", ["1.5", "-0.1", "NaN", "Infinity"])
def test_a_threshold_outside_0_1_or_not_finite_gets_a_400_and_the_connection_stays(world, value):
    with httpx2.Client() as c:
        r = _post(c, world.url + "/completions", '{"prompt": "Start with 2.", "threshold": %s}' % value)
        assert r.status_code == 400 and r.json()["error"]["param"] == "threshold", r.text
        _ok_after(c, world)


def test_an_integer_past_a_floats_range_gets_a_400_naming_the_field_not_a_500(world):
    """JSON's integers have no bound: ``1`` and 400 zeros as ``temperature`` or ``threshold`` overflowed the decoder's
    float checks into a 500 (``1e400`` was refused as not finite)."""
    huge = "1" + "0" * 400
    with httpx2.Client() as c:
        for route, body in (("/completions", '"prompt": "Start with 2."'),
                            ("/chat/completions", '"messages": [{"role": "user", "content": "Start with 2."}]')):
            for field in ("temperature", "top_p", "threshold", "window_min_logprob"):
                for value in (huge, "-" + huge):
                    r = _post(c, world.url + route, "{%s, \"%s\": %s}" % (body, field, value))
                    assert r.status_code == 400, (route, field, r.text)
                    assert r.json()["error"] == {"message": f"{field}: Input should be a finite number",
                                                 "type": "invalid_request_error", "param": field, "code": None}
        _ok_after(c, world)


def test_an_empty_model_name_is_served_as_null_is(world):
    """``model: ""`` names no model, as ``null``: vLLM serves it (``_is_model_supported``); it got a 404 here, while
    a missing model was served. Another name is still a 404."""
    c = world.client()
    done = c.completions.create(model="", prompt="Start with 2.", max_tokens=1, seed=0)
    assert done.model == "semanticspec" and done.choices[0].finish_reason in ("stop", "length")
    chat = c.chat.completions.create(model="", messages=[{"role": "user", "content": "Start with 2."}], max_tokens=1)
    assert chat.model == "semanticspec"
    with pytest.raises(openai.NotFoundError, match="this server serves 'semanticspec'"):
        c.completions.create(model="semanticspec2", prompt="Start with 2.", max_tokens=1)


def test_plain_openai_calls_without_max_tokens_succeed(world):
    """``create(model, messages)`` and ``create(model, prompt)`` with nothing else: chat writes up to the room the
    prompt leaves (here the answer's end), completions at most 16 tokens (OpenAI's and vLLM's defaults)."""
    c = world.client()
    problem = TASK.problems(1, seed=11)[0]["problem"]
    chat = c.chat.completions.create(model="semanticspec", messages=[{"role": "user", "content": problem}])
    assert chat.choices[0].finish_reason == "stop" and "Answer:" in chat.choices[0].message.content
    done = c.completions.create(model="semanticspec", prompt=LONG)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens <= 16
    nulls = c.completions.create(model="semanticspec", prompt=LONG, max_tokens=None, seed=3)
    assert nulls.usage.completion_tokens <= 16
    short = c.completions.create(model="semanticspec", prompt="Start with 2.", max_tokens=2, seed=0)
    assert short.usage.completion_tokens <= 2


def test_what_common_clients_send_is_taken(world):
    """Neutral values of fields the endpoint cannot honour, text content parts, the developer role, a lower-case
    bearer scheme and ``models.retrieve``; non-neutral values are refused by name as not supported."""
    c = world.client()
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1, "suffix": None,
               "response_format": {"type": "text"}, "echo": False, "logprobs": None}
    got = c.completions.create(model="semanticspec", prompt="Start with 2.", max_tokens=4, seed=0,
                               extra_body={k: v for k, v in neutral.items() if k not in ("presence_penalty",
                                                                                         "frequency_penalty")},
                               presence_penalty=0, frequency_penalty=0)
    assert got.choices[0].text is not None
    chat = c.chat.completions.create(model="semanticspec", max_tokens=4, seed=0, logprobs=False, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Start with 2."}]}])
    assert chat.choices[0].message.role == "assistant"
    card = c.models.retrieve("semanticspec")
    assert card.id == "semanticspec" and card.model_extra["max_model_len"] == 256 - 7  # the decoder keeps 7 free
    fill = c.completions.create(model="semanticspec", prompt="Start with 2.", max_tokens=1, seed=0)
    room = card.model_extra["max_model_len"] - fill.usage.prompt_tokens  # as a client sizes it: it was refused
    assert c.completions.create(model="semanticspec", prompt="Start with 2.", max_tokens=room, seed=0).choices
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    for field, value in (("presence_penalty", 0.5), ("logit_bias", {"7": 10}), ("best_of", 2), ("echo", True),
                         ("logprobs", 2), ("response_format", {"type": "json_object"})):
        with pytest.raises(openai.BadRequestError, match="not supported") as e:
            c.completions.create(model="semanticspec", prompt="Start with 2.", max_tokens=4,
                                 extra_body={field: value})
        assert e.value.body["param"] == field
    with pytest.raises(openai.BadRequestError, match="not supported") as e:
        c.chat.completions.create(model="semanticspec", max_tokens=4, messages=[{"role": "user", "content": "1"}],
                                  tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.body["param"] == "tools"


def test_a_json_body_sent_as_a_form_is_told_to_send_its_content_type(world):
    """``curl -d '{...}'`` without ``-H 'Content-Type: application/json'`` sends a form: the 400 says so, since
    "the body must be a JSON object" alone reads wrong to someone whose body is one."""
    body = json.dumps({"prompt": "Start with 2.", "max_tokens": 2})
    with httpx2.Client() as c:
        r = c.post(world.url + "/completions", content=body,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    assert "it came as application/x-www-form-urlencoded; send it with Content-Type: application/json" in \
        r.json()["error"]["message"]


def test_a_lower_case_bearer_scheme_is_accepted():
    from semanticspec.serve.app import key_matches

    assert key_matches(b"bearer sk-1", "sk-1") and key_matches(b"Bearer  sk-1 ", "sk-1")
    assert not key_matches(b"Basic sk-1", "sk-1") and not key_matches(b"bearer sk-2", "sk-1")
    assert not key_matches(b"", "sk-1")


@pytest.mark.parametrize("method,path,body,status,says", [
    ("POST", "/completions", b"\xff\xfe{", 400, "malformed request body"),
    ("POST", "/completions", b"", 400, "no body"),
    ("POST", "/completions", b"[1, 2]", 400, "JSON object"),
    ("GET", "/nowhere", None, 404, "Invalid URL (GET /v1/nowhere)"),
    ("GET", "/completions", None, 405, "method GET is not allowed"),
    ("POST", "/completions", b'{"prompt": 7}', 400, "prompt: Input should be a valid string"),
    ("POST", "/completions", b'{"prompt": "x", "temperature": "hot"}', 400, "temperature: Input should be"),
    ("POST", "/completions", b'{"prompt": "x", "max_completion_tokens": 0}', 400, "max_completion_tokens=0"),
    ("POST", "/completions", b'{"prompt": "x", "model": "gpt-4"}', 404, "this server serves 'semanticspec'"),
])
def test_every_refusal_is_openais_error_json_without_pydantic_markers(world, method, path, body, status, says):
    with httpx2.Client() as c:
        r = c.request(method, world.url + path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status
        err = r.json()["error"]
        assert says in err["message"] and set(err) == {"message", "type", "param", "code"}
        assert err["param"] is None or not any(t in err["param"] for t in (".str", ".float", ".int", "["))
        _ok_after(c, world)


def test_a_request_whose_planning_fails_is_answered_and_the_endpoint_goes_on(world_tokenizer):
    """A fault outside the decoder's checks (a tokenizer that raises, a bug) ends that request with an OpenAI error
    (a 500 at once, not a wait forever), and the next request is served."""
    from semanticspec.serve.app import build_app

    class Decoder:
        tokenizer, policy, config = world_tokenizer, None, None

        def contexts(self):
            return 256, 256

        def spare(self, config):
            return 1

        def plan(self, prompts, config):
            if "boom" in prompts[0]:
                raise TypeError("TextEncodeInput must be Union[...]")
            raise ValueError(f"prompt={prompts[0]!r}: refused")

    run = Running(build_app(Decoder()))
    try:
        with httpx2.Client() as c:
            t0 = time.time()
            r = _post(c, run.url + "/completions", {"prompt": "boom", "max_tokens": 4})
            assert r.status_code == 500 and "TextEncodeInput" in r.json()["error"]["message"]
            assert time.time() - t0 < 10
            r = _post(c, run.url + "/completions", {"prompt": "fine", "max_tokens": 4, "stream": True})
            assert r.status_code == 400 and "refused" in r.json()["error"]["message"]
        assert run.app.state.scheduler.failure is None and run.app.state.scheduler.pending == 0
    finally:
        run.stop()
        run.app.state.scheduler.stop(0)


def test_a_prompt_token_count_that_raises_ends_that_request_not_the_decode_thread():
    """The served path's prompt token count runs in the decode thread: a count that raises (the tokenizer refusing a
    string) ends that request with an error; the thread and the next request go on (it once killed the thread)."""
    from semanticspec.served import ServedPrompt
    from semanticspec.serve.scheduler import Job, Scheduler

    class Plan:  # a served plan's prompts: texts no server counted (a server that states no context)
        def __init__(self, prompt, config):
            self.inputs, self.cfg = ([ServedPrompt(prompt)], [ServedPrompt(prompt)]), config

    class Served:
        def plan(self, prompts, config):
            if prompts == ["bad"]:
                return Plan("bad", config)
            raise ValueError("prompt: refused")

        def prompt_room(self, plan):
            return None

    def count(text):
        raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")

    sched = Scheduler(Served(), count_tokens=count)
    got = []
    for prompt in ("bad", "next"):
        done = threading.Event()
        sched.submit(Job(prompt, DecodeConfig(), lambda u, d=done: (got.append(u), d.set())))
        assert done.wait(10)
    assert [u.finish for u in got] == ["error", "invalid"] and "TextEncodeInput" in got[0].error
    assert sched.failure is None and sched.pending == 0
    sched.stop(1)


def test_a_loop_that_fails_ends_its_requests_and_the_next_request_is_served(tiny_pair):
    from semanticspec.serve.scheduler import Job, Scheduler
    from tests.conftest import PROMPTS
    from tests.semanticspec.conftest import stub_decoder

    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok)
    step_loop, calls = dec.step_loop, []

    def flaky(*a):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access")
        return step_loop(*a)

    dec.step_loop = flaky
    sched = Scheduler(dec)
    got = []
    for k in range(2):
        done = threading.Event()
        sched.submit(Job(PROMPTS[0], DecodeConfig(max_new_tokens=8, seed=k), lambda u, d=done: (
            u.finish and (got.append(u), d.set()))))
        assert done.wait(30)
    assert got[0].finish == "error" and "illegal memory access" in got[0].error
    assert got[1].finish in ("stop", "length") and sched.failure is None
    sched.stop(1)


def test_abandoned_non_streaming_requests_free_their_rows_within_a_round():
    """Non-streaming clients that give up leave their loop at the next round: with one row and a short queue, 6
    abandoned requests neither decode to their end nor keep their queue slots (each once decoded all its steps and
    kept its slot, behind the key check's BaseHTTPMiddleware)."""
    from semanticspec.serve.app import Settings, build_app
    from semanticspec.serve.cli import ServeOptions, build

    dec = build(ServeOptions()).state.scheduler.dec
    run = Running(build_app(dec, Settings(max_rows=1, max_queue=4, api_key="k")))
    sched, steps = run.app.state.scheduler, run.app.state.metrics.steps
    kw = dict(model="semanticspec", prompt=LONGER, max_tokens=150, extra_body={"method": "target_only",
                                                                                "lookahead": 1})
    try:
        whole = run.client(api_key="k").completions.create(**kw, seed=0).usage.model_extra["semanticspec"]["steps"]
        before = sum(steps.labels(d)._value.get() for d in ("accept", "accept_fast", "reject", "target"))
        for k in range(6):
            with pytest.raises(openai.APITimeoutError):
                run.client(api_key="k", timeout=0.3).completions.create(**kw, seed=k)
        t0 = time.time()
        while sched.pending and time.time() - t0 < 20:
            time.sleep(0.05)
        # each left its loop or the waiting line (or, on a loaded machine, went before its body was read)
        assert sched.pending == 0 and 1 <= sched.cancelled + sched.dropped <= 6
        decoded = sum(steps.labels(d)._value.get() for d in ("accept", "accept_fast", "reject", "target")) - before
        assert decoded < 6 * whole, (decoded, whole)  # each decoded to its end before: 6 * whole
        assert sched.max_after_cancel <= 1  # target-only, one step a round: at most that round's step
        text = httpx2.get(f"{run.url[:-3]}/metrics").text  # counters (gauges before; the dropped ones not exported)
        for name, value in (("cancelled_rows", sched.cancelled), ("dropped_requests", sched.dropped)):
            assert f"# TYPE semanticspec_{name}_total counter" in text or f"# TYPE semanticspec_{name} counter" in text
            assert f"semanticspec_{name}_total {float(value)}" in text, text
        ok = run.client(api_key="k").completions.create(model="semanticspec", prompt="Start with 1.", max_tokens=4)
        assert ok.choices[0].finish_reason in ("stop", "length")
    finally:
        run.stop()
        sched.stop(0)


def test_a_stop_string_across_a_step_boundary_never_reaches_the_stream(world):
    """A stop string that starts at the end of one step and ends in the next: the stream holds the step's end back
    until the next step says, so the streamed chunks add up to the non-streamed text."""
    from arithmetic_world.models import load_tokenizer

    c = world.client()
    prompt = TASK.prompt_text(load_tokenizer(), TASK.problems(1, seed=11)[0]["problem"])
    whole = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7).choices[0].text
    cut = whole.index("\n\n")
    stop = whole[cut:cut + 5]  # the first step's end and the second's first characters
    got = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7, stop=stop)
    assert got.choices[0].text == whole[:cut]
    streamed = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == whole[:cut]


def test_a_stop_inside_a_window_counts_only_the_steps_up_to_it(world):
    """``usage`` of a row a stop string ended inside a window counts the steps up to the stop, not the window's later
    ones, and its decode seconds are the steps' own (once 0.0)."""
    from arithmetic_world.models import load_tokenizer

    c = world.client()
    prompt = TASK.prompt_text(load_tokenizer(), TASK.problems(3, seed=11)[2]["problem"])
    whole = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7)
    first = whole.choices[0].text.index("\n\n")
    sched = world.app.state.scheduler
    before = sched.cancelled, sched.after_cancel
    stop = c.completions.create(model="semanticspec", prompt=prompt, max_tokens=96, seed=7,
                                stop=whole.choices[0].text[first + 2:][:3])
    used, all_ = stop.usage.model_dump(), whole.usage.model_dump()
    assert used["completion_tokens"] < all_["completion_tokens"]
    assert used["semanticspec"]["steps"] <= 2 and used["semanticspec"]["decode_s"] > 0
    # no client cancelled: the window's steps after the stop are no steps decoded after a cancel
    assert (sched.cancelled, sched.after_cancel) == before


FUZZ_VALUES = [None, True, -1, 0, 2**63, -(2**63) - 1, 1e308, -1e-308, "NaN", "Infinity", "-Infinity", "",
               "\u0000", "\ud800", "\U0001F600" * 50, "e\u0301" * 3, "\u202e" + "evil", [], {}, [[[[]]]],
               {"a": {"b": [1, {"c": None}]}}, ["x"] * 3, "x" * 5000]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "n", "stream", "stream_options", "user", "method", "threshold", "lookahead", "window_min_logprob",
          "allow_sampling_mismatch", "logprobs", "echo", "presence_penalty", "logit_bias", "tools", "response_format"]


def _literal(v) -> str:
    """A JSON text of ``v``; the strings "NaN"/"Infinity" become the bare tokens Python's json reads."""
    if v in ("NaN", "Infinity", "-Infinity"):
        return v
    return json.dumps(v)


def _corpus():
    base = {"/completions": {"prompt": "Start with 2.", "max_tokens": 3, "seed": 0},
            "/chat/completions": {"messages": [{"role": "user", "content": "Start with 2."}], "max_tokens": 3,
                                  "seed": 0}}
    for route, body in base.items():
        for field in FIELDS:
            for v in FUZZ_VALUES:
                others = ", ".join(f'"{k}": {json.dumps(x)}' for k, x in body.items() if k != field)
                yield route, "{" + others + (", " if others else "") + f'"{field}": {_literal(v)}' + "}"
        for raw in ("", "null", "[]", "7", '"x"', "{", '{"prompt": }', "\x00", "{}" * 3,
                    '{"messages": [{"role": "tool", "content": "x"}]}',
                    '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}'):
            yield route, raw


def _well_formed(r: httpx2.Response) -> bool:
    """A completion (200: JSON with choices, or events ending with [DONE]) or OpenAI's error JSON (4xx)."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    try:
        body = r.json()
    except ValueError:
        return False
    if r.status_code == 200:
        return "choices" in body
    return 400 <= r.status_code < 500 and set(body.get("error", {})) == {"message", "type", "param", "code"}


@pytest.mark.slow  # hundreds of requests: 4.4 s
def test_fuzzed_bodies_get_an_openai_error_or_a_completion_and_the_endpoint_stays_healthy(world):
    """Every field of both routes given odd Unicode, huge and negative numbers, NaN and infinities, nested junk and
    wrong types (and broken bodies): each answer comes within a bound, is a JSON error in OpenAI's shape (4xx) or a
    completion (200), never a 5xx; the connection is kept, and ``/health`` is ok at the end."""
    corpus = list(_corpus())
    assert len(corpus) > 1000
    bad = []
    with httpx2.Client(timeout=30) as c:
        for route, raw in corpus:
            t0 = time.time()
            r = c.post(world.url + route, content=raw.encode("utf-8", "surrogatepass"),
                       headers={"Content-Type": "application/json"})
            ok = _well_formed(r)
            if not ok or time.time() - t0 > 20:
                bad.append((route, raw[:80], r.status_code, r.text[:120]))
        assert c.get(world.url[:-3] + "/health").json()["status"] == "ok"
    assert bad == []


def test_stop_answers_the_requests_left_at_once_while_their_round_still_runs(tiny_pair):
    """A served round takes seconds of HTTP: stop() marked the rows cancelled and the decode thread answered them
    after its round, past uvicorn's cut a second later (plain-text 500s, streams cut). It answers them itself, with a
    503, as soon as its grace ends; each job is answered once, also when its round then ends it."""
    from semanticspec.serve.scheduler import Job, Scheduler
    from tests.conftest import PROMPTS
    from tests.semanticspec.conftest import stub_decoder

    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok)
    slow = threading.Event()
    def sleep(*args):
        if slow.is_set():
            time.sleep(1.5)

    hook = target.register_forward_hook(sleep)
    sched = Scheduler(dec)
    got, started = {k: [] for k in range(3)}, threading.Event()
    try:
        for k in range(3):
            sched.submit(Job(PROMPTS[0], DecodeConfig(max_new_tokens=150, seed=k),
                             lambda u, k=k: (got[k].append((time.time(), u)), u.delta and started.set())))
        assert started.wait(30)
        slow.set()  # every target forward from now on takes 1.5 s
        time.sleep(0.3)  # inside such a forward
        t0 = time.time()
        sched.stop(0.2)
    finally:
        hook.remove()
    ends = {k: [(t, u) for t, u in us if u.finish] for k, us in got.items()}
    assert all(len(e) == 1 for e in ends.values()), ends  # once each
    assert all(u.status == 503 and "shut down" in u.error for (_, u), in ends.values())
    assert max(t for (t, _), in ends.values()) - t0 < 0.2 + 0.6  # not after the round (1.5 s, 1.2 s of it left)
    assert sched.pending == 0


def test_a_decode_thread_that_dies_ends_the_requests_still_in_its_inbox():
    """A fault of the scheduler itself ends every open request with its reason, those it has not taken from its inbox
    yet too: they once waited for an answer that never came, and a request submitted after it is refused."""
    from semanticspec.served import ServedPrompt
    from semanticspec.serve.scheduler import Job, Scheduler

    class Plan:
        def __init__(self, prompt, config):
            self.inputs, self.cfg = ([ServedPrompt(prompt)], [ServedPrompt(prompt)]), config

    class Served:
        def plan(self, prompts, config):
            return Plan(prompts[0], config)

        def prompt_room(self, plan):
            return None

    placing, fail = threading.Event(), threading.Event()

    class Failing(Scheduler):
        def _place(self):
            placing.set()
            assert fail.wait(10)
            raise RuntimeError("scheduler fault")

    sched = Failing(Served())
    ends = {k: threading.Event() for k in ("first", "queued")}
    got = {}

    def notify(name):
        return lambda u: u.finish and (got.setdefault(name, u), ends[name].set())

    sched.submit(Job("first", DecodeConfig(), notify("first")))
    assert placing.wait(10)  # the first request is taken and planned; the thread is about to fail
    sched.submit(Job("queued", DecodeConfig(), notify("queued")))  # still in the inbox when it fails
    fail.set()
    assert ends["first"].wait(10) and ends["queued"].wait(10)
    assert {u.finish for u in got.values()} == {"error"} and all("scheduler fault" in u.error for u in got.values())
    assert sched.pending == 0
    with pytest.raises(RuntimeError, match="scheduler fault"):
        sched.submit(Job("late", DecodeConfig(), lambda u: None))
