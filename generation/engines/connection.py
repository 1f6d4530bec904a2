"""One HTTP connection to a serving engine, as the ``openai`` sampler makes it.

An ``openai.OpenAI`` client per URL with a timeout per attempt and bounded retries (the client
retries connection errors, timeouts, 429 and 5xx with backoff); the API key is read from an
environment variable and never logged or put in an error message (a server that echoes a header
back has it blanked, :func:`redact`). :class:`Connection` also checks ``/models``, reads ``GET /version`` and
posts to an engine's native routes (SGLang's ``/generate``) through the same client, so retries, timeouts
and key handling are the same on every route. The engine clients, the ``openai`` label sampler and the HTTP
judge all go through it, and a failure is an :class:`~generation.engines.base.EngineError` subclass
(:class:`~generation.engines.base.Unreachable` after the retries) that the CLIs catch by type.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from generation.engines.base import EngineError, Refused, Unreachable, Unsupported

_KEY_NAME = re.compile(r"(?i)(api[_-]?key|token|secret)")


def redact(message: str, *keys: str) -> str:
    """``message`` with ``keys`` and the value of every key-like environment variable (``*API_KEY*``, ``*TOKEN*``,
    ``*SECRET*``, 8 characters or more) blanked as ``***``: the one place a key is taken out of a message."""
    values = [k for k in keys if k] + [v for n, v in os.environ.items() if _KEY_NAME.search(n) and len(v) >= 8]
    for value in sorted(set(values), key=len, reverse=True):
        message = message.replace(value, "***")
    return message


def public_url(url: str) -> str:
    """``url`` without the user and password it may carry (``http://user:pass@host/``, which the HTTP client sends as
    basic auth): how a message, a log line or ``/health`` names a server."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def at_least(client, version: str | None, floor: str, engine: str) -> None:
    """Refuse a server older than ``floor`` (or one that does not say), naming its URL, its version and the floor.

    Raises:
        Unsupported: ``version`` is None, unparsable or below ``floor``.
    """
    from packaging.version import InvalidVersion, Version

    try:
        ok = version is not None and Version(version.split()[-1]) >= Version(floor)
    except InvalidVersion:
        ok = False
    if not ok:
        raise Unsupported(f"{engine} server {client.url} reports version {version or 'unknown'}; this client needs "
                          f"{engine} >= {floor}; upgrade the server", client.url)


DOWN_S = 30.0
"""Seconds a server that is gone (no connection, or no answer in time after the retries) is not asked again."""
MODELS_S = 10.0
"""Seconds each attempt of ``/v1/models`` (the first request, and a cheap one) waits at most, whatever the
connection's timeout: a server that takes connections and never answers held a start-up silent for the timeout times
the retries (6 minutes at the defaults)."""


def url_problem(url: str) -> str | None:
    """What keeps ``url`` from naming a server (no http(s) scheme, no host, a port outside 1-65535), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError outside 0-65535
    except ValueError as e:
        return str(e)
    if parts.scheme not in ("http", "https"):
        return f"no http:// or https:// scheme (it has {parts.scheme + '://' if parts.scheme else 'none'})"
    if not parts.hostname:
        return "no host"
    return "port 0" if port == 0 else None


class Connection:
    """A client of one server.

    Args:
        url: the server's base URL, with or without the ``/v1`` suffix (``http://127.0.0.1:8000/v1``).
        api_key_env: environment variable holding the API key ("" or unset: no key).
        timeout: seconds per request attempt.
        retries: attempts per request (>= 1).

    Raises:
        ImportError: the ``openai`` client is not installed.
        ValueError: ``retries < 1`` or ``timeout <= 0``.
    """

    def __init__(self, url: str, *, api_key_env: str = "OPENAI_API_KEY", timeout: float = 120.0, retries: int = 3):
        try:
            import openai
        except ImportError as e:
            raise ImportError("engine clients need the openai client: pip install "
                              f"'semanticspec-probes[openai]' ({e})") from None
        if retries < 1 or timeout <= 0:
            raise ValueError(f"retries={retries} (expected >= 1), timeout={timeout} (expected > 0)")
        if problem := url_problem(url):  # each was asked three times and called a server that is down
            raise ValueError(f"server URL {public_url(url)!r}: {problem}; expected http(s)://HOST[:PORT][/v1]")
        self.openai = openai
        root = url.rstrip("/").removesuffix("/v1")  # a user and password in it are sent, never shown
        self.root = public_url(root)
        self.url = self.root + "/v1"
        self.retries = retries
        self.key_env = api_key_env
        self._key = os.environ.get(api_key_env, "") if api_key_env else ""
        self.client = openai.OpenAI(base_url=root + "/v1", api_key=self._key or "none", timeout=timeout,
                                    max_retries=retries - 1)
        self.root_client = self.client.with_options(base_url=root)
        self.contexts: dict[str, int] = {}
        """Per model name, the context ``/v1/models`` states (``max_model_len``), filled by :meth:`models`."""
        self.down_s = min(timeout, DOWN_S)
        """Seconds a server found gone is not asked again (:meth:`_call`): :data:`DOWN_S`, or the timeout if shorter."""
        self._down: tuple[float, str] | None = None
        """When a request last found the server gone (no connection, or no answer in time after the retries), and
        why."""
        self._trying = threading.Condition()  # the one request trying a gone server again; the others wait on it
        self._trier: int | None = None  # that request's thread

    def say(self, e: BaseException | str) -> str:
        """An exception (or text) with the API key blanked out (:func:`redact`)."""
        return redact(e if isinstance(e, str) else f"{type(e).__name__}: {e}", self._key)

    def error(self, what: str, e: BaseException, fix: str = "") -> EngineError:
        """The error of a failed request: :class:`Refused` for a client error the server answered at once (400, 413,
        422: never retried; its message the server's), else :class:`Unreachable` (the URL, what failed, the cause with
        the key blanked, the fix)."""
        status = getattr(e, "status_code", None)
        if isinstance(e, self.openai.APIStatusError) and status in (400, 413, 422):
            body = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
            said = body.get("message") if isinstance(body, dict) else None
            param = body.get("param") if isinstance(body, dict) else None
            return Refused(self.say(f"server {self.root} refused {what} ({status}): {said or self.say(e)}"
                                    + (f"; {fix}" if fix else "")), self.root, status,
                           param if isinstance(param, str) else None)
        if not fix and isinstance(e, (self.openai.AuthenticationError, self.openai.PermissionDeniedError)):
            fix = self.key_fix()
        fix = fix or "check that the server is running and reachable"
        return Unreachable(self.say(f"server {self.root} failed {what} after {self.retries} attempt(s): "
                                    f"{self.say(e)}; {fix}"), self.root)

    def key_fix(self) -> str:
        """What to do about a refused key: set the variable read, or name one (none was)."""
        if self.key_env:
            return f"set ${self.key_env} to a key it accepts"
        return "name an environment variable holding a key it accepts (api_key_env=...; the commands' --api_key_env)"

    # -- routes ---------------------------------------------------------------------------------

    def models(self) -> list[str]:
        """The model names ``/v1/models`` lists; their contexts, where it states them (vLLM's and SGLang's model
        cards carry ``max_model_len``; llama-cpp-python's do not), go to :attr:`contexts`.

        Raises:
            EngineError: the server refused the key or did not answer.
        """
        try:
            listed = list(self.client.with_options(timeout=min(self.client.timeout, MODELS_S)).models.list())
        except (self.openai.AuthenticationError, self.openai.PermissionDeniedError) as e:
            given = f"the API key from ${self.key_env}" if self.key_env else "a request without an API key"
            raise Unreachable(self.say(f"server {self.url} refused {given} at /v1/models ({self.say(e)}); "
                                       f"{self.key_fix()}"), self.root) from None
        except self.openai.OpenAIError as e:
            if isinstance(e, self.openai.APIStatusError) and e.status_code < 500:  # it answered, once: no such route
                raise Unreachable(self.say(f"server {self.root} answered /v1/models with {e.status_code} "
                                           f"({self.say(e)}); fix the URL (the server's root, or its /v1)"),
                                  self.root) from None
            raise Unreachable(self.say(f"server {self.url} did not answer /v1/models after {self.retries} attempt(s) "
                                       f"({self.say(e)}); start it or fix the URL"), self.root) from None
        self.contexts = {m.id: n for m in listed if type(n := getattr(m, "max_model_len", None)) is int and n > 0}
        return [m.id for m in listed]

    def check_model(self, model: str | None) -> str:
        """The model name to request, checked against what the server lists (one cheap call, fails fast).

        Raises:
            EngineError: no answer, or it does not serve ``model`` (naming what it serves).
        """
        served = self.models()
        if model is None:
            if len(served) != 1:
                raise Unsupported(f"server {self.root} serves {served}; name one with model=...", self.root)
            return served[0]
        if served and model not in served:
            raise Unsupported(f"server {self.root} does not serve model {model!r}; it serves {served}", self.root)
        return model

    def get(self, path: str, patient: bool = False) -> Any | None:
        """``GET path`` on the server's root, one quick attempt (``patient``: the connection's timeout and retries);
        None when it has no such route or fails."""
        client = self.root_client if patient else self.root_client.with_options(max_retries=0, timeout=5.0)
        try:
            return client.get(path, cast_to=object)
        except self.openai.OpenAIError:
            return None

    def version(self, route: str = "/version") -> str | None:
        """The server's reported version (vLLM answers ``GET /version``), else None."""
        got = self.get(route)
        return str(got["version"]) if isinstance(got, dict) and "version" in got else None

    def post(self, path: str, body: dict, what: str | None = None) -> tuple[Any, float]:
        """``POST path`` (on the root) with retries: the decoded JSON answer and the seconds it took.

        Raises:
            EngineError: the server refused the request or did not answer after the retries.
        """
        return self._call(what or path, "", lambda: self.root_client.post(path, body=body, cast_to=object))

    def completions(self, what: str = "/v1/completions", fix: str = "", **kw) -> tuple[Any, float]:
        """``completions.create(**kw)`` with retries: the response and the seconds it took.

        Raises:
            EngineError: the server refused the request or did not answer after the retries.
        """
        return self._call(what, fix, lambda: self.client.completions.create(**kw))

    def _call(self, what: str, fix: str, request) -> tuple[Any, float]:
        """``request()`` with the client's retries, and the seconds it took; a server gone (no connection, or no
        answer in time after the retries) is not asked again for :attr:`down_s` seconds, so the requests behind a hung
        server fail at once instead of each waiting out its timeouts; then one request tries it again and the others
        wait for its answer.

        Raises:
            EngineError: the server refused the request, did not answer after the retries, or is gone.
        """
        trier = self._admit(what)
        t = time.perf_counter()
        try:
            answer = request()
            self._down = None
        except self.openai.OpenAIError as e:
            gone = isinstance(e, self.openai.APIConnectionError)  # no connection, or a timeout (its subclass)
            self._down = (time.monotonic(), f"it failed {what} after {self.retries} attempt(s) ({self.say(e)})") \
                if gone else None  # an answer, even a refusal, says it is there
            raise self.error(what, e, fix) from None
        finally:
            if trier:
                with self._trying:
                    self._trier = None
                    self._trying.notify_all()
        return answer, time.perf_counter() - t

    def _admit(self, what: str) -> bool:
        """Let a request go to the server, refusing it while the server is marked gone; once the mark is
        :attr:`down_s` old, the first request tries the server (True: it is the one) and the others wait for its
        answer, then go or are refused by it."""
        with self._trying:
            while True:
                if self._down is None:
                    return False
                since, why = self._down
                if time.monotonic() - since < self.down_s:
                    raise Unreachable(f"server {self.root} is not asked {what}: {why} {time.monotonic() - since:.0f} s "
                                      f"ago (asked again {self.down_s:g} s after)", self.root)
                if self._trier is None:
                    self._trier = threading.get_ident()
                    return True
                self._trying.wait()

    def down(self) -> str | None:
        """Why requests to this server are refused now without asking it (it was found gone less than
        :attr:`down_s` seconds ago), else None."""
        down = self._down
        if down is None or (left := self.down_s - (time.monotonic() - down[0])) <= 0:
            return None
        return f"{self.root} is not asked for {left:.0f} s more: {down[1]}"


def connect(client, url: str, model: str | None, *, version_route: str | None = "/version", **conn) -> None:
    """Give an engine client its :class:`Connection` (``conn``: ``api_key_env``, ``timeout``, ``retries``), root
    ``url``, checked ``model``, its ``context_length`` as ``/v1/models`` states it (None where it does not) and
    ``version`` (from ``GET version_route``; None: the client reads it itself).

    Raises:
        EngineError: the server does not answer ``/v1/models`` or does not serve ``model``.
    """
    client.conn = Connection(url, **conn)
    client.url = client.conn.root
    client.model = client.conn.check_model(model)
    client.context_length = client.conn.contexts.get(client.model)
    client.version = client.conn.version(version_route) if version_route else None


def identify(conn: Connection) -> tuple[str | None, str | None]:
    """Which engine serves at ``conn`` and its version: ``("sglang", v)`` (``/server_info``, older
    ``/get_server_info``), ``("llama.cpp", v)`` (llama-cpp-python's ``/openapi.json``), ``("vllm", v)``
    (``/version``), or ``(None, None)`` for another OpenAI-compatible server (a few quick GETs, no retries)."""
    info = conn.get("/server_info") or conn.get("/get_server_info")
    if isinstance(info, dict) and info.get("version") is not None:
        return "sglang", str(info["version"])
    api = conn.get("/openapi.json")
    title = (api.get("info") or {}) if isinstance(api, dict) else {}
    if "llama" in str(title.get("title", "")).lower():
        return "llama.cpp", str(title.get("version")) if title.get("version") is not None else None
    version = conn.version()
    return ("vllm", version) if version is not None else (None, None)


def other_engine(conn: Connection, expected: str) -> str | None:
    """Why the server at ``conn`` cannot be the ``expected`` engine's (:func:`identify` says it is another's, with the
    kind to connect with), or None (it is that engine's, or unknown): asked only where the expected engine's own
    routes failed, so a client given the wrong ``kind`` says so instead of asking for an upgrade or a restart."""
    found, version = identify(conn)
    if found is None or found == expected:
        return None
    names = {"sglang": "SGLang", "vllm": "vLLM", "llama.cpp": "llama-cpp-python"}
    return (f"server {conn.root} answers as {names[found]} (version {version or 'unknown'}), not as "
            f"{names.get(expected, expected)}; connect to it as {found!r} (make_engine({found!r}, ...), the "
            f"commands' --engine {found})")
