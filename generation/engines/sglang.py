"""Engine client of SGLang's native ``POST /generate`` (``python -m sglang.launch_server``).

A read sends context + step as the server's own token ids with ``logprob_start_len`` = the step's
first token - 1, ``max_new_tokens: 2`` (:data:`READ_TOKENS`), ``top_logprobs_num: k`` and, when asked,
``return_hidden_states``.
SGLang answers the first position asked for with ``[null, id, text]`` and a null top-k entry
(``python/sglang/srt/managers/scheduler_output_processor_mixin.py`` ``_process_input_token_logprobs``:
``[None] + input_token_logprobs[:-1]``, 0.4.6 to 0.5.23), so that entry is dropped, as SGLang's own frontend
does. The radix cache is reused up to ``min(input_len - 1, logprob_start_len)`` (``schedule_batch.py``
``Req._compute_max_prefix_len``): all of a cached context but its last token is not prefilled again, and
the answer holds the step's log-probs, its hidden rows and the next token. The ids come from the
server's ``/v1/tokenize`` (one CPU-only request): the context and context + step are tokenized
together, and the step starts where the context's ids end (a tokenizer that merges the two is refused),
so nothing is re-tokenized on the client.

Answer fields (``python/sglang/srt/managers/io_struct.py`` ``GenerateReqInput``; ``meta_info``):
``input_token_logprobs`` / ``output_token_logprobs``: per position ``[logprob, token_id, text]``;
``input_top_logprobs`` / ``output_top_logprobs``: per position a list of those; ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``finish_reason`` (``{"type": "stop", "matched": str | id}``
or ``{"type": "length"}``) and ``hidden_states`` (the prefill's rows as one list of rows, then one row
per decoded token).

Written tokens' log-probs are ``log_softmax(logits / T)`` unless the batch is greedy or the server runs with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (``python/sglang/srt/layers/sampler.py``), an environment variable no route
reports; prompt (read) log-probs are raw. So at 0 < T != 1 a write that asks for its tokens' log-probs reads them
back raw, as prompt tokens, in a second request (:meth:`SGLangEngine._read_back`).

Every sampling request states the whole distribution: ``temperature``, ``top_p`` and neutral ``top_k`` (-1),
``min_p`` (0), ``repetition_penalty`` (1) and both penalties (0), since ``/generate`` fills unset fields from
``--preferred-sampling-params`` (``tokenizer_manager.py``: ``{**preferred, **request}``; it reads no generation config,
only the chat route does). That flag is read from ``/server_info``, and a server whose preferred fields reach what a
request leaves unset (a ``stop``, ``ignore_eos``, ...) is refused (:func:`preferred_refusal`).

The version and the flags come from ``/server_info`` (older: ``/get_server_info``; SGLang has no ``/version``):
below :data:`MIN_VERSION` (``/v1/tokenize`` from 0.5.4, ``sampling_seed`` from 0.5.3) the server is refused
before any request that reads or writes. ``hidden`` is refused on a server whose rows are not the last layer
after the final norm, or below :data:`HIDDEN_MIN_VERSION` (:func:`hidden_refusals`).

A ``/generate`` answer whose ``finish_reason`` is ``abort`` comes with HTTP 200 (the scheduler aborted it: a restart,
memory pressure): it is asked again, up to the connection's retries, before it is an error. One whose ``matched`` is
``"NaN happened"`` (a sampled id outside the vocabulary) is an error at once. A server started without
``--enable-deterministic-inference`` ignores ``sampling_seed``: the client warns once (:class:`UnseededServer`).

Hidden rows are AFTER the model's final norm (``"final_norm"``, as transformers' last
``hidden_states`` entry): in ``python/sglang/srt/models/llama.py`` ``LlamaModel.forward`` ends with
``hidden_states, _ = self.norm(hidden_states, residual)`` and ``LlamaForCausalLM.forward`` passes that
to ``LogitsProcessor``, whose ``capture_hidden_mode`` FULL stores those very rows
(``python/sglang/srt/layers/logits_processor.py``, ``hidden_states_to_store = hidden_states``); the
other model files follow the same pattern (an EAGLE-3 draft's auxiliary layers are the exception,
and are not what ``/generate`` returns for a plain server).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
from packaging.version import Version

from generation.engines import HIDDEN_NORM, NEUTRAL_SAMPLING
from generation.engines.base import (Capabilities, EngineError, MalformedAnswer, Reading, TokenLogprobs, Unsupported,
                                     Usage, Written, spell)
from generation.engines.connection import at_least, connect, other_engine
from generation.engines.openai_compat import top_k_of
from generation.specs import SamplingSpec, StepSpec

MIN_VERSION = "0.5.4"
"""The oldest SGLang this client reads and writes with: ``/v1/tokenize`` exists from 0.5.4 (``sampling_seed`` from
0.5.3, honoured only with ``--enable-deterministic-inference``)."""
NAN_STOP = "NaN happened"
"""The ``matched`` of a request SGLang ended at a token id outside the vocabulary (NaN logits), shaped as a stop
string's (``schedule_batch.py`` ``FINISH_MATCHED_STR(matched="NaN happened")``): a failure, never a delimiter or EOS."""

HIDDEN_MIN_VERSION = "0.5.17"
"""The oldest SGLang whose hidden rows this client reads: before it, a batched prefill slices each request's rows by
``len(req.origin_input_ids)`` and advances the offset only for requests that asked for hidden states, while the
batch's rows hold only each request's uncached (*extend*) part (``scheduler_output_processor_mixin.py``
``process_batch_result_prefill`` in 0.5.4/0.5.9, ``_append_prefill_hidden_states`` in 0.5.14/0.5.16): with a
radix-cache hit, as every read after the first has, one request gets another's rows, silently. 0.5.17 slices by
``extend_input_len`` and advances for every request."""
STATED_FIELDS = frozenset(("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                           "presence_penalty", "frequency_penalty", "sampling_seed"))
"""The sampling fields every ``/generate`` request of this client states: ``--preferred-sampling-params`` can only
fill others."""
PRE_NORM_MODELS = ("deepseek-v4", "deepseekv4")
"""Model names (lower case, in ``model_path``) whose SGLang hidden rows come before the final norm."""
READ_TOKENS = 2
"""New tokens a read asks for: the bonus token, and one more so that an EOS bonus token ends at ``stop`` (SGLang before
:data:`EOS_FIRST_VERSION` tests the length limit first, so a one-token request that drew EOS ends at ``length``); the
second is dropped."""
EOS_FIRST_VERSION = "0.5.18"
"""From this SGLang on, EOS and stop strings are tested before the length limit (``schedule_batch.py``
``Req.update_finish_state``); before it, a write whose last allowed token is EOS ends at ``length``, its EOS row in
``output_token_logprobs`` (:meth:`SGLangEngine._written`)."""
LONG_CONTEXT = 128
"""Contexts of more tokens than this, read for the first time with ``hidden``, are prefilled first
(:meth:`SGLangEngine._prefill`): one request more per prompt instead of a hidden row per context token."""
KNOWN_TEXTS = 4096
"""Texts whose server token ids an :class:`SGLangEngine` keeps: a step read after a context it has seen (the previous
step + the bonus token, or a step the server wrote) needs no ``/v1/tokenize`` call, so a kept step costs two requests
(the draft's write, this read) and a refused one three."""



class UnseededServer(UserWarning):
    """An SGLang server that ignores sampling seeds: ``sampling_seed`` is read only with
    ``--enable-deterministic-inference`` (``sampling/sampling_batch_info.py``: the seeds' tensor is None otherwise)."""


def hidden_refusals(url: str, info: dict) -> tuple[str, ...]:
    """Why the server's hidden rows are not the last layer's, or not this request's (each: the version or the flag,
    and the fix); empty when they are."""
    out = []
    if Version(str(info["version"]).split()[-1]) < Version(HIDDEN_MIN_VERSION):  # at_least parsed it
        out.append(f"SGLang server {url} runs {info['version']}, which before {HIDDEN_MIN_VERSION} gives a request "
                   "another request's hidden rows when prefills with a cached prefix are batched; upgrade it to SGLang "
                   f">= {HIDDEN_MIN_VERSION} to read 'hidden', or train the probe on 'topk_stats'")
    if not info.get("enable_return_hidden_states", False):
        out.append(f"SGLang server {url} was started without --enable-return-hidden-states; restart it with that flag "
                   "to read 'hidden'")
    mode = info.get("return_hidden_states_mode")
    if mode not in (None, "full"):
        out.append(f"SGLang server {url} runs --return-hidden-states-mode {mode}, which refuses "
                   "return_hidden_states; restart it with --return-hidden-states-mode full")
    spec = info.get("speculative_algorithm")
    if spec:
        out.append(f"SGLang server {url} runs speculative decoding (--speculative-algorithm {spec}), whose hidden rows "
                   "are the draft's auxiliary layers; restart it without --speculative-algorithm to read 'hidden'")
    if info.get("enable_return_aux_hidden_states"):
        out.append(f"SGLang server {url} runs --enable-return-aux-hidden-states, whose rows are auxiliary layers "
                   "concatenated; restart it without that flag to read 'hidden'")
    return tuple(out)


def preferred_refusal(url: str, info: dict) -> str | None:
    """Why the server's ``--preferred-sampling-params`` would change what this client asks (the fields it fills that
    the client does not state), or None."""
    import json

    preferred = info.get("preferred_sampling_params")
    if isinstance(preferred, str):
        try:
            preferred = json.loads(preferred)
        except ValueError:
            return f"SGLang server {url} states --preferred-sampling-params {preferred!r}, which is not JSON"
    extra = sorted(set(preferred or {}) - STATED_FIELDS)
    if not extra:
        return None
    return (f"SGLang server {url} runs --preferred-sampling-params with {extra}, fields this client does not state, "
            "so the server would fill them into every request; restart it without those fields (these are stated in "
            f"every request and may stay: {sorted(STATED_FIELDS)})")


class SGLangEngine:
    """A client of one SGLang server (>= :data:`MIN_VERSION`).

    Args:
        url: its base URL (``http://127.0.0.1:30000``, with or without ``/v1``).
        model: the model name it serves; None = the one it lists.
        api_key_env, timeout, retries: as :class:`~generation.engines.connection.Connection`.

    Raises:
        EngineError: the server does not answer ``/v1/models`` or does not serve ``model``.
        Unsupported: it is not an SGLang server, one older than :data:`MIN_VERSION`, or one whose
            ``--preferred-sampling-params`` fill fields a request leaves unset.

    Warns:
        UnseededServer: the server runs without ``--enable-deterministic-inference`` (it ignores ``sampling_seed``).
    """

    name = "sglang"

    def __init__(self, url: str, model: str | None = None, **conn):
        connect(self, url, model, version_route=None, **conn)
        if self.context_length is not None:  # what a request may fill: SGLang refuses input + max_new_tokens >= its
            self.context_length -= READ_TOKENS  # context_len, and a read asks for READ_TOKENS past a step that fills it
        self._known: OrderedDict[str, list[int]] = OrderedDict()
        self.info = self._server_info()
        self.version = str(self.info.get("version")) if self.info.get("version") is not None else None
        at_least(self, self.version, MIN_VERSION, "SGLang")
        self.length_first = Version(self.version.split()[-1]) < Version(EOS_FIRST_VERSION)  # at_least parsed it
        if (why := preferred_refusal(self.url, self.info)) is not None:
            raise Unsupported(why, self.url)
        self._caps = self._capabilities()
        self.seeded = bool(self.info.get("enable_deterministic_inference"))
        if not self.seeded:
            warnings.warn(UnseededServer(
                f"SGLang server {self.url} runs without --enable-deterministic-inference, so it ignores sampling "
                "seeds: its sampled steps and drawn tokens cannot be repeated with a seed (a resumed label build "
                "draws other samples); start it with the flag to make them repeatable"), stacklevel=2)

    def _server_info(self) -> dict:
        info = self.conn.get("/server_info", patient=True) or self.conn.get("/get_server_info", patient=True)
        if not isinstance(info, dict):
            if (why := other_engine(self.conn, "sglang")) is not None:
                raise Unsupported(why, self.url)
            raise Unsupported(f"server {self.url} answers neither /server_info nor /get_server_info; is it an SGLang "
                              "server? Give the URL of python -m sglang.launch_server", self.url)
        return info

    def _capabilities(self) -> Capabilities:
        why = hidden_refusals(self.url, self.info)
        path = str(self.info.get("model_path") or self.model).lower().replace("_", "-")
        norm = "pre_norm" if any(m in path for m in PRE_NORM_MODELS) else HIDDEN_NORM["sglang"]
        return Capabilities(True, None, not why, None if why else norm, why)

    def capabilities(self) -> Capabilities:
        return self._caps

    # -- requests -------------------------------------------------------------------------------

    def _generate(self, body: dict) -> tuple[dict, dict, float]:
        ((got, meta),), secs = self._generate_all(body, 1)
        return got, meta, secs

    def _generate_all(self, body: dict, n: int) -> tuple[list[tuple[dict, dict]], float]:
        """``POST /generate`` of ``n`` prompts (one: a plain body; more: lists): each answer and its ``meta_info``, and
        the seconds; asked again when the scheduler aborted one (an abort comes with HTTP 200)."""
        for _ in range(self.conn.retries):
            got, secs = self.conn.post("/generate", body, "/generate")
            got = got if isinstance(got, list) else [got]
            if len(got) != n or not all(isinstance(g, dict) and isinstance(g.get("meta_info"), dict) for g in got):
                raise MalformedAnswer(f"server {self.url} answered /generate of {n} prompt(s) without {n} answers "
                                      "holding the field meta_info", self.url)
            finishes = [g["meta_info"].get("finish_reason") for g in got
                        if isinstance(g["meta_info"].get("finish_reason"), dict)]
            if any(f.get("matched") == NAN_STOP for f in finishes):
                raise EngineError(f"server {self.url} ended a /generate request at a token outside the vocabulary "
                                  f"(finish_reason matched {NAN_STOP!r}: NaN logits); check the model's weights and "
                                  "dtype on the server", self.url)
            aborted = [f for f in finishes if f.get("type") == "abort"]
            if not aborted:
                return [(g, g["meta_info"]) for g in got], secs
        raise EngineError(f"server {self.url} aborted a /generate request {self.conn.retries} time(s): "
                          f"{aborted[0].get('message', '')!s:.200}; check its log (out of memory, a too-long input, a "
                          "restart)", self.url)

    def _remember(self, text: str, ids: list[int]) -> None:
        """The server's ids of a text this client has seen it tokenize (the newest :data:`KNOWN_TEXTS` kept)."""
        self._known[text] = ids
        self._known.move_to_end(text)
        while len(self._known) > KNOWN_TEXTS:
            self._known.popitem(last=False)

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        got, _ = self.conn.post("/v1/tokenize", {"model": self.model, "prompt": texts}, "/v1/tokenize")
        tokens = got.get("tokens") if isinstance(got, dict) else None
        if not isinstance(tokens, list) or len(tokens) != len(texts) or not all(isinstance(t, list) for t in tokens):
            raise MalformedAnswer(f"server {self.url} answered /v1/tokenize of {len(texts)} texts without the field "
                                  f"tokens holding {len(texts)} token lists", self.url)
        return [[int(i) for i in t] for t in tokens]

    def prompt_tokens(self, texts: list[str]) -> list[int]:
        """One ``/v1/tokenize`` of all ``texts``."""
        return [len(ids) for ids in self._tokenize(list(texts))]

    def _ids(self, context: str, step: str) -> tuple[list[int], int]:
        """The server's ids of context + step and the index of the step's first token (one ``/v1/tokenize``)."""
        ctx, full = self._tokenize([context, context + step])
        if not ctx or full[:len(ctx)] != ctx or len(full) == len(ctx):
            raise MalformedAnswer(f"server {self.url}: the context's {len(ctx)} token(s) are not a prefix of context + "
                                  f"step's {len(full)}: its tokenizer merges the context's end with the step's start "
                                  "(or the context or the step is empty)", self.url)
        self._remember(context, ctx)
        return full, len(ctx)

    def _sampling(self, sampling: SamplingSpec, seed: int, max_new_tokens: int) -> dict:
        return {"max_new_tokens": max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                **NEUTRAL_SAMPLING["sglang"], "sampling_seed": seed & 0x7FFFFFFF}

    def _usage(self, meta: dict, secs: float) -> Usage:
        prompt, cached = int(meta.get("prompt_tokens", 0)), meta.get("cached_tokens")
        return Usage(prompt, int(meta.get("completion_tokens", 0)), None if cached is None else int(cached),
                     None if cached is None else prompt - int(cached), secs)

    def _logprobs(self, rows, tops, n: int, k: int, what: str, field: str) -> TokenLogprobs:
        """``n`` positions of ``[logprob, id, text]`` rows and their top-k lists, refused when short."""
        rows, tops = rows or [], tops or []
        if len(rows) < n or (k and len(tops) < n):
            raise MalformedAnswer(f"server {self.url} returned {len(rows)} {what} log-prob rows "
                                  f"({field}_token_logprobs) and {len(tops)} top-k rows ({field}_top_logprobs); "
                                  f"expected {n}", self.url)
        rows, tops = rows[len(rows) - n:], tops[len(tops) - n:] if k else [[]] * n
        if any(not isinstance(r, list) or len(r) < 2 or r[0] is None for r in rows):
            raise MalformedAnswer(f"server {self.url} returned no log-prob for some of the {n} {what} tokens "
                                  f"({field}_token_logprobs)", self.url)
        top = [top_k_of([float(e[0]) for e in (t or [])], k, self.url, f"{what} token {j}") for j, t in enumerate(tops)]
        return TokenLogprobs([str(r[2]) if len(r) > 2 and r[2] is not None else "" for r in rows],
                             [int(r[1]) for r in rows], torch.tensor([float(r[0]) for r in rows]),
                             torch.tensor(top, dtype=torch.float32).reshape(n, k))

    def _read_rows(self, prompt: dict, start: int, top_k: int, hidden: bool, sampling: SamplingSpec, seed: int):
        """``POST /generate`` reading ``prompt`` (its ``input_ids`` or its ``text``) from its token ``start``: the
        answer, its ``meta_info``, the seconds, and the prompt rows from ``start`` on with their top-k (the first one
        asked for, ``start - 1``, SGLang always answers ``[null, id, text]``: it is dropped)."""
        got, meta, secs = self._generate({**prompt, "logprob_start_len": start - 1,
                                          "sampling_params": self._sampling(sampling, seed, READ_TOKENS),
                                          "return_logprob": True, "top_logprobs_num": top_k,
                                          "return_hidden_states": bool(hidden), "return_text_in_logprobs": True})
        rows, tops = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
        if not isinstance(rows, list) or not rows:
            raise MalformedAnswer(f"server {self.url} answered /generate without the field input_token_logprobs",
                                  self.url)
        return got, meta, secs, rows[1:], (tops or [None])[1:]

    def _hidden(self, meta: dict, n: int) -> torch.Tensor:
        """The step's last-layer rows: the last ``n`` rows the prefill returned."""
        rows = [r for part in meta.get("hidden_states") or [] if part and isinstance(part[0], list) for r in part]
        if len(rows) < n:
            raise MalformedAnswer(f"server {self.url} returned {len(rows)} hidden row(s) (hidden_states) for a step of "
                                  f"{n} token(s)", self.url)
        return torch.tensor(rows[len(rows) - n:], dtype=torch.float32)

    # -- the Engine protocol ----------------------------------------------------------------------

    def read(self, context: str, step: str, *, top_k: int, hidden: bool, sampling: SamplingSpec,
             seed: int) -> Reading:
        if hidden and not self.capabilities().hidden:
            raise Unsupported(" ".join(self.capabilities().remarks), self.url)
        if top_k < 1:
            raise ValueError(f"top_k={top_k}: expected >= 1")
        known, tokens, kw = self._known.get(context), None, (top_k, hidden, sampling, seed)
        if known:  # no /v1/tokenize call: the server tokenizes context + step, read from the context's last token
            got, meta, secs, rows, tops = self._read_rows({"text": context + step}, len(known), *kw)
            if rows and spell(_texts(rows), step) is not None:  # else its tokenizer merged across the boundary
                tokens = self._logprobs(rows, tops, len(rows), top_k, "step", "input")
        if tokens is None:  # the context's ids are not known, or the server split context + step elsewhere
            ids, start = self._ids(context, step)
            if hidden and start > LONG_CONTEXT:
                self._prefill(ids[:start])
            got, meta, secs, rows, tops = self._read_rows({"input_ids": ids}, start, *kw)  # exact
            tokens = self._logprobs(rows, tops, len(ids) - start, top_k, "step", "input")
        self._remember(context + step, (self._known.get(context) or []) + list(tokens.ids or []))
        eos, next_text, next_id = self._next_token(meta, str(got.get("text", "")))
        if not eos and next_text and next_id is not None:  # "": a special token, skipped
            self._remember(context + step + next_text, self._known[context + step] + [next_id])
        return Reading(tokens, self._hidden(meta, len(tokens.tokens)) if hidden else None, next_text, eos,
                       self._usage(meta, secs))

    def _next_token(self, meta: dict, text: str) -> tuple[bool, str, int | None]:
        """The token after a read step: whether it is EOS, its text and its id. A read asks for two tokens because
        SGLang before :data:`EOS_FIRST_VERSION` tests the length limit before EOS (``schedule_batch.py``
        ``Req.check_finished``): one token that is EOS ends at ``length``, told from any other special token by
        nothing. Two: EOS first ends at ``stop`` after one; else ``text`` holds both but a special second token (an
        EOS: its row reads ``"</s>"``, the text skips it), and the first token's text is its part of it
        (:func:`spell`)."""
        rows = [r for r in meta.get("output_token_logprobs") or [] if r and len(r) > 2]
        if (meta.get("finish_reason") or {}).get("type") == "stop" and int(meta.get("completion_tokens", 0)) <= 1:
            return True, "", None
        if len(rows) < 2:  # one token written (a server that stops at the first): its text is the answer's
            return False, text, int(rows[0][1]) if rows else None
        texts = _texts(rows[:2])  # each id decoded alone with its special tokens (batch_decode's default)
        pieces = spell(texts, text) or (["", text] if spell(texts[1:], text) else None) or \
            ([text, ""] if spell(texts[:1], text) else None)  # a special token (an EOS after the first) the text skips
        if pieces is None:
            raise MalformedAnswer(f"server {self.url} answered a read with token texts that do not spell its text",
                                  self.url)
        return False, pieces[0], int(rows[0][1])

    def _prefill(self, ids: list[int]) -> None:
        """Have the server cache a long context first (one token written, nothing returned): SGLang returns a hidden
        row for every position it computes (no "last n rows" option), so a first read of a long context would carry
        them all as JSON floats; after this request the read computes, and returns, the step's rows and one more."""
        self._generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})

    def write(self, context: str, *, step: StepSpec | None, max_tokens: int, sampling: SamplingSpec, seed: int,
              top_k: int | None = None, n: int | None = None) -> Written | list[Written]:
        """``n``: one ``/generate`` of ``n`` copies of the prompt, copy ``j`` with ``sampling_seed`` ``seed + j`` (one
        ``sampling_params`` with ``n`` would give every copy the same seed)."""
        seeds = [seed] if n is None else [seed + j for j in range(n)]
        params = [self._sampling(sampling, s, max_tokens) for s in seeds]
        for p in params:
            p.update(stop=list(step.delimiters), no_stop_trim=True) if step is not None else None
        scaled = bool(top_k) and sampling.temperature not in (0.0, 1.0)  # written log-probs would be tempered
        known = self._known.get(context)
        body = {"input_ids": known} if known else {"text": context}
        if n is not None:
            body = {k: [v] * n for k, v in body.items()}
        body.update(sampling_params=params if n is not None else params[0], return_logprob=True,
                    top_logprobs_num=0 if scaled else top_k or 0,
                    return_text_in_logprobs=True)  # the written ids: the next read after this text needs no tokenize
        answers, secs = self._generate_all(body, len(seeds))
        out = [self._written(got, meta, secs if j == 0 else 0.0, context, known, step, top_k, scaled, s)
               for j, ((got, meta), s) in enumerate(zip(answers, seeds))]
        return out if n is not None else out[0]

    def _written(self, got: dict, meta: dict, secs: float, context: str, known: list[int] | None,
                 step: StepSpec | None, top_k: int | None, scaled: bool, seed: int) -> Written:
        text, finish = str(got.get("text", "")), meta.get("finish_reason") or {}
        matched = finish.get("matched")
        if finish.get("type") == "length":
            how = "eos" if self._eos_at_cap(meta, text) else "length"
        elif isinstance(matched, str) and step is not None:  # no_stop_trim keeps the stop string; before 0.5.14
            how, cut = "delimiter", text.find(matched)         # (PR #25980) it could keep text after it as well
            text = text[:cut + len(matched)] if cut >= 0 else text + matched
        else:
            how = "eos"
        n = int(meta.get("completion_tokens", 0)) - (how == "eos")  # the EOS token is not in the text
        rows = meta.get("output_token_logprobs") or []
        tokens = None
        if scaled:
            tokens, usage = self._read_back(context, known, rows[:n], top_k, seed)
            secs += usage.seconds
        elif top_k:
            tokens = self._logprobs(rows[:n], (meta.get("output_top_logprobs") or [])[:n], n, top_k, "written",
                                    "output")
        if known and how != "eos" and spell(_texts(rows), text) is not None:
            self._remember(context + text, known + [int(r[1]) for r in rows])
        return Written(text, how, tokens, self._usage(meta, secs))

    def _eos_at_cap(self, meta: dict, text: str) -> bool:
        """A write that SGLang before :data:`EOS_FIRST_VERSION` ended at ``length`` drew EOS as its last allowed token:
        its last row reads as a special token (``"</s>"``) that the text skips, the rows before it spell the text."""
        texts = _texts(meta.get("output_token_logprobs") or []) if self.length_first else []
        return bool(texts) and spell(texts, text) is None and spell(texts[:-1], text) is not None

    def _read_back(self, context: str, known: list[int] | None, rows: list, top_k: int, seed: int):
        """The written tokens' raw log-probs: SGLang tempers written tokens' log-probs (not prompt tokens'), so the
        context + the written ids are read as a prompt, greedy (one more request; one more ``/v1/tokenize`` when the
        context's ids are not known)."""
        ctx = known or self._tokenize([context])[0]
        written = [int(r[1]) for r in rows if isinstance(r, list) and len(r) > 1]
        if not written:
            return self._logprobs([], [], 0, top_k, "written", "output"), Usage(0, 0)
        _, meta, secs, back_rows, tops = self._read_rows({"input_ids": ctx + written}, len(ctx), top_k, False,
                                                         SamplingSpec(0.0, 1.0), seed)
        return self._logprobs(back_rows, tops, len(written), top_k, "written", "input"), self._usage(meta, secs)


def _texts(rows: list) -> list[str]:
    """The texts of ``[logprob, id, text]`` rows (``return_text_in_logprobs``: each id decoded alone)."""
    return [str(r[2]) for r in rows if r and len(r) > 2 and r[2] is not None]
