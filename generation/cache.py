"""The one batched KV cache: prefill, fork, feed and rollback by length, for every model the package runs.

Label sampling (:func:`generation.sampling.generate`), the label build's step reading
(:mod:`datamodules.labels.reading`), the world benchmark's timing and the decoder all run their models
through :class:`BatchedCache`, so the cost a benchmark measures is the cost the decoder pays.

Rows advance by different amounts (one row drafts 9 tokens, another 4; one row's step is rolled
back, another's kept). Every row keeps explicit position ids (the index of the token in its own
sequence) and a 2D attention mask marks which cache columns belong to it; a column a row did not
use (it was not fed in that forward, or fed fewer tokens) is masked. Rollback is by length: a
row's last ``n`` tokens leave its sequence and their columns are masked. Masked columns do not
pile up: trailing columns no row uses are cropped (with one row every rollback is a plain crop
and the cache never holds a masked column), and once the columns beyond the longest row are more
than ``compact_at`` of the cache's width, :meth:`BatchedCache.compact` gathers every row's columns into one
right-aligned block (keys carry their rotary positions, so moving them is exact).

Every method that runs the model or changes the cache's tensors runs under ``torch.inference_mode`` (not
``no_grad``: no version counters or view tracking per op), as the decoder's whole loop does, which makes a decode
measurably faster than under ``no_grad`` on a CPU.
Its logits and hidden states are inference tensors: read them, or ``.clone()`` them outside inference mode before
changing them in place.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache


def own_mask_ok(config) -> bool:
    """Whether a feed may hand the model a ready 4D mask (:meth:`BatchedCache._attention_mask`): the model attends
    through SDPA and every layer attends causally to the whole context (no sliding windows or chunks, which a
    4D mask given as-is would override)."""
    layers = set(getattr(config, "layer_types", None) or ["full_attention"])
    return (getattr(config, "_attn_implementation", None) == "sdpa" and layers == {"full_attention"}
            and getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size",
                                                                            None) is None)


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

    def predicting(self, a: int, b: int, before: torch.Tensor | None) -> torch.Tensor:
        """(b - a, V) logits predicting the fed tokens at indices ``a`` to ``b - 1`` (index ``n`` is the token
        after the last one fed): each the logits one position back, ``before`` (the row's ``last_logits`` when it
        was fed) for index 0. Needs ``all_logits``."""
        return self.logits[a - 1 : b - 1] if a >= 1 else torch.cat([before[None], self.logits[: b - 1]])


@dataclass(frozen=True)
class ForwardRecord:
    """One forward of a :class:`BatchedCache`, as :func:`record_forwards` keeps it.

    Attributes:
        model: the model that ran it.
        rows: rows fed something (the forward computes every live row of the cache, fed or not).
        positions: positions computed, padding included: the live rows times the widest feed.
        tokens: tokens fed (positions that carried a row's token).
        seconds: wall time of the model call.
        live: rows computed (the cache's rows less those :meth:`BatchedCache.retire` dropped).
    """

    model: object
    rows: int
    positions: int
    tokens: int
    seconds: float
    live: int = 0


_RECORDERS: list[list[ForwardRecord]] = []


@contextmanager
def record_forwards() -> Iterator[list[ForwardRecord]]:
    """Keep a :class:`ForwardRecord` of every :meth:`BatchedCache.feed` that runs a forward inside the block.

    The benchmarks' batch cost model is fitted on these (``benchmarks/batching.py``); recording changes
    nothing a decode computes. Blocks nest; each keeps the forwards run while it is open.
    """
    log: list[ForwardRecord] = []
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        _RECORDERS.remove(log)


def context_length(config) -> int | None:
    """Positions a model of ``config`` (its transformers config) knows: ``max_position_embeddings`` of its text
    config, or None."""
    return getattr(_text(config), "max_position_embeddings", None)


def vocab_size(config) -> int | None:
    """The ``vocab_size`` of ``config``'s text config (what transformers compares to tell whether two models share a
    tokenizer), or None."""
    return getattr(_text(config), "vocab_size", None)


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class BatchedCache:
    """A model, its KV cache and, per row, the token sequence it has in context.

    ``seq[i]`` is row ``i``'s prompt plus committed output plus tentative tokens, in this model's
    tokenization; the first ``len(cols[i])`` of them are in the cache (``cols[i]``: their cache columns); the rest
    are *pending* and go into the next :meth:`feed`. ``last_logits[i]`` (V,) predicts ``seq[i][len(cols[i])]`` when
    nothing is pending.

    Counters of the forwards run so far: ``forward_s`` (their seconds), and per row ``passes`` (forwards that fed
    it) and ``served_s`` (their seconds); :func:`record_forwards` keeps each forward's rows, tokens and positions.

    Args:
        model: a transformers causal LM (eval mode), on any device.
        n_rows: batch size.
        pad_token_id: id fed in unused slots (masked, never attended).
        layer_ids: ``hidden_states`` indices to return from feeds that ask for hidden states.
        compact_at: compact before a feed once columns beyond the longest row exceed this share of
            the cache's width (and 16 columns); 1.0 never compacts.
    """

    def __init__(self, model, n_rows: int, pad_token_id: int = 0, layer_ids: Sequence[int] = (-1,),
                 compact_at: float = 0.25):
        if n_rows < 1:
            raise ValueError(f"n_rows={n_rows}; expected >= 1")
        if not 0 < compact_at <= 1:
            raise ValueError(f"compact_at={compact_at}; expected a share in (0, 1]")
        self.model = model
        self.device = next(model.parameters()).device
        self.context = context_length(model.config)
        self.pad_token_id = int(pad_token_id)
        self.layer_ids = list(layer_ids)
        self.compact_at = float(compact_at)
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(n_rows, 0, dtype=torch.long, device=self.device)  # (B, cache length)
        self.cols: list[list[int]] = [[] for _ in range(n_rows)]  # cache column of every fed token
        self.live: list[int] = list(range(n_rows))  # rows the cache's tensors hold, in their order (retire())
        self._at = {i: i for i in self.live}  # row -> its index in the cache's tensors
        self.seq: list[list[int]] = [[] for _ in range(n_rows)]
        self.last_logits: list[torch.Tensor | None] = [None] * n_rows
        self.passes = [0] * n_rows  # forwards that fed this row something
        self.forward_s = 0.0  # wall time of the forwards
        self.served_s = [0.0] * n_rows  # wall time of the forwards that fed this row something
        self._own_mask = own_mask_ok(model.config)

    @property
    def n_rows(self) -> int:
        return len(self.seq)

    @property
    def holes(self) -> int:
        """Masked cache columns summed over the live rows (0 when every row uses every column)."""
        return self.mask.numel() - sum(len(self.cols[i]) for i in self.live)

    @property
    def slack(self) -> int:
        """Cache columns beyond the longest live row: what compaction would remove."""
        return self.mask.shape[1] - max((len(self.cols[i]) for i in self.live), default=0)

    def extend(self, i: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to row ``i``'s sequence: the next :meth:`feed` of the row reads them (the one way a
        caller adds tokens; :meth:`rollback` takes them back by length)."""
        self.seq[i].extend(int(t) for t in tokens)

    def pending(self, i: int) -> list[int]:
        """Tokens of row ``i`` not yet in the cache."""
        return self.seq[i][len(self.cols[i]) :]

    def prefill(self, prompts: Sequence[Sequence[int]], hidden: bool = False) -> dict[int, Feed]:
        """Set every row's sequence to its prompt and read them all in one forward."""
        if len(prompts) != self.n_rows:
            raise ValueError(f"{len(prompts)} prompts for a cache of {self.n_rows} rows")
        for i, p in enumerate(prompts):
            if not len(p):
                raise ValueError(f"prompt {i} is empty; a prompt holds at least BOS")
            self.seq[i] = list(p)
        return self.feed(range(self.n_rows), hidden=hidden)

    @torch.inference_mode()
    def select(self, index: Sequence[int]) -> None:
        """Rows become copies of rows ``index`` (``[0, 0, 1, 1]``: two of each); pending tokens travel too."""
        if len(self.live) != self.n_rows:
            raise ValueError(f"select() on a cache with retired rows ({self.n_rows - len(self.live)}); select first")
        idx = torch.as_tensor(list(index), dtype=torch.long)
        if len(idx) == 0 or int(idx.min()) < 0 or int(idx.max()) >= self.n_rows:
            raise ValueError(f"index {list(index)[:8]} must be non-empty row numbers below {self.n_rows}")
        if self.mask.shape[1]:
            self.cache.batch_select_indices(idx.to(self.device))
        self.mask = self.mask[idx.to(self.device)]
        pick = idx.tolist()
        self.cols = [list(self.cols[i]) for i in pick]
        self.seq = [list(self.seq[i]) for i in pick]
        self.last_logits = [self.last_logits[i] for i in pick]
        self.passes = [self.passes[i] for i in pick]
        self.served_s = [self.served_s[i] for i in pick]
        self.live = list(range(len(pick)))
        self._at = {i: i for i in self.live}

    @torch.inference_mode()
    def add_row(self, prompt: Sequence[int]) -> int:
        """A new row holding ``prompt`` (pending: the next :meth:`feed` of the row reads it, beside the other rows'
        tokens); returns its index. Its cache columns so far are masked, so what the other rows compute does not
        change (rows do not attend to each other). How a server admits a request into a running batch.
        """
        if not len(prompt):
            raise ValueError("the new row's prompt is empty; a prompt holds at least BOS")
        i, T = self.n_rows, self.mask.shape[1]
        layers = getattr(self.cache, "layers", [])
        if T and any(getattr(layer, "keys", None) is None or layer.keys.shape[-2] != T for layer in layers):
            raise ValueError("add_row() needs every layer to hold every cache column (no sliding-window layer)")
        if T:
            for layer in layers:
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros((1, *layer.keys.shape[1:]))])
                layer.values = torch.cat([layer.values, layer.values.new_zeros((1, *layer.values.shape[1:]))])
        self.mask = torch.cat([self.mask[:, :T], torch.zeros(1, T, dtype=torch.long, device=self.device)])
        self.seq.append([int(t) for t in prompt])
        self.cols.append([])
        self.last_logits.append(None)
        self.passes.append(0)
        self.served_s.append(0.0)
        self._at[i] = len(self.live)
        self.live.append(i)
        return i

    def fork(self, n: int) -> None:
        """Every row becomes ``n`` consecutive copies of itself (N samples of one prefix)."""
        if n < 1:
            raise ValueError(f"n={n}; expected >= 1")
        if n > 1:
            self.select([i for i in range(self.n_rows) for _ in range(n)])

    @torch.inference_mode()
    def feed(self, rows: Sequence[int], hidden: bool = False, all_logits: bool = False) -> dict[int, Feed]:
        """Run one forward over the pending tokens of ``rows`` (right-padded; unused columns masked).

        Rows with nothing pending are skipped; when no row has anything pending no forward runs.
        Sets ``last_logits`` of every fed row. Returns ``{row: Feed}`` for the fed rows.
        """
        todo = {i: self.pending(i) for i in rows}
        todo = {i: t for i, t in todo.items() if t}
        if not todo:
            return {}
        retired = [i for i in todo if i not in self._at]
        if retired:
            raise ValueError(f"rows {retired} were retired; a retired row is not fed again")
        self._maybe_compact()
        at, B, width, T0 = self._at, len(self.live), max(len(t) for t in todo.values()), self.mask.shape[1]
        full = len(todo) == B and all(len(t) == width for t in todo.values())  # no column masked by this feed
        ids = [[self.pad_token_id] * width for _ in range(B)]
        pos = [[0] * width for _ in range(B)]
        for i, toks in todo.items():
            ids[at[i]][: len(toks)] = toks
            n0 = len(self.cols[i])
            pos[at[i]] = list(range(n0, n0 + width))  # position = index in the row's own sequence
        if full:
            new_mask = torch.ones((B, width), dtype=torch.long, device=self.device)
        else:
            new_mask = torch.zeros((B, width), dtype=torch.long)
            for i, toks in todo.items():
                new_mask[at[i], : len(toks)] = 1
            new_mask = new_mask.to(self.device)
        no_holes = full and self.holes == 0
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        if all_logits:
            keep = 0
        else:  # only each row's last position: saves the (B, width, V) logits on large vocabularies
            last = sorted({len(t) - 1 for t in todo.values()})
            keep = 1 if last == [width - 1] else torch.tensor(last, dtype=torch.long, device=self.device)
        t0 = self._clock()
        out = self.model(
            input_ids=torch.tensor(ids, device=self.device),
            # no masked column anywhere: the model's own causal mask is the same and cheaper to build
            attention_mask=None if no_holes else self._attention_mask(width),
            position_ids=torch.tensor(pos, device=self.device),
            cache=self.cache,
            use_cache=True,
            output_hidden_states=hidden,
            logits_to_keep=keep,
        )
        self._count(todo, width, self._clock() - t0)
        result: dict[int, Feed] = {}
        for i, toks in todo.items():
            start, n = len(self.cols[i]), len(toks)
            self.cols[i].extend(range(T0, T0 + n))
            self.passes[i] += 1
            r = at[i]
            if all_logits:
                logits = out.logits[r, :n]
            elif isinstance(keep, int):
                logits = out.logits[r, -1:]
            else:
                col = last.index(n - 1)
                logits = out.logits[r, col : col + 1]
            h = torch.stack([out.hidden_states[k][r, :n] for k in self.layer_ids]) if hidden else None  # (L, n, D)
            result[i] = Feed(start, logits, h)
            self.last_logits[i] = logits[-1]
        return result

    def _attention_mask(self, width: int) -> torch.Tensor:
        """The mask of a feed of ``width`` columns: the 2D column mask, or for a model whose every layer attends
        causally through SDPA the 4D boolean mask transformers would build from it (query column ``q`` sees the
        used columns ``<= q``), built here in three ops instead of transformers' general mask functions."""
        if not self._own_mask:
            return self.mask
        cols = torch.arange(self.mask.shape[1], device=self.device)
        causal = cols[None, :] <= cols[-width:, None]  # (width, T)
        return self.mask.bool()[:, None, None, :] & causal

    def _clock(self) -> float:
        """Now; while a :func:`record_forwards` block is open on an accelerator, after its queued work is done."""
        if _RECORDERS and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _count(self, todo: dict[int, list[int]], width: int, seconds: float) -> None:
        """Count one forward's time (and the served rows'); record its rows, tokens and positions (padding included)
        in the open :func:`record_forwards` blocks."""
        self.forward_s += seconds
        for i in todo:
            self.served_s[i] += seconds
        tokens = sum(len(t) for t in todo.values())
        for log in _RECORDERS:
            log.append(ForwardRecord(self.model, len(todo), len(self.live) * width, tokens, seconds, len(self.live)))

    @torch.inference_mode()
    def rollback(self, i: int, n: int, last_logits: torch.Tensor | None = None) -> None:
        """Remove the last ``n`` tokens of row ``i``, fed or pending.

        Args:
            i: row.
            n: tokens to remove from the end of ``seq[i]``.
            last_logits: (V,) logits predicting the new end of the row, if known (else None).
        """
        if n <= 0:
            return
        if n > len(self.seq[i]):
            raise ValueError(f"cannot roll back {n} tokens of row {i}: it holds {len(self.seq[i])}")
        if i not in self._at:
            raise ValueError(f"row {i} was retired; a retired row is not rolled back")
        del self.seq[i][-n:]
        drop = self.cols[i][len(self.seq[i]) :]
        if drop:
            self.mask[self._at[i], drop] = 0
            del self.cols[i][len(self.seq[i]) :]
        self.last_logits[i] = last_logits
        self._trim()

    @torch.inference_mode()
    def retire(self, rows: Sequence[int]) -> None:
        """Drop finished rows from the cache's tensors, so later forwards compute only the live rows.

        A retired row keeps its ``seq`` and counters; feeding or rolling it back is refused. What the live
        rows compute does not change (rows do not attend to each other).
        """
        gone = {i for i in rows if i in self._at}
        if not gone:
            return
        keep = [i for i in self.live if i not in gone]
        if keep:
            idx = torch.tensor([self._at[i] for i in keep], dtype=torch.long, device=self.device)
            if self.mask.shape[1]:
                self.cache.batch_select_indices(idx)
            self.mask = self.mask[idx]
        else:  # nothing left to compute: free the tensors
            self.cache = DynamicCache(config=self.model.config)
            self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.live, self._at = keep, {i: k for k, i in enumerate(keep)}
        if keep:
            self._trim()

    def _trim(self) -> None:
        """Crop trailing cache columns that no row uses (with one row: every rollback is a plain crop)."""
        width = max((self.cols[i][-1] + 1 for i in self.live if self.cols[i]), default=0)
        extra = self.mask.shape[1] - width
        if extra > 0 and width == 0:  # no live row fed yet: a crop would leave layers of 0 columns that add_row skips
            self.cache = DynamicCache(config=self.model.config)
            self.mask = self.mask[:, :0]
        elif extra > 0:
            self.cache.crop(-extra)
            self.mask = self.mask[:, :width]

    def _maybe_compact(self) -> None:
        slack = self.slack
        if slack > 16 and slack > self.compact_at * self.mask.shape[1]:
            self.compact()

    @torch.inference_mode()
    def compact(self) -> bool:
        """Gather every row's cache columns into one right-aligned block, dropping masked columns.

        Returns False (and leaves the cache as it is) when a layer holds fewer columns than the
        mask, as a sliding-window layer does once it is full.
        """
        width = max(len(self.cols[i]) for i in self.live)
        T = self.mask.shape[1]
        layers = getattr(self.cache, "layers", [])
        if width == T or any(getattr(layer, "keys", None) is None or layer.keys.shape[-2] != T for layer in layers):
            return False
        idx = torch.zeros(len(self.live), width, dtype=torch.long)
        mask = torch.zeros(len(self.live), width, dtype=torch.long)
        for k, i in enumerate(self.live):
            c = self.cols[i]
            if c:
                idx[k, width - len(c) :] = torch.as_tensor(c)
                mask[k, width - len(c) :] = 1
            self.cols[i] = list(range(width - len(c), width))
        idx = idx.to(self.device)
        for layer in layers:
            B, H, _, D = layer.keys.shape
            g = idx[:, None, :, None].expand(B, H, width, D)
            layer.keys, layer.values = layer.keys.gather(2, g), layer.values.gather(2, g)
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = width
        self.mask = mask.to(self.device)
        return True
