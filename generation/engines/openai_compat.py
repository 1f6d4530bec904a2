"""Engine clients over ``/v1/completions``: llama-cpp-python's server and vLLM.

Both read context + step in one request that echoes the prompt with its log-probs and draws one more
token (``max_tokens: 1``); the step's tokens are found in the echo by text offsets (the context's
length), never by re-tokenizing on the client. Both write a step with the delimiters as ``stop``.

- llama-cpp-python (``python -m llama_cpp.server``): ``echo: true, logprobs: k``; its top-k come
  keyed by token text. It returns no cached-token count and no hidden states. Its echo pairs prompt
  token ``i`` with logit row ``i`` (``llama_cpp/llama.py`` ``_create_completion``, 0.3.x), which is
  right only when the model adds BOS (the row after BOS predicts the first echoed token); a model
  without BOS gets every prompt log-prob one position off, so such a server is refused for reading.
  A write can hold up to 3 tokens more than ``max_tokens``: it finishes a character split over byte tokens first
  (``_create_completion`` skips its length check while ``multibyte_fix`` waits for the last bytes); its
  ``completion_tokens`` counts them, and so does the row.
  The C++ ``llama-server`` has no echo at all (it answers ``/props``) and is refused for reading too.
- vLLM: ``echo: true, logprobs: k`` plus ``prompt_logprobs: k`` in the body: ``choices[].prompt_logprobs``
  gives per position ``{token_id: {logprob, rank, decoded_token}}`` (None at position 0), the top-k by
  id. k is capped by ``--max-logprobs`` (default 20). Prompt log-probs skip its prefix cache.
"""

from __future__ import annotations

import torch

from dataclasses import replace

from generation.engines import NEUTRAL_SAMPLING
from generation.engines.base import (Capabilities, EngineError, MalformedAnswer, Reading, TokenLogprobs, Unsupported,
                                     Usage, Written)
from generation.engines.connection import at_least, connect, other_engine
from generation.specs import SamplingSpec, StepSpec, is_count

VLLM_MAX_LOGPROBS = 20
"""vLLM's default ``--max-logprobs``."""
VLLM_MIN_VERSION = "0.11.1"
"""The oldest vLLM this client reads and writes with (``return_token_ids``, ``prompt_logprobs`` in the completions
body; the fixtures ``tests/fixtures/engines/vllm-*.json`` cover 0.11 and 0.34). 0.11.0 tests the length limit before
EOS (``v1/core/sched/utils.py`` ``check_stop``; 0.11.1 tests EOS first): a read (one new token) that draws EOS ends at
``length`` with no text, told from no token by nothing, so the row would decode past the target's end."""


def top_k_of(entries: list[float], k: int, url: str, where: str) -> list[float]:
    """The ``k`` largest of one position's returned log-probs, descending; fewer than ``k`` is refused."""
    if len(entries) < k:
        raise MalformedAnswer(f"server {url} returned {len(entries)} top-k entries at {where}; asked for {k}", url)
    return sorted(entries, reverse=True)[:k]


TOP_K_SLACK = 1
"""A text-keyed top-k answer is asked for this many entries more than the probe reads (:func:`text_keyed_top`)."""
SHARED_TEXTS = ("", "\ufffd")
"""Texts several tokens can read as (llama-cpp-python reads control tokens and the byte tokens of a split character as
"", decoding each alone with ``errors="ignore"``; vLLM and SGLang read such byte tokens as U+FFFD): only entries keyed
by one of them can have lost a log-prob."""


def text_keyed_top(top: dict[str, float], own_text: str, own: float, k: int, url: str, where: str,
                   slack: int = TOP_K_SLACK) -> tuple[list[float], bool]:
    """One position's top-k values from an OpenAI ``top_logprobs`` dict keyed by token TEXT (asked for k + ``slack``
    entries), and whether they may be inexact.

    The server writes its top k + slack into a dict by each token's text, then adds the position's own token (one
    entry more when that token is not among them). Two tokens that read the same share one key and the higher
    log-prob is lost; only texts in :data:`SHARED_TEXTS` can be shared. So fewer than k + slack entries lost one
    (refused, with counts). Exactly k + slack entries, a shared text among them and the own token's log-prob the
    smallest look alike whether the own token ranks k + slack or a lost entry was replaced by the added own token:
    the values are returned and flagged (the caller counts such positions; on the world's GGUF, with one control
    token, nothing can be lost). Otherwise the k largest are exact.

    Raises:
        MalformedAnswer: fewer than k + ``slack`` entries.
    """
    want = k + slack
    if len(top) < want:
        raise MalformedAnswer(
            f"server {url} returned {len(top)} top-k entries at {where}; asked for {want}: the server keys "
            "top_logprobs by token text, so tokens that read the same (llama.cpp reads control tokens as \"\") "
            "share one key and the higher log-prob is lost; serve a model whose likely tokens read differently "
            "(e.g. only EOS a control token), or read with an engine that keys top-k by token id (vLLM "
            "prompt_logprobs, SGLang)", url)
    others = [v for t, v in top.items() if t != own_text]
    unsure = (len(top) == want and own_text in top and bool(others) and own <= min(others)
              and any(t in SHARED_TEXTS for t in top))
    return sorted(top.values(), reverse=True)[:k], unsure


def step_positions(offsets: list[int], texts: list[str], n_prompt: int, context: str, step: str,
                   url: str) -> list[int]:
    """Indices of the step's tokens in an echoed prompt, found by text offsets (the context's length).

    Offsets are anchored at the prompt's end (a server may count a BOS text at the start), so the
    last prompt token ends at ``len(context + step)``.

    Raises:
        MalformedAnswer: no token starts where the step starts (the tokenizer merges the context's end with
            the step's start), or the found tokens do not spell the step.
    """
    if n_prompt < 1 or len(offsets) < n_prompt or len(texts) < n_prompt:
        raise MalformedAnswer(f"server {url} echoed {min(len(offsets), len(texts))} prompt token(s) with offsets; "
                              f"expected {n_prompt} (missing fields)", url)
    shift = offsets[n_prompt - 1] + len(texts[n_prompt - 1]) - len(context + step)
    starts = [offsets[i] - shift for i in range(n_prompt)]
    idx = [i for i in range(n_prompt) if starts[i] >= len(context)]
    if not idx or starts[idx[0]] != len(context):
        raise MalformedAnswer(f"server {url}: no echoed token starts at the step's first character (offset "
                              f"{len(context)}; token starts {starts[-len(idx) - 1:]}): its tokenizer merges the "
                              "context's end with the step's start; end steps at a delimiter the tokenizer splits at",
                              url)
    spelled = "".join(texts[i] for i in idx)
    if spelled != step and not _split_characters(starts, texts, idx, context + step):
        raise MalformedAnswer(f"server {url}: the {len(idx)} echoed step token(s) spell {spelled!r}, not the step "
                              f"{step!r}", url)
    return idx


def _split_characters(starts: list[int], texts: list[str], idx: list[int], prompt: str) -> bool:
    """The step's tokens fall short of spelling it only where bytes of a character split over several read "" or
    U+FFFD (each token decoded alone, as llama-cpp-python does with ``errors="ignore"``), their offsets (the prefix
    decoded whole) in order: each token's text is the step's stretch from its start to the next token's, or lost
    bytes alone."""
    bounds = [starts[i] for i in idx] + [len(prompt)]
    if any(a > b for a, b in zip(bounds, bounds[1:])):
        return False
    return all(texts[i] in ("", prompt[a:b]) or set(texts[i]) == {"\ufffd"} for i, a, b in zip(idx, bounds, bounds[1:]))


def _usage(usage, seconds: float) -> Usage:
    """:class:`Usage` from an OpenAI usage object (``prompt_tokens_details.cached_tokens`` when present)."""
    if usage is None:
        return Usage(0, 0, seconds=seconds)
    cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None)
    prompt = int(usage.prompt_tokens or 0)
    return Usage(prompt, int(usage.completion_tokens or 0), cached,
                 None if cached is None else prompt - int(cached), seconds)


def _after(choice, prompt: str, eos: bool) -> str:
    """The drawn token's text from an echo answer ("" at EOS); vLLM leaves the prompt out with ``return_token_ids``."""
    text = choice.text or ""
    return "" if eos else text[len(prompt):] if text.startswith(prompt) else text


class _Completions:
    """What llama.cpp and vLLM clients share: setup, the request, the echo's step, the written step."""

    name = "?"
    takes_n = True
    """The server answers ``n`` samples in one request (vLLM; llama-cpp-python ignores ``n``)."""
    sampling_extra: dict = {}
    """Request fields this engine needs to sample as the package does (none by default)."""
    top_k_slack = 0
    """Log-probs asked for beyond the probe's k (text-keyed answers need one more, :func:`text_keyed_top`)."""
    unsure_positions = 0
    """Positions whose text-keyed top-k may have lost an entry (:func:`text_keyed_top`), counted over the client's
    life."""

    def __init__(self, url: str, model: str | None = None, **conn):
        connect(self, url, model, **conn)
        self._caps: Capabilities | None = None

    def capabilities(self) -> Capabilities:
        if self._caps is None:
            self._caps = self._probe()
        return self._caps

    def _probe(self) -> Capabilities:
        raise NotImplementedError

    def _check_read(self, top_k: int, hidden: bool) -> None:
        caps = self.capabilities()
        if hidden and not caps.hidden:
            raise EngineError(f"{self.name} server {self.url} returns no hidden states; read 'hidden' from SGLang "
                              "(--enable-return-hidden-states) or train the probe on 'topk_stats'", self.url)
        if not caps.prompt_logprobs:
            raise EngineError(f"{self.name} server {self.url} cannot return prompt log-probs: "
                              + " ".join(caps.remarks), self.url)
        if top_k < 1 or (caps.max_top_k is not None and top_k > caps.max_top_k):
            raise EngineError(f"top_k={top_k}: {self.name} server {self.url} returns 1..{caps.max_top_k} "
                              "log-probs per position", self.url)

    def _create(self, prompt: str, *, max_tokens: int, sampling: SamplingSpec, seed: int, logprobs: int | None,
                echo: bool = False, stop: list[str] | None = None, extra: dict | None = None, n: int | None = None):
        """One ``/v1/completions`` request and its seconds, asked again (up to the connection's retries in all, then
        an EngineError) when the engine aborted or failed it: vLLM answers a request its engine aborted (a shutdown,
        ``/pause``) with HTTP 200 and ``finish_reason`` ``"abort"`` (``v1/engine/__init__.py``
        ``FINISH_REASON_STRINGS``, which also lists ``"error"``), the partial text as if it had ended."""
        fix = (f"start vllm serve with --max-logprobs >= {logprobs}" if self.name == "vllm" and logprobs else "")
        for _ in range(self.conn.retries):
            resp, secs = self.conn.completions(
                fix=fix, model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, seed=seed & 0x7FFFFFFF, logprobs=logprobs, echo=echo, stop=stop,
                extra_body={**self.sampling_extra, **(extra or {})} or None, **({"n": n} if n is not None else {}))
            aborted = [c.finish_reason for c in resp.choices or [] if c.finish_reason in ("abort", "error")]
            if not aborted:
                return resp, secs
        raise EngineError(f"server {self.url} ended a /v1/completions request with finish_reason {aborted[0]!r} "
                          f"{self.conn.retries} time(s) (HTTP 200: its engine aborted or failed it, a restart or a "
                          "pause); check its log", self.url)

    def _choice(self, resp):
        if not resp.choices:
            raise MalformedAnswer(f"server {self.url} returned no choice", self.url)
        return resp.choices[0]

    def _logprobs(self, choice) -> dict:
        lp = choice.logprobs
        lp = lp.model_dump() if hasattr(lp, "model_dump") else lp
        if not lp or any(lp.get(f) is None for f in ("tokens", "text_offset", "token_logprobs", "top_logprobs")):
            raise MalformedAnswer(f"server {self.url} returned no logprobs (tokens, text_offset, token_logprobs, "
                                  "top_logprobs) for a request that asked for them", self.url)
        return lp

    def _echo_step(self, lp: dict, idx: list[int], k: int, tops: list[list[float]] | None,
                   ids: list[int] | None, slack: int | None = None) -> TokenLogprobs:
        own = [lp["token_logprobs"][i] for i in idx]
        if any(v is None for v in own):
            raise MalformedAnswer(f"server {self.url} returned no log-prob for {sum(v is None for v in own)} of the "
                                  f"step's {len(idx)} token(s) (the first prompt position has none: give a non-empty "
                                  "context)", self.url)
        if tops is None:
            slack = self.top_k_slack if slack is None else slack
            got = [text_keyed_top(lp["top_logprobs"][i] or {}, lp["tokens"][i], v, k, self.url, f"step token {j}",
                                  slack) for j, (i, v) in enumerate(zip(idx, own))]
            tops = [t for t, _ in got]
            self.unsure_positions += sum(u for _, u in got)
        top = [top_k_of(t, k, self.url, f"step token {j}") for j, t in enumerate(tops)]
        return TokenLogprobs([lp["tokens"][i] for i in idx], ids, torch.tensor(own, dtype=torch.float32),
                             torch.tensor(top, dtype=torch.float32).reshape(len(idx), k))

    def read(self, context: str, step: str, *, top_k: int, hidden: bool, sampling: SamplingSpec,
             seed: int) -> Reading:
        """The echo request (the module docstring): the step's tokens found among the echoed ones, their top-k
        (:meth:`_echo_top`) and the drawn token after them."""
        self._check_read(top_k, hidden)
        resp, secs = self._create(context + step, max_tokens=1, sampling=sampling, seed=seed,
                                  logprobs=top_k + self.top_k_slack, echo=True, extra=self._read_extra(top_k))
        choice = self._choice(resp)
        lp = self._logprobs(choice)
        generated = int(getattr(resp.usage, "completion_tokens", 0) or 0)
        n_prompt = len(lp["tokens"]) - generated
        try:
            idx = step_positions(lp["text_offset"], lp["tokens"], n_prompt, context, step, self.url)
        except MalformedAnswer:
            idx = self._positions_by_ids(context, choice, n_prompt)
            if idx is None:
                raise
        tops, ids, eos = self._echo_top(choice, idx)
        return Reading(self._echo_step(lp, idx, top_k, tops, ids), None, _after(choice, context + step, eos), eos,
                       _usage(resp.usage, secs))

    def _read_extra(self, top_k: int) -> dict | None:
        """Request fields a read adds for this engine (none by default)."""
        return None

    def _echo_top(self, choice, idx: list[int]) -> tuple[list[list[float]] | None, list[int] | None, bool]:
        """The step's top-k by id (None: read from the text-keyed ``top_logprobs``), its ids (None: unknown), and
        whether the drawn token is EOS."""
        return None, None, choice.finish_reason == "stop"

    def _positions_by_ids(self, context: str, choice, n_prompt: int) -> list[int] | None:
        """The step's indices found by token ids when the echoed texts do not add up; None: the engine cannot."""
        return None

    def _counts(self, route: str, field: str, texts: list[str]) -> list[int]:
        """One ``POST route`` per text (sent as ``field``), and the ``count`` of tokens each answer states."""
        out = []
        for text in texts:
            got, _ = self.conn.post(route, {"model": self.model, field: text}, route)
            count = got.get("count") if isinstance(got, dict) else None
            if not isinstance(count, int):
                raise MalformedAnswer(f"server {self.url} answered {route} without an integer count", self.url)
            out.append(count)
        return out

    # -- writing --------------------------------------------------------------------------------

    def write(self, context: str, *, step: StepSpec | None, max_tokens: int, sampling: SamplingSpec, seed: int,
              top_k: int | None = None, n: int | None = None) -> Written | list[Written]:
        if n is not None and not self.takes_n:  # one request per sample, seeded as vLLM seeds a request's children
            return [self.write(context, step=step, max_tokens=max_tokens, sampling=sampling, seed=seed + j,
                               top_k=top_k) for j in range(n)]
        if n is not None and sampling.greedy:  # greedy samples are one: vLLM refuses n > 1 at a temperature below
            w = self.write(context, step=step, max_tokens=max_tokens, sampling=sampling, seed=seed, top_k=top_k)
            return [w] + [replace(w, usage=Usage(0, 0))] * (n - 1)  # 1e-5 (_verify_greedy_sampling)
        stops = list(step.delimiters) if step is not None else None
        asked = self._write_logprobs(top_k, stops)
        resp, secs = self._create(context, max_tokens=max_tokens, sampling=sampling, seed=seed, logprobs=asked,
                                  stop=stops, extra={"include_stop_str_in_output": True} if stops else None, n=n)
        choices = sorted(resp.choices or [], key=lambda c: c.index) if n is not None else [self._choice(resp)]
        if len(choices) != (n or 1):
            raise MalformedAnswer(f"server {self.url} returned {len(choices)} choice(s) (choices); asked for n={n}",
                                  self.url)
        usage = _usage(resp.usage, secs)  # a request's usage: on its first sample
        out = [self._written(c, stops or [], top_k, asked, usage if j == 0 else Usage(0, 0))
               for j, c in enumerate(choices)]
        return out if n is not None else out[0]

    def _written(self, choice, stops: list[str], top_k: int | None, asked: int | None, usage: Usage) -> Written:
        text, how = self._ending(choice, stops)
        tokens = None
        if top_k:
            lp = self._logprobs(choice)
            first = lp["text_offset"][0] if lp["text_offset"] else 0  # llama.cpp counts from the prompt's start
            idx = [i for i, o in enumerate(lp["text_offset"]) if o - first < len(text)]
            tokens = self._echo_step(lp, idx, top_k, None, None, slack=(asked or top_k) - top_k)
        return Written(text, how, tokens, usage)

    def _write_logprobs(self, top_k: int | None, stops: list[str] | None) -> int | None:
        return top_k + self.top_k_slack if top_k else None

    def _ending(self, choice, stops: list[str]) -> tuple[str, str]:
        """The written text (its delimiter put back when the server cut it) and how it ended."""
        text = choice.text or ""
        if choice.finish_reason == "length":
            return text, "length"
        if any(text.endswith(d) for d in stops):
            return text, "delimiter"
        hit = self._cut_delimiter(choice, text, stops) if stops else None
        return (text + hit, "delimiter") if hit is not None else (text, "eos")

    def _cut_delimiter(self, choice, text: str, stops: list[str]) -> str | None:
        """The delimiter the server cut off ``text``, or None (the step ended at EOS)."""
        raise NotImplementedError


class LlamaCppEngine(_Completions):
    """A client of llama-cpp-python's server (``python -m llama_cpp.server``).

    Args:
        url: its base URL (``http://127.0.0.1:8811/v1``).
        model: the model alias it serves; None = the one it lists.
        n_ctx: the context the server was started with (its ``--n_ctx``), which llama-cpp-python states nowhere;
            None: unknown, so a row near the context's end ends with the server's refusal (``error``) instead of
            stopping at the context (``context``).
        api_key_env, timeout, retries: as :class:`~generation.engines.connection.Connection`.

    Raises:
        ValueError: an ``n_ctx`` that is not an integer >= 1.
        EngineError: the server does not answer ``/v1/models`` or does not serve ``model``.
    """

    name = "llama.cpp"
    takes_n = False
    top_k_slack = TOP_K_SLACK
    sampling_extra = NEUTRAL_SAMPLING["llama.cpp"]
    """llama-cpp-python samples with top-k 40, min-p 0.05 and a repeat penalty of 1.1 unless told otherwise; these
    turn all three off, so greedy text equals the in-process greedy text (its top-p still cuts the untempered
    distribution, before the temperature, where the package's sampler cuts the tempered one)."""

    def __init__(self, url: str, model: str | None = None, *, n_ctx: int | None = None, **conn):
        if n_ctx is not None and not is_count(n_ctx):
            raise ValueError(f"n_ctx={n_ctx!r}: expected the server's context in tokens (an integer >= 1), or None")
        super().__init__(url, model, **conn)
        self.context_length = n_ctx
        if self.version is None:  # llama-cpp-python has no /version; its FastAPI app states it in /openapi.json
            info = (self.conn.get("/openapi.json") or {}).get("info") or {}
            self.version = f"llama-cpp-python {info['version']}" if isinstance(info.get("version"), str) else None

    def _probe(self) -> Capabilities:
        if self.conn.get("/props") is not None:
            why = (f"{self.url} is llama.cpp's C++ llama-server, which returns log-probs of generated tokens only "
                   "(no echo); serve the GGUF with llama-cpp-python (python -m llama_cpp.server) to read steps")
            return Capabilities(False, None, False, None, (why,))
        try:
            got, _ = self.conn.post("/extras/tokenize", {"input": "", "model": self.model}, "/extras/tokenize")
        except EngineError:  # no such route: another engine's server, given as llama.cpp
            if (why := other_engine(self.conn, "llama.cpp")) is not None:
                raise Unsupported(why, self.url) from None
            raise
        if not isinstance(got, dict) or not isinstance(got.get("tokens"), list):
            raise MalformedAnswer(f"server {self.url} answered /extras/tokenize without a token list", self.url)
        if not got["tokens"]:
            why = (f"the model at {self.url} adds no BOS token, and llama-cpp-python's echo then pairs every prompt "
                   "token with the previous position's log-probs (llama_cpp/llama.py _create_completion); serve a "
                   "GGUF whose tokenizer adds BOS (tokenizer.ggml.add_bos_token = true) to read steps")
            return Capabilities(False, None, False, None, (why,))
        return Capabilities(True, None, False, None)

    def prompt_tokens(self, texts: list[str]) -> list[int] | None:
        """One ``POST /extras/tokenize/count`` per text (llama-cpp-python tokenizes it as a completion's prompt: BOS
        where the model adds one, special tokens read), where the context is known (``n_ctx``); else None."""
        return None if self.context_length is None else self._counts("/extras/tokenize/count", "input", texts)

    def _write_logprobs(self, top_k: int | None, stops: list[str] | None) -> int | None:
        # The server cuts the stop string off the text but keeps its tokens in the logprobs: asking for them
        # (k = 0 when none are wanted) tells a delimiter from EOS.
        return top_k + self.top_k_slack if top_k else (0 if stops else None)

    def _cut_delimiter(self, choice, text: str, stops: list[str]) -> str | None:
        """The stop string the server cut off ``text``, from the tokens it keeps in the log-probs past the text, found
        by their offsets: a token holding bytes of a character split over several reads "" (llama-cpp-python decodes
        each alone with ``errors="ignore"``), so the joined token texts fall short of the text before the cut."""
        lp = self._logprobs(choice)
        first = lp["text_offset"][0] if lp["text_offset"] else 0  # llama.cpp counts from the prompt's start
        rest = "".join(t[max(0, len(text) - (o - first)):] for t, o in zip(lp["tokens"], lp["text_offset"])
                       if o - first + len(t) > len(text))
        return max((d for d in stops if rest.startswith(d)), key=len, default=None)


class VLLMEngine(_Completions):
    """A client of vLLM's OpenAI server (``vllm serve``).

    Args:
        url: its base URL (``http://127.0.0.1:8000/v1``).
        model: the model name it serves; None = the one it lists.
        max_logprobs: the server's ``--max-logprobs`` (vLLM does not report it; default 20).
        api_key_env, timeout, retries: as :class:`~generation.engines.connection.Connection`.

    Raises:
        EngineError: the server does not answer ``/v1/models`` or does not serve ``model``.
    """

    name = "vllm"
    sampling_extra = {**NEUTRAL_SAMPLING["vllm"], "return_tokens_as_token_ids": False}
    """vLLM fills every sampling field a request leaves out from the model's ``generation_config.json``
    (``--generation-config auto``): these state ``top_k``, ``min_p``, ``repetition_penalty`` and both penalties as the
    package's sampler uses them (off). And the log-probs' tokens as texts: a server started with
    ``--return-tokens-as-token-ids`` writes them ``"token_id:N"`` unless the request says otherwise
    (``serving_completion.py``: the request's field, else the server's flag), and the written tokens' offsets would
    count those strings."""

    def __init__(self, url: str, model: str | None = None, *, max_logprobs: int | None = VLLM_MAX_LOGPROBS, **conn):
        super().__init__(url, model, **conn)
        if self.version is None and (why := other_engine(self.conn, "vllm")) is not None:  # no /version: not vLLM?
            raise Unsupported(why, self.url)
        at_least(self, self.version, VLLM_MIN_VERSION, "vLLM")
        self.max_logprobs = max_logprobs

    def _probe(self) -> Capabilities:
        why = (f"vLLM returns no hidden states over HTTP (RFCs #24288, #48743); its log-probs are capped by "
               f"--max-logprobs (here {self.max_logprobs}), and prompt log-probs skip its prefix cache")
        return Capabilities(True, self.max_logprobs, False, None, (why,))

    def _read_extra(self, top_k: int) -> dict | None:
        return {"prompt_logprobs": top_k, "return_token_ids": True}

    def _echo_top(self, choice, idx: list[int]) -> tuple[list[list[float]] | None, list[int] | None, bool]:
        extra_fields = choice.model_extra or {}
        prompt = extra_fields.get("prompt_logprobs")
        if not isinstance(prompt, list) or len(prompt) <= idx[-1]:
            raise MalformedAnswer(f"server {self.url} returned {len(prompt) if isinstance(prompt, list) else 0} "
                                  f"prompt_logprobs rows; the step needs rows up to {idx[-1] + 1}", self.url)
        tops = [[float(e["logprob"]) for e in (prompt[i] or {}).values()] for i in idx]
        ids = extra_fields.get("prompt_token_ids")
        ids = [int(ids[i]) for i in idx] if isinstance(ids, list) and len(ids) > idx[-1] else None
        # stop_reason: None at EOS, the token id of an end-of-turn id the generation config lists (an int), the
        # matched string of a stop string (none is sent here)
        eos = choice.finish_reason == "stop" and not isinstance(extra_fields.get("stop_reason"), str)
        return tops, ids, eos

    def prompt_tokens(self, texts: list[str]) -> list[int]:
        """One ``POST /tokenize`` per text (``TokenizeCompletionRequest``: the prompt as a completion reads it, special
        tokens added); its ``count``."""
        return self._counts("/tokenize", "prompt", texts)

    def _positions_by_ids(self, context: str, choice, n_prompt: int) -> list[int] | None:
        """vLLM 0.11 decodes each echoed id alone, so SentencePiece spaces and the bytes of a split UTF-8 character do
        not add up to the prompt: the step is found by ids instead, the context's ids from ``POST /tokenize`` (one
        more request, only for such a prompt) against ``prompt_token_ids`` (``return_token_ids``)."""
        ids = (choice.model_extra or {}).get("prompt_token_ids")
        got, _ = self.conn.post("/tokenize", {"model": self.model, "prompt": context}, "/tokenize")
        ctx = got.get("tokens") if isinstance(got, dict) else None
        if not isinstance(ids, list) or not isinstance(ctx, list):
            raise MalformedAnswer(f"server {self.url} answered without prompt_token_ids or /tokenize without tokens; "
                                  "the echoed texts do not add up to the prompt, so the step cannot be found", self.url)
        if ids[:len(ctx)] != ctx or not len(ctx) < n_prompt:
            raise MalformedAnswer(f"server {self.url}: the context's {len(ctx)} token id(s) (/tokenize) are not a "
                                  f"prefix of the prompt's {n_prompt} (prompt_token_ids): its tokenizer merges the "
                                  "context's end with the step's start; end steps at a delimiter the tokenizer splits "
                                  "at", self.url)
        return list(range(len(ctx), n_prompt))

    def _write_logprobs(self, top_k: int | None, stops: list[str] | None) -> int | None:
        # Written tokens' top_logprobs are keyed by text (prompt_logprobs, by id, exist for prompts only): two tokens
        # that read alike share a key. One entry more, when --max-logprobs allows, tells a lost entry from a full
        # answer (text_keyed_top), as for llama.cpp.
        if not top_k:
            return None
        return top_k + (self.max_logprobs is None or top_k < self.max_logprobs)

    def _cut_delimiter(self, choice, text: str, stops: list[str]) -> str | None:
        reason = (choice.model_extra or {}).get("stop_reason")
        return reason if isinstance(reason, str) else None  # include_stop_str_in_output ignored: put it back
