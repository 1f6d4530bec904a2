"""The OpenAI-compatible SemanticSpec endpoint: FastAPI routes over the decode thread (:mod:`.scheduler`).

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (streaming as server-sent events in OpenAI's chunk format,
ending with ``data: [DONE]``), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus). :func:`build_app` puts them
in front of any decoder: in-process models (:class:`~semanticspec.decoder.SemanticSpecDecoder`) or two servers
(:class:`~semanticspec.served.ServedDecoder`); ``python -m semanticspec.serve`` builds one from a config.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import random
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from generation.engines.base import Refused
from generation.engines.connection import public_url
from semanticspec.config import DecodeConfig
from semanticspec.methods import METHODS
from semanticspec.serve.protocol import (ChatRequest, CompletionRequest, Reply, error_body, lone_surrogate, unsupported,
                                   usage)
from semanticspec.serve.scheduler import Job, QueueFull, Scheduler, Update

log = logging.getLogger(__name__)

ENDPOINT_METHODS = tuple(m for m in METHODS if m not in ("hf_target_only", "token_sd"))
"""Methods a request may name: every step-loop method (transformers' own loops decode whole batches alone)."""


class BadRequest(Exception):
    """A request the endpoint refuses with a 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error",
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.headers = param, status, kind, headers


class Metrics:
    """The endpoint's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("semanticspec_requests", "Requests by route (the endpoint's route template, "
                                "'other' for a path it does not serve) and status code", ["route", "status"],
                                registry=r)
        self.tokens = Counter("semanticspec_tokens", "Tokens: prompt, completion, and the draft's share of completion",
                              ["kind"], registry=r)
        self.steps = Counter("semanticspec_steps", "Steps tried, by decision: accept and accept_fast (a draft step "
                             "kept), reject (refused), target (the target wrote it)", ["decision"], registry=r)
        self.step_seconds = Histogram("semanticspec_step_seconds", "Seconds per tried step", registry=r,
                                      buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.queue = Gauge("semanticspec_queue_length", "Requests waiting for room in a loop", registry=r)
        self.running = Gauge("semanticspec_running_rows", "Rows decoding now (in every loop: while an old loop "
                             "drains beside a fresh one, this can exceed --max_rows)", registry=r)
        self.max_after_cancel = Gauge("semanticspec_max_steps_after_cancel", "The most steps one cancelled row "
                                      "decoded after its cancel", registry=r)
        # as vLLM's request_success, e2e_request_latency_seconds and time_to_first_token_seconds, with its buckets
        # (vllm/v1/metrics/loggers.py at 005a810); a row that failed counts too, as finished_reason="error"
        self.finished = Counter("semanticspec_requests_finished", "Requests decoded to their end, by OpenAI's "
                                "finish_reason (stop, length), or error (a server failed the row, or the shutdown "
                                "ended it)", ["finished_reason"], registry=r)
        self.latency = Histogram("semanticspec_e2e_request_latency_seconds", "Seconds from a request's arrival to its "
                                 "end", registry=r, buckets=(0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50,
                                                             60, 120, 240, 480, 960, 1920, 7680))
        self.first_text = Histogram("semanticspec_time_to_first_token_seconds", "Seconds from a request's arrival to "
                                    "its first output text (streamed or not)", registry=r,
                                    buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1,
                                             2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560))

    def watch(self, sched: Scheduler) -> None:
        """Export ``sched``'s running totals as counters (read at each scrape)."""
        self.registry.register(_SchedulerTotals(sched))

    def count(self, scope, status: int | str) -> None:
        """Count a request answered with ``status`` under :func:`route_label` of its ``scope``."""
        self.requests.labels(route_label(scope), str(status)).inc()

    def end(self, job: Job, u: Update) -> None:
        """Count a request's end ``u`` (a finish reason, or error): its tokens, its latency and its time to first
        text."""
        self.finished.labels(u.finish).inc()
        self.latency.observe(time.monotonic() - job.arrived)
        if job.first_text_at is not None:
            self.first_text.observe(job.first_text_at - job.arrived)
        if u.result is not None and u.finish not in ("error", "invalid"):
            self.tokens.labels("completion").inc(u.result.stats.output_tokens)
            self.tokens.labels("draft").inc(u.result.stats.draft_tokens)

    def on_step(self, decision: str, seconds: float) -> None:
        self.steps.labels(decision).inc()
        self.step_seconds.observe(seconds)


class _SchedulerTotals:
    """The scheduler's running totals, as Prometheus counters (``*_total``: ``rate()`` reads them)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    def collect(self):
        s = self.sched
        yield CounterMetricFamily("semanticspec_cancelled_rows", "Rows that left their loop before their end (their "
                                  "client went away)", value=s.cancelled)
        yield CounterMetricFamily("semanticspec_dropped_requests", "Requests whose client went away while they "
                                  "waited for room in a loop", value=s.dropped)
        yield CounterMetricFamily("semanticspec_steps_after_cancel", "Steps of cancelled rows decoded after the "
                                  "cancel (those their loop's round had already written)", value=s.after_cancel)


COUNTED = "semanticspec.counted"
"""A request's scope key: its answer is counted already (a scrape of /metrics counts itself)."""


def route_label(scope) -> str:
    """The route a request's ``scope`` matches, as its template (``/v1/models/{model:path}``), or ``other``: a metric's
    label is never the raw path a client sent, which would make one series per path anyone cares to request."""
    route = scope.get("route")  # Starlette's router sets it on a match (a path-only match too: a 405)
    if route is None:  # not routed yet (the key check), or no route matched (a 404)
        route = next((r for r in scope["app"].router.routes if r.matches(scope)[0] != Match.NONE), None)
    return getattr(route, "path", "other")


@dataclasses.dataclass
class Settings:
    """How the endpoint serves (the ``serve`` command's options).

    Attributes:
        model_name: the name ``/v1/models`` lists and requests name.
        max_rows: rows one loop decodes together.
        max_queue: requests waiting or decoding at once; past it a 429 with ``Retry-After``.
        api_key: when set, ``/v1`` routes want ``Authorization: Bearer <key>`` (checked in constant time, never
            logged).
        chat_template: a Jinja chat template for the target tokenizer (None: the tokenizer's own).
        tokenizer: the target's tokenizer, for a decoder that holds none (two servers): chat templates and prompt
            token counts; None there: chat routes answer 400 and ``prompt_tokens`` is 0.
        backends: the URLs ``/health`` checks (the servers a served decoder reads).
    """

    model_name: str = "semanticspec"
    max_rows: int = 16
    max_queue: int = 128
    api_key: str | None = None
    chat_template: str | None = None
    tokenizer: object = None
    backends: tuple[str, ...] = ()


def build_app(decoder, settings: Settings | None = None) -> FastAPI:
    """The endpoint's FastAPI app over ``decoder``; its decode thread starts now and stops with the app's lifespan
    (``app.state.scheduler``)."""
    s = settings or Settings()
    metrics = Metrics()
    tok = getattr(decoder, "tokenizer", None)
    count = None if tok is not None or s.tokenizer is None else (lambda text: len(s.tokenizer(text).input_ids))
    sched = Scheduler(decoder, s.max_rows, s.max_queue, on_step=metrics.on_step, count_tokens=count,
                      rows_per_loop=max(256, s.max_rows))
    metrics.watch(sched)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        sched.stop(timeout=0.0)  # uvicorn waited for the open requests (its graceful-shutdown timeout)

    app = FastAPI(title="SemanticSpec endpoint", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.settings = sched, metrics, s
    app.add_middleware(Guard, settings=s, metrics=metrics)  # inside Starlette's ServerErrorMiddleware
    _errors(app)
    _routes(app, decoder, sched, metrics, s)
    return app


def _errors(app: FastAPI) -> None:
    """Every refusal in OpenAI's error JSON: bad bodies (pydantic), unknown routes and methods (Starlette), the
    endpoint's own checks (:class:`BadRequest`); the key check and the last-resort 500 are :class:`Guard`'s."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        ctype = request.headers.get("content-type", "")
        if param is None and "json" not in ctype and not message.startswith("malformed JSON"):  # curl -d's form type
            message += f" (it came as {ctype or 'no Content-Type'}; send it with Content-Type: application/json)"
        return JSONResponse(error_body(message, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path}); see GET /v1/models and the POST routes " \
                      "/v1/completions and /v1/chat/completions"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path} (allowed: " \
                      f"{(exc.headers or {}).get('Allow', '?')})"
        else:  # FastAPI's "There was an error parsing the body": a body that is not UTF-8 JSON
            message = f"malformed request body: {exc.detail}; send UTF-8 JSON"
        return JSONResponse(error_body(message, None), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(BadRequest)
    async def bad(request: Request, exc: BadRequest):
        return JSONResponse(error_body(str(exc), exc.param, exc.kind), status_code=exc.status,
                            headers=exc.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "json-or-python", "function-after",
              "function-before", "function-wrap"}


def validation_message(errors: list) -> tuple[str, str | None]:
    """A pydantic refusal as one message and the field it names (``param`` without pydantic's union tags such as
    ``prompt.str`` or ``temperature.float``, which vLLM strips too). Of a union's refusals, one per form, the one that
    reached deepest is told: ``[{"type": "text", "text": 1}]`` as content is refused at ``messages.0.content.0.text``,
    not as a content that should have been a string."""
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    loc = [x for x in first.get("loc", ()) if isinstance(x, int) or (x != "body" and x.split("[")[0] not in _TYPE_TAGS
                                                                     and "[" not in x)]
    param = ".".join(str(x) for x in loc) or None
    kind = first.get("type")
    if kind == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error') or first.get('msg', '')}", None
    if kind == "extra_forbidden":
        return f"{param}: unknown field (not an OpenAI field this endpoint knows, nor a SemanticSpec option)", param
    if kind == "string_unicode" and param is None:  # a field's name: its values are checked in check_body
        return ("body: a field's name holds a lone UTF-16 surrogate, which is not Unicode text; send the character "
                "itself or a whole surrogate pair"), None
    if kind == "missing" and param is None:
        return "the request has no body: send a JSON object with the route's fields", None
    if kind in ("model_type", "model_attributes_type", "dict_type") and param is None:
        return "the body must be a JSON object with the route's fields", None
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


class Guard:
    """The endpoint's outermost ASGI layer: the ``/v1`` key check and a last-resort JSON 500.

    A plain ASGI middleware rather than FastAPI's ``@app.middleware("http")`` (Starlette's ``BaseHTTPMiddleware``),
    under which ``request.is_disconnected()`` never saw a non-streaming client leave, so its row decoded to the end.
    A fault no handler maps is answered in OpenAI's JSON with the connection kept open (an unhandled exception would
    have Starlette answer in plain text and uvicorn drop the keep-alive connection), and logged once.
    """

    def __init__(self, app, settings: Settings, metrics: Metrics) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key, path, started = self.settings.api_key, scope["path"], False

        async def sending(message) -> None:  # every answer is counted as it starts, once
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                if not scope.get(COUNTED):
                    self.metrics.count(scope, message["status"])
            await send(message)

        if key and path.startswith("/v1") and not key_matches(dict(scope["headers"]).get(b"authorization", b""), key):
            return await JSONResponse(error_body("invalid API key", None, "authentication_error"),
                                      status_code=401)(scope, receive, sending)
        try:
            await self.app(scope, receive, sending)
        except ClientDisconnect:  # the client went before its body was read: no one to answer
            self.metrics.count(scope, 499)
        except Exception as e:  # noqa: BLE001 - the answer a client can read, instead of a dropped connection
            log.exception("%s %s failed", scope.get("method"), path)
            if not started:
                body = error_body(f"internal error: {type(e).__name__}: {e}", None, "server_error")
                await JSONResponse(body, status_code=500)(scope, receive, sending)


def key_matches(header: bytes, key: str) -> bool:
    """``Authorization: Bearer <key>``, the scheme in any case (RFC 7235), the key compared in constant time."""
    scheme, _, given = header.decode("latin-1").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _info_routes(app: FastAPI, dec, sched: Scheduler, metrics: Metrics, s: Settings) -> None:
    known = [c - dec.spare(dec.config) for c in dec.contexts() if c is not None]  # what prompt + max_tokens may
    card = {"id": s.model_name, "object": "model", "created": int(time.time()), "owned_by": "semanticspec-probes",
            **({"max_model_len": min(known)} if known else {})}  # fill, as vLLM's and SGLang's cards state it

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        if model != s.model_name:
            raise BadRequest(f"model={model!r}: this server serves {s.model_name!r}", "model", 404,
                             "not_found_error")
        return card

    @app.get("/version")
    async def version(request: Request):  # vLLM's route: clients and probes of a vLLM fleet ask it
        return {"version": _package_version()}

    @app.get("/health")
    async def health(request: Request):
        down = [public_url(u) for u in s.backends if not await _answers(u)]
        marked = marked_down(dec)
        down += [u for u in marked if u not in down]
        if sched.failure or down:
            why = sched.failure or "backend down: " + ", ".join(marked.get(u, u) for u in down)
            return JSONResponse({"status": "down", "reason": why, "backends_down": down}, status_code=503)
        return {"status": "ok", "running": sched.running, "queued": sched.queued}

    @app.get("/metrics")
    async def prometheus(request: Request):
        metrics.count(request.scope, 200)  # this scrape is in its own answer, counted here, not as it starts
        request.scope[COUNTED] = True
        metrics.queue.set(sched.queued)
        metrics.running.set(sched.running)
        metrics.max_after_cancel.set(sched.max_after_cancel)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def prompt_char_limit(dec, tok) -> tuple[int, str] | None:
    """More characters than a prompt that fits the target's context can hold, and why: the context times its
    tokenizer's longest token (a token covers at most that many characters), twice (a normalizer may fold
    characters); None where either is unknown. A longer prompt is refused before it is tokenized, which would hold
    the decode thread, and every request in it, for seconds."""
    ctx = dec.contexts()[0]
    if ctx is None or tok is None:
        return None
    longest = max((len(t) for t in tok.get_vocab()), default=0)
    return 2 * ctx * longest, f"a prompt that fits the target's context of {ctx} tokens holds fewer (its " \
                               f"tokenizer's longest token has {longest} characters); shorten it"


def _check_length(chars: int, limit: tuple[int, str] | None, field: str) -> None:
    if limit is not None and chars > limit[0]:
        raise BadRequest(f"{field}: {chars} characters; {limit[1]}", field)


def _routes(app: FastAPI, dec, sched: Scheduler, metrics: Metrics, s: Settings) -> None:
    _info_routes(app, dec, sched, metrics, s)
    limit = prompt_char_limit(dec, getattr(dec, "tokenizer", None) or s.tokenizer)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise BadRequest(f"prompt: {len(prompt)} prompts; this endpoint decodes one per request", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise BadRequest("prompt: empty; give the text to continue", "prompt")
        _check_length(len(prompt), limit, "prompt")
        return await _serve(request, body, prompt, Reply(False, s.model_name), dec, sched, metrics, s)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if not body.messages:
            raise BadRequest("messages: empty; give at least one message", "messages")
        messages, template = [m.as_template_turn() for m in body.messages], s.chat_template
        # every turn, an empty one too, writes at least a character of the template
        _check_length(sum(len(m["content"]) + 1 for m in messages), limit, "messages")
        tok = getattr(dec, "tokenizer", None) or s.tokenizer
        if tok is None:
            raise BadRequest("messages: this endpoint has no tokenizer to format a chat with; use /v1/completions, "
                             "or start the server with --tokenizer DIR (the target's tokenizer)", "messages")
        if not (template or getattr(tok, "chat_template", None)):
            raise BadRequest("messages: the target tokenizer has no chat template; use /v1/completions, or start "
                             "the server with --chat_template", "messages")

        def prompt():  # formatted in the decode thread, which owns the tokenizers
            return chat_prompt(dec, tok, messages, template)
        return await _serve(request, body, prompt, Reply(True, s.model_name), dec, sched, metrics, s)


async def _answers(url: str) -> bool:
    """The server at ``url`` lists its models within two seconds (one try; the key is not needed to answer)."""
    import openai

    def ask() -> bool:
        client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="health", timeout=2.0, max_retries=0)
        try:
            client.models.list()
        except openai.AuthenticationError:
            return True  # it answers; it wants a key
        except openai.OpenAIError:
            return False
        return True

    return await asyncio.to_thread(ask)


def chat_prompt(dec, tok, messages: list[dict], template: str | None):
    """The prompt of a chat: the target tokenizer ``tok``'s chat template (or ``template``) with the assistant's turn
    opened, as the decoder reads it (each model's token ids in-process, text served)."""
    from jinja2 import TemplateError

    try:
        text = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    except (TemplateError, TypeError) as e:  # its own raise_exception (roles it cannot format), or an operation its
        # values refuse (a content it adds to a number): vLLM's serving_chat answers both with a 400, not a 500
        raise ValueError(f"messages: the chat template cannot format them: {e}") from None
    if not hasattr(dec, "draft_tokenizer"):
        return text
    ids = list(tok(text, add_special_tokens=False).input_ids)
    if dec.shared:
        return ids
    return ids, list(dec.draft_tokenizer(text, add_special_tokens=False).input_ids)


def check_body(body) -> None:
    """The checks pydantic cannot make (BadRequest naming the field): text that is not Unicode, OpenAI's fields at
    values this endpoint cannot honour, ``stream_options`` that set a field without a stream and an empty stop string
    (vLLM refuses both, ``protocol.py``'s ``validate_stream_options``, which takes an empty ``{}``, and
    ``sampling_params.py``)."""
    for hit in (lone_surrogate(body.model_dump(exclude_none=True)), unsupported(body)):
        if hit is not None:
            raise BadRequest(hit[1], hit[0])
    if body.stream_options is not None and body.stream_options.model_fields_set and not body.stream:
        raise BadRequest("stream_options: allowed only with stream=true (a non-streamed answer carries its usage)",
                         "stream_options")
    if "" in body.stops():
        raise BadRequest("stop: holds an empty string (it would match anywhere); leave it out", "stop")


def decode_config(body, policy=None, base: DecodeConfig | None = None) -> DecodeConfig:
    """The request's :class:`DecodeConfig`, every field checked (BadRequest naming the request's field): ``base``
    (the decoder's own config, default ``DecodeConfig()``) with the request's fields; ``policy``: the decoder's, whose
    ``tau`` a request's ``threshold`` replaces. Without ``max_tokens`` the config holds the decoder's default budget,
    which the scheduler replaces by the route's default (:func:`budget_rule`)."""
    base = base or DecodeConfig()
    given = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if given is not None and given <= 0:
        raise BadRequest(f"{param}={given}: expected an integer >= 1", param)
    if body.n != 1:
        raise BadRequest(f"n={body.n}: this endpoint writes one choice per request (n=1)", "n")
    if body.method not in ENDPOINT_METHODS:
        raise BadRequest(f"method={body.method!r}: expected one of {ENDPOINT_METHODS}", "method")
    if body.threshold is not None and body.method != "semanticspec":
        raise BadRequest(f"threshold: applies to method 'semanticspec', not {body.method!r}", "threshold")
    seed = body.seed if body.seed is not None else random.getrandbits(31)
    method = body.method
    if body.threshold is not None:
        try:
            method = dataclasses.replace(policy, tau=float(body.threshold))
        except ValueError as e:  # the policy's own check of tau, named by the request's field
            raise BadRequest(f"threshold={body.threshold}: {e}", "threshold") from e
    try:
        return dataclasses.replace(base, max_new_tokens=given or base.max_new_tokens, temperature=body.temperature,
                                   top_p=body.top_p, seed=seed, method=method, lookahead=body.lookahead,
                                   window_min_logprob=body.window_min_logprob,
                                   target_first_step=base.target_first_step if body.target_first_step is None else
                                   body.target_first_step, allow_sampling_mismatch=body.allow_sampling_mismatch)
    except ValueError as e:  # DecodeConfig's own checks (temperature, top_p, lookahead...), naming the field
        raise BadRequest(str(e), _param_of(str(e))) from e


def budget_rule(cap: int | None):
    """The budget of a request without ``max_tokens``, from the room its prompt leaves (None: unknown, then the
    decoder's default): at most ``cap`` tokens (completions: 16), or all the room (chat: ``cap`` None)."""
    def budget(room: int | None) -> int:
        if room is None:
            return cap or DecodeConfig.max_new_tokens
        return min(cap, room) if cap else room
    return budget


async def _serve(request: Request, body, prompt, reply: Reply, dec, sched: Scheduler, metrics: Metrics,
                 s: Settings):
    if body.model and body.model != s.model_name:  # "" names no model, as null: vLLM's _is_model_supported
        raise BadRequest(f"model={body.model!r}: this server serves {s.model_name!r}", "model", 404,
                         "not_found_error")
    check_body(body)
    config = decode_config(body, getattr(dec, "policy", None), getattr(dec, "config", None))
    no_budget = body.max_tokens is None and body.max_completion_tokens is None
    loop, updates = asyncio.get_running_loop(), asyncio.Queue()
    job = Job(prompt, config, lambda u: loop.call_soon_threadsafe(updates.put_nowait, u), body.stops(), body.stream,
              budget=budget_rule(body.default_tokens) if no_budget else None)
    if marked := marked_down(dec):  # known before the first step: a stream's 502 too, not a 200 with an error event
        raise BadRequest("backend down: " + "; ".join(marked.values()), None, 502, "server_error")
    try:
        sched.submit(job)
    except QueueFull as e:
        raise BadRequest(f"the server is busy: {e}; retry later", None, 429, "rate_limit_error",
                         {"Retry-After": "1"}) from e
    except RuntimeError as e:
        raise BadRequest(str(e), None, 503, "server_error") from e
    try:
        first = await _next(updates, request, job)
        if first.planned and not body.stream:
            end = await _next(updates, request, job)  # a non-streaming job is told nothing before its end
    except _Gone:
        return Response(status_code=499)  # nginx's "client closed request": no one reads it
    if not first.planned:  # refused (invalid) or failed while planning: the request's only update
        e = _refusal(first, "messages" if reply.chat else "prompt")
        if e.param == "max_tokens" and body.max_completion_tokens is not None:  # the field the request gave
            e = BadRequest(str(e).replace("max_tokens", "max_completion_tokens"), "max_completion_tokens")
        raise e
    metrics.tokens.labels("prompt").inc(first.prompt_tokens)
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(updates, request, job, reply, first.prompt_tokens, include, metrics),
                                 media_type="text/event-stream")
    metrics.end(job, end)
    if end.finish in ("error", "invalid"):
        raise _refusal(end, "messages" if reply.chat else "prompt")
    return reply.full(end.result.text, end.finish, usage(first.prompt_tokens, end.result))


def _refusal(u: Update, prompt_field: str) -> BadRequest:
    """The error a failed request gets: 400 for a refusal (the endpoint's checks, or a server that refused the
    request as the caller's error), 503 at shutdown, 502 when a server failed, 500 for a fault of the endpoint."""
    if u.finish == "invalid":
        param = _param_of(u.error)
        if param in (None, "prompt"):
            return BadRequest(_worded(u.error, prompt_field), prompt_field)
        return BadRequest(u.error, param)
    if isinstance(u.cause, Refused):
        return BadRequest(u.error, "max_tokens" if "max_tokens" in str(u.cause.param) else prompt_field)
    return BadRequest(u.error or "the decode failed", None, u.status, "server_error")


def marked_down(dec) -> dict[str, str]:
    """The decoder's servers found gone a short while ago, whose requests are refused meanwhile without asking them
    (``Connection.down``): their URL and why."""
    return {c.root: why for e in (getattr(dec, "target", None), getattr(dec, "draft", None))
            if (c := getattr(e, "conn", None)) is not None and (why := c.down())}


class _Gone(Exception):
    """The client went away before its answer (its job is cancelled)."""


async def _next(updates: asyncio.Queue, request: Request, job: Job) -> Update:
    """The job's next update; a client that went away cancels its job (its row leaves at the next round).

    Raises:
        _Gone: the client disconnected.
    """
    while True:
        try:
            return await asyncio.wait_for(updates.get(), 0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled = True
                raise _Gone from None


async def _sse(updates, request, job: Job, reply: Reply, n_prompt: int, include_usage: bool, metrics: Metrics):
    """The job's server-sent events: a chat's role chunk, a chunk per text delta, the last with its finish reason, then
    ``[DONE]``; a row that failed (a server, a fault, the shutdown) ends with an error event saying why, then
    ``[DONE]``. With ``include_usage`` a usage chunk comes before ``[DONE]`` and every other chunk has ``"usage":
    null``, as OpenAI documents it."""
    def chunk(delta: str, finish: str | None = None, role: bool = False) -> dict:
        body = reply.chunk(delta, finish, role=role)
        return {**body, "usage": None} if include_usage else body

    first = True
    try:
        while True:
            u = await _next(updates, request, job)
            if u.finish is not None:
                metrics.end(job, u)
            if u.finish in ("error", "invalid"):
                e = _refusal(u, "messages" if reply.chat else "prompt")
                yield _event(error_body(str(e), e.param, e.kind))
                break
            if first and reply.chat:
                yield _event(chunk("", role=True))
            if u.delta or (first and not reply.chat):
                yield _event(chunk(u.delta))
            first = False
            if u.finish is not None:
                yield _event(chunk("", u.finish))
                if include_usage:
                    yield _event(reply.usage_chunk(usage(n_prompt, u.result)))
                break
        yield "data: [DONE]\n\n"
    except _Gone:
        return
    finally:
        job.cancelled = job.cancelled or not job.ended


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _worded(message: str, field: str) -> str:
    """A refusal of the request's one prompt in the request's words: the decoder names it ``prompt 0`` (its index in
    a batch), and a chat's prompt is its messages in the chat template."""
    for head in ("prompt 0 ", "the prompt "):
        if message.startswith(head):
            it = "messages: the chat in its template" if field == "messages" else "prompt: the prompt"
            return f"{it} {message[len(head):]}"
    return message


def _param_of(message: str) -> str | None:
    """The request field a decoder's refusal names (its messages start ``name=value``)."""
    head = message.split("=", 1)[0].strip().split(" ")[-1]
    fields = ("max_tokens", "temperature", "top_p", "method", "lookahead", "window_min_logprob", "prompt", "seed")
    head = "max_tokens" if head == "max_new_tokens" else head  # the request's name of the decoder's field
    return head if head in fields else "prompt" if "prompt" in message else None


def _package_version() -> str:
    """The installed semanticspec-probes' version ("unknown" when it is run from files not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("semanticspec-probes")
    except PackageNotFoundError:
        return "unknown"
