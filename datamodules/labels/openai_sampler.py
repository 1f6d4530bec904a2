"""The ``openai`` step sampler: any OpenAI-compatible ``/v1/completions`` server writes the steps.

vLLM (``vllm serve``), SGLang (``python -m sglang.launch_server``) and the llama.cpp server
(``python -m llama_cpp.server``) all speak this protocol. Each request asks for ``n`` samples of one
prefix with the build's temperature, top-p, ``max_tokens`` = the step cap, the step delimiters as
``stop`` and a seed of its own. Requests run concurrently (at most ``concurrency`` in flight),
spread round-robin over the role's endpoints; the client's timeout and retries are bounded.

A server that returns fewer samples than ``n`` (the llama.cpp server ignores ``n``) is noticed on
its first answer: the missing samples are asked for one per request with distinct seeds, and from
then on that endpoint gets one request per sample.

Every request states the whole distribution: temperature, top-p and the engine's own neutral top-k, min-p and
repetition penalty (:data:`~generation.engines.NEUTRAL_SAMPLING`; the engine is told from its routes), since vLLM
and SGLang fill unset fields from the model's ``generation_config.json`` and llama-cpp-python from its own
defaults. A server that is none of the three gets temperature and top-p alone, with a warning.

Requests go through :class:`~generation.engines.connection.Connection` (one per URL): its retries, timeouts and key
handling; a failure raises an :class:`~generation.engines.base.EngineError` subclass naming the URL, never the key.
"""

from __future__ import annotations

import itertools
import warnings
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

from generation.engines import NEUTRAL_SAMPLING
from generation.engines.base import MalformedAnswer
from generation.engines.connection import Connection, identify
from generation.handover import prompt_text
from generation.specs import SamplingSpec, StepSpec
from datamodules.labels.samplers import StepSampler, request_seed, step_from_text

DEFAULT_EXTRA_BODY = {"include_stop_str_in_output": True, "no_stop_trim": True}
"""Asks vLLM (``include_stop_str_in_output``) and SGLang (``no_stop_trim``) to keep the stop string in the text;
servers that do not know a field ignore it, and the delimiter is then put back (:func:`step_from_text`)."""


class OpenAISampler(StepSampler):
    """Steps sampled by OpenAI-compatible servers, returned in the role's token ids.

    Args:
        urls: base URLs serving the model, e.g. ``["http://127.0.0.1:8000/v1"]``; several spread the load.
        model: the model name the servers expect; None = the one model the first server lists.
        tokenizer, delimiters, max_step_tokens, temperature, top_p: as :class:`StepSampler`.
        api_key_env: environment variable holding the API key ("" or unset: no key).
        concurrency: requests in flight at most.
        timeout: seconds per request attempt.
        retries: attempts per request (connection errors, timeouts, 429 and 5xx are retried with backoff).
        prompt: send the prefix as ``text`` (every server) or as ``tokens`` (vLLM, SGLang: no re-tokenization).
        extra_body: extra request fields (default :data:`DEFAULT_EXTRA_BODY`; ``{}`` sends none).
        rank: this process's rank; ranks start the round-robin at different endpoints.

    Raises:
        ImportError: the ``openai`` client is not installed.
        ValueError: a bad argument.
        EngineError: the first server cannot be reached (``Unreachable``) or does not serve ``model``
            (``Unsupported``, naming what it serves), naming the URL, never the key.
    """

    backend = "openai"

    def __init__(self, urls: list[str], model: str | None, tokenizer, step: StepSpec, sampling: SamplingSpec,
                 *, api_key_env: str = "OPENAI_API_KEY", concurrency: int = 8, timeout: float = 120.0,
                 retries: int = 3, prompt: str = "text", extra_body: dict | None = None, rank: int = 0):
        super().__init__(tokenizer, step, sampling)
        if not urls:
            raise ValueError("urls is empty: give the base URL of at least one server, e.g. http://127.0.0.1:8000/v1")
        if prompt not in ("text", "tokens"):
            raise ValueError(f"prompt={prompt!r}: expected 'text' or 'tokens'")
        if concurrency < 1 or retries < 1 or timeout <= 0:
            raise ValueError(f"concurrency={concurrency}, retries={retries} (both >= 1), timeout={timeout} (> 0)")
        self.urls = [u.rstrip("/") for u in urls]
        self.conns = [Connection(u, api_key_env=api_key_env, timeout=timeout, retries=retries) for u in self.urls]
        self.concurrency, self.retries, self.prompt = concurrency, retries, prompt
        self.extra_body = dict(DEFAULT_EXTRA_BODY if extra_body is None else extra_body)
        self.ignores_n = [False] * len(self.urls)
        self._round_robin = itertools.islice(itertools.cycle(range(len(self.urls))), rank % len(self.urls), None)
        self.requests = self.generated_tokens = 0
        self.model = self.conns[0].check_model(model)
        self.engine, self.server_version = identify(self.conns[0])
        self.sampling_fields = dict(NEUTRAL_SAMPLING.get(self.engine or "", {}))
        if self.engine is None:
            warnings.warn(f"sampling server {self.urls[0]} is not vLLM, SGLang or llama-cpp-python: only temperature "
                          "and top_p are sent, and its own defaults for top_k, min_p and repetition penalty apply",
                          stacklevel=2)

    # -- sampling -------------------------------------------------------------------------------

    def _prompt(self, ids: list[int]) -> str | list[int]:
        return list(ids) if self.prompt == "tokens" else prompt_text(self.tokenizer, ids)

    def _request(self, k: int, prompt, count: int, seed: int, step: bool = True,
                 max_tokens: int | None = None) -> tuple[list[Any], Any]:
        """One completions request to endpoint ``k``: its choices (by index) and usage.

        ``step=False`` asks for a continuation without stop strings (a whole trace, up to ``max_tokens``).
        """
        extra = {**self.sampling_fields, **(self.extra_body if step else {})}
        resp, _ = self.conns[k].completions(
            f"/v1/completions (model {self.model!r})", model=self.model, prompt=prompt, n=count,
            temperature=self.sampling.temperature, top_p=self.sampling.top_p,
            max_tokens=max_tokens or self.max_step_tokens,
            stop=self.stops if step else None, seed=seed, extra_body=extra or None)
        return sorted(resp.choices or [], key=lambda c: c.index), resp.usage

    def _step(self, choice, generated: int | None) -> list[int]:
        extra = choice.model_extra or {}
        reason = extra.get("stop_reason", extra.get("matched_stop", "unknown"))
        ids, how = step_from_text(self.tokenizer, choice.text or "", choice.finish_reason, self.stops,
                                  stop_reason=reason, generated_tokens=generated)
        self.step_ends[how] += 1
        return ids

    def sample(self, contexts, n, seed):
        prompts = [self._prompt(c) for c in contexts]
        out: list[list[list[int] | None]] = [[None] * n for _ in contexts]
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures: dict = {}

            def submit(i: int, first: int, count: int) -> None:
                k = next(self._round_robin)
                if self.ignores_n[k] and count > 1:  # known to ignore n: one request per sample
                    for j in range(first, first + count):
                        submit(i, j, 1)
                    return
                futures[pool.submit(self._request, k, prompts[i], count, request_seed(seed, i, first))] = (i, first,
                                                                                                          count, k)

            for i in range(len(contexts)):
                submit(i, 0, n)
            try:
                while futures:
                    done, _ = wait(futures, return_when=FIRST_COMPLETED)
                    for f in done:
                        i, first, count, k = futures.pop(f)
                        choices, usage = f.result()
                        self.requests += 1
                        self.generated_tokens += getattr(usage, "completion_tokens", 0) or 0
                        if not choices:
                            raise MalformedAnswer(f"sampling server {self.urls[k]} returned no choice (choices) for "
                                                  "a prompt", self.conns[k].root)
                        if len(choices) < count:  # the server ignores n: ask for the rest one at a time
                            self.ignores_n[k] = True
                            for j in range(first + len(choices), first + count):
                                submit(i, j, 1)
                        single = len(choices) == 1 and usage is not None
                        for j, c in enumerate(choices[:count]):
                            out[i][first + j] = self._step(c, usage.completion_tokens if single else None)
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        self.samples += n * len(contexts)
        return out  # type: ignore[return-value]

    def complete(self, contexts, max_new_tokens, seed):
        prompts = [self._prompt(c) for c in contexts]
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = [pool.submit(self._request, next(self._round_robin), p, 1, request_seed(seed, i, 0), False,
                                   max_new_tokens) for i, p in enumerate(prompts)]
            try:
                answers = [f.result() for f in futures]
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        self.requests += len(answers)
        self.generated_tokens += sum(getattr(u, "completion_tokens", 0) or 0 for _, u in answers)
        return [(choices[0].text or "") if choices else "" for choices, _ in answers]

    def provenance(self):
        return {"backend": "openai", "model": self.model, "urls": self.urls, "engine": self.engine,
                "server_version": self.server_version, "prompt": self.prompt, "stops": self.stops,
                "sampling_fields": self.sampling_fields}

    def stats(self):
        return {**super().stats(), "requests": self.requests, "generated_tokens": self.generated_tokens,
                "ignores_n": [u for u, x in zip(self.urls, self.ignores_n) if x]}
