"""One model's batched KV cache over rows of different lengths, and the step writer built on it.

Rows advance by different amounts (one row drafts 9 tokens, another 4; one row's step is rejected
and rolled back, another's is kept), so the cache cannot be cropped per row. Instead every row
keeps explicit position ids (the index of the token in its own sequence) and the 2D attention
mask marks which cache slots belong to it: a slot a row did not use, or rolled back, is a masked
*hole*. Trailing columns that no row uses are cropped off with ``DynamicCache.crop``, so with one
row a rollback is an ordinary crop and the cache never has holes.

Tokens are sampled only with :func:`generation.sampling.sample_next` (the one sampler) and step
features are computed only with :func:`generation.features.step_features`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from generation.sampling import sample_next
from generation.features import FeatureSpec, pad_steps, probe_input, step_features


@dataclass
class Feed:
    """What one batched forward gave one row.

    Attributes:
        start: index in the row's sequence of the first token fed.
        logits: (n, V) logits at every fed position (``all_logits``) or (1, V) at the last one.
        hidden: (L, n, D) hidden states of the requested layers at every fed position, or None.
    """

    start: int
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class CacheRunner:
    """A model, its KV cache and, per row, the token sequence it has in context.

    ``seq[i]`` is row ``i``'s prompt plus committed output plus tentative tokens, in this model's
    tokenization; ``n_fed[i]`` of them are in the cache; the rest are *pending* and go into the
    next :meth:`feed`. ``last_logits[i]`` (V,) predicts ``seq[i][n_fed[i]]`` when nothing is pending.

    Args:
        model: a transformers causal LM (eval mode), on any device.
        n_rows: batch size.
        pad_token_id: id fed in unused slots (masked, never attended).
        layer_ids: ``hidden_states`` indices to return from feeds that ask for hidden states.
    """

    def __init__(self, model, n_rows: int, pad_token_id: int = 0, layer_ids: Sequence[int] = (-1,)):
        self.model = model
        self.device = next(model.parameters()).device
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.context: int | None = getattr(cfg, "max_position_embeddings", None)  # positions the model knows
        self.pad_token_id = int(pad_token_id)
        self.layer_ids = list(layer_ids)
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(n_rows, 0, dtype=torch.long, device=self.device)  # (B, cache length)
        self.cols: list[list[int]] = [[] for _ in range(n_rows)]  # cache column of every fed token
        self.seq: list[list[int]] = [[] for _ in range(n_rows)]
        self.last_logits: list[torch.Tensor | None] = [None] * n_rows
        self.passes = [0] * n_rows  # forwards that fed this row something
        self.calls = 0  # forwards in total

    @property
    def n_fed(self) -> list[int]:
        return [len(c) for c in self.cols]

    def pending(self, i: int) -> list[int]:
        """Tokens of row ``i`` not yet in the cache."""
        return self.seq[i][len(self.cols[i]) :]

    @torch.no_grad()
    def feed(self, rows: Sequence[int], hidden: bool = False, all_logits: bool = False) -> dict[int, Feed]:
        """Run one forward over the pending tokens of ``rows`` (right-padded, holes masked).

        Rows with nothing pending are skipped; when no row has anything pending no forward runs.
        Sets ``last_logits`` of every fed row. Returns ``{row: Feed}`` for the fed rows.
        """
        todo = {i: self.pending(i) for i in rows if self.pending(i)}
        if not todo:
            return {}
        B, width, T0 = len(self.seq), max(len(t) for t in todo.values()), self.mask.shape[1]
        ids = torch.full((B, width), self.pad_token_id, dtype=torch.long)
        new_mask = torch.zeros((B, width), dtype=torch.long)
        pos = torch.zeros((B, width), dtype=torch.long)
        for i, toks in todo.items():
            n0 = len(self.cols[i])
            ids[i, : len(toks)] = torch.as_tensor(toks)
            new_mask[i, : len(toks)] = 1
            pos[i] = n0 + torch.arange(width)  # position = index in the row's own sequence
        self.mask = torch.cat([self.mask, new_mask.to(self.device)], dim=1)
        keep = None
        if not all_logits:  # only each row's last position: saves the (B, width, V) logits on large vocabularies
            keep = torch.tensor(sorted({len(t) - 1 for t in todo.values()}), dtype=torch.long)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=self.mask,
            position_ids=pos.to(self.device),
            cache=self.cache,
            use_cache=True,
            output_hidden_states=hidden,
            logits_to_keep=0
            if keep is None
            else (1 if len(keep) == 1 and keep[0] == width - 1 else keep.to(self.device)),
        )
        self.calls += 1
        result: dict[int, Feed] = {}
        for i, toks in todo.items():
            start, n = len(self.cols[i]), len(toks)
            self.cols[i].extend(range(T0, T0 + n))
            self.passes[i] += 1
            if keep is None:
                logits = out.logits[i, :n]
            else:
                col = 0 if out.logits.shape[1] == 1 else int((keep == n - 1).nonzero()[0, 0])
                logits = out.logits[i, col : col + 1]
            h = torch.stack([out.hidden_states[l][i, :n] for l in self.layer_ids]) if hidden else None  # (L, n, D)
            result[i] = Feed(start, logits, h)
            self.last_logits[i] = logits[-1]
        return result

    def rollback(self, i: int, n: int, last_logits: torch.Tensor | None = None) -> None:
        """Remove the last ``n`` tokens of row ``i`` (masking their cache slots).

        Args:
            i: row.
            n: tokens to remove from the end of ``seq[i]``, fed or pending.
            last_logits: (V,) logits predicting the new end of the row, if known (else None).
        """
        if n <= 0:
            return
        if n > len(self.seq[i]):
            raise ValueError(f"cannot roll back {n} tokens of row {i}: it holds {len(self.seq[i])}")
        del self.seq[i][-n:]
        drop = self.cols[i][len(self.seq[i]) :]
        if drop:
            self.mask[i, drop] = 0
            del self.cols[i][len(self.seq[i]) :]
        self.last_logits[i] = last_logits
        self._trim()

    def _trim(self) -> None:
        """Crop trailing cache columns that no row uses (with one row: every rollback is a plain crop)."""
        used = self.mask.any(0).nonzero()
        length = int(used[-1, 0]) + 1 if len(used) else 0
        extra = self.mask.shape[1] - length
        if extra > 0:
            self.cache.crop(-extra)
            self.mask = self.mask[:, :length]


def rows_input(
    spec: FeatureSpec,
    tokens: Sequence[Sequence[int]],
    hidden: Sequence[torch.Tensor] | None = None,
    logits: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Flat probe inputs (B, W) of several rows' steps, through the one feature function.

    Args:
        spec: the probe's feature spec (``layer_ids`` as the runner returned them, see below).
        tokens: per row, the step's tokens.
        hidden: ``hidden`` group: per row (L, k_i, D) states of the step's tokens at the
            probe's layers, in ``spec.layer_ids`` order (a runner returns exactly those).
        logits: ``token_stats`` group: per row (k_i, V) logits predicting each step token.
    """
    lengths = torch.tensor([len(t) for t in tokens])
    hs = None
    if spec.needs_hidden:
        padded = pad_steps([h.transpose(0, 1) for h in hidden])  # (B, k, L, D)
        hs = list(padded.unbind(2))  # L x (B, k, D), as HF hands out hidden_states
        spec = FeatureSpec(spec.groups, list(range(len(hs))), spec.pooling, spec.token_stats)
    lg = tk = None
    if spec.needs_logits:
        lg = pad_steps([l.float() for l in logits])  # (B, k, V)
        tk = pad_steps([torch.as_tensor(list(t), dtype=torch.long) for t in tokens])
        lg, tk = lg.to(lengths.device), tk.to(lengths.device)
    parts = step_features(spec, lengths, hs, lg, tk)
    return probe_input(parts, spec.groups)


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


def write_steps(
    runner: CacheRunner,
    rows: Sequence[int],
    *,
    stop: Callable[[list[int]], bool],
    limits: dict[int, int],
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    forced: dict[int, list[int]] | None = None,
    collect_hidden: bool = False,
    feed_last: bool = False,
    record_logits: bool = False,
    record_forced_logits: bool = False,
) -> dict[int, StepDraft]:
    """Sample one step for every row in ``rows`` together, continuing ``runner``'s cache.

    A row's step ends when ``stop(step_tokens)`` is true (delimiter, EOS, ``max_step_tokens``)
    or it holds ``limits[row]`` tokens. The sampled tokens are appended to ``runner.seq``; the
    last one stays pending unless ``feed_last`` (needed to read its hidden state, and it leaves
    the logits after the step in ``last_logits``).

    Args:
        runner: the writing model's cache.
        rows: rows that write a step now.
        stop: step stopper (``generation.steps.StepStopper``).
        limits: per row, the most tokens the step may hold (token budget left).
        temperature: sampling temperature; 0 is greedy.
        top_p: nucleus mass.
        generator: torch generator for sampling.
        forced: per row, tokens that open the step and are already in ``runner.seq``.
        collect_hidden: keep the hidden states of the step's tokens (for a probe).
        feed_last: feed the step's last token too.
        record_logits: keep the logits each token was sampled from (token-level speculation needs them).
        record_forced_logits: also keep the logits that predicted the forced tokens (a probe's token
            statistics cover the whole step); the forced tokens must still be pending.

    Returns:
        ``{row: StepDraft}``.
    """
    forced = forced or {}
    steps = {}
    for i in rows:
        f = list(forced.get(i, []))
        steps[i] = StepDraft(len(runner.seq[i]) - len(f), f, len(f))
    writing = [
        i for i in rows if not (steps[i].tokens and (stop(steps[i].tokens) or len(steps[i].tokens) >= limits[i]))
    ]
    last = [i for i in rows if i not in writing and feed_last]
    before = {i: runner.last_logits[i] for i in rows}
    first = True
    while writing or last:
        # With forced tokens, the first forward keeps every position's logits: they predicted the forced tokens.
        need_all = first and record_forced_logits and any(steps[i].n_forced for i in writing + last)
        fed = runner.feed(writing + last, hidden=collect_hidden, all_logits=need_all)
        if need_all:
            for i in rows:
                if steps[i].n_forced:
                    steps[i].forced_logits = _forced_logits(steps[i], fed.get(i), before[i])
        first = False
        if collect_hidden:
            for i, f in fed.items():
                skip = max(0, steps[i].start - f.start)  # fed tokens before the step belong to the prefix
                steps[i].hidden.extend(f.hidden[:, skip:].unbind(1))
        last = []
        if not writing:
            break
        missing = [i for i in writing if runner.last_logits[i] is None]
        if missing:
            raise RuntimeError(f"rows {missing} have no logits to sample from; feed their prompt first")
        logits = torch.stack([runner.last_logits[i].float().cpu() for i in writing])
        toks = sample_next(logits, temperature, top_p, generator).tolist()
        still = []
        for k, (i, t) in enumerate(zip(writing, toks)):
            if record_logits:
                steps[i].logits.append(logits[k])
            steps[i].tokens.append(int(t))
            runner.seq[i].append(int(t))
            if stop(steps[i].tokens) or len(steps[i].tokens) >= limits[i]:
                if feed_last:
                    last.append(i)
            else:
                still.append(i)
        writing = still
    return steps


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
            raise RuntimeError("the logits predicting a forced token were not kept; feed it in the step's first forward")
    return out
