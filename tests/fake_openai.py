"""Local OpenAI-compatible servers for the tests: a completions server backed by a real (tiny) model
(:class:`FakeJudgeServer` below answers judge prompts by rule instead).

:class:`FakeServer` answers as llama-cpp-python's server does (``llama_cpp/llama.py`` ``_create_completion``,
0.3.x): it ignores ``n``, cuts the stop string off the text, says ``finish_reason: stop`` for a stop string and for
EOS alike, and with ``logprobs`` lists every generated token, the cut stop string's included, with text offsets from
the prompt's start. Given a ``version`` it answers as vLLM does (``GET /version``; ``n`` children seeded ``seed + j``,
``v1/engine/parallel_sampling.py``; ``include_stop_str_in_output`` and ``stop_reason`` honoured).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer

import torch

from generation.sampling import generate
from generation.specs import SamplingSpec

POLL_S = 0.02
"""How often a server's loop checks for ``close()`` (the standard library's 0.5 s made every test's teardown wait half a
second)."""


class JsonHandler(BaseHTTPRequestHandler):
    """The fakes' request handler base: quiet, and ``_send(code, obj)`` answers JSON."""

    def log_message(self, *args):
        pass

    def _send(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class LoopbackServer:
    """The fakes' server skeleton: a handler class served on a loopback port from a daemon thread, and ``close()``."""

    def _serve(self, handler: type[JsonHandler], threaded: bool = True) -> str:
        """Start serving ``handler``; returns the server's root URL (``http://127.0.0.1:PORT``)."""
        self.httpd = (ThreadingHTTPServer if threaded else HTTPServer)(("127.0.0.1", 0), handler)
        threading.Thread(target=self.httpd.serve_forever, args=(POLL_S,), daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class InFlight:
    """Requests in flight now (``now``) and at most (``peak``), over one server or several that share it.

    A request counts from its arrival until its answer is ready, not until it is sent: a client that has its answer
    may already send the next request while the server thread is still writing.
    """

    def __init__(self):
        self.lock, self.now, self.peak = threading.Lock(), 0, 0

    def __enter__(self):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def __exit__(self, *exc):
        with self.lock:
            self.now -= 1


class FakeServer(LoopbackServer):
    """Serves ``model`` (with ``tokenizer``) as ``name`` on a loopback port; ``.url`` is its ``/v1`` base URL.

    Args:
        fail_first: answer the first this many completion requests with HTTP 503.
        delay: seconds to wait before answering a completion request.
        version: what ``GET /version`` answers, as vLLM (None: 404, and ``/openapi.json`` names llama-cpp-python).
        status: answer every request with this HTTP status (e.g. 401, a refused key) instead.
        in_flight: the gauge that counts this server's completion requests in flight (share one between servers to
            bound their sum); a gauge of its own by default.
    """

    def __init__(self, model, tokenizer, name: str = "tiny", *, fail_first: int = 0, delay: float = 0.0,
                 version: str | None = None, status: int | None = None, in_flight: InFlight | None = None):
        self.model, self.tok, self.name = model, tokenizer, name
        self.fail_first, self.delay, self.version, self.status = fail_first, delay, version, status
        self.requests: list[tuple[dict, dict]] = []
        self.in_flight = in_flight or InFlight()
        self.lock = threading.Lock()
        outer = self

        class Handler(JsonHandler):
            def do_GET(self):
                if outer.status is not None:  # a refusing server (401: a bad key) refuses every route
                    self._send(outer.status, {"error": {"message": "refused: bad key " +
                                                        self.headers.get("Authorization", "")}})
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": outer.name, "object": "model"}]})
                elif self.path == "/version" and outer.version is not None:
                    self._send(200, {"version": outer.version})
                elif self.path == "/openapi.json" and outer.version is None:  # llama-cpp-python says who it is here
                    self._send(200, {"info": {"title": "🦙 llama.cpp Python API", "version": "0.3.16"}})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    k = len(outer.requests)
                with outer.in_flight:
                    time.sleep(outer.delay)
                    if outer.status is not None:
                        answer = outer.status, {"error": {"message": "refused: bad key " +
                                                          self.headers.get("Authorization", "")}}
                    elif k <= outer.fail_first:
                        answer = 503, {"error": {"message": "busy"}}
                    else:
                        answer = 200, outer.complete(body)
                self._send(*answer)

        self.url = self._serve(Handler) + "/v1"

    def complete(self, body: dict) -> dict:
        tok, prompt = self.tok, body["prompt"]
        ids = tok(prompt).input_ids  # BOS as the model's tokenizer adds it
        vllm, stops = self.version is not None, body.get("stop") or []
        choices, used = [], 0
        for j in range(int(body.get("n") or 1) if vllm else 1):
            g = torch.Generator().manual_seed(int(body.get("seed", 0)) + j)
            row = generate(self.model, [ids], max_new_tokens=int(body["max_tokens"]),
                           sampling=SamplingSpec(float(body["temperature"]), float(body.get("top_p", 1.0))),
                           generator=g, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0,
                           stop=lambda t: any(s in tok.decode(t, skip_special_tokens=True) for s in stops))[0]
            eos = row[-1] == tok.eos_token_id
            gen = row[:-1] if eos else row
            used += len(row)
            text = tok.decode(gen, skip_special_tokens=True)
            hit = min(((text.index(s), s) for s in stops if s in text), default=None)
            if hit is not None:
                text = text[: hit[0] + (len(hit[1]) if vllm and body.get("include_stop_str_in_output") else 0)]
            c = {"index": j, "text": text, "finish_reason": "stop" if eos or hit is not None else "length",
                 "logprobs": None}
            if vllm:
                c["stop_reason"] = hit[1] if hit is not None else None
            elif body.get("logprobs") is not None:  # every generated token, the cut stop string's included
                pieces = [tok.decode(gen[:k + 1])[len(tok.decode(gen[:k])):] for k in range(len(gen))]
                offsets = [len(prompt) + sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
                c["logprobs"] = {"tokens": pieces, "text_offset": offsets, "token_logprobs": [0.0] * len(pieces),
                                 "top_logprobs": [{p: 0.0} for p in pieces]}
            choices.append(c)
        return {"id": "x", "object": "text_completion", "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": used, "total_tokens": len(ids) + used}}


class FakeJudgeServer(LoopbackServer):
    """A local OpenAI-compatible judge endpoint: answers 'yes' when both steps share their last number.

    Args:
        fail_first: answer the first this many requests with HTTP 503.
        api: the API the test calls (``chat`` or ``completions``), recorded as ``.api``; the server answers both.
    """

    def __init__(self, fail_first: int = 0, api: str = "chat"):
        self.requests, self.fail_first, self.api = [], fail_first, api
        outer = self

        class Handler(JsonHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, dict(self.headers), body))
                if len(outer.requests) <= outer.fail_first:
                    self.send_response(503)
                    self.end_headers()
                    return
                prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
                a, b = [line.split(":", 1)[1] for line in prompt.splitlines() if line.startswith("Step")]
                yes = a.strip(" .").split()[-1] == b.strip(" .").split()[-1]
                lp = {"yes": -0.1 if yes else -2.5, "no": -2.5 if yes else -0.1}
                if "messages" in body:
                    out = {"choices": [{"message": {"content": "yes" if yes else "no"}, "logprobs": {"content": [
                        {"token": "yes" if yes else "no",
                         "top_logprobs": [{"token": t, "logprob": v} for t, v in lp.items()]}]}}]}
                else:
                    out = {"choices": [{"text": " yes" if yes else " no",
                                        "logprobs": {"top_logprobs": [{" " + t: v for t, v in lp.items()}]}}]}
                self._send(200, out)

        self.url = self._serve(Handler, threaded=False) + "/v1"
