"""Streaming label shards: the split of rows by problem and the iterable dataset the dataloaders read.

:class:`ShardStream` splits shards across dataloader workers and DDP ranks and shuffles rows
through a bounded buffer, so memory holds one shard plus the buffer whatever the dataset's size.
A batch is ``{role: {"features": float32 (B_r, W_r), "label": float32 (B_r,), "writer": int8 (B_r,)}}``
(``W_r``: the chosen feature groups flattened and concatenated, ``generation.features.probe_input``;
``writer``: ``labels.TARGET`` or ``labels.DRAFT``, who wrote the step); a role is absent from a batch
that has no row of it.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from datamodules.labels import shards as S
from datamodules.labels.coordination import dist_info

SPLITS = ("train", "val", "test")
Batch = dict[str, dict[str, torch.Tensor]]


def split_of(problem_ids: torch.Tensor, seed: int, val_fraction: float, test_fraction: float) -> torch.Tensor:
    """Split code per row (0 train, 1 val, 2 test) from a hash of ``(seed, problem_id)``."""
    uniq, inverse = torch.unique(problem_ids, return_inverse=True)
    u = torch.tensor([int.from_bytes(hashlib.sha256(f"{seed}:{int(p)}".encode()).digest()[:8], "little") / 2**64
                      for p in uniq.tolist()], dtype=torch.float64)
    code = torch.zeros(len(uniq), dtype=torch.int8)
    code[u < val_fraction + test_fraction] = 2
    code[u < val_fraction] = 1
    return code[inverse] if len(problem_ids) else torch.zeros(0, dtype=torch.int8)


def read_rows(path: str | Path, roles: list[str], groups: tuple[str, ...], columns: tuple[str, ...]) -> dict:
    """One shard's rows: per role ``<role>.input`` (the feature groups, flat, in ``groups`` order) and ``columns``.

    The ``hidden`` group stays float16 when it is the only one (half the buffer memory); with
    ``token_stats`` or ``topk_stats`` the input is float32.
    """
    keys = {"hidden": "features", "token_stats": "token_stats", "topk_stats": "topk_stats"}
    t = S.read_shard(path, [f"{r}.{k}" for r in roles for k in [keys[g] for g in groups] + list(columns)])
    out = {f"{r}.{c}": t[f"{r}.{c}"] for r in roles for c in columns}
    for r in roles:
        parts = [t[f"{r}.{keys[g]}"] for g in groups]
        out[f"{r}.input"] = parts[0] if len(parts) == 1 else torch.cat([p.float() for p in parts], dim=1)
    return out


class ShardStream(IterableDataset):
    """Batches of one split streamed from shards.

    Rows are striped across DDP ranks by their position in the epoch's shard order (every rank gets the same
    number, the few left over are dropped so no rank waits), and shards are dealt round-robin to dataloader
    workers; with several workers under DDP each worker also stops at the batch count every rank's share reaches
    (:meth:`_worker_cap`), a rank dropping its last few rows. Shuffling permutes the shard order each epoch and
    draws batches uniformly from a buffer of at most ``shuffle_buffer`` rows (each row is copied into the buffer
    once and out once).

    Args:
        shards: per shard ``{"path", "rows": {split: int}}`` (rows of each split, finite rows only).
        roles: roles to stream.
        split: ``train``, ``val`` or ``test``.
        batch_size: rows per batch (all roles together).
        shuffle: shuffle (train) or keep file order (val/test).
        shuffle_buffer: rows held for shuffling.
        seed: seed of the split hash and of shuffling.
        fractions: ``(val_fraction, test_fraction)``.
        nonfinite: ``error`` or ``drop`` rows whose features hold NaN or inf.
        groups: feature groups to stream (``hidden``, ``token_stats``, ``topk_stats``), concatenated in this order.
        num_workers: the dataloader workers that share the stream (several: its length is unknown, :meth:`__len__`).
    """

    def __init__(self, shards: list[dict], roles: list[str], split: str, batch_size: int, shuffle: bool,
                 shuffle_buffer: int, seed: int, fractions: tuple[float, float], nonfinite: str = "error",
                 groups: tuple[str, ...] = ("hidden",), num_workers: int = 0):
        self.shards, self.roles, self.split, self.groups = shards, list(roles), split, tuple(groups)
        self.num_workers = num_workers
        self.batch_size, self.shuffle, self.shuffle_buffer = batch_size, shuffle, shuffle_buffer
        self.seed, self.fractions, self.nonfinite = seed, fractions, nonfinite
        self.epoch = -1
        self.rank, self.world = dist_info(env=False)

    def __len__(self) -> int:
        """Batches per rank, exactly, with at most one dataloader worker.

        Raises:
            TypeError: with several workers, each of which ends with a short batch of its own shards: the count then
                depends on how the epoch's shards fall to them. ``len()`` of the loader raises it too, so Lightning
                reads the loader as one of unknown length and validates when it ends (an upper bound made it wait
                for a last batch that never came, and no validation ran).
        """
        if self.num_workers > 1:
            raise TypeError(f"{self.split} batches with num_workers={self.num_workers}: unknown until the epoch's "
                            "shards are dealt to the workers")
        per_rank = sum(s["rows"][self.split] for s in self.shards) // self.world
        return math.ceil(per_rank / self.batch_size)

    def _order(self) -> list[int]:
        order = list(range(len(self.shards)))
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + max(self.epoch, 0))
            order = torch.randperm(len(order), generator=g).tolist()
        return order

    def _rows(self, shard: dict, offset: int, limit: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's rows of ``shard`` in this split: role -> (features, labels, writers)."""
        t = read_rows(shard["path"], self.roles, self.groups, ("label", "problem_id", "writer"))
        out, at = {}, offset
        for r in self.roles:
            f, y = t[f"{r}.input"], t[f"{r}.label"]
            keep = split_of(t[f"{r}.problem_id"], self.seed, *self.fractions) == SPLITS.index(self.split)
            finite = torch.isfinite(f).all(1)
            if not bool(finite.all()):
                if self.nonfinite == "error":
                    raise ValueError(f"shard {shard['path']} has {int((~finite).sum())} {r} rows with NaN/inf features")
                keep &= finite
            idx = keep.nonzero().squeeze(1)
            pos = at + torch.arange(len(idx))  # position of each row in the split's global order
            at += len(idx)
            mine = (pos % self.world == self.rank) & (pos < limit)
            out[r] = (f[idx[mine]], y[idx[mine]], t[f"{r}.writer"][idx[mine]])
        return out

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        order = self._order()
        sizes = [self.shards[k]["rows"][self.split] for k in order]
        limit = (sum(sizes) // self.world) * self.world
        offsets = dict(zip(order, itertools.accumulate(sizes, initial=0)))  # each shard's first row in the split
        mine = order[wid::nw]
        g = torch.Generator().manual_seed(hash((self.seed, self.epoch, self.rank, wid)) % 2**62)
        batches = self._shuffled(mine, offsets, limit, g) if self.shuffle else self._in_order(mine, offsets, limit)
        yield from itertools.islice(batches, self._worker_cap(mine, offsets, limit) if nw > 1 else None)

    def _worker_cap(self, mine: list[int], offsets: dict, limit: int) -> int | None:
        """The batches a worker of several yields on every rank: the fewest any rank's share of the worker's shards
        makes (each worker ends with a short batch of its own, so the ranks' counts differed by one, and DDP's
        collectives then waited or failed). A rank with more drops its last rows; one process: no cap."""
        if self.world == 1:
            return None

        def rows(r: int) -> int:  # positions p of the worker's shards, p < limit, striped to rank r (p % world == r)
            return sum(max(0, _ceil_div(min(offsets[k] + self.shards[k]["rows"][self.split], limit) - r, self.world)
                           - _ceil_div(offsets[k] - r, self.world)) for k in mine)

        return min(math.ceil(rows(r) / self.batch_size) for r in range(self.world))

    def _in_order(self, mine, offsets, limit) -> Iterator[Batch]:
        # Roles share batches in file order, so a rank yields exactly ceil(rows / batch_size) batches:
        # what __len__ promises (Lightning stops there) and the same count on every DDP rank.
        queue: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        queued = 0
        for k in mine:
            for r, (f, y, w) in self._rows(self.shards[k], offsets[k], limit).items():
                if len(y):
                    queue.append((r, f, y, w))
                    queued += len(y)
            while queued >= self.batch_size:
                yield self._pop(queue, self.batch_size)
                queued -= self.batch_size
        if queued:
            yield self._pop(queue, queued)

    @staticmethod
    def _pop(queue: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]], k: int) -> Batch:
        """Take the first ``k`` queued rows (in place) as one batch."""
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        while k:
            r, f, y, w = queue[0]
            take = min(k, len(y))
            parts.setdefault(r, []).append((f[:take], y[:take], w[:take]))
            if take == len(y):
                queue.pop(0)
            else:
                queue[0] = (r, f[take:], y[take:], w[take:])
            k -= take
        return {r: {"features": torch.cat([p[0] for p in ps]).float(), "label": torch.cat([p[1] for p in ps]),
                    "writer": torch.cat([p[2] for p in ps])} for r, ps in parts.items()}

    def _shuffled(self, mine, offsets, limit, g) -> Iterator[Batch]:
        buf = _Buffer(self.roles)
        for k in mine:
            for r, (f, y, w) in self._rows(self.shards[k], offsets[k], limit).items():
                buf.add(r, f, y, w)
            if buf.size() >= self.shuffle_buffer + self.batch_size:
                yield from buf.take(buf.size() - self.shuffle_buffer, self.batch_size, g, last=False)
        yield from buf.take(buf.size(), self.batch_size, g, last=True)


def _ceil_div(x: int, n: int) -> int:
    return -(-x // n)


class _Buffer:
    """Rows of several roles in preallocated slots; :meth:`take` draws batches uniformly."""

    def __init__(self, roles: list[str]):
        self.roles = roles
        self.F: dict[str, torch.Tensor | None] = {r: None for r in roles}
        self.Y: dict[str, torch.Tensor] = {r: torch.zeros(0) for r in roles}
        self.W: dict[str, torch.Tensor] = {r: torch.zeros(0, dtype=torch.int8) for r in roles}
        self.used: dict[str, torch.Tensor] = {r: torch.zeros(0, dtype=torch.bool) for r in roles}

    def size(self) -> int:
        return int(sum(int(u.sum()) for u in self.used.values()))

    def add(self, r: str, f: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
        if not len(y):
            return
        free = (~self.used[r]).nonzero().squeeze(1)
        if len(free) < len(y):  # grow to fit (happens while the buffer fills, then rarely)
            grow = max(len(y) - len(free), len(self.used[r]))
            old = self.F[r]
            self.F[r] = torch.empty(len(self.used[r]) + grow, f.shape[1], dtype=f.dtype)
            if old is not None:
                self.F[r][: len(old)] = old
            self.Y[r] = torch.cat([self.Y[r], torch.empty(grow, dtype=y.dtype)])
            self.W[r] = torch.cat([self.W[r], torch.empty(grow, dtype=w.dtype)])
            self.used[r] = torch.cat([self.used[r], torch.zeros(grow, dtype=torch.bool)])
            free = (~self.used[r]).nonzero().squeeze(1)
        slots = free[: len(y)]
        self.F[r][slots] = f
        self.Y[r][slots] = y
        self.W[r][slots] = w
        self.used[r][slots] = True

    def take(self, k: int, batch_size: int, g: torch.Generator, last: bool) -> Iterator[Batch]:
        if not last:
            k = (k // batch_size) * batch_size
        if k <= 0:
            return
        occ = {r: self.used[r].nonzero().squeeze(1) for r in self.roles}
        sizes = [len(occ[r]) for r in self.roles]
        starts = np.cumsum([0] + sizes)
        chosen = torch.randperm(int(starts[-1]), generator=g)[:k]  # positions in the roles' concatenation
        batch_of = torch.arange(len(chosen)) // batch_size
        n_batches = int(batch_of[-1]) + 1
        parts: dict[str, tuple] = {}
        for i, r in enumerate(self.roles):
            if self.F[r] is None:  # this role never had a row
                parts[r] = ((), (), (), [0] * n_batches)
                continue
            m = (chosen >= int(starts[i])) & (chosen < int(starts[i + 1]))
            slots = occ[r][chosen[m] - int(starts[i])]
            counts = torch.bincount(batch_of[m], minlength=n_batches).tolist()
            parts[r] = (self.F[r][slots].float().split(counts), self.Y[r][slots].split(counts),
                        self.W[r][slots].split(counts), counts)
            self.used[r][slots] = False
        for b in range(n_batches):
            yield {r: {"features": parts[r][0][b], "label": parts[r][1][b], "writer": parts[r][2][b]}
                   for r in self.roles if parts[r][3][b]}


class EpochLoader(DataLoader):
    """A DataLoader that sets its stream's epoch (shard order, shuffle seed) at every pass: the trainer's epoch where
    ``epoch_of`` gives one, so a resumed run reads epoch ``k`` as an uninterrupted run does, else one more than the
    last pass's. Its iterators seed from a generator of its own, not from torch's global one, which the training's
    dropout draws from (a resumed run's first iterator is made before its epoch restores that state)."""

    def __init__(self, dataset, *, epoch_of=lambda: None, **kw) -> None:
        super().__init__(dataset, generator=torch.Generator().manual_seed(dataset.seed), **kw)
        self.epoch_of = epoch_of

    def __iter__(self):
        epoch = self.epoch_of()
        self.dataset.epoch = self.dataset.epoch + 1 if epoch is None else epoch
        return super().__iter__()
