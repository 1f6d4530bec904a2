"""Loopback fakes of SGLang's ``/generate`` and vLLM's ``/v1/completions``, written from the engines' code paths.

Each fake answers as the engine's own code does; the answer shapes are recorded, with the engine file and function
they come from, in ``tests/fixtures/engines/*.json`` (and ``tests/generation/test_engines.py`` checks the fakes
against them).

A toy model stands behind both: words (with the spaces after them) are tokens, id = a hash of the text,
BOS (id 1, text ``<s>``) starts every prompt, and the log-probs at each position are a fixed function
of the ids before it (:func:`own_logprob`, :func:`top_entries`), so a test knows exactly what the
answer must map to. The model continues with :data:`CONTINUATION` (:func:`toy_continue`: each word beats a
runner-up by a small margin, so sampling fields the server fills in by itself change what it writes).

- SGLang (``python/sglang/srt/managers/scheduler_output_processor_mixin.py``
  ``_process_input_token_logprobs``; ``schedule_batch.py`` ``Req._compute_max_prefix_len``; ``io_struct.py``
  ``GenerateReqInput``; ``entrypoints/http_server.py`` ``/server_info``):
  the entry at ``logprob_start_len`` is ``[null, id, text]`` and its top-k ``null``; top-k lists only with
  ``top_logprobs_num > 0``; ``output_ids`` in every answer; the radix cache is reused up to
  ``min(input_len - 1, logprob_start_len)``; written log-probs are ``log_softmax(logits / T)`` (toy: divided
  by ``T``) unless greedy or ``SGLANG_RETURN_ORIGINAL_LOGPROB``; no ``/version`` route, the version and the
  flags in ``/server_info`` (older versions: ``/get_server_info`` alone).
- vLLM (``vllm/entrypoints/openai/serving_completion.py``, ``protocol.py`` ``CompletionRequest``,
  ``vllm/config`` ``get_diff_sampling_param``): ``echo`` + ``logprobs`` give the legacy ``logprobs`` (tokens,
  text_offset from 0 with the BOS text, token_logprobs, top_logprobs) over prompt + output; ``prompt_logprobs``
  per position ``{id: {logprob, rank, decoded_token}}`` (None at 0); ``return_token_ids`` adds
  ``prompt_token_ids`` and ``token_ids``; ``include_stop_str_in_output``, ``stop_reason``; a k above
  ``max_logprobs`` is a 400; ``prompt_tokens_details`` is null unless ``--enable-prompt-tokens-details``;
  unset sampling fields come from the model's ``generation_config.json`` (``--generation-config auto``).
"""

from __future__ import annotations

import json
import math
import random
import re
import zlib

from tests.fake_openai import JsonHandler, LoopbackServer

BOS, BOS_TEXT, EOS, END_OF_TURN = 1, "<s>", 2, 3
CONTINUATION = "a b\n\nc d"
NEXT = "next"
AFTER_NEXT = " then"
END_OF_TURN_TEXT = "<end_of_turn>"
EOS_TEXT = "</s>"
"""A special token's own text (per-token texts are decoded with special tokens; ``text`` skips them)."""
"""The token a read draws after :data:`NEXT` (SGLang's reads ask for two tokens)."""
RUNNER_UP = " z"
"""The toy model's second choice at every written position (:func:`toy_continue`)."""
NEUTRAL = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""Sampling fields that change nothing (the package's one sampler draws from temperature and top-p alone)."""


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


def toy_continue(ids: list[int], max_tokens: int, stops: list[str], keep_stop: bool, params: dict, seed: int | None):
    """What the toy model writes after ``ids`` with these sampling ``params`` (temperature, top_p, top_k, min_p,
    repetition_penalty, presence_penalty): at each position the next word of :data:`CONTINUATION` (logit 1.0) or
    :data:`RUNNER_UP` (logit 0.9); a repetition penalty divides the logit of a word already seen and a presence
    penalty is subtracted from it, top-k 1 or a min-p above 0.9 keeps the first alone. Returns the words, the text
    (cut after the first stop string), ``"stop"`` or ``"length"``, and the stop string matched."""
    rng = random.Random(seed)
    out, text, seen = [], "", list(ids)
    for w in words(CONTINUATION)[:max_tokens]:
        w = _draw(w, seen, params, rng)
        out.append(w)
        seen.append(tid(w))
        text += w
        hit = next((s for s in stops if s in text), None)
        if hit:
            cut = text.index(hit) + (len(hit) if keep_stop else 0)
            return out, text[:cut], "stop", hit
    return out, text, "length", None


def _draw(word: str, seen: list[int], params: dict, rng: random.Random) -> str:
    logits = {word: 1.0, RUNNER_UP: 0.9}
    rp, pp = float(params.get("repetition_penalty", 1.0)), float(params.get("presence_penalty", 0.0))
    logits = {w: v / rp - pp if tid(w) in seen else v for w, v in logits.items()}
    ranked = sorted(logits, key=logits.get, reverse=True)
    t = float(params.get("temperature", 1.0))
    if t == 0:
        return ranked[0]
    p = {w: math.exp(logits[w] / t) for w in ranked}
    z = sum(p.values())
    p = {w: v / z for w, v in p.items()}
    k = int(params.get("top_k", 0))
    keep = ranked[:k] if 0 < k < len(ranked) else ranked
    keep = [w for w in keep if p[w] >= float(params.get("min_p", 0.0)) * p[ranked[0]]]
    if float(params.get("top_p", 1.0)) < p[ranked[0]]:
        keep = keep[:1]
    return rng.choices(keep, weights=[p[w] for w in keep])[0]


class _Server(LoopbackServer):
    def __init__(self, routes_get, routes_post):
        self.requests: list[tuple[str, dict, dict]] = []
        self.answers: list[tuple[str, dict]] = []
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
                code, answer = f(body, headers) if f else (404, {"detail": "Not Found"})
                outer.answers.append((self.path, answer))
                self._send(code, answer)

        self.root = self._serve(Handler)

    def posts(self, path: str) -> list[dict]:
        return [b for p, _, b in self.requests if p == path]


def _older(version: str, than: str) -> bool:
    from packaging.version import Version

    return Version(version) < Version(than)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class FakeSGLang(_Server):
    """SGLang's native server (``python -m sglang.launch_server``), as a toy.

    Args:
        version: what ``/server_info`` reports.
        hidden: started with ``--enable-return-hidden-states``.
        info: more ``/server_info`` fields (``return_hidden_states_mode``, ``speculative_algorithm``, ...).
        info_routes: the routes that answer the server info (``/get_server_info`` alone before ``/server_info``).
        original_logprob: started with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (written log-probs are raw).
        preferred: its ``--preferred-sampling-params`` (a dict, stated in ``/server_info`` as the JSON string the
            flag took): ``/generate`` fills the fields a request leaves unset from it, then from ``SamplingParams``'
            defaults (``tokenizer_manager.py`` ``_create_tokenized_object``: ``{**preferred, **obj.sampling_params}``);
            ``/generate`` reads no generation config.
        short_top: return this many top-k entries per position instead of the k asked for.
        drop_rows: return this many fewer input log-prob rows than the engine would.
        abort: answer ``/generate`` with ``finish_reason`` ``abort`` (HTTP 200): every request (True) or the first
            ``abort`` requests (an int).
        busy: answer the first ``busy`` GETs of each server-info route with a 503 (a server too busy to answer).
        tail_after_stop: text kept after a matched stop string with ``no_stop_trim`` (before 0.5.14, PR #25980,
            when several tokens were accepted in one step).
        context_len: the model's context, which ``/v1/models`` states as the card's ``max_model_len``
            (``entrypoints/http_server.py`` ``available_models``: ``tokenizer_manager.model_config.context_len``).
        deterministic: started with ``--enable-deterministic-inference``, stated in ``/server_info``; without it the
            server ignores ``sampling_seed`` (``sampling/sampling_batch_info.py``: the seeds' tensor is built only
            ``if enable_deterministic``, else None, and ``layers/sampler.py`` draws unseeded; read in SGLang v0.5.3,
            v0.5.4 and main of 2026-08).
        special_next: the token after a read step is a special token that is not EOS (a base model's end-of-turn):
            its text decodes to "" (``skip_special_tokens``), the request ending at ``length``.
        eos_next: the token after a read step is EOS: ``schedule_batch.py`` ``Req.check_finished`` tests the length
            limit first before 0.5.18, so a one-token read ends at ``length`` there; a longer one (or any from 0.5.18,
            ``Req.update_finish_state``) at ``stop`` (matched: the EOS id).
        nan: end every ``/generate`` as SGLang ends a request whose sampled id falls outside the vocabulary (NaN
            logits): ``finish_reason`` ``{"type": "stop", "matched": "NaN happened"}`` (``schedule_batch.py``
            ``_check_vocab_boundary_finish``, SGLang v0.5.4 to v0.5.17 and main of 2026-08), shaped as a matched stop
            string.
    """

    def __init__(self, name="toy", *, version="0.5.23", hidden=True, info=None,
                 info_routes=("/server_info", "/get_server_info"), original_logprob=False, preferred=None,
                 short_top=None, drop_rows=0, abort=False, busy=0, tail_after_stop="", context_len=4096,
                 deterministic=True, nan=False, special_next=False, eos_next=False):
        self.name, self.version, self.hidden, self.nan = name, version, hidden, nan
        self.special_next, self.eos_next, self.context_len = special_next, eos_next, context_len
        self.short_top, self.drop_rows, self.abort = short_top, drop_rows, abort
        self.original_logprob = original_logprob
        self.preferred, self.tail_after_stop = dict(preferred or {}), tail_after_stop
        self.info = {"version": version, "disable_radix_cache": False, "enable_return_hidden_states": hidden,
                     "speculative_algorithm": None, "enable_deterministic_inference": deterministic,
                     "preferred_sampling_params": json.dumps(preferred) if preferred else None, **(info or {})}
        self.busy = {r: busy for r in info_routes}
        self.cache: list[list[int]] = []
        self.effective: list[dict] = []
        card = {"id": name, "object": "model", "owned_by": "sglang", "root": name, "max_model_len": context_len}
        get = {"/v1/models": lambda: (200, {"object": "list", "data": [card]})}
        get.update({r: (lambda r=r: self._info(r)) for r in info_routes})
        super().__init__(get, {"/v1/tokenize": self._tokenize, "/generate": self._generate})

    def _info(self, route):
        if self.busy[route]:
            self.busy[route] -= 1
            return 503, {"error": {"message": "busy"}}
        return 200, self.info

    def _tokenize(self, body, headers):
        p = body["prompt"]
        toks = [ids_of(t) for t in p] if isinstance(p, list) else ids_of(p)
        return 200, {"tokens": toks, "count": [len(t) for t in toks] if isinstance(p, list) else len(toks)}

    def _params(self, sp: dict) -> dict | None:
        """The sampling fields the request leaves unset filled from ``--preferred-sampling-params``, then SGLang's
        defaults; None for a top_k SGLang refuses (``SamplingParams.verify``: -1 or >= 1)."""
        base = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0}
        got = {f: v for f, v in {**base, **self.preferred, **sp}.items() if f in base}
        if got["top_k"] == 0 or got["top_k"] < -1:
            return None
        return {**got, "top_k": 0 if got["top_k"] == -1 else got["top_k"]}

    def _aborts(self) -> bool:
        if self.abort is True or self.abort is False:
            return self.abort
        self.abort -= 1
        return self.abort >= 0

    def _input_rows(self, ids, start, k):
        """``input_token_logprobs`` from ``start``: the first entry ``[None, id, text]``, its top-k ``None``."""
        texts = {tid(w): w for w in words(CONTINUATION + NEXT)} | SEEN
        lps = [[None if i == start else own_logprob(ids[:i], ids[i]), ids[i], texts.get(ids[i], f"#{ids[i]}")]
               for i in range(start, len(ids))]
        tops = [None if i == start else [list(e) for e in top_entries(ids[:i], self.short_top or k)]
                for i in range(start, len(ids))]
        return lps[self.drop_rows:], tops[self.drop_rows:]

    def _after_read(self, max_new: int) -> tuple[list[str], str, str, object]:
        """The tokens a read draws after its step (words, text, finish, matched): :data:`NEXT` then
        :data:`AFTER_NEXT`; a special first token skipped in the text; an EOS first ends at ``stop`` when a second
        token was allowed or from 0.5.18, else at ``length`` (``Req.check_finished`` tests the length limit first)."""
        if self.eos_next:
            return [EOS_TEXT], "", *(("stop", EOS) if max_new > 1 or not _older(self.version, "0.5.18")
                                     else ("length", None))
        words_ = [END_OF_TURN_TEXT if self.special_next else NEXT, AFTER_NEXT][:max_new]
        return words_, "".join(words_[1:] if self.special_next else words_), "length", None

    def _generate(self, body, headers):
        prompts = body.get("input_ids") or body.get("text")
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], (list, str)):  # a batch: one answer each
            answers = []
            for j, p in enumerate(prompts):
                one = {**body, "input_ids" if "input_ids" in body else "text": p}
                if isinstance(body.get("sampling_params"), list):
                    one["sampling_params"] = body["sampling_params"][j]
                code, answer = self._generate(one, headers)
                if code != 200:
                    return code, answer
                answers.append(answer)
            return 200, answers
        sp = body.get("sampling_params") or {}
        params = self._params(sp)
        if params is None:
            return 400, {"error": {"message": f"top_k must be -1 (disable), or at least 1, got {sp['top_k']}."}}
        self.effective.append(params)
        ids = body.get("input_ids") or ids_of(body["text"])
        if len(ids) + sp.get("max_new_tokens", 128) >= self.context_len:  # tokenizer_manager.py _validate_one_request
            return 400, {"error": {"message": "Requested token count exceeds the model's maximum context length of "
                                              f"{self.context_len} tokens."}}
        k, want = int(body.get("top_logprobs_num") or 0), bool(body.get("return_logprob"))
        start = body.get("logprob_start_len", -1)
        start = len(ids) - 1 if start == -1 or not want else start
        cap = max(min(len(ids) - 1, start), 0)  # Req._compute_max_prefix_len
        cached = min(max((_lcp(ids, s) for s in self.cache), default=0), cap)
        seed = sp.get("sampling_seed") if self.info["enable_deterministic_inference"] else None
        if sp.get("max_new_tokens") in (1, 2) and body.get("logprob_start_len", -1) >= 0:  # a read
            out_words, text, finish, hit = self._after_read(sp["max_new_tokens"])
        else:
            out_words, text, finish, hit = toy_continue(ids, sp.get("max_new_tokens", 128), sp.get("stop") or [],
                                                        sp.get("no_stop_trim", False), params, seed)
        if hit and sp.get("no_stop_trim"):
            text += self.tail_after_stop
        out_ids = [tid(w) for w in out_words]
        self.cache.append(ids + out_ids)
        meta = {"id": "r", "e2e_latency": 0.001, "prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                "cached_tokens": cached,
                "finish_reason": ({"type": "abort", "message": "aborted by the scheduler"} if self._aborts() else
                                  {"type": "stop", "matched": "NaN happened"} if self.nan else
                                  {"type": "stop", "matched": hit} if finish == "stop" else
                                  {"type": "length", "length": len(out_ids)})}
        if want:
            meta["input_token_logprobs"], tops = self._input_rows(ids, start, k)
            full, t = ids + out_ids, float(params["temperature"])
            scale = 1.0 if t == 0 or self.original_logprob else t
            meta["output_token_logprobs"] = [[own_logprob(full[:i], full[i]) / scale, full[i], w]
                                              for i, w in zip(range(len(ids), len(full)), out_words)]
            if k:
                meta["input_top_logprobs"] = tops
                meta["output_top_logprobs"] = [[[v / scale, j, s] for v, j, s in top_entries(full[:i], k)]
                                               for i in range(len(ids), len(full))]
        if body.get("return_hidden_states"):
            meta["hidden_states"] = [[[float(i), float(ids[i] % 10), 0.5] for i in range(cached, len(ids))]]
        return 200, {"text": text, "output_ids": out_ids, "meta_info": meta}


class FakeVLLM(_Server):
    """vLLM's OpenAI server (``vllm serve``), as a toy.

    Args:
        version: what ``/version`` reports.
        max_logprobs: its ``--max-logprobs``.
        prompt_tokens_details: started with ``--enable-prompt-tokens-details`` (else ``usage`` carries null).
        generation_config: the model's ``generation_config.json`` fields vLLM fills into unset sampling fields.
        short_top: put this many entries in each prompt_logprobs position instead of k (+ the prompt token).
        status: answer every completions request with this HTTP status, echoing the Authorization header.
        max_model_len: its context, which ``/v1/models`` states on the base model's card (``serving_models.py``
            ``show_available_models``: ``ModelCard(max_model_len=self.max_model_len)``) and ``/tokenize`` too.
        twin_texts: the two most likely tokens read alike ("", as control tokens), so a text-keyed top-k loses one.
        lone_texts: echo each token's text decoded alone, as vLLM 0.11 does for SentencePiece tokenizers (the toy:
            without its trailing spaces), so the texts do not add up to the prompt.
        end_of_turn: the token after every read prompt is :data:`END_OF_TURN`, an id the model's
            ``generation_config.json`` lists in ``eos_token_id`` beside the tokenizer's EOS:
            ``SamplingParams.update_from_generation_config`` puts it in ``stop_token_ids``, and ``check_stop``
            (``v1/core/sched/utils.py``, 0.11.1 and 0.34; 0.11.0, which the client refuses, tested the length
            first) ends the request with ``finish_reason`` ``"stop"`` and
            ``stop_reason`` = that id, an int (text "": a special token).
        abort: answer the first ``abort`` completions requests as vLLM answers a request its engine aborted (a
            shutdown, ``/pause``): HTTP 200, the partial text, ``finish_reason`` ``"abort"`` (``v1/engine/__init__.py``
            ``FINISH_REASON_STRINGS``; only ``"error"`` becomes a 500 in ``serving.py`` ``_raise_if_error``; vLLM
            main of 2026-07).
    """

    def __init__(self, name="toy", *, version="0.11.1", max_logprobs=20, prompt_tokens_details=False,
                 generation_config=None, short_top=None, status=None, lone_texts=False, twin_texts=False,
                 max_model_len=4096, end_of_turn=False, abort=0):
        self.lone_texts, self.twin_texts, self.end_of_turn = lone_texts, twin_texts, end_of_turn
        self.abort = abort
        self.version = version
        card = {"id": name, "object": "model", "owned_by": "vllm", "max_model_len": max_model_len}
        self.name, self.max_logprobs, self.short_top, self.status = name, max_logprobs, short_top, status
        self.details, self.generation_config = prompt_tokens_details, dict(generation_config or {})
        self.effective: list[dict] = []
        super().__init__({"/v1/models": lambda: (200, {"object": "list", "data": [card]}),
                          "/version": lambda: (200, {"version": version})},
                         {"/v1/completions": self._complete,
                          "/tokenize": lambda body, h: (200, {"tokens": ids_of(body["prompt"]),
                                                              "count": len(ids_of(body["prompt"])),
                                                              "max_model_len": max_model_len})})

    def _logprobs(self, full, texts, start, k, offset0=0):
        out = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        off = offset0
        for i in range(start, len(full)):
            lp = None if i == 0 else own_logprob(full[:i], full[i])
            out["tokens"].append(texts[i])
            out["text_offset"].append(off)
            out["token_logprobs"].append(lp)
            tops = [(v, "" if self.twin_texts and j < 2 else t) for j, (v, _, t) in enumerate(top_entries(full[:i], k))]
            out["top_logprobs"].append(None if i == 0 else {texts[i]: lp, **{t: v for v, t in reversed(tops)}})
            off += len(texts[i])
        return out

    def _params(self, body: dict) -> dict:
        """``CompletionRequest.to_sampling_params``: a field the request leaves out comes from the generation config
        (``default_sampling_params``, ``config/model.py`` ``get_diff_sampling_param``; the two penalties from 0.31),
        then from ``SamplingParams``' own default."""
        base = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0}
        filled = set(base) - ({"presence_penalty", "frequency_penalty"} if _older(self.version, "0.31") else set())
        got = {f: body[f] if body.get(f) is not None else self.generation_config.get(f, v) if f in filled else v
               for f, v in base.items()}
        return {**got, "top_k": 0 if got["top_k"] == -1 else got["top_k"]}

    def _refused(self, body: dict, params: dict) -> str | None:
        """Why vLLM answers the request with a 400: more log-probs than ``--max-logprobs``, or ``n`` > 1 at a
        greedy temperature (``sampling_params.py`` ``_verify_greedy_sampling``: below ``_SAMPLING_EPS``, 1e-5)."""
        k = body.get("logprobs")
        if k is not None and k > self.max_logprobs or (body.get("prompt_logprobs") or 0) > self.max_logprobs:
            return f"Requested prompt logprobs of {k}, which is greater than max allowed: {self.max_logprobs}"
        if params["temperature"] < 1e-5 and (body.get("n") or 1) > 1:
            return f"n must be 1 when using greedy sampling, got {body['n']}."
        return None

    def _complete(self, body, headers):
        if self.status:
            return self.status, {"error": {"message": "refused: " + headers.get("authorization", "")}}
        params, k = self._params(body), body.get("logprobs")
        if (refused := self._refused(body, params)) is not None:
            return 400, {"error": {"message": refused, "type": "BadRequestError"}}
        self.effective.append(params)
        prompt = body["prompt"]
        ids, texts = ids_of(prompt), [BOS_TEXT] + [w.rstrip(" ") if self.lone_texts else w for w in words(prompt)]
        if body.get("echo") and self.end_of_turn:
            out_words, text, finish, hit = [""], "", "stop", END_OF_TURN
        elif body.get("echo"):
            out_words, text, finish, hit = [NEXT], NEXT, "length", None
        elif body.get("n", 1) > 1:  # child j seeded seed + j (v1/engine/parallel_sampling.py ParentRequest)
            return self._samples(body, params, ids, prompt)
        else:
            out_words, text, finish, hit = toy_continue(ids, body["max_tokens"], body.get("stop") or [],
                                                        body.get("include_stop_str_in_output", False), params,
                                                        body.get("seed"))
        if self.abort:
            self.abort -= 1
            finish, hit, out_words, text = "abort", None, out_words[:1], text[:len(out_words[0])] if out_words else ""
        full = ids + ([END_OF_TURN] if hit == END_OF_TURN else [tid(w) for w in out_words])
        all_texts = texts + out_words
        choice = {"index": 0, "finish_reason": finish, "stop_reason": hit, "logprobs": None, "prompt_logprobs": None}
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
        else:
            choice["text"] = text
            if k is not None:
                choice["logprobs"] = self._logprobs(full, all_texts, len(ids), k)
        if body.get("return_token_ids"):
            choice["prompt_token_ids"], choice["token_ids"] = ids, full[len(ids):]
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out_words),
                 "total_tokens": len(ids) + len(out_words),
                 "prompt_tokens_details": {"cached_tokens": 2} if self.details else None}
        return 200, {"id": "x", "object": "text_completion", "created": 0, "model": self.name, "choices": [choice],
                     "usage": usage}


    def _samples(self, body, params, ids, prompt):
        choices, used = [], 0
        for j in range(body["n"]):
            seed = None if body.get("seed") is None else body["seed"] + j
            out_words, text, finish, hit = toy_continue(ids, body["max_tokens"], body.get("stop") or [],
                                                        body.get("include_stop_str_in_output", False), params, seed)
            used += len(out_words)
            choices.append({"index": j, "text": text, "finish_reason": finish, "stop_reason": hit, "logprobs": None})
        usage = {"prompt_tokens": len(ids), "completion_tokens": used, "total_tokens": len(ids) + used}
        return 200, {"id": "x", "object": "text_completion", "created": 0, "model": self.name, "choices": choices,
                     "usage": usage}


class FakeLlamaCpp(_Server):
    """Only what :class:`LlamaCppEngine` asks before reading: ``/v1/models``, and ``/props`` (the C++
    ``llama-server``) or ``/extras/tokenize`` (llama-cpp-python; ``bos``: the model adds BOS), and
    ``/openapi.json`` (its version)."""

    def __init__(self, name="toy", *, cpp=False, bos=True, version="0.3.16"):
        get = {"/v1/models": lambda: (200, {"object": "list", "data": [{"id": name}]}),
               "/openapi.json": lambda: (200, {"info": {"title": "🦙 llama.cpp Python API", "version": version}})}
        if cpp:
            get["/props"] = lambda: (200, {"default_generation_settings": {}})
        super().__init__(get, {"/extras/tokenize": lambda body, h: (200, {"tokens": [BOS] if bos else []})})


class ScriptSGLang(_Server):
    """SGLang's ``/generate`` over a real tokenizer (``tokenizers.Tokenizer``) and a model that writes ``script``.

    The model's next token after a prompt whose ids begin the script's is the script's next one (log-prob -0.1, the
    runner-up -2.0), after the script EOS. Per-token texts are each id decoded alone, as SGLang returns them in every
    version (``tokenizer_manager.py`` ``detokenize_logprob_tokens``: ``batch_decode`` of one-id lists, special tokens
    kept), while ``text``
    is the output decoded after its prompt (``detokenizer_manager.py``: incremental, so it adds up). ``/v1/tokenize``
    as the tokenizer encodes; hidden rows are not served.
    """

    def __init__(self, tokenizer, script: str, name: str = "toy"):
        self.tok, self.script, self.name = tokenizer, tokenizer.encode(script).ids, name
        self.eos = tokenizer.token_to_id("</s>")
        info = {"version": "0.5.23", "enable_return_hidden_states": False, "disable_radix_cache": False,
                "enable_deterministic_inference": True}
        card = {"id": name, "object": "model", "owned_by": "sglang", "root": name, "max_model_len": 4096}
        super().__init__({"/v1/models": lambda: (200, {"object": "list", "data": [card]}),
                          "/server_info": lambda: (200, info)},
                         {"/v1/tokenize": self._tokenize, "/generate": self._generate})

    def _tokenize(self, body, headers):
        p = body["prompt"]
        toks = [self.tok.encode(t).ids for t in p] if isinstance(p, list) else self.tok.encode(p).ids
        return 200, {"tokens": toks}

    def _next(self, ids: list[int]) -> int:
        n = len(ids)
        return self.script[n] if ids == self.script[:n] and n < len(self.script) else self.eos

    def _row(self, lp, i: int) -> list:
        return [lp, i, self.tok.decode([i], skip_special_tokens=False)]  # batch_decode's default: "</s>" reads whole

    def _generate(self, body, headers):
        sp = body.get("sampling_params") or {}
        ids = list(body.get("input_ids") or self.tok.encode(body["text"]).ids)
        k, start = int(body.get("top_logprobs_num") or 0), body.get("logprob_start_len", -1)
        out, stop, finish = [], sp.get("stop") or [], {"type": "length", "length": 0}
        while True:  # schedule_batch.py Req.update_finish_state (0.5.18 on): stop strings and EOS, then the length
            nxt = self._next(ids + out)
            out.append(nxt)
            written = self.tok.decode(ids + out)[len(self.tok.decode(ids)):]
            hit = next((s for s in stop if s in written), None)
            if nxt == self.eos or hit:
                finish = {"type": "stop", "matched": hit or self.eos}
                break
            if len(out) >= sp.get("max_new_tokens", 128):
                finish = {"type": "length", "length": len(out)}
                break
        text = self.tok.decode(ids + [i for i in out if i != self.eos])[len(self.tok.decode(ids)):]
        if finish.get("matched") and isinstance(finish["matched"], str) and not sp.get("no_stop_trim"):
            text = text[:text.index(finish["matched"])]
        tops = [[-0.1, 0, "?"], [-2.0, 0, "?"]] + [[-3.0 - j, 0, "?"] for j in range(k)]
        meta = {"id": "r", "prompt_tokens": len(ids), "completion_tokens": len(out), "cached_tokens": 0,
                "finish_reason": finish,
                "output_token_logprobs": [self._row(-0.1, i) for i in out],
                "output_top_logprobs": [tops[:k] for _ in out]}
        if start >= 0:
            meta["input_token_logprobs"] = [self._row(None if j == start else -0.1, ids[j])
                                            for j in range(start, len(ids))]
            meta["input_top_logprobs"] = [None if j == start else tops[:k] for j in range(start, len(ids))]
        return 200, {"text": text, "output_ids": out, "meta_info": meta}
