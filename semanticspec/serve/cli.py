"""``python -m semanticspec.serve``: an OpenAI-compatible SemanticSpec endpoint (FastAPI on uvicorn).

With no arguments it serves the embedded world in-process with the shipped probes, on http://127.0.0.1:8000/v1, so
any OpenAI client can try it with no server to start. ``--target_url`` and ``--draft_url`` put it in front of two
servers (llama.cpp, vLLM or SGLang) instead; ``--config`` reads the same options from YAML
(``configs/serve/default.yaml``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from datamodules.tasks.base import Task
from generation.cli import check_yaml_files, fail, one_line_parser

PROG = "python -m semanticspec.serve"
PAIRED = ("--target_url and --draft_url go together: give both servers, or neither to serve the embedded world "
          "in-process")
WORLD_PROBES = {"in-process": "probes", "served": "probes-topk"}
"""The default world's shipped probe pairs (folders of its model root): hidden states and token statistics
in-process, top-k statistics (what a server returns) served."""


def world_chat(suffix: str, bos: bool = True) -> str:
    """The embedded world's chat format: its tokenizer has no chat template, so the world's endpoint formats a chat
    as its task's prompt: BOS (in-process; a server adds its own), the system and user turns one per line (a system
    turn read as text before the problem, as Gemma-3's template folds it into the first user turn), then the task's
    prompt ``suffix``. An assistant turn is refused (a 400 naming it): the world's models answer one problem and
    cannot continue a conversation; nothing is dropped without a word."""
    turns = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('message ' ~ loop.index0 ~ "
             "' is an assistant message: the embedded world\\'s models answer one problem; they cannot continue a "
             "conversation') }}{% endif %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ m['content'] }}"
             "{% endfor %}")
    return ("{{ bos_token }}" if bos else "") + turns + "{{ " + json.dumps(suffix) + " }}"


@dataclass
class ServeOptions:
    """What python -m semanticspec.serve serves and how."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    target_url: str | None = None
    """The target's server (with --draft_url): serve in front of two servers instead of in-process models."""
    draft_url: str | None = None
    """The draft's server."""
    engine: Literal["llama.cpp", "vllm", "sglang"] = "llama.cpp"
    """Kind of the two servers."""
    target_model: str | None = None
    """Model name the target server serves (None: the one it lists)."""
    draft_model: str | None = None
    """Model name the draft server serves (None: the one it lists)."""
    backend_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the two servers' API key."""
    concurrency: int = 4
    """Served: requests in flight at once per server."""
    backend_timeout: float = 120.0
    """Served: seconds a server has to answer one attempt of a request; a hung server fails its requests after the
    attempts (then it is not asked again for 30 s, or this timeout if shorter)."""
    backend_retries: int = 3
    """Served: attempts per request to a server (connection errors, timeouts, 429 and 5xx are tried again)."""
    backend_n_ctx: int | None = None
    """Served by llama.cpp: the context both servers were started with (their --n_ctx), which llama-cpp-python
    states nowhere; without it a request near the context's end fails with the server's 400 instead of stopping
    with finish_reason "length". vLLM and SGLang state theirs."""
    target_probe: str | None = None
    """Exported target probe directory (None: the embedded world's shipped probe for the mode)."""
    draft_probe: str | None = None
    """Exported draft probe directory (None: the world's)."""
    threshold: float | None = None
    """Default tau of SemanticSpec's threshold rule (a request's "threshold" field overrides it); None: the one
    `python -m semanticspec.evaluate` stored beside the probes (threshold.json), else 0.5."""
    model_name: str = "semanticspec"
    """The model name /v1/models lists and requests name."""
    max_rows: int = 16
    """Rows one loop decodes together (new requests join between rounds)."""
    max_queue: int = 128
    """Requests waiting or decoding at once; past it a 429 with Retry-After."""
    api_key_env: str = "SEMANTICSPEC_API_KEY"
    """Environment variable holding the key /v1 routes want (unset or empty: none). Never logged."""
    chat_template: str | None = None
    """A file holding a Jinja chat template, or the template itself (read as vLLM reads --chat-template), checked at
    start-up on a one-message chat (None: the target tokenizer's; the embedded world's task format)."""
    tokenizer: str | None = None
    """Served: a local directory with the target's tokenizer, for chat templates and prompt token counts (None: the
    world's when the target probe reads the world's target, else none: chat routes answer 400)."""
    task: Task | None = None
    """Served: the task whose answer marker ends a decode once its line is complete (a class path with its
    init_args, as the label build's --build.task; None: the embedded world's when the target probe reads the world's
    target, else none: a decode ends at EOS, a stop string or max_tokens)."""
    shutdown_timeout: float = 30.0
    """Seconds SIGTERM waits for requests in flight; those left then end with an error (503) in their last second."""
    threads: int | None = None
    """torch CPU threads (None: OMP_NUM_THREADS, else the cores)."""


def build(opts: ServeOptions):
    """The app of ``opts``: the decoder (the default world's models in-process, found through its registration
    (``datamodules.tasks.worlds``), or two servers) and the endpoint's settings."""
    from semanticspec.policies import default_policy
    from semanticspec.serve.app import Settings, build_app
    from semanticspec.policies import stored_tau

    if (opts.target_url is None) != (opts.draft_url is None):
        raise ValueError(PAIRED)
    from datamodules.tasks.worlds import default_world

    world, mode, tok = default_world(), "in-process" if opts.target_url is None else "served", None
    root = world.model_root()
    probes = [p or str(root / WORLD_PROBES[mode] / role) for p, role in ((opts.target_probe, "target"),
                                                                          (opts.draft_probe, "draft"))]
    world_tok = world.load_tokenizer(root)  # in-process the models'; served, the servers' when the probes read it
    reads_world = mode == "served" and _reads_with(probes[0], world_tok)
    task = world.task() if mode == "in-process" else _served_task(opts.task, reads_world, world)
    template = _template(opts.chat_template)
    tau = opts.threshold if opts.threshold is not None else stored_tau(probes[0])  # None: the default, 0.5
    if mode == "in-process":
        from semanticspec import SemanticSpecDecoder

        template = template or world_chat(task.prompt_suffix)
        check_template(world_tok, template)  # before the models load
        target, draft = (world.load_model(role, root) for role in ("target", "draft"))
        policy = default_policy(fast_path=True, tau=tau)
        from probes.config import OtherModelError

        try:
            dec = SemanticSpecDecoder(target, draft, world_tok, target_probe=probes[0], draft_probe=probes[1],
                                      policy=policy, task=task)
        except OtherModelError as e:
            raise ValueError(f"{e}. In-process the endpoint serves the embedded world's models; serve probes of "
                             "other models in front of their two servers (--target_url, --draft_url)") from None
        backends = ()
    else:
        from generation.engines import make_engine
        from semanticspec import ServedDecoder

        kw = {"api_key_env": opts.backend_key_env, "timeout": opts.backend_timeout, "retries": opts.backend_retries}
        if opts.backend_n_ctx is not None:
            kw["n_ctx"] = opts.backend_n_ctx
        target = make_engine(opts.engine, opts.target_url, opts.target_model, **kw)
        draft = make_engine(opts.engine, opts.draft_url, opts.draft_model, **kw)
        dec = ServedDecoder(target, draft, probes[0], probes[1], default_policy(fast_path=False, tau=tau), task=task,
                            concurrency=opts.concurrency)
        dec.check_servers()  # servers that cannot serve the probes are refused here, not as each request's 400
        backends = (target.url, draft.url)
        if opts.tokenizer is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(opts.tokenizer, local_files_only=True)
        elif reads_world:  # the world's probes, shipped or own: its tokenizer and chat format
            tok = world_tok
            template = template or world_chat(task.prompt_suffix, bos=False)
        if template is not None:
            check_template(tok, template)
    key = os.environ.get(opts.api_key_env) or None
    return build_app(dec, Settings(model_name=opts.model_name, max_rows=opts.max_rows, max_queue=opts.max_queue,
                                   api_key=key, chat_template=template, backends=backends, tokenizer=tok))


def _reads_with(probe: str, tokenizer) -> bool:
    """The probe exported at ``probe`` reads a model with ``tokenizer`` (its ``config.json``'s
    ``reads.tokenizer_hash``)."""
    from generation.fingerprints import tokenizer_hash
    from probes.model import probe_config

    return (probe_config(probe).reads or {}).get("tokenizer_hash") == tokenizer_hash(tokenizer)


def _served_task(task: Task | None, reads_world: bool, world):
    """A served endpoint's task: ``--task``, else the world's where the target probe reads the world's target
    (``reads_world``: its servers serve the world), else None: another model's output is not cut at the world's
    answer marker."""
    if task is not None:
        return task
    return world.task() if reads_world else None


def _template(value: str | None) -> str | None:
    """``--chat_template``: the file it names, else the template itself where it holds ``{``, ``}`` or a line break,
    as vLLM reads its ``--chat-template`` (ValueError: neither a readable file nor a template)."""
    if value is None:
        return None
    try:
        return Path(value).read_text()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the text
        if any(c in value for c in "{}\n"):
            return value
        raise ValueError(f"--chat_template={value!r}: no readable file ({getattr(e, 'strerror', None) or e}) and no "
                         "Jinja template; give the path of a file holding one, or the template") from None


def check_template(tok, template: str) -> None:
    """Refuse a chat ``template`` the target tokenizer ``tok`` cannot format a one-message chat with (naming the
    template's fault), or one with no tokenizer to format chats."""
    from jinja2 import TemplateError

    if tok is None:
        raise ValueError("--chat_template: this endpoint has no tokenizer to format chats with; give --tokenizer DIR "
                         "(the target's tokenizer)")
    try:
        tok.apply_chat_template([{"role": "user", "content": "1 + 1"}], chat_template=template,
                                add_generation_prompt=True, tokenize=False)
    except (TemplateError, TypeError) as e:  # a syntax error, its own raise_exception, or an operation it cannot do
        raise ValueError(f"--chat_template: the target tokenizer cannot format a chat with it "
                         f"({type(e).__name__}: {e})") from None


def _parser():
    from jsonargparse import ActionConfigFile, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    description = __doc__.split("\n\n")[1].replace("\n", " ").replace("``", "")
    parser = one_line_parser(PROG, description=description, allow_abbrev=False)
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="YAML with these options")
    parser.add_class_arguments(ServeOptions, as_positional=False)
    return parser


def option_problem(opts: ServeOptions) -> str | None:
    """What is wrong with the options alone, before anything loads (the first problem), or None."""
    if opts.backend_n_ctx is not None and opts.engine != "llama.cpp":
        return (f"--backend_n_ctx={opts.backend_n_ctx}: for llama.cpp servers, which state no context (--engine "
                f"{opts.engine} states its own)")
    for name in ("port", "max_rows", "max_queue", "concurrency", "backend_retries", "backend_n_ctx"):
        if getattr(opts, name) is not None and getattr(opts, name) < 1:
            return f"--{name}={getattr(opts, name)}: expected an integer >= 1"
    if opts.port > 65535:
        return f"--port={opts.port}: expected a port from 1 to 65535"
    if not opts.shutdown_timeout >= 0:
        return f"--shutdown_timeout={opts.shutdown_timeout}: expected seconds >= 0"
    if not opts.backend_timeout > 0:
        return f"--backend_timeout={opts.backend_timeout}: expected seconds > 0"
    if opts.threshold is not None and not 0 <= opts.threshold <= 1:  # NaN too; refused before the models load
        return f"--threshold={opts.threshold}: expected a number in [0, 1]"
    if (opts.target_url is None) != (opts.draft_url is None):  # before the imports of build()
        return PAIRED
    if opts.target_url is None and (given := _served_only(opts)):
        return (f"{', '.join(given)}: options of a served endpoint (with --target_url and --draft_url); in-process "
                "the embedded world's models are served")
    if opts.tokenizer is not None and not Path(opts.tokenizer).expanduser().is_dir():
        return f"--tokenizer={opts.tokenizer}: no such directory (a local folder holding the target's tokenizer)"
    return None


def main(argv: list[str] | None = None) -> None:
    """Parse the options, build the app and serve it until SIGINT or SIGTERM (then exit 0). Every refusal before
    serving (a bad option, a backend that does not answer, a port in use) is one line with exit status 2."""
    from generation.threads import apply_threads, set_wait_policy

    set_wait_policy()  # before torch loads: idle threads sleep rather than spin, as the other commands do
    try:
        check_yaml_files(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        fail(PROG, str(e))
    parser = _parser()
    ns = parser.parse_args(argv)
    try:
        ns = parser.instantiate(ns)  # --task: its class with its init_args
    except (ValueError, TypeError, OSError) as e:
        fail(PROG, f"--task: {e}")
    opts = ServeOptions(**{k: v for k, v in vars(ns).items() if k in ServeOptions.__dataclass_fields__})
    if problem := option_problem(opts):
        fail(PROG, problem)
    sock = _bind(opts.host, opts.port)  # before the models load: a port in use is refused at once
    from generation.cli import sigterm_interrupts
    from generation.engines.base import EngineError

    try:
        with sigterm_interrupts():  # while the models load or the servers are asked: a stop is Ctrl-C
            apply_threads(opts.threads, log=None)
            app = build(opts)
    except (ValueError, OSError, EngineError) as e:
        fail(PROG, str(e))
    except KeyboardInterrupt:
        print(f"{PROG}: stopped while starting; nothing was served", file=sys.stderr)
        raise SystemExit(130) from None
    _serve(app, opts, sock)


SERVED_ONLY = ("engine", "target_model", "draft_model", "backend_key_env", "concurrency", "backend_timeout",
               "backend_retries", "backend_n_ctx", "tokenizer", "task")
"""The options that only a served endpoint reads."""


def _served_only(opts: ServeOptions) -> list[str]:
    """The served-only options ``opts`` gives other values than their defaults, as ``--name=value``."""
    default = ServeOptions()
    given = {k: getattr(opts, k) for k in SERVED_ONLY if getattr(opts, k) != getattr(default, k)}
    return [f"--{k}={type(v).__module__}.{type(v).__qualname__}" if isinstance(v, Task) else f"--{k}={v}"
            for k, v in given.items()]


def _bind(host: str, port: int):
    """A socket listening on ``host:port`` (uvicorn serves on it), or exit 2 naming the port."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # two bound sockets may share a port until one listens: the second endpoint is refused here
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:  # no such name, or not this machine's
            fail(PROG, f"--host={host}: not an address of this machine ({e.strerror or e})")
        fail(PROG, f"--port={port}: cannot listen on {host}:{port} ({e.strerror or e}); is another server there?")
    sock.set_inheritable(True)
    return sock


def _serve(app, opts: ServeOptions, sock) -> None:
    """uvicorn on ``sock`` until SIGINT or SIGTERM: it stops admitting, lets requests in flight finish for up to
    ``--shutdown_timeout`` seconds, and ends those left with an error (503; streams: an error event and ``[DONE]``)
    a second before uvicorn would cancel their handlers."""
    import asyncio
    import signal

    import uvicorn

    sched = app.state.scheduler

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            grace = max(0.0, opts.shutdown_timeout - 1.0)
            stopping = asyncio.ensure_future(asyncio.to_thread(sched.stop, grace))
            await super().shutdown(sockets)
            while not (stopping.done() or self.force_exit):
                await asyncio.wait({stopping}, timeout=0.1)
            if self.force_exit:  # a second Ctrl-C quits now, as uvicorn's own; it skipped the app's shutdown
                sched.abort("the server was stopped (a second Ctrl-C) before this request finished")
                for _ in range(40):  # the handlers send their 503s (cancelled at the loop's end: a traceback each)
                    if not self.server_state.tasks:
                        break
                    await asyncio.sleep(0.05)
                await self.lifespan.shutdown()
            await stopping

    def done(sig, frame):  # uvicorn re-raises the signal it shut down for, once its handlers are gone: exit 0
        raise SystemExit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, done)
    host = f"[{opts.host}]" if ":" in opts.host else opts.host  # an IPv6 address, as a URL writes it
    print(f"SemanticSpec endpoint on http://{host}:{opts.port}/v1 (model {opts.model_name!r})", flush=True)
    Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=opts.shutdown_timeout)).run(
        sockets=[sock])


if __name__ == "__main__":  # `python -m semanticspec.serve` is the documented command; this runs the same
    main()
