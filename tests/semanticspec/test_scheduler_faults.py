"""The endpoint's scheduler and app under faults and races: a fake decoder drives the Scheduler deterministically, no
models (each row writes one 1-token step per round from a script). Each test failed on the code before its fix."""

import queue
import threading
import time
from typing import NamedTuple

import pytest

from semanticspec.config import DecodeConfig
from semanticspec.results import Decision, DecodeResult, DecodeStats, StepEvent, StepTrace


class _Plan(NamedTuple):
    method: str
    inputs: tuple
    keys: list
    sampling: object
    cfg: DecodeConfig
    loop: object
    step: object
    spare: int


class _Row:
    def __init__(self, prompt, budget, hook=None):
        self.prompt, self.budget, self.hook = prompt, budget, hook
        self._done, self.stop_reason, self.error, self.cause = False, None, None, None
        self.trace, self.stats, self.text = [], DecodeStats(), ""

    @property
    def done(self):
        if self.hook is not None:
            self.hook()
        return self._done

    @done.setter
    def done(self, v):
        self._done = v

    def fail(self, why):
        self.done, self.stop_reason, self.error = True, "error", why


class _Loop:
    def __init__(self, dec, prompt, budget):
        self.dec, self.rows = dec, [_Row(prompt, budget, dec.done_hook)]

    def admit(self, prompts, budget, key):
        self.rows.append(_Row(prompts[0], budget, self.dec.done_hook))
        return len(self.rows) - 1

    def cancel(self, i, why):
        if not self.rows[i].done:
            self.rows[i].fail(why)

    def serve(self, method):
        ended = set()
        while True:
            active = [i for i, r in enumerate(self.rows) if not r.done]
            if self.dec.round_gate is not None:
                self.dec.round_gate()
            new = []
            for i in active:
                r, steps = self.rows[i], self.dec.steps.get(self.rows[i].prompt, ["w "] * 1000)
                k = len(r.trace)
                if k >= len(steps):
                    r.done, r.stop_reason = True, "eos"
                    continue
                t = StepTrace("target", steps[k], 1, decision=Decision.TARGET, seconds=0.001)
                r.trace.append(t)
                r.text += steps[k]
                r.stats.output_tokens += 1
                r.stats.steps += 1
                if r.stats.output_tokens >= r.budget:
                    r.done, r.stop_reason = True, "budget"
                new.append(StepEvent(i, t, r.text))
            yield from new
            for i, r in enumerate(self.rows):
                if r.done and i not in ended:
                    ended.add(i)
                    text = r.text + (self.dec.tail(r) if self.dec.tail else "")
                    yield StepEvent(i, None, text, DecodeResult(text, r.trace, r.stats, r.stop_reason, r.error))
            if not active and all(r.done for r in self.rows):
                return


class FakeDecoder:
    tokenizer = policy = config = None

    def __init__(self, steps=None, plan_hook=None, round_gate=None, tail=None, done_hook=None):
        self.steps, self.plan_hook, self.round_gate, self.tail = steps or {}, plan_hook, round_gate, tail
        self.done_hook = done_hook

    def contexts(self):
        return None, None

    def plan(self, prompts, config):
        if self.plan_hook:
            self.plan_hook(prompts[0])
        return _Plan("m", ([prompts[0]], [prompts[0]]), [None], None, config, None, None, 1)

    def prompt_room(self, plan):
        return None

    def step_loop(self, plan, inputs, keys):
        return _Loop(self, inputs[0][0], plan.cfg.max_new_tokens)

    def row_inputs(self, inputs, i):
        return inputs[0][i], inputs[1][i]


def _job(prompt, notify, n=8, **kw):
    from semanticspec.serve.scheduler import Job
    return Job(prompt, DecodeConfig(max_new_tokens=n), notify, **kw)


def test_running_does_not_race_the_decode_thread():
    """Scheduler.running, read by /health and /metrics on the event loop's thread, reads a loop's jobs while the
    decode thread adds one (admit) or removes one (a row's end): it once iterated the dict itself, and /health
    answered 500 (dictionary changed size during iteration) under load."""
    from semanticspec.serve.scheduler import Scheduler

    armed, inside, resume = threading.Event(), threading.Event(), threading.Event()

    def done_hook():  # a thread switch inside the reader's iteration, made deterministic
        if armed.is_set() and threading.current_thread().name == "reader":
            armed.clear()
            inside.set()
            assert resume.wait(10)

    at_gate = threading.Event()
    dec = FakeDecoder(done_hook=done_hook, round_gate=lambda: (at_gate.set(), time.sleep(0.01)))
    s = Scheduler(dec)
    try:
        s.submit(_job("a", lambda u: None, n=1000))
        assert at_gate.wait(10)
        got = {}

        def read():
            try:
                got["rows"] = s.running
            except Exception as e:  # noqa: BLE001
                got["error"] = e

        armed.set()
        reader = threading.Thread(target=read, name="reader")
        reader.start()
        assert inside.wait(10)  # the reader is inside `for i in self.jobs`
        joined = threading.Event()
        s.submit(_job("b", lambda u: u.planned or joined.set(), n=1000))  # B's first delta: it is in A's loop
        assert joined.wait(10)
        resume.set()
        reader.join(10)
        assert "error" not in got, got  # RuntimeError: dictionary changed size during iteration
    finally:
        s.abort("test over")
        s.stop(1)


def test_one_requests_notify_fault_neither_kills_the_thread_nor_strands_the_others():
    """A callback that raises (call_soon_threadsafe on a closed event loop raises RuntimeError) cancels its own
    request only: it once escaped _send, killed the decode thread and raised again in _fail_all, so the requests
    after it never ended."""
    from semanticspec.serve.scheduler import Scheduler

    at_gate, gate = threading.Event(), threading.Event()
    s = Scheduler(FakeDecoder(round_gate=lambda: (at_gate.set(), gate.wait(10))))

    def closed_loop(u):
        if not u.planned:
            raise RuntimeError("Event loop is closed")

    s.submit(_job("a", closed_loop))
    assert at_gate.wait(10)  # A's first round is running
    b_end = threading.Event()
    s.submit(_job("b", lambda u: u.finish and b_end.set()))
    gate.set()
    try:
        assert b_end.wait(3), (s.failure, s.pending)  # B never answered, pending stays 1
        assert s.failure is None  # one request's callback took the endpoint down for everyone
    finally:
        s.abort("test over")


class _HeldInbox(queue.Queue):
    """put() waits for `release`: a submit preempted after its check (under the lock) and before its put."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def put(self, item, block=True, timeout=None):
        self.entered.set()
        assert self.release.wait(10)
        super().put(item, block, timeout)


@pytest.mark.parametrize("how", ["thread fault", "stop"])
def test_a_request_submitted_as_the_thread_ends_is_answered(how):
    """submit() checks stopping and failure, counts the request and queues it under one lock: it once queued it
    after the lock, so _fail_all (or the thread's own exit after stop()) could run in between and leave it in an
    inbox nobody reads, never answered, its queue slot never freed."""
    from semanticspec.serve.scheduler import Scheduler

    fail = threading.Event()

    class S(Scheduler):
        def _place(self):
            if fail.is_set():
                raise RuntimeError("scheduler fault")
            super()._place()

    s = S(FakeDecoder())
    s.inbox = _HeldInbox()
    ended = threading.Event()
    sub = threading.Thread(target=s.submit, args=(_job("late", lambda u: u.finish and ended.set()),))
    sub.start()
    assert s.inbox.entered.wait(10)
    threading.Timer(0.5, s.inbox.release.set).start()  # the submitting thread runs again 0.5 s later
    if how == "stop":
        s.stop(timeout=5)
    else:
        fail.set()
        s._thread.join(5)
    sub.join(5)
    assert not s._thread.is_alive()
    assert ended.wait(2), f"never answered; pending={s.pending}, inbox={s.inbox.qsize()}"


def test_abort_ends_a_request_the_thread_is_planning():
    """stop()'s abort ends the request the decode thread holds while it plans it (tokenizing; a served decoder's
    prompt reads over HTTP) too, with a 503: it once ended only those in the inbox, the waiting line and the loops,
    and that one was admitted and decoded past stop()."""
    from semanticspec.serve.scheduler import Scheduler

    planning, release = threading.Event(), threading.Event()

    def slow_plan(prompt):
        planning.set()
        assert release.wait(10)

    s = Scheduler(FakeDecoder(plan_hook=slow_plan, round_gate=lambda: time.sleep(0.01)))
    got, first_delta = [], threading.Event()
    s.submit(_job("slow", lambda u: (got.append(u), u.delta and first_delta.set()), n=1000))
    assert planning.wait(10)
    with s._lock:  # what stop() does: no more requests, then, its grace over, abort()
        s.stopping = True
    s.abort("the server shut down before this request finished")
    # answered now, not once its plan returns: a served plan waits on a server, up to its timeout, and uvicorn
    # cancelled the handler at the end of its grace (a plain-text 500 and a traceback)
    assert [u.status for u in got if u.finish] == [503]
    release.set()
    try:
        decoded = first_delta.wait(2)
        ends = [u for u in got if u.finish]
        assert not decoded and ends and ends[0].status == 503, (decoded, ends, s.running)
    finally:
        for g in list(s.groups.values()):
            for j in g.jobs.values():
                j.cancelled = True
        s.stop(2)


@pytest.mark.parametrize("stream", [False, True])
def test_a_valueerror_while_joining_a_loop_gets_an_openai_error(stream):
    """A request refused (ValueError) as it joins a loop, after its planned update, gets OpenAI's error: a 400, or
    in a stream an error event and [DONE]. The app once read such an end as a result (500 AttributeError) and ended
    a stream bare. (In-process, BatchedCache.add_row refuses a model with sliding-window layers when a request joins
    a running loop.)"""
    from fastapi.testclient import TestClient
    from semanticspec.serve.app import build_app

    class Dec(FakeDecoder):
        def step_loop(self, plan, inputs, keys):
            raise ValueError("add_row() needs every layer to hold every cache column (no sliding-window layer)")

    app = build_app(Dec())
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": stream})
    if stream:
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"error"' in r.text, r.text
    else:
        assert r.status_code == 400 and "sliding-window" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_completed_by_the_ends_own_text_finishes_with_stop(stream):
    """The end event's text can hold more than the last step (the target's last bonus token, when the budget ends
    the row): cut at a stop string, it finishes with 'stop', as OpenAI's finish_reason does when a stop sequence was
    hit; it once kept the budget's 'length'."""
    from fastapi.testclient import TestClient
    from semanticspec.serve.app import build_app

    dec = FakeDecoder(steps={"p": ["x ", "y"]}, tail=lambda row: "z" if row.stop_reason == "budget" else "")
    with TestClient(build_app(dec)) as c:
        r = c.post("/v1/completions", json={"prompt": "p", "max_tokens": 2, "stop": ["yz"], "stream": stream})
    if stream:
        import json
        chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        text = "".join(ch["choices"][0]["text"] for ch in chunks)
        finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]]
    else:
        text, finish = r.json()["choices"][0]["text"], [r.json()["choices"][0]["finish_reason"]]
    assert text == "x " and finish == ["stop"], (text, finish)


def test_health_does_not_hand_out_credentials_in_backend_urls():
    """/health, outside the /v1 key check, names a backend that is down without the user and password its URL
    carries: it once answered the URL whole."""
    from fastapi.testclient import TestClient
    from semanticspec.serve.app import Settings, build_app

    app = build_app(FakeDecoder(), Settings(api_key="sk-endpoint", backends=("http://svc:hunter2pw@127.0.0.1:9/",)))
    with TestClient(app) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        r = c.get("/health")
    assert r.status_code == 503 and "hunter2pw" not in r.text, r.text


def test_max_rows_above_256_is_served():
    """`python -m semanticspec.serve --max_rows 300` serves: it once exited 2 with "rows_per_loop=256: expected at
    least max_rows=300", an option the command does not have."""
    from semanticspec.serve.app import Settings, build_app

    app = build_app(FakeDecoder(), Settings(max_rows=300, max_queue=1000))
    app.state.scheduler.stop(1)


def test_a_shutdown_ends_every_request_once_and_counts_none_as_a_client_gone():
    """stop()'s abort ends a row decoding, one waiting for room and one still in the inbox, each with one end and
    nothing after it, and none of them counts as a client that went away (cancelled, dropped): the one in the inbox
    was once planned after its end and told so, and the others were counted as clients gone."""
    from semanticspec.serve.scheduler import Scheduler

    gate, held = threading.Event(), threading.Event()
    gate.set()

    def round_gate():  # rounds run (10 ms each) while the gate is open; a round waits at a closed one
        if not gate.is_set():
            held.set()
        assert gate.wait(10)
        time.sleep(0.01)

    s = Scheduler(FakeDecoder(round_gate=round_gate), max_rows=1)
    got = {k: [] for k in ("decoding", "waiting", "inbox")}
    told = {k: threading.Event() for k in got}

    def notify(name):
        return lambda u: (got[name].append(u), told[name].set())

    s.submit(_job("a", notify("decoding"), n=1000))
    s.submit(_job("b", notify("waiting"), n=1000))  # planned, no room: it waits
    assert told["decoding"].wait(10) and told["waiting"].wait(10)
    gate.clear()
    assert held.wait(10)  # the thread waits in a round: what is submitted now stays in the inbox
    s.submit(_job("c", notify("inbox"), n=1000))
    s.abort("the server shut down before this request finished")
    gate.set()
    s.stop(5)
    for name, updates in got.items():
        ends = [k for k, u in enumerate(updates) if u.finish]
        assert ends == [len(updates) - 1] and updates[-1].status == 503, (name, updates[-3:])
    assert len(got["inbox"]) == 1 and (s.cancelled, s.dropped, s.pending) == (0, 0, 0)
