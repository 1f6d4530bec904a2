"""Loopback fakes of SGLang's ``/generate`` and vLLM's ``/v1/completions``, written from their documented schemas.

A toy model stands behind both: words (with the spaces after them) are tokens, id = a hash of the text,
BOS (id 1, text ``<s>``) starts every prompt, and the log-probs at each position are a fixed function
of the ids before it (:func:`own_logprob`, :func:`top_entries`), so a test knows exactly what the
answer must map to. The model always continues with :data:`CONTINUATION`.

- SGLang (``io_struct.py`` ``GenerateReqInput``; ``meta_info``): ``/generate`` answers
  ``input_token_logprobs`` / ``output_token_logprobs`` as ``[logprob, id, text]``, ``input_top_logprobs``
  as lists of those, ``hidden_states`` as ``[prefill rows, ...]`` for the rows after the cached prefix,
  ``cached_tokens``, ``finish_reason``; ``/v1/tokenize``, ``/get_server_info``.
- vLLM (``serving_completion.py``): ``echo`` + ``logprobs`` give the legacy ``logprobs`` (tokens, text_offset from
  0 with the BOS text, token_logprobs, top_logprobs) over prompt + output; ``prompt_logprobs`` per position
  ``{id: {logprob, rank, decoded_token}}`` (None at 0); ``return_token_ids`` adds ``prompt_token_ids`` and
  drops the prompt from ``text``; ``include_stop_str_in_output``, ``stop_reason``; a k above ``max_logprobs`` is a 400.
"""

from __future__ import annotations

import json
import re
import zlib

from tests.fake_openai import JsonHandler, LoopbackServer

BOS, BOS_TEXT = 1, "<s>"
CONTINUATION = "a b\n\nc d"
NEXT = "next"


def words(text: str) -> list[str]:
    return re.findall(r"\S+\s*|\s+", text)  # a token keeps the spaces after it


SEEN: dict[int, str] = {}
"""Every word the toy tokenizer has seen, by id (so answers can give a token's text, as a server's tokenizer does)."""


def tid(word: str) -> int:
    i = zlib.crc32(word.encode()) % 50000 + 10
    SEEN[i] = word
    return i


def ids_of(text: str) -> list[int]:
    return [BOS] + [tid(w) for w in words(text)]


def own_logprob(prefix: list[int], token: int) -> float:
    """The toy model's log-prob of ``token`` after ``prefix``."""
    return -round(0.5 + 0.01 * len(prefix) + (token % 7) * 0.1, 6)


def top_entries(prefix: list[int], k: int) -> list[tuple[float, int, str]]:
    """The toy model's ``k`` most likely tokens after ``prefix``: ``(logprob, id, text)``, descending."""
    return [(-round(0.01 * (j + 1) + 0.001 * len(prefix), 6), 60000 + j, f" w{j}") for j in range(k)]


class _Server(LoopbackServer):
    def __init__(self, routes_get, routes_post):
        self.requests: list[tuple[str, dict, dict]] = []
        outer = self

        class Handler(JsonHandler):
            def do_GET(self):
                f = routes_get.get(self.path)
                self._send(*(f() if f else (404, {"detail": "Not Found"})))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                headers = {k.lower(): v for k, v in self.headers.items()}
                outer.requests.append((self.path, headers, body))
                f = routes_post.get(self.path)
                self._send(*(f(body, headers) if f else (404, {"detail": "Not Found"})))

        self.root = self._serve(Handler)

    def posts(self, path: str) -> list[dict]:
        return [b for p, _, b in self.requests if p == path]


def _continue(ids: list[int], max_tokens: int, stops: list[str], keep_stop: bool):
    """The toy continuation: its words up to ``max_tokens``, cut after the first stop string."""
    out, text = [], ""
    for w in words(CONTINUATION)[:max_tokens]:
        out.append(w)
        text += w
        hit = next((s for s in stops if s in text), None)
        if hit:
            cut = text.index(hit) + (len(hit) if keep_stop else 0)
            return out, text[:cut], "stop", hit
    return out, text, "length", None


class FakeSGLang(_Server):
    """SGLang's native server (``python -m sglang.launch_server``), as a toy.

    Args:
        hidden: started with ``--enable-return-hidden-states``.
        short_top: return this many top-k entries per position instead of the k asked for.
        drop_rows: return this many fewer input log-prob rows than asked for.
    """

    def __init__(self, name="toy", *, hidden=True, short_top=None, drop_rows=0, cached=None):
        self.name, self.hidden, self.short_top, self.drop_rows, self.cached = name, hidden, short_top, drop_rows, cached
        super().__init__({"/v1/models": lambda: (200, {"object": "list", "data": [{"id": self.name}]}),
                          "/get_server_info": lambda: (200, {"version": "0.5.0", "disable_radix_cache": False,
                                                             "enable_return_hidden_states": self.hidden}),
                          "/version": lambda: (200, {"version": "0.5.0"})},
                         {"/v1/tokenize": self._tokenize, "/generate": self._generate})

    def _tokenize(self, body, headers):
        p = body["prompt"]
        toks = [ids_of(t) for t in p] if isinstance(p, list) else ids_of(p)
        return 200, {"tokens": toks, "count": [len(t) for t in toks] if isinstance(p, list) else len(toks)}

    def _rows(self, ids, start, k):
        texts = {tid(w): w for w in words(CONTINUATION + NEXT)} | SEEN
        lps = [[own_logprob(ids[:i], ids[i]), ids[i], texts.get(ids[i], f"#{ids[i]}")] for i in range(start, len(ids))]
        tops = [[list(e) for e in top_entries(ids[:i], self.short_top or k)] for i in range(start, len(ids))]
        return lps[self.drop_rows:], tops[self.drop_rows:]

    def _generate(self, body, headers):
        ids = body.get("input_ids") or ids_of(body["text"])
        sp = body["sampling_params"]
        k = body.get("top_logprobs_num", 0)
        start = body.get("logprob_start_len", -1)
        cached = self.cached if self.cached is not None else max(start, 0)
        meta = {"prompt_tokens": len(ids), "cached_tokens": cached}
        if start >= 0:  # a read: the next token
            out_words, text, finish, hit = [NEXT], NEXT, "length", None
        else:
            out_words, text, finish, hit = _continue(ids, sp["max_new_tokens"], sp.get("stop") or [],
                                                     sp.get("no_stop_trim", False))
        out_ids = [tid(w) for w in out_words]
        meta.update(completion_tokens=len(out_ids),
                    finish_reason={"type": "stop", "matched": hit} if finish == "stop" else {"type": "length",
                                                                                             "length": len(out_ids)})
        if body.get("return_logprob"):
            if start >= 0:
                meta["input_token_logprobs"], meta["input_top_logprobs"] = self._rows(ids, start, k)
            full = ids + out_ids
            meta["output_token_logprobs"] = [[own_logprob(full[:i], full[i]), full[i], w]
                                              for i, w in zip(range(len(ids), len(full)), out_words)]
            meta["output_top_logprobs"] = [[list(e) for e in top_entries(full[:i], k)] for i in range(len(ids), len(full))]
        if body.get("return_hidden_states"):
            meta["hidden_states"] = [[[float(i), float(ids[i] % 10), 0.5] for i in range(cached, len(ids))]]
        return 200, {"text": text, "meta_info": meta}


class FakeVLLM(_Server):
    """vLLM's OpenAI server (``vllm serve``), as a toy.

    Args:
        max_logprobs: its ``--max-logprobs``.
        short_top: put this many entries in each prompt_logprobs position instead of k (+ the prompt token).
        status: answer every completions request with this HTTP status, echoing the Authorization header.
    """

    def __init__(self, name="toy", *, max_logprobs=20, short_top=None, status=None):
        self.name, self.max_logprobs, self.short_top, self.status = name, max_logprobs, short_top, status
        super().__init__({"/v1/models": lambda: (200, {"object": "list", "data": [{"id": self.name}]}),
                          "/version": lambda: (200, {"version": "0.11.0"})},
                         {"/v1/completions": self._complete})

    def _logprobs(self, full, texts, start, k, offset0=0):
        out = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        off = offset0
        for i in range(start, len(full)):
            lp = None if i == 0 else own_logprob(full[:i], full[i])
            out["tokens"].append(texts[i])
            out["text_offset"].append(off)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if i == 0 else {texts[i]: lp, **{t: v for v, _, t in
                                                                             top_entries(full[:i], k)}})
            off += len(texts[i])
        return out

    def _complete(self, body, headers):
        if self.status:
            return self.status, {"error": {"message": "refused: " + headers.get("authorization", "")}}
        k = body.get("logprobs")
        if k is not None and k > self.max_logprobs or (body.get("prompt_logprobs") or 0) > self.max_logprobs:
            return 400, {"error": {"message": f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                                              f"{self.max_logprobs}", "type": "BadRequestError"}}
        prompt = body["prompt"]
        ids, texts = ids_of(prompt), [BOS_TEXT] + words(prompt)
        if body.get("echo"):
            out_words, text, finish, hit = [NEXT], NEXT, "length", None
        else:
            out_words, text, finish, hit = _continue(ids, body["max_tokens"], body.get("stop") or [],
                                                     body.get("include_stop_str_in_output", False))
        full, all_texts = ids + [tid(w) for w in out_words], texts + out_words
        choice = {"index": 0, "finish_reason": finish, "stop_reason": hit, "logprobs": None}
        if body.get("echo"):
            choice["text"] = ("" if body.get("return_token_ids") else prompt) + text
            if k is not None:
                choice["logprobs"] = self._logprobs(full, all_texts, 0, k)
            pk = body.get("prompt_logprobs")
            if pk is not None:
                choice["prompt_logprobs"] = [None] + [
                    {str(full[i]): {"logprob": own_logprob(full[:i], full[i]), "rank": 3, "decoded_token": texts[i]},
                     **{str(t): {"logprob": v, "rank": j + 1, "decoded_token": s}
                        for j, (v, t, s) in enumerate(top_entries(full[:i], self.short_top or pk))}}
                    for i in range(1, len(ids))]
            if body.get("return_token_ids"):
                choice["prompt_token_ids"] = ids
        else:
            choice["text"] = text
            if k is not None:
                choice["logprobs"] = self._logprobs(full, all_texts, len(ids), k)
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out_words),
                 "total_tokens": len(ids) + len(out_words), "prompt_tokens_details": {"cached_tokens": 2}}
        return 200, {"id": "x", "object": "text_completion", "model": self.name, "choices": [choice], "usage": usage}


class FakeLlamaCpp(_Server):
    """Only what :class:`LlamaCppEngine` asks before reading: ``/v1/models``, and ``/props`` (the C++
    ``llama-server``) or ``/extras/tokenize`` (llama-cpp-python; ``bos``: the model adds BOS)."""

    def __init__(self, name="toy", *, cpp=False, bos=True):
        get = {"/v1/models": lambda: (200, {"object": "list", "data": [{"id": name}]})}
        if cpp:
            get["/props"] = lambda: (200, {"default_generation_settings": {}})
        super().__init__(get, {"/extras/tokenize": lambda body, h: (200, {"tokens": [BOS] if bos else []})})
