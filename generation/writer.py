"""Writing steps on a :class:`~generation.cache.BatchedCache`: the decoder's step loop and label sampling.

:meth:`StepWriter.write` samples one step for several rows together, each stopping at its own
delimiter, cap or budget; :func:`generate` is label sampling on top of it (prefill once, fork
``num_samples`` rows per prompt, write). Tokens are drawn only by
:meth:`generation.sampling.Sampler.draw`, on the logits' device: per token the host receives the
``B`` sampled ids (the stop check needs them) and never the ``(B, V)`` logits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from generation.cache import BatchedCache, Feed
from generation.sampling import Sampler
from generation.specs import SamplingSpec


@dataclass
class StepDraft:
    """A step being written by one model for one row.

    Attributes:
        start: index in the writer's ``seq`` where the step begins (forced tokens included).
        tokens: the step's tokens (forced prefix, then sampled).
        n_forced: how many leading tokens were given (e.g. the target's bonus token), not sampled.
        hidden: per fed step token, (L, D) states, when collected.
    """

    start: int
    tokens: list[int]
    n_forced: int = 0
    hidden: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    """Per sampled token, the (V,) logits it was drawn from, when recorded."""
    forced_logits: list[torch.Tensor] = field(default_factory=list)
    """Per forced token, the writer's (V,) logits that predicted it, when recorded."""

    def token_logits(self) -> list[torch.Tensor]:
        """(V,) logits predicting every token of the step, forced ones first (``record_logits``)."""
        return self.forced_logits + self.logits

    def pooled_input(self) -> torch.Tensor:
        """(L, k, D) states of the step's tokens, in order."""
        return torch.stack(self.hidden, dim=1)


@dataclass(frozen=True)
class StepWriter:
    """A model that writes steps: its cache, its step stopper and the sampler it draws with.

    Built once per decode (or label sampling run), so the step and sampling specs reach the writing code in one
    object instead of through every call.

    Attributes:
        cache: the model's batched KV cache.
        stop: its step stopper (``StepSpec.stopper(tokenizer)``): true once a step's tokens end it (delimiter,
            EOS, cap).
        sampler: the one sampler (spec and random streams: shared, or one per cache row).
    """

    cache: BatchedCache
    stop: Callable[[list[int]], bool]
    sampler: Sampler

    def write(
        self,
        rows: Sequence[int],
        limits: dict[int, int],
        *,
        forced: dict[int, list[int]] | None = None,
        collect_hidden: bool = False,
        feed_last: bool = False,
        record_logits: bool = False,
        record_forced_logits: bool | Collection[int] = False,
    ) -> dict[int, StepDraft]:
        """Sample one step for every row in ``rows`` together, continuing the cache.

        A row's step ends when ``stop(step_tokens)`` is true or it holds ``limits[row]`` tokens. The sampled
        tokens are appended to the cache's ``seq``; the last one stays pending unless ``feed_last`` (needed to
        read its hidden state, and it leaves the logits after the step in ``last_logits``).

        Args:
            rows: rows that write a step now.
            limits: per row, the most tokens the step may hold (token budget left).
            forced: per row, tokens that open the step and are already in the cache's ``seq``.
            collect_hidden: keep the hidden states of the step's tokens (for a probe).
            feed_last: feed the step's last token too.
            record_logits: keep the logits each token was sampled from (token-level speculation needs them).
            record_forced_logits: also keep the logits that predicted the forced tokens (a probe's token
                statistics cover the whole step), for every row (True) or the rows given; their forced tokens
                must still be pending.

        Returns:
            ``{row: StepDraft}``.
        """
        cache, forced = self.cache, forced or {}
        steps = {i: StepDraft(len(cache.seq[i]) - len(forced.get(i, [])), list(forced.get(i, [])),
                              len(forced.get(i, []))) for i in rows}

        def done(i: int) -> bool:
            return bool(steps[i].tokens) and (self.stop(steps[i].tokens) or len(steps[i].tokens) >= limits[i])

        writing = [i for i in rows if not done(i)]
        last = [i for i in rows if i not in writing and feed_last]
        before = {i: cache.last_logits[i] for i in rows}
        forced_rows = set(rows) if record_forced_logits is True else set(record_forced_logits or ())
        first = True
        while writing or last:
            # With forced tokens, the first forward keeps every position's logits: they predicted the forced tokens.
            need_all = first and any(steps[i].n_forced for i in writing + last if i in forced_rows)
            fed = cache.feed(writing + last, hidden=collect_hidden, all_logits=need_all)
            _keep_read(steps, fed, {i: before[i] for i in forced_rows} if need_all else None, collect_hidden)
            first, last = False, []
            if not writing:
                break
            missing = [i for i in writing if cache.last_logits[i] is None]
            if missing:
                raise RuntimeError(f"rows {missing} have no logits to sample from; feed their prompt first")
            logits = torch.stack([cache.last_logits[i] for i in writing]).float()  # (B, V), stays on the device
            for k, (i, t) in enumerate(zip(writing, self.sampler.draw(logits, writing).tolist())):  # one host sync
                if record_logits:
                    steps[i].logits.append(logits[k])
                steps[i].tokens.append(int(t))
                cache.extend(i, [t])
                if done(i) and feed_last:
                    last.append(i)
            writing = [i for i in writing if not done(i)]
        return steps


def _keep_read(steps: dict[int, StepDraft], fed: dict[int, Feed], before: dict | None, hidden: bool) -> None:
    """Keep what a feed read for the steps: the logits of their forced tokens (``before`` given), their states."""
    if before is not None:
        for i, step in steps.items():
            if step.n_forced and i in before:
                step.forced_logits = _forced_logits(step, fed.get(i), before[i])
    if hidden:
        for i, f in fed.items():
            skip = max(0, steps[i].start - f.start)  # fed tokens before the step belong to the prefix
            steps[i].hidden.extend(f.hidden[:, skip:].unbind(1))


def _forced_logits(step: StepDraft, feed: Feed | None, before: torch.Tensor | None) -> list[torch.Tensor]:
    """The logits that predicted a step's forced tokens: from the feed that read them, or held before it."""
    out = []
    for k in range(step.n_forced):
        j = step.start + k - (feed.start if feed is not None else step.start + step.n_forced)  # index among fed tokens
        if feed is not None and j >= 1:
            out.append(feed.logits[j - 1])
        elif j == 0 and before is not None:
            out.append(before)
        else:
            raise RuntimeError("the logits predicting a forced token were not kept; feed it in the "
                               "step's first forward")
    return out


DEFAULT_SAMPLING = SamplingSpec()
"""The paper's sampling (T 0.6, top-p 0.95): :func:`generate`'s default."""


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingSpec = DEFAULT_SAMPLING,
    generator: torch.Generator | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    num_samples: int = 1,
) -> list[list[int]]:
    """Sample a continuation of every prompt (token lists) in one batch on a :class:`BatchedCache`.

    A row stops at ``eos_token_id``, when ``stop(new_tokens)`` is true, or at ``max_new_tokens``;
    the stopping token is kept. With ``num_samples > 1`` every prompt is prefilled once and its
    cache forked into ``num_samples`` rows (the label pipeline's N samples per prefix).

    Returns:
        The new tokens of each row: ``len(prompts) * num_samples`` lists, prompt ``i``'s samples
        at rows ``i * num_samples`` to ``(i + 1) * num_samples - 1``.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}; expected >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}; expected >= 1")
    if not prompts:
        return []
    cache = BatchedCache(model, len(prompts), pad_token_id)
    cache.prefill(prompts)
    cache.fork(num_samples)

    def done(tokens: list[int]) -> bool:
        return (eos_token_id is not None and tokens[-1] == eos_token_id) or (stop is not None and stop(tokens))

    rows = range(cache.n_rows)
    steps = StepWriter(cache, done, Sampler(sampling, generator)).write(rows, {i: max_new_tokens for i in rows})
    return [steps[i].tokens for i in rows]
