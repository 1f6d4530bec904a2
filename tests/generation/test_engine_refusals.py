"""A server's client error is the caller's to fix: :class:`~generation.engines.connection.Connection` raises
:class:`~generation.engines.base.Refused` with the server's own message after one request, not retried; a server
that is down still raises :class:`~generation.engines.base.Unreachable` after the retries."""

import base64
import re
import threading
import time

import pytest

from tests.fake_openai import JsonHandler, LoopbackServer

pytest.importorskip("openai")

CONTEXT_MESSAGE = ("This model's maximum context length is 256 tokens, however you requested 300 tokens (290 in your "
                   "prompt; 10 for the completion). Please reduce your prompt; or completion length.")


class AnsweringServer(LoopbackServer):
    """Answers every ``POST`` with ``status`` and ``body``, counting the requests.

    Its 400 body is llama-cpp-python's for a prompt past its context: ``ErrorResponseFormatters.
    context_length_exceeded`` in ``llama_cpp/server/errors.py``, llama-cpp-python 0.3.36.
    """

    def __init__(self, status: int, body: dict):
        self.requests = 0
        outer = self

        class Handler(JsonHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests += 1
                self._send(status, body)

        self.url = self._serve(Handler) + "/v1"


@pytest.fixture
def server(request):
    s = AnsweringServer(*request.param)
    yield s
    s.close()


PAST_CONTEXT = (400, {"error": {"message": CONTEXT_MESSAGE, "type": "invalid_request_error", "param": "messages",
                                "code": "context_length_exceeded"}})


@pytest.mark.parametrize("server", [PAST_CONTEXT], indirect=True)
def test_a_prompt_past_the_servers_context_is_refused_once_with_its_message(server):
    from generation.engines.base import Refused
    from generation.engines.connection import Connection

    conn = Connection(server.url, api_key_env="", timeout=10, retries=3)
    with pytest.raises(Refused) as e:
        conn.completions(model="m", prompt="x", max_tokens=1)
    assert e.value.status == 400 and e.value.param == "messages"
    message = str(e.value)
    assert CONTEXT_MESSAGE in message and server.url.removesuffix("/v1") in message and "attempt" not in message
    assert server.requests == 1  # not retried


@pytest.mark.parametrize("server", [(503, {"error": {"message": "busy"}})], indirect=True)
def test_a_busy_server_is_still_unreachable_after_the_retries(server):
    from generation.engines.base import Unreachable
    from generation.engines.connection import Connection

    conn = Connection(server.url, api_key_env="", timeout=10, retries=3)
    with pytest.raises(Unreachable) as e:
        conn.completions(model="m", prompt="x", max_tokens=1)
    assert "3 attempt(s)" in str(e.value) and server.requests == 3


class HangingServer(LoopbackServer):
    """Holds every ``POST`` for ``hang`` seconds before answering 200 with a minimal completion (a stopped server that
    still accepts connections, as a SIGSTOPped llama.cpp does), counting the requests."""

    def __init__(self, hang: float):
        self.requests, self.hang = 0, hang
        outer = self

        class Handler(JsonHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests += 1
                time.sleep(outer.hang)
                try:
                    self._send(200, {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                     "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
                                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                except OSError:  # the client gave up waiting
                    pass

        self.url = self._serve(Handler) + "/v1"


def test_a_hung_server_fails_the_requests_behind_it_at_once_and_is_asked_again_later():
    from generation.engines.base import Unreachable
    from generation.engines.connection import Connection

    server = HangingServer(hang=2.0)
    try:
        conn = Connection(server.url, api_key_env="", timeout=0.5, retries=2)
        t0 = time.perf_counter()
        with pytest.raises(Unreachable, match="after 2 attempt"):
            conn.completions(model="m", prompt="x", max_tokens=1)
        waited = time.perf_counter() - t0
        for _ in range(5):  # behind it: refused without a request
            with pytest.raises(Unreachable, match=r"is not asked /v1/completions: it failed .* \(asked again 0\.5 s"):
                conn.completions(model="m", prompt="x", max_tokens=1)
        assert server.requests == 2 and waited >= 1.0
        assert conn.down().startswith(f"{conn.root} is not asked for ")  # what /health reports meanwhile
        server.hang = 0.2  # it answers again, slowly
        time.sleep(conn.down_s)
        assert conn.down() is None
        got = []  # four requests at once: one tries the server, the three behind it wait for its answer, then go
        threads = [threading.Thread(target=lambda: got.append(conn.completions(model="m", prompt="x", max_tokens=1)))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [a.choices[0].text for a, _ in got] == ["ok"] * 4 and server.requests == 6
        assert conn.completions(model="m", prompt="x", max_tokens=1)[0].choices[0].text == "ok"
    finally:
        server.close()


def test_a_servers_user_and_password_reach_it_and_no_message():
    """A URL may carry a user and password (``http://user:pass@host/v1``), which the HTTP client sends: every message
    (and ``/health``, and a log) names the server without them. Messages once carried the URL whole."""
    from generation.engines.base import Unreachable
    from generation.engines.connection import Connection

    seen = []

    class Recording(LoopbackServer):
        def __init__(self):
            class Handler(JsonHandler):
                def do_POST(self):
                    self.rfile.read(int(self.headers["Content-Length"]))
                    seen.append(self.headers.get("Authorization"))
                    self._send(503, {"error": {"message": "busy"}})

            self.url = self._serve(Handler) + "/v1"

    s = Recording()
    try:
        with_login = s.url.replace("http://", "http://svc:hunter2pw@")
        conn = Connection(with_login, api_key_env="", timeout=10, retries=1)
        with pytest.raises(Unreachable) as e:
            conn.completions(model="m", prompt="x", max_tokens=1)
    finally:
        s.close()
    assert seen == ["Basic " + base64.b64encode(b"svc:hunter2pw").decode()]  # sent, as httpx sends a URL's login
    assert conn.url == s.url and "hunter2pw" not in str(e.value) and s.url.removesuffix("/v1") in str(e.value)


@pytest.mark.parametrize("url, said", [("127.0.0.1:8000/v1", "no http:// or https:// scheme"),
                                       ("ftp://127.0.0.1:8000/v1", "no http:// or https:// scheme (it has ftp://)"),
                                       ("", "no http:// or https:// scheme"), ("http:///v1", "no host"),
                                       ("http://127.0.0.1:99999/v1", "Port out of range")])
def test_a_url_that_names_no_server_is_refused_as_such(url, said):
    """Each was asked three times and reported as a server that is down ("start it or fix the URL")."""
    from generation.engines.connection import Connection

    with pytest.raises(ValueError, match=f"server URL .*: {re.escape(said)}"):
        Connection(url, api_key_env="", timeout=10, retries=3)


def test_a_server_that_answers_models_with_404_is_not_called_down():
    """A 404 is answered once (the openai client does not retry it): it was reported as "did not answer /v1/models
    after 3 attempt(s)"."""
    from generation.engines.base import Unreachable
    from generation.engines.connection import Connection

    class NoRoutes(LoopbackServer):
        def __init__(self):
            class Handler(JsonHandler):
                def do_GET(self):
                    self._send(404, {"detail": "Not Found"})

            self.url = self._serve(Handler) + "/v2"

    s = NoRoutes()
    try:
        with pytest.raises(Unreachable, match=r"answered /v1/models with 404 .*; fix the URL") as e:
            Connection(s.url, api_key_env="", timeout=10, retries=3).models()
    finally:
        s.close()
    assert "attempt" not in str(e.value)


def test_models_waits_its_own_short_time_not_the_connections_timeout(monkeypatch):
    """A server that takes connections and never answers held a start-up silent for the request timeout times the
    retries (6 minutes at the endpoint's defaults): ``/v1/models`` now waits at most ``MODELS_S`` each attempt."""
    from generation.engines import connection
    from generation.engines.base import Unreachable

    class Slow(LoopbackServer):
        def __init__(self):
            class Handler(JsonHandler):
                def do_GET(self):
                    time.sleep(2)
                    self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

            self.url = self._serve(Handler) + "/v1"

    monkeypatch.setattr(connection, "MODELS_S", 0.5)
    s = Slow()
    try:
        with pytest.raises(Unreachable, match="did not answer /v1/models after 1 attempt"):
            connection.Connection(s.url, api_key_env="", timeout=30, retries=1).models()  # answered in 2 s before
    finally:
        s.close()
