"""The OpenAI-compatible SemanticSpec endpoint: FastAPI routes over the decode thread (:mod:`.scheduler`).

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (streaming as server-sent events in OpenAI's chunk format,
ending with ``data: [DONE]``), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus). :func:`build_app` puts them
in front of any decoder: in-process models (:class:`~probes.decoder.SemanticSpecDecoder`) or two servers
(:class:`~probes.decoding.served.ServedDecoder`); ``python -m probes.serve`` builds one from a config.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import random

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from probes.decoding.config import DecodeConfig
from probes.decoding.methods import METHODS
from probes.serve.protocol import ChatRequest, CompletionRequest, Reply, error_body, usage
from probes.serve.scheduler import Job, QueueFull, Scheduler, Update

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
        self.requests = Counter("semanticspec_requests", "Requests by route and status code", ["route", "status"],
                                registry=r)
        self.tokens = Counter("semanticspec_tokens", "Tokens: prompt, completion, and the draft's share of completion",
                              ["kind"], registry=r)
        self.steps = Counter("semanticspec_steps", "Steps tried, by decision: accept and accept_fast (a draft step "
                             "kept), reject (refused), target (the target wrote it)", ["decision"], registry=r)
        self.step_seconds = Histogram("semanticspec_step_seconds", "Seconds per tried step", registry=r,
                                      buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.queue = Gauge("semanticspec_queue_length", "Requests waiting for room in a loop", registry=r)
        self.running = Gauge("semanticspec_running_rows", "Rows decoding now", registry=r)

    def on_step(self, decision: str, seconds: float) -> None:
        self.steps.labels(decision).inc()
        self.step_seconds.observe(seconds)


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
    sched = Scheduler(decoder, s.max_rows, s.max_queue, on_step=metrics.on_step, count_tokens=count)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        sched.stop(timeout=0.0)  # uvicorn waited for the open requests (its graceful-shutdown timeout)

    app = FastAPI(title="SemanticSpec endpoint", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.settings = sched, metrics, s
    _errors(app, metrics)
    _routes(app, decoder, sched, metrics, s)
    return app


def _errors(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        if first.get("type") == "json_invalid":
            message, param = f"malformed JSON: {first.get('msg', '')}", None
        elif first.get("type") == "extra_forbidden":
            message = f"{param}: unknown field"
        else:
            message = f"{param}: {first.get('msg', 'invalid value')}"
        metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(error_body(message, param), status_code=400)

    @app.exception_handler(BadRequest)
    async def bad(request: Request, exc: BadRequest):
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(error_body(str(exc), exc.param, exc.kind), status_code=exc.status,
                            headers=exc.headers)

    @app.middleware("http")
    async def key_check(request: Request, call_next):
        key = app.state.settings.api_key
        if key and request.url.path.startswith("/v1"):
            if not hmac.compare_digest(request.headers.get("authorization", "").encode(), f"Bearer {key}".encode()):
                metrics.requests.labels(request.url.path, "401").inc()
                return JSONResponse(error_body("invalid API key", None, "authentication_error"), status_code=401)
        return await call_next(request)


def _info_routes(app: FastAPI, sched: Scheduler, metrics: Metrics, s: Settings) -> None:
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": 0,
                                            "owned_by": "semanticspec-probes"}]}

    @app.get("/health")
    async def health():
        down = [u for u in s.backends if not await _answers(u)]
        if sched.failure or down:
            why = sched.failure or "backend down: " + ", ".join(down)
            return JSONResponse({"status": "down", "reason": why, "backends_down": down}, status_code=503)
        return {"status": "ok", "running": sched.running, "queued": sched.queued}

    @app.get("/metrics")
    async def prometheus():
        metrics.queue.set(sched.queued)
        metrics.running.set(sched.running)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _routes(app: FastAPI, dec, sched: Scheduler, metrics: Metrics, s: Settings) -> None:
    _info_routes(app, sched, metrics, s)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise BadRequest(f"prompt: {len(prompt)} prompts; this endpoint decodes one per request", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise BadRequest("prompt: empty; give the text to continue", "prompt")
        return await _serve(request, body, prompt, Reply(False, s.model_name), dec, sched, metrics, s)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if not body.messages:
            raise BadRequest("messages: empty; give at least one message", "messages")
        messages, template = [m.model_dump(exclude_none=True) for m in body.messages], s.chat_template
        tok = getattr(dec, "tokenizer", None) or s.tokenizer
        if tok is None or not (template or getattr(tok, "chat_template", None)):
            raise BadRequest("messages: the target model has no chat template; use /v1/completions, or start the "
                             "server with --chat_template", "messages")

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
    text = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    if not hasattr(dec, "draft_tokenizer"):
        return text
    ids = list(tok(text, add_special_tokens=False).input_ids)
    if dec.shared:
        return ids
    return ids, list(dec.draft_tokenizer(text, add_special_tokens=False).input_ids)


def decode_config(body) -> DecodeConfig:
    """The request's :class:`DecodeConfig`, every field checked (BadRequest naming the request's field)."""
    max_tokens = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if max_tokens <= 0:
        raise BadRequest(f"{param}={max_tokens}: expected an integer >= 1", param)
    if body.n != 1:
        raise BadRequest(f"n={body.n}: this endpoint writes one choice per request (n=1)", "n")
    if body.method not in ENDPOINT_METHODS:
        raise BadRequest(f"method={body.method!r}: expected one of {ENDPOINT_METHODS}", "method")
    if body.threshold is not None and body.method != "semanticspec":
        raise BadRequest(f"threshold: applies to method 'semanticspec', not {body.method!r}", "threshold")
    seed = body.seed if body.seed is not None else random.getrandbits(31)
    try:
        return DecodeConfig(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=seed,
                            method=body.method, lookahead=body.lookahead, window_min_logprob=body.window_min_logprob,
                            allow_sampling_mismatch=body.allow_sampling_mismatch)
    except ValueError as e:  # DecodeConfig's own checks (temperature, top_p, lookahead...), naming the field
        raise BadRequest(str(e), _param_of(str(e))) from e


async def _serve(request: Request, body, prompt, reply: Reply, dec, sched: Scheduler, metrics: Metrics,
                 s: Settings):
    if body.model is not None and body.model != s.model_name:
        raise BadRequest(f"model={body.model!r}: this server serves {s.model_name!r}", "model", 404,
                         "not_found_error")
    config = decode_config(body)
    if body.threshold is not None:
        config = dataclasses.replace(config, method=dataclasses.replace(dec.policy, tau=float(body.threshold)))
    loop, updates = asyncio.get_running_loop(), asyncio.Queue()
    job = Job(prompt, config, lambda u: loop.call_soon_threadsafe(updates.put_nowait, u), body.stops(), body.stream)
    try:
        sched.submit(job)
    except QueueFull as e:
        raise BadRequest(f"the server is busy: {e}; retry later", None, 429, "rate_limit_error",
                         {"Retry-After": "1"}) from e
    except RuntimeError as e:
        raise BadRequest(str(e), None, 503, "server_error") from e
    first = await _next(updates, request, job)
    if first.finish == "invalid":
        raise BadRequest(first.error, _param_of(first.error))
    n_prompt = first.prompt_tokens
    metrics.tokens.labels("prompt").inc(n_prompt)
    route = request.url.path
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        metrics.requests.labels(route, "200").inc()
        return StreamingResponse(_sse(updates, request, job, reply, n_prompt, include, metrics),
                                 media_type="text/event-stream")
    u = await _next(updates, request, job)  # the end: a non-streaming job is told nothing before it
    if u.finish == "error":
        metrics.requests.labels(route, "502").inc()
        return JSONResponse(error_body(u.error or "the decode failed", None, "server_error"), status_code=502)
    metrics.requests.labels(route, "200").inc()
    _count(metrics, u)
    return reply.full(u.result.text, u.finish, usage(n_prompt, u.result))


async def _next(updates: asyncio.Queue, request: Request, job: Job) -> Update:
    """The job's next update; a client that went away cancels its job (its row leaves at the next round)."""
    while True:
        try:
            return await asyncio.wait_for(updates.get(), 0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled = True
                raise asyncio.CancelledError from None


async def _sse(updates, request, job: Job, reply: Reply, n_prompt: int, include_usage: bool, metrics: Metrics):
    """The job's server-sent events: a chunk per text delta, the last with its finish reason, then ``[DONE]``; a
    row a server failed ends with an error event naming the server."""
    first = True
    try:
        while True:
            u = await _next(updates, request, job)
            if u.finish == "error":
                yield _event(error_body(u.error or "the decode failed", None, "server_error"))
                break
            if u.delta or first:
                yield _event(reply.chunk(u.delta, first=first))
                first = False
            if u.finish is not None:
                yield _event(reply.chunk("", u.finish))
                _count(metrics, u)
                if include_usage:
                    yield _event(reply.usage_chunk(usage(n_prompt, u.result)))
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = job.cancelled or not job.ended


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _count(metrics: Metrics, u: Update) -> None:
    st = u.result.stats
    metrics.tokens.labels("completion").inc(st.output_tokens)
    metrics.tokens.labels("draft").inc(st.draft_tokens)


def _param_of(message: str) -> str | None:
    """The request field a decoder's refusal names (its messages start ``name=value``)."""
    head = message.split("=", 1)[0].strip().split(" ")[-1]
    fields = ("max_tokens", "temperature", "top_p", "method", "lookahead", "window_min_logprob", "prompt", "seed")
    head = "max_tokens" if head == "max_new_tokens" else head  # the request's name of the decoder's field
    return head if head in fields else "prompt" if "prompt" in message else None

