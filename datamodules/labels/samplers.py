"""Step samplers: who writes the N steps after every prefix of a label build.

Sampling is the cost of a label build; reading the steps (hidden states and token statistics) and
labelling them stay in the package. A sampler only returns each model's steps as token ids in that
model's own tokenization, so every backend feeds the same reading pass (:mod:`datamodules.labels.reading`).

Backends (``build.sampling.backend``):

- ``hf`` (default): the package's own KV-cache sampler (:func:`generation.writer.generate`), no server.
- ``openai``: any OpenAI-compatible ``/v1/completions`` endpoint (vLLM ``serve``, SGLang, the llama.cpp
  server); see :mod:`datamodules.labels.openai_sampler`.
- ``vllm``: vLLM's offline ``LLM`` engine in this process (``pip install "semanticspec-probes[vllm]"``, GPUs).

A server returns text. :func:`step_from_text` turns one returned completion into the step the
``hf`` sampler would have kept: the delimiter that stopped it put back when the server cut it off
(vLLM ``include_stop_str_in_output``, or the ``stop_reason`` / ``matched_stop`` it reports, or,
for a server that says neither, its token count), and EOS appended when the model ended there.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from generation.specs import SamplingSpec, StepSpec
from generation.writer import generate

def minimal_stops(delimiters: Sequence[str]) -> list[str]:
    """The delimiters a server must stop at: those holding no other delimiter.

    A server cuts at the first stop string it sees, so ``".\\n\\n"`` never fires before ``"\\n\\n"``;
    for the blank-line family this leaves ``["\\n\\n"]``, and restoring a cut-off delimiter is exact.
    """
    out = [d for d in dict.fromkeys(delimiters) if not any(o != d and o in d for o in delimiters)]
    return out or list(delimiters)


def request_seed(seed: int, context: int, sample: int) -> int:
    """Seed of one sample's request: distinct per (context, sample), fits in 31 bits (llama.cpp takes uint32)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{context}:{sample}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def step_from_text(tokenizer, text: str, finish_reason: str | None, stops: Sequence[str], *,
                   stop_reason: Any = "unknown", generated_tokens: int | None = None) -> tuple[list[int], str]:
    """One returned completion as a step in ``tokenizer``'s ids, and how its end was resolved.

    Args:
        tokenizer: the sampling model's tokenizer.
        text: the completion's text.
        finish_reason: ``stop`` (a stop string or EOS) or ``length`` (the step cap).
        stops: the stop strings sent (:func:`minimal_stops`).
        stop_reason: what the server says stopped it: the matched string, a token id or None for EOS
            (vLLM's ``stop_reason``, SGLang's ``matched_stop``); ``"unknown"`` when it says nothing.
        generated_tokens: tokens the server generated for this one completion (its ``usage`` when
            the request asked for one); EOS and a cut-off stop string count there, not in ``text``.

    Returns:
        ``(ids, how)``; ``how`` is ``included`` (the text kept its delimiter), ``reported`` (put back
        from ``stop_reason``), ``counted`` (put back because the server's token count matches the text
        with its delimiter rather than without), ``assumed`` (put back with nothing to tell a stop
        string from EOS), ``eos`` or ``length``.
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    def ids(s):
        return list(tokenizer(s, add_special_tokens=False).input_ids) if s else []
    if any(text.endswith(s) for s in stops):
        return ids(text), "included"
    if finish_reason == "length":
        return ids(text) or eos, "length"
    if finish_reason != "stop":
        raise ValueError(f"finish_reason={finish_reason!r}: expected 'stop' or 'length'")
    if isinstance(stop_reason, str) and stop_reason != "unknown":
        return ids(text + stop_reason), "reported"
    if stop_reason != "unknown":  # None or a token id: the model ended the text (EOS)
        return ids(text) + eos, "eos"
    if generated_tokens is not None:
        # A cut-off stop string was generated (and counted); EOS is not counted. The count tells the two apart
        # unless the stop string merges into the text's last token (then both readings have as many tokens).
        n_text, n_stop = len(ids(text)), len(ids(text + stops[0]))
        if n_text != n_stop:
            if abs(generated_tokens - n_stop) <= abs(generated_tokens - n_text):
                return ids(text + stops[0]), "counted"
            return ids(text) + eos, "eos"
    return ids(text + stops[0]), "assumed"  # a step ends at a delimiter far more often than at EOS


class StepSampler:
    """Samples ``n`` steps after every context, in one model's tokenization.

    Args:
        tokenizer: the sampled model's tokenizer (steps come back in its ids).
        step: what a step is (the build's; recorded in the manifest).
        sampling: temperature and top-p.

    Subclasses set :attr:`backend` and implement :meth:`sample`; :attr:`step_ends` counts how the
    returned steps' ends were resolved (:func:`step_from_text`), for the manifest.
    """

    backend = "?"

    def __init__(self, tokenizer, step: StepSpec, sampling: SamplingSpec):
        self.tokenizer, self.step, self.sampling = tokenizer, step, sampling
        self.delimiters, self.max_step_tokens = list(step.delimiters), step.max_step_tokens
        self.stops = minimal_stops(self.delimiters)
        self.step_ends: Counter = Counter()
        self.samples = 0

    def sample(self, contexts: list[list[int]], n: int, seed: int) -> list[list[list[int]]]:
        """``n`` steps after every context: ``out[i][j]`` is sample ``j`` of context ``i`` (token ids)."""
        raise NotImplementedError

    def complete(self, contexts: list[list[int]], max_new_tokens: int, seed: int) -> list[str]:
        """One continuation of every context up to EOS or ``max_new_tokens``, as text (the target's own traces
        for ``prefix_source: target``)."""
        raise NotImplementedError

    def provenance(self) -> dict[str, Any]:
        """What sampled (recorded in the manifest's ``sampler``): backend, model, server version, ..."""
        return {"backend": self.backend}

    def stats(self) -> dict[str, Any]:
        """Counts of this run: samples and how their ends were resolved."""
        return {"samples": self.samples, "step_ends": dict(sorted(self.step_ends.items()))}


class HFSampler(StepSampler):
    """The package's own sampler: one batched KV cache per shard (:func:`generation.writer.generate`)."""

    backend = "hf"

    def __init__(self, model, tokenizer, step: StepSpec, sampling: SamplingSpec):
        super().__init__(tokenizer, step, sampling)
        self.model = model

    def sample(self, contexts, n, seed):
        device = next(self.model.parameters()).device
        g = torch.Generator(device=device).manual_seed(seed)
        tok = self.tokenizer
        rows = generate(self.model, contexts, max_new_tokens=self.max_step_tokens, sampling=self.sampling,
                        generator=g, stop=self.step.stopper(tok), eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id or 0, num_samples=n)
        self.samples += len(rows)
        return [rows[i * n : (i + 1) * n] for i in range(len(contexts))]

    def complete(self, contexts, max_new_tokens, seed, batch_size: int = 64):
        device = next(self.model.parameters()).device
        g = torch.Generator(device=device).manual_seed(seed)
        tok, out = self.tokenizer, []
        for i in range(0, len(contexts), batch_size):
            rows = generate(self.model, contexts[i : i + batch_size], max_new_tokens=max_new_tokens,
                            sampling=self.sampling, generator=g, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id or 0)
            out += [tok.decode(r, skip_special_tokens=True) for r in rows]
        return out

    def provenance(self):
        return {"backend": "hf", "model": getattr(self.model.config, "_name_or_path", None)}


class VLLMSampler(StepSampler):
    """vLLM's offline engine: ``SamplingParams(n, stop, include_stop_str_in_output=True, seed)`` per context.

    Args:
        path: the model folder (the one the package reads with transformers).
        tensor_parallel_size: GPUs the engine shards the model over.
        gpu_memory_utilization: share of each GPU's memory the engine may take; leave room for the
            target and draft that read the steps afterwards (and for the other role's engine).
        seed: the engine's seed (each request also carries its own).
        **kwargs: :class:`StepSampler` arguments.
    """

    backend = "vllm"

    def __init__(self, path: str, tokenizer, step: StepSpec, sampling: SamplingSpec, *,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.4, seed: int = 0,
                 dtype: str = "auto"):
        super().__init__(tokenizer, step, sampling)
        try:
            import vllm
        except ImportError as e:
            raise ImportError("sampling.backend='vllm' needs vLLM: pip install 'semanticspec-probes[vllm]' "
                              f"(on a machine with CUDA GPUs); import failed with: {e}") from None
        self._vllm, self.path = vllm, path
        self.engine = vllm.LLM(model=path, tensor_parallel_size=tensor_parallel_size,
                               gpu_memory_utilization=gpu_memory_utilization, seed=seed, dtype=dtype)

    def sample(self, contexts, n, seed):
        params = [self._vllm.SamplingParams(n=n, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                            max_tokens=self.max_step_tokens, stop=self.stops,
                                            include_stop_str_in_output=True, seed=request_seed(seed, i, 0))
                  for i in range(len(contexts))]
        outs = self.engine.generate([{"prompt_token_ids": list(c)} for c in contexts], params, use_tqdm=False)
        result = []
        for out in outs:
            steps = []
            for c in out.outputs:
                ids, how = step_from_text(self.tokenizer, c.text, c.finish_reason, self.stops,
                                          stop_reason=c.stop_reason)
                self.step_ends[how] += 1
                steps.append(ids)
            if len(steps) != n:
                raise RuntimeError(f"vLLM returned {len(steps)} samples for one prompt; asked for n={n}")
            result.append(steps)
        self.samples += n * len(contexts)
        return result

    def complete(self, contexts, max_new_tokens, seed):
        params = [self._vllm.SamplingParams(n=1, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                            max_tokens=max_new_tokens, seed=request_seed(seed, i, 0))
                  for i in range(len(contexts))]
        outs = self.engine.generate([{"prompt_token_ids": list(c)} for c in contexts], params, use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    def provenance(self):
        return {"backend": "vllm", "model": self.path, "server_version": getattr(self._vllm, "__version__", None)}
