"""Step samplers: who writes the N steps after every prefix of a label build.

Sampling is the cost of a label build; reading the steps (hidden states and token statistics) and
labelling them stay in the package. A sampler only returns each model's steps as token ids in that
model's own tokenization, so every backend feeds the same reading pass (:mod:`datamodules.labels.reading`).

Backends (``build.sampling.backend``):

- ``hf`` (default): the package's own KV-cache sampler (:func:`generation.sampling.generate`), no server.
- ``openai``: a model's servers (vLLM, SGLang, llama-cpp-python) through the package's engine clients; see
  :mod:`datamodules.labels.openai_sampler`.
- ``vllm``: vLLM's offline ``LLM`` engine in this process (``pip install "semanticspec-probes[vllm]"``, GPUs).

Each returned step is counted by how it ended (``delimiter``, ``eos`` or ``length``), for the manifest.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import torch

from generation.specs import SamplingSpec, StepSpec
from generation.sampling import generate

def request_seed(seed: int, context: int, sample: int) -> int:
    """Seed of one sample's request: distinct per (context, sample), fits in 31 bits (llama.cpp takes uint32)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{context}:{sample}".encode()).digest()[:4], "little") & 0x7FFFFFFF


class StepSampler:
    """Samples ``n`` steps after every context, in one model's tokenization.

    Args:
        tokenizer: the sampled model's tokenizer (steps come back in its ids).
        step: what a step is (the build's; recorded in the manifest).
        sampling: temperature and top-p.

    Subclasses set :attr:`backend` and implement :meth:`sample`; :attr:`step_ends` counts how the
    returned steps ended (:meth:`_step`), for the manifest.
    """

    backend = "?"

    def __init__(self, tokenizer, step: StepSpec, sampling: SamplingSpec):
        self.tokenizer, self.step, self.sampling = tokenizer, step, sampling
        self.delimiters, self.max_step_tokens = list(step.delimiters), step.max_step_tokens
        self.step_ends: Counter = Counter()
        self.samples = 0

    def _step(self, text: str, how: str) -> list[int]:
        """A step a server wrote (its delimiter in ``text``) in the role's ids, EOS appended where ``how`` is
        ``"eos"`` (or the text is empty); counted in :attr:`step_ends`."""
        self.step_ends[how] += 1
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []
        return ids + eos if how == "eos" else ids or eos

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
    """The package's own sampler: one batched KV cache per shard (:func:`generation.sampling.generate`)."""

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


def end_token_ids(path: str, tokenizer) -> frozenset[int]:
    """The ids vLLM ends a request at: the tokenizer's EOS and the ``eos_token_id`` of the model folder's
    ``generation_config.json`` (vLLM adds those to every request's stop ids:
    ``SamplingParams.update_from_generation_config``)."""
    from transformers import GenerationConfig

    try:
        extra = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json (or a hub name not in the local cache)
        extra = None
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return frozenset(i for i in [tokenizer.eos_token_id, *extra] if i is not None)


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
        self.end_ids = end_token_ids(path, tokenizer)

    def _generate(self, contexts, seed: int, **params) -> list:
        """One request per context at the build's temperature and top-p, context ``i`` seeded from ``seed``."""
        params = [self._vllm.SamplingParams(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                            seed=request_seed(seed, i, 0), **params) for i in range(len(contexts))]
        return self.engine.generate([{"prompt_token_ids": list(c)} for c in contexts], params, use_tqdm=False)

    def sample(self, contexts, n, seed):
        outs = self._generate(contexts, seed, n=n, max_tokens=self.max_step_tokens, stop=self.delimiters,
                              include_stop_str_in_output=True)
        result = []
        for out in outs:
            steps = [self._step(c.text, self._how(c)) for c in out.outputs]
            if len(steps) != n:
                raise RuntimeError(f"vLLM returned {len(steps)} samples for one prompt; asked for n={n}")
            result.append(steps)
        self.samples += n * len(contexts)
        return result

    def _how(self, c) -> str:
        """How one ``CompletionOutput`` ended. ``stop_reason`` is the matched stop string (kept in the text), else
        None at EOS or the end-of-turn id (an int). vLLM's V1 engine before 0.11.1 tests the length limit before EOS
        (``v1/core/sched/utils.py`` ``check_stop``), so a step whose last allowed token is an end id ends at
        ``length`` holding that id in ``token_ids``: it ended at EOS all the same."""
        if c.finish_reason == "length" and not (c.token_ids and c.token_ids[-1] in self.end_ids):
            return "length"
        return "delimiter" if isinstance(c.stop_reason, str) else "eos"

    def complete(self, contexts, max_new_tokens, seed):
        return [o.outputs[0].text for o in self._generate(contexts, seed, n=1, max_tokens=max_new_tokens)]

    def provenance(self):
        return {"backend": "vllm", "model": self.path, "server_version": getattr(self._vllm, "__version__", None)}
