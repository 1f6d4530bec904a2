"""Sampling: the one sampler (temperature / top-p draws from logits, on the logits' device) and the steps written with
it on a :class:`~generation.cache.BatchedCache`.

Label sampling (:func:`generate`), the decoder's step loop, token-level speculation and the local engine all draw
tokens with :meth:`Sampler.draw` and read its distribution with :meth:`Sampler.probs`, so every figure comes from
the same sampling code. :meth:`StepWriter.write` samples one step for several rows together, each stopping at its own
delimiter, cap or budget; :func:`generate` is label sampling on top of it (prefill once, fork ``num_samples`` rows
per prompt, write). Per token the host receives the ``B`` sampled ids (the stop check needs them) and never the
``(B, V)`` logits.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from generation.cache import BatchedCache, Feed
from generation.specs import SamplingSpec

Streams = torch.Generator | Sequence[torch.Generator] | None
"""One random stream for every row, or one per row (a row then draws the same whatever its batch)."""


def stream_seed(seed: int, index: int, stream: str) -> int:
    """Seed of one random stream of item ``index`` (a prompt), independent of the other items and their order."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}:{stream}".encode()).digest()[:8], "little") & (2**63 - 1)


StreamKey = tuple[int, int]
"""``(seed, index)``: what one prompt's random streams are seeded from (:func:`stream_seed`)."""


def key_stream(key: StreamKey, stream: str) -> torch.Generator:
    """The CPU generator of one prompt's random stream ``stream`` (``"sampling"``, ``"coins"``), seeded from its
    key (:func:`stream_seed`)."""
    return torch.Generator().manual_seed(stream_seed(*key, stream))


def stream_keys(seed: int | Sequence[int], n: int) -> list[StreamKey]:
    """The :data:`StreamKey` of each of ``n`` prompts.

    One int ``seed``: prompt ``k`` of the call seeds its streams from ``(seed, k)``, so the call decodes the same
    whatever its batch size, but a prompt moved to another position (or decoded alone) draws otherwise. One seed
    per prompt (the OpenAI API's per-request ``seed``): prompt ``k`` seeds from ``(seed[k], 0)``, its own seed alone,
    so it decodes the same in any batch, at any position and alone (``seed=[seed[k]]`` or ``seed=seed[k]``).

    Raises:
        ValueError: a seed that is not an integer, or a list whose length is not ``n`` (naming both).
    """
    errors = seed_errors(seed)
    if errors:
        raise ValueError(errors[0])
    if _is_int(seed):
        return [(int(seed), k) for k in range(n)]
    if len(seed) != n:
        raise ValueError(f"seed holds {len(seed)} seeds for {n} prompts: give one seed per prompt, or one integer")
    return [(int(s), 0) for s in seed]


def seed_errors(seed) -> list[str]:
    """What is wrong with ``seed`` as :func:`stream_keys` reads it, whatever the number of prompts (the one check;
    :class:`~semanticspec.config.DecodeConfig` calls it too): ``[]``, or one message naming the bad value."""
    if _is_int(seed):
        return []
    if isinstance(seed, (str, bytes)) or not isinstance(seed, Sequence):
        return [f"seed={seed!r}: expected an integer, or a list of one integer per prompt"]
    bad = [f"seed[{k}]={s!r}" for k, s in enumerate(seed) if not _is_int(s)]
    return [f"{', '.join(bad)}: expected integers (one seed per prompt)"] if bad else []


def _is_int(x) -> bool:
    """An integer (a NumPy one too), not a bool."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def row_streams(generator: Streams, rows: Sequence[int]) -> Streams:
    """The streams of ``rows``: a shared generator as it is, per-row generators picked by row."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    return [generator[i] for i in rows]


@dataclass(frozen=True)
class Sampler:
    """The one sampler bound to its :class:`~generation.specs.SamplingSpec` and random streams.

    Built once per decode (or label sampling run) and handed to the writers, so temperature and top-p
    travel as one validated object instead of through every call.

    A generator draws only on its own device, so draws from logits on another device (a model on a GPU, with the
    decoder's CPU streams) come from that device's twins of the streams (:func:`placed`): made once per device, each
    seeded like the stream it stands for, then kept. A row then draws from one stream per device, whatever its batch;
    its tokens on a GPU differ from those on the CPU (another generator), as reproducibly.

    Attributes:
        spec: temperature and top-p.
        generator: one stream for every row, or one per cache row (``rows`` index it).
    """

    spec: SamplingSpec = SamplingSpec()
    generator: Streams = None
    _twins: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def draw(self, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """One token per row of ``logits`` (B, V), row ``k`` of the batch being cache row ``rows[k]``; temperature 0
        is greedy. Returns (B,).

        With one stream per row (``generator`` a sequence), row ``k`` draws from its own, so its token does not
        depend on the other rows (:func:`exponential_race`); one stream for the batch draws with
        ``torch.multinomial``.
        """
        if self.spec.temperature == 0:
            return logits.argmax(-1)
        probs = _nucleus(logits, self.spec.temperature, self.spec.top_p)
        streams = row_streams(self.streams_on(logits.device), rows)
        if streams is None or isinstance(streams, torch.Generator):
            return torch.multinomial(probs, 1, generator=streams).squeeze(-1)
        return exponential_race(probs, streams)

    def streams_on(self, device: torch.device) -> Streams:
        """The streams that draw on ``device``: the sampler's own where they live there, else their twins."""
        g = self.generator
        if _device(g) in (None, device):
            return g
        if device not in self._twins:
            self._twins[device] = placed(g, device)
        return self._twins[device]

    def add_stream(self, generator: torch.Generator) -> None:
        """A new cache row's stream (the sampler has one per row); twins on other devices are made again with it."""
        self.generator.append(generator)
        self._twins.clear()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution :meth:`draw` draws from, (..., V)."""
        return sampling_probs(logits, self.spec.temperature, self.spec.top_p)

    def stream(self, row: int) -> torch.Generator | None:
        """The random stream of cache row ``row``."""
        return self.generator if self.generator is None or isinstance(self.generator, torch.Generator) \
            else self.generator[row]


def _device(generator: Streams) -> torch.device | None:
    """Where the streams draw (None: no streams)."""
    if generator is None:
        return None
    if isinstance(generator, torch.Generator):
        return generator.device
    return generator[0].device if len(generator) else None


def placed(generator: torch.Generator | Sequence[torch.Generator], device: torch.device | str) -> Streams:
    """New generators on ``device``, each seeded with the initial seed of its counterpart in ``generator`` (one, or
    a sequence): the stream a generator started as, on another device (where it gives other numbers)."""
    def twin(g: torch.Generator) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(g.initial_seed())
    return twin(generator) if isinstance(generator, torch.Generator) else [twin(g) for g in generator]


def exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One draw per row of ``probs`` (B, V) (unnormalised is fine), row ``k`` from its own generator. Returns (B,).

    The exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per entry picks index ``i`` with probability
    ``p_i / sum(p)``. It is what ``torch.multinomial(p, 1)`` computes for one sample, so each row draws the token
    a per-row ``torch.multinomial(probs[k : k + 1], 1, generator=generators[k])`` would, and consumes its stream
    alike; but the B per-row calls shrink to B ``exponential_`` fills and one batched division and argmax
    (half the time of a batch of 8 rows over the world's 513 tokens).
    """
    if len(generators) != len(probs):
        raise ValueError(f"{len(generators)} generators for {len(probs)} rows; give one per row")
    race = torch.empty_like(probs)  # as torch.multinomial's own: same dtype, same numbers drawn
    for row, g in zip(race, generators):
        row.exponential_(generator=g)
    return (probs / race).argmax(-1)


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution :meth:`Sampler.draw` draws from, as (..., V) probabilities (one-hot when greedy)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = _nucleus(logits.reshape(-1, logits.shape[-1]), temperature, top_p)
    return (probs / probs.sum(-1, keepdim=True)).reshape(logits.shape)


def _nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(B, V) tempered probabilities with the tail outside the nucleus zeroed (not renormalised)."""
    return top_p_filter(torch.softmax(logits.float() / temperature, dim=-1), top_p)


def top_p_filter(probs: torch.Tensor, top_p: float, head: int = 256) -> torch.Tensor:
    """Zero the tail of each row of ``probs`` (B, V) outside the nucleus of mass ``top_p``.

    The nucleus is found among each row's ``head`` most likely tokens when they hold ``top_p`` of
    the mass (a top-k instead of sorting a 262k vocabulary every token), else by a full sort; the
    result is the same either way.
    """
    if top_p >= 1.0:
        return probs
    k = min(head, probs.shape[-1])
    top, idx = probs.topk(k, dim=-1)  # sorted, descending
    if k < probs.shape[-1] and not bool((top.sum(-1) >= top_p).all()):
        top, idx = probs.sort(dim=-1, descending=True)
    drop = top.cumsum(-1) - top > top_p  # keep the token that crosses top_p
    return torch.zeros_like(probs).scatter(-1, idx, top.masked_fill(drop, 0.0))


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
