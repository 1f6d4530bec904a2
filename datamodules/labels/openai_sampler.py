"""The ``openai`` step sampler: each role's servers write the steps, through the package's engine clients.

The servers are vLLM (``vllm serve``), SGLang (``python -m sglang.launch_server``) or llama-cpp-python
(``python -m llama_cpp.server``), named by ``engine`` or told from their routes. Each prefix's ``n`` samples are one
:meth:`~generation.engines.base.Engine.write` with ``n``: the step's delimiters as stops, ``max_tokens`` = the step
cap, sample ``j`` seeded ``seed + j`` (one vLLM request, one SGLang batch; llama-cpp-python ignores ``n``: one
request a sample, each seeded apart);
what the engine clients do for every served path holds here too: the whole distribution stated (no server default
leaks in), the delimiter a server cut off put back, EOS told from a stop string, an SGLang abort asked again.
Prefixes run concurrently (at most ``concurrency`` at once), spread round-robin over the role's servers.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

from generation.engines import make_engine
from generation.engines.base import Unsupported
from generation.engines.connection import Connection, identify, public_url
from generation.handover import prompt_text
from generation.specs import SamplingSpec, StepSpec
from datamodules.labels.samplers import StepSampler, request_seed


class OpenAISampler(StepSampler):
    """Steps sampled by a model's servers, returned in the role's token ids.

    Args:
        urls: base URLs serving the model, e.g. ``["http://127.0.0.1:8000/v1"]``; several spread the load.
        model: the model name the servers expect; None = the one model the first server lists.
        tokenizer, step, sampling: as :class:`StepSampler`.
        engine: ``"vllm"``, ``"sglang"`` or ``"llama.cpp"``; None = told from the first server's routes.
        api_key_env: environment variable holding the API key ("" or unset: no key).
        concurrency: prefixes sampled at once.
        timeout: seconds per request attempt.
        retries: attempts per request (connection errors, timeouts, 429 and 5xx are retried with backoff).
        rank: this process's rank; ranks start the round-robin at different servers.

    Raises:
        ValueError: a bad argument.
        EngineError: a server cannot be reached (``Unreachable``), does not serve ``model``, is none of the three
            engines, or is one the engine clients refuse (``Unsupported``), naming the URL, never the key.
    """

    backend = "openai"

    def __init__(self, urls: list[str], model: str | None, tokenizer, step: StepSpec, sampling: SamplingSpec,
                 *, engine: str | None = None, api_key_env: str = "OPENAI_API_KEY", concurrency: int = 8,
                 timeout: float = 120.0, retries: int = 3, rank: int = 0):
        super().__init__(tokenizer, step, sampling)
        if not urls:
            raise ValueError("urls is empty: give the base URL of at least one server, e.g. http://127.0.0.1:8000/v1")
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency}: expected >= 1")
        self.urls = [u.rstrip("/") for u in urls]
        conn = dict(api_key_env=api_key_env, timeout=timeout, retries=retries)
        if engine is None:
            first = Connection(self.urls[0], **conn)
            first.check_model(model)  # an unreachable server or another model: refused before asking who it is
            engine = identify(first)[0]
            if engine is None:
                raise Unsupported(f"sampling server {first.url} is not vLLM, SGLang or llama-cpp-python (none of "
                                  "their routes answers); sample with one of them, or name the engine", first.root)
        self.engine = engine
        self.engines = [make_engine(engine, u, model, **conn) for u in self.urls]
        self.model, self.concurrency = self.engines[0].model, concurrency
        self._round_robin = itertools.islice(itertools.cycle(range(len(self.urls))), rank % len(self.urls), None)
        self.generated_tokens = 0

    def _each(self, contexts: list[list[int]], seed: int, n: int | None = None, **write) -> list:
        """One ``write`` per context on the servers in turn, at most ``concurrency`` at once. With ``n``, context
        ``i``'s samples are seeded from ``request_seed(seed, i, 0)`` on (the engine's ``seed + j``), except on
        llama-cpp-python, which ignores ``n``: there each sample is a request of its own, seeded
        ``request_seed(seed, i, j)``, so a build repeats (and resumes) the samples it drew before the engine clients
        wrote them."""
        def one(engine, prompt: str, i: int):
            if n is not None and engine.name == "llama.cpp":
                return [engine.write(prompt, sampling=self.sampling, seed=request_seed(seed, i, j), **write)
                        for j in range(n)]
            return engine.write(prompt, sampling=self.sampling, seed=request_seed(seed, i, 0), n=n, **write)

        calls = [(self.engines[next(self._round_robin)], prompt_text(self.tokenizer, c), i)
                 for i, c in enumerate(contexts)]
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = [pool.submit(one, *call) for call in calls]
            try:
                answers = [f.result() for f in futures]
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        for w in answers:
            self.generated_tokens += sum(x.usage.completion_tokens for x in (w if isinstance(w, list) else [w]))
        return answers

    def sample(self, contexts, n, seed):
        answers = self._each(contexts, step=self.step, max_tokens=self.max_step_tokens, n=n, seed=seed)
        self.samples += n * len(contexts)
        return [[self._step(w.text, w.stop) for w in ws] for ws in answers]

    def complete(self, contexts, max_new_tokens, seed):
        return [w.text for w in self._each(contexts, step=None, max_tokens=max_new_tokens, seed=seed)]

    def provenance(self):
        return {"backend": "openai", "model": self.model, "urls": [public_url(u) for u in self.urls],  # as logged
                "engine": self.engine, "server_version": self.engines[0].version, "delimiters": self.delimiters}

    def stats(self):
        return {**super().stats(), "generated_tokens": self.generated_tokens}
