"""Engine client of SGLang's native ``POST /generate`` (``python -m sglang.launch_server``).

A read sends context + step as the server's own token ids with ``logprob_start_len`` = the step's
first token, ``max_new_tokens: 1``, ``top_logprobs_num: k`` and, when asked, ``return_hidden_states``.
The radix cache is reused up to ``logprob_start_len``, so a cached context is not prefilled again and
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

Hidden rows are AFTER the model's final norm (``"final_norm"``, as transformers' last
``hidden_states`` entry): in ``python/sglang/srt/models/llama.py`` ``LlamaModel.forward`` ends with
``hidden_states, _ = self.norm(hidden_states, residual)`` and ``LlamaForCausalLM.forward`` passes that
to ``LogitsProcessor``, whose ``capture_hidden_mode`` FULL stores those very rows
(``python/sglang/srt/layers/logits_processor.py``, ``hidden_states_to_store = hidden_states``); the
other model files follow the same pattern (an EAGLE-3 draft's auxiliary layers are the exception,
and are not what ``/generate`` returns for a plain server).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from generation.engines import HIDDEN_NORM
from generation.engines.base import Capabilities, EngineError, MalformedAnswer, Reading, TokenLogprobs, Usage, Written
from generation.engines.connection import connect
from generation.engines.openai_compat import top_k_of
from generation.specs import SamplingSpec, StepSpec


KNOWN_TEXTS = 4096
"""Texts whose server token ids an :class:`SGLangEngine` keeps: a step read after a context it has seen (the previous
step + the bonus token, or a step the server wrote) needs no ``/v1/tokenize`` call, so a kept step costs two requests
(the draft's write, this read) and a refused one three."""


class SGLangEngine:
    """A client of one SGLang server.

    Args:
        url: its base URL (``http://127.0.0.1:30000``, with or without ``/v1``).
        model: the model name it serves; None = the one it lists.
        api_key_env, timeout, retries: as :class:`~generation.engines.connection.Connection`.

    Raises:
        EngineError: the server does not answer ``/v1/models`` or does not serve ``model``.
    """

    name = "sglang"

    def __init__(self, url: str, model: str | None = None, *, api_key_env: str = "OPENAI_API_KEY",
                 timeout: float = 120.0, retries: int = 3):
        connect(self, url, model, api_key_env=api_key_env, timeout=timeout, retries=retries)
        self._caps: Capabilities | None = None
        self._known: OrderedDict[str, list[int]] = OrderedDict()

    def capabilities(self) -> Capabilities:
        if self._caps is None:
            info = self.conn.get("/get_server_info") or self.conn.get("/server_info")
            if not isinstance(info, dict):
                raise EngineError(f"server {self.url} did not answer /get_server_info; is it an SGLang server?", self.url)
            self.version = self.version or info.get("version")
            hidden = bool(info.get("enable_return_hidden_states", False))
            why = () if hidden else (f"SGLang server {self.url} was started without --enable-return-hidden-states; "
                                     "restart it with that flag to read 'hidden'",)
            self._caps = Capabilities(True, None, hidden, HIDDEN_NORM["sglang"] if hidden else None,
                                      not info.get("disable_radix_cache", False), why)
        return self._caps

    # -- requests -------------------------------------------------------------------------------

    def _generate(self, body: dict) -> tuple[dict, dict, float]:
        got, secs = self.conn.post("/generate", body, "/generate")
        if isinstance(got, list) and len(got) == 1:
            got = got[0]
        if not isinstance(got, dict) or not isinstance(got.get("meta_info"), dict):
            raise MalformedAnswer(f"server {self.url} answered /generate without meta_info", self.url)
        return got, got["meta_info"], secs

    def _remember(self, text: str, ids: list[int]) -> None:
        """The server's ids of a text this client has seen it tokenize (the newest :data:`KNOWN_TEXTS` kept)."""
        self._known[text] = ids
        self._known.move_to_end(text)
        while len(self._known) > KNOWN_TEXTS:
            self._known.popitem(last=False)

    def _ids(self, context: str, step: str) -> tuple[list[int], int]:
        """The server's ids of context + step and the index of the step's first token (one ``/v1/tokenize``)."""
        got, _ = self.conn.post("/v1/tokenize", {"model": self.model, "prompt": [context, context + step]},
                                "/v1/tokenize")
        tokens = got.get("tokens") if isinstance(got, dict) else None
        if not isinstance(tokens, list) or len(tokens) != 2:
            raise MalformedAnswer(f"server {self.url} answered /v1/tokenize of 2 texts without 2 token lists", self.url)
        ctx, full = tokens
        if not ctx or full[:len(ctx)] != ctx or len(full) == len(ctx):
            raise MalformedAnswer(f"server {self.url}: the context's {len(ctx)} token(s) are not a prefix of context + "
                                  f"step's {len(full)}: its tokenizer merges the context's end with the step's start "
                                  "(or the context or the step is empty)", self.url)
        self._remember(context, [int(i) for i in ctx])
        return [int(i) for i in full], len(ctx)

    def _sampling(self, sampling: SamplingSpec, seed: int, max_new_tokens: int) -> dict:
        return {"max_new_tokens": max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "sampling_seed": seed & 0x7FFFFFFF}

    def _usage(self, meta: dict, secs: float) -> Usage:
        prompt, cached = int(meta.get("prompt_tokens", 0)), meta.get("cached_tokens")
        return Usage(prompt, int(meta.get("completion_tokens", 0)), None if cached is None else int(cached),
                     None if cached is None else prompt - int(cached), secs)

    def _logprobs(self, rows, tops, n: int, k: int, what: str) -> TokenLogprobs:
        """``n`` positions of ``[logprob, id, text]`` rows and their top-k lists, refused when short."""
        rows, tops = rows or [], tops or []
        if len(rows) < n or (k and len(tops) < n):
            raise MalformedAnswer(f"server {self.url} returned {len(rows)} {what} log-prob rows and {len(tops)} top-k "
                                  f"rows; expected {n}", self.url)
        rows, tops = rows[len(rows) - n:], tops[len(tops) - n:] if k else [[]] * n
        if any(r is None or r[0] is None for r in rows):
            raise MalformedAnswer(f"server {self.url} returned no log-prob for some of the {n} {what} tokens", self.url)
        top = [top_k_of([float(e[0]) for e in (t or [])], k, self.url, f"{what} token {j}") for j, t in enumerate(tops)]
        return TokenLogprobs([str(r[2]) if len(r) > 2 and r[2] is not None else "" for r in rows],
                             [int(r[1]) for r in rows], torch.tensor([float(r[0]) for r in rows]),
                             torch.tensor(top, dtype=torch.float32).reshape(n, k))

    def _hidden(self, meta: dict, n: int) -> torch.Tensor:
        """The step's last-layer rows: the last ``n`` rows the prefill returned."""
        rows = [r for part in meta.get("hidden_states") or [] if part and isinstance(part[0], list) for r in part]
        if len(rows) < n:
            raise MalformedAnswer(f"server {self.url} returned {len(rows)} hidden row(s) for a step of {n} token(s)",
                                  self.url)
        return torch.tensor(rows[len(rows) - n:], dtype=torch.float32)

    # -- the Engine protocol ----------------------------------------------------------------------

    def read(self, context: str, step: str, *, top_k: int, hidden: bool, sampling: SamplingSpec,
             seed: int) -> Reading:
        if hidden and not self.capabilities().hidden:
            raise EngineError(" ".join(self.capabilities().remarks), self.url)
        if top_k < 1:
            raise ValueError(f"top_k={top_k}: expected >= 1")
        known = self._known.get(context)
        got = self._read_known(context, step, known, top_k, hidden, sampling, seed) if known else None
        if got is None:  # the context's ids are not known, or the server split context + step elsewhere
            ids, start = self._ids(context, step)
            got = self._read_ids(ids, start, top_k, hidden, sampling, seed)
        tokens, meta, got_text, secs = got
        finish = meta.get("finish_reason") or {}
        eos = finish.get("type") == "stop"
        n = len(tokens.tokens)
        ctx_ids = self._known.get(context) or []
        self._remember(context + step, ctx_ids + list(tokens.ids or []))
        nxt = meta.get("output_token_logprobs") or []
        if not eos and len(nxt) == 1 and nxt[0] and len(nxt[0]) > 1:
            self._remember(context + step + got_text, self._known[context + step] + [int(nxt[0][1])])
        return Reading(tokens, self._hidden(meta, n) if hidden else None, "" if eos else got_text, eos,
                       self._usage(meta, secs))

    def _read_body(self, top_k: int, hidden: bool, sampling: SamplingSpec, seed: int) -> dict:
        return {"sampling_params": self._sampling(sampling, seed, 1), "return_logprob": True, "top_logprobs_num": top_k,
                "return_hidden_states": bool(hidden), "return_text_in_logprobs": True}

    def _read_ids(self, ids: list[int], start: int, top_k: int, hidden: bool, sampling: SamplingSpec, seed: int):
        """Read with the step's token ids known: exact."""
        got, meta, secs = self._generate({"input_ids": ids, "logprob_start_len": start,
                                          **self._read_body(top_k, hidden, sampling, seed)})
        tokens = self._logprobs(meta.get("input_token_logprobs"), meta.get("input_top_logprobs"), len(ids) - start,
                                top_k, "step")
        return tokens, meta, str(got.get("text", "")), secs

    def _read_known(self, context: str, step: str, known: list[int], top_k: int, hidden: bool,
                    sampling: SamplingSpec, seed: int):
        """Read without a ``/v1/tokenize`` call when the context's ids are known from an earlier answer: the server
        tokenizes context + step and returns the rows from the context's end; None when those rows do not spell
        the step (the server's tokenizer merged across the boundary), and the caller asks for the ids."""
        got, meta, secs = self._generate({"text": context + step, "logprob_start_len": len(known),
                                          **self._read_body(top_k, hidden, sampling, seed)})
        rows = meta.get("input_token_logprobs") or []
        if not rows or _spelled(rows) != step:
            return None
        tokens = self._logprobs(rows, meta.get("input_top_logprobs"), len(rows), top_k, "step")
        return tokens, meta, str(got.get("text", "")), secs

    def write(self, context: str, *, step: StepSpec | None, max_tokens: int, sampling: SamplingSpec, seed: int,
              top_k: int | None = None) -> Written:
        params = self._sampling(sampling, seed, max_tokens)
        if step is not None:
            params.update(stop=list(step.delimiters), no_stop_trim=True)
        known = self._known.get(context)
        body = {"input_ids": known} if known else {"text": context}
        body.update(sampling_params=params, return_logprob=True, top_logprobs_num=top_k or 0,
                    return_text_in_logprobs=True)  # the written ids: the next read after this text needs no tokenize
        got, meta, secs = self._generate(body)
        text, finish = str(got.get("text", "")), meta.get("finish_reason") or {}
        matched = finish.get("matched")
        if finish.get("type") == "length":
            how = "length"
        elif isinstance(matched, str) and step is not None:
            how, text = "delimiter", text if text.endswith(matched) else text + matched
        else:
            how = "eos"
        tokens = None
        if top_k:
            n = int(meta.get("completion_tokens", 0)) - (how == "eos")  # the EOS token is not in the text
            rows, tops = meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or []
            tokens = self._logprobs(rows[:n], tops[:n], n, top_k, "written")
        out = meta.get("output_token_logprobs") or []
        if known and how != "eos" and _spelled(out) == text:
            self._remember(context + text, known + [int(r[1]) for r in out])
        return Written(text, how, tokens, self._usage(meta, secs))


def _spelled(rows: list) -> str:
    """The text ``[logprob, id, text]`` rows spell (``return_text_in_logprobs``)."""
    return "".join(str(r[2]) for r in rows if r and len(r) > 2 and r[2] is not None)
