"""`SemanticProbeDataModule`: streams label shards to the probes' training, flat in memory.

``prepare_data`` builds what is missing (:func:`datamodules.build.build`); ``setup`` checks the
manifest against the build config and every shard against its checksum, and splits by problem
(a hash of the problem id, so no problem lands in two splits and nothing needs a global index).
The dataloaders stream shards through an :class:`~torch.utils.data.IterableDataset` that splits
them across dataloader workers and DDP ranks and shuffles rows through a bounded buffer, so
memory holds one shard plus the buffer whatever the dataset's size.

A batch is ``{role: {"features": float32 (B_r, W_r), "label": float32 (B_r,), "writer": int8 (B_r,)}}``
(``W_r``: the chosen feature groups flattened and concatenated, ``generation.features.probe_input``;
``writer``: ``labels.TARGET`` or ``labels.DRAFT``, who wrote the step); a role is absent from a batch
that has no row of it.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from datamodules import shards as S
from datamodules.build import build
from datamodules.build_config import ROLES, BuildConfig, signature, signature_mismatches
from generation.groups import require_features

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


def dist_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of torch.distributed when initialised, else ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def read_rows(path: str | Path, roles: list[str], groups: tuple[str, ...], columns: tuple[str, ...]) -> dict:
    """One shard's rows: per role ``<role>.input`` (the feature groups, flat, in ``groups`` order) and ``columns``.

    The ``hidden`` group stays float16 when it is the only one (half the buffer memory); with
    ``token_stats`` the input is float32.
    """
    keys = {"hidden": "features", "token_stats": "token_stats"}
    t = S.read_shard(path, [f"{r}.{k}" for r in roles for k in [keys[g] for g in groups] + list(columns)])
    out = {f"{r}.{c}": t[f"{r}.{c}"] for r in roles for c in columns}
    for r in roles:
        parts = [t[f"{r}.{keys[g]}"] for g in groups]
        out[f"{r}.input"] = parts[0] if len(parts) == 1 else torch.cat([p.float() for p in parts], dim=1)
    return out


class ShardStream(IterableDataset):
    """Batches of one split streamed from shards.

    Rows are striped across DDP ranks by their position in the epoch's shard order (every rank
    gets the same number, the few left over are dropped so no rank waits), and shards are dealt
    round-robin to dataloader workers. Shuffling permutes the shard order each epoch and draws
    batches uniformly from a buffer of at most ``shuffle_buffer`` rows (each row is copied into
    the buffer once and out once).

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
        groups: feature groups to stream (``hidden`` and/or ``token_stats``), concatenated in this order.
    """

    def __init__(self, shards: list[dict], roles: list[str], split: str, batch_size: int, shuffle: bool,
                 shuffle_buffer: int, seed: int, fractions: tuple[float, float], nonfinite: str = "error",
                 groups: tuple[str, ...] = ("hidden",)):
        self.shards, self.roles, self.split, self.groups = shards, list(roles), split, tuple(groups)
        self.batch_size, self.shuffle, self.shuffle_buffer = batch_size, shuffle, shuffle_buffer
        self.seed, self.fractions, self.nonfinite = seed, fractions, nonfinite
        self.epoch = -1
        self.rank, self.world = dist_rank_world()

    def __len__(self) -> int:
        """Batches per rank (an upper bound with several workers, whose last batches may be short)."""
        total = sum(s["rows"][self.split] for s in self.shards)
        per_rank = total // self.world
        workers = max(1, getattr(self, "_num_workers", 1))
        return math.ceil(per_rank / self.batch_size) + (workers - 1 if per_rank else 0)

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
        total = sum(self.shards[k]["rows"][self.split] for k in order)
        limit = (total // self.world) * self.world
        offsets, at = {}, 0
        for k in order:
            offsets[k], at = at, at + self.shards[k]["rows"][self.split]
        mine = order[wid::nw]
        g = torch.Generator().manual_seed(hash((self.seed, self.epoch, self.rank, wid)) % 2**62)
        if self.shuffle:
            yield from self._shuffled(mine, offsets, limit, g)
        else:
            yield from self._in_order(mine, offsets, limit)

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


class _EpochLoader(DataLoader):
    """A DataLoader that bumps its stream's epoch (shard order, shuffle seed) at every pass."""

    def __iter__(self):
        self.dataset.epoch += 1
        return super().__iter__()


class SemanticProbeDataModule(pl.LightningDataModule):
    """Label shards for the target and draft probes, built on demand and streamed.

    Args:
        data_dir: folder of ``manifest.json`` and ``shard-*.safetensors``.
        build: how to build missing data (see :class:`~datamodules.build.BuildConfig`); None
            never builds and only reads what ``data_dir`` holds.
        roles: which probes' data to stream: ``target`` (label q) and/or ``draft`` (label p).
        batch_size: rows per batch, all roles together.
        num_workers: dataloader worker processes (shards are dealt among them).
        shuffle_buffer: rows held to shuffle the training stream (memory: about
            ``shuffle_buffer * 2 * L * D`` bytes).
        val_fraction: share of problems in the validation split.
        test_fraction: share of problems in the test split.
        seed: seed of the split hash and of shuffling.
        skip_corrupt: skip (with a warning) shards whose checksum differs instead of failing.
        nonfinite: ``error`` on NaN/inf features, or ``drop`` those rows (counted in ``dropped_rows``).
        feature_groups: feature groups the probes read, from those the data holds (``hidden``: pooled
            hidden states; ``token_stats``: the reading model's statistics of the step's tokens).
            None = every group the data holds (``[hidden, token_stats]`` for builds of this version).
            The paper's probe is ``[hidden]``.
    """

    def __init__(
        self,
        data_dir: str = "data/arithmetic",
        build: BuildConfig | None = BuildConfig(),  # noqa: B008  (LightningCLI shows the default)
        roles: list[str] = ["target", "draft"],  # noqa: B006  (LightningCLI shows it)
        batch_size: int = 128,
        num_workers: int = 0,
        shuffle_buffer: int = 16384,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        skip_corrupt: bool = False,
        nonfinite: str = "error",
        feature_groups: list[str] | None = None,
    ):
        super().__init__()
        errors = []
        bad = [r for r in roles if r not in ROLES]
        if bad or not roles:
            errors.append(f"roles={roles}: expected a non-empty subset of {list(ROLES)}")
        for name, value, low in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0), ("shuffle_buffer", shuffle_buffer, 0)):
            if value < low:  # name only what is wrong
                errors.append(f"{name}={value}: expected >= {low}")
        if not (0 <= val_fraction and 0 <= test_fraction and val_fraction + test_fraction < 1):
            errors.append(f"val_fraction={val_fraction}, test_fraction={test_fraction}: need >= 0 each and a sum below 1")
        if nonfinite not in ("error", "drop"):
            errors.append(f"nonfinite={nonfinite!r}: expected 'error' or 'drop'")
        if feature_groups is not None:
            from generation.groups import check_groups

            errors += check_groups(feature_groups, None)
        if errors:
            raise ValueError("invalid SemanticProbeDataModule arguments: " + "; ".join(errors))
        self.data_dir, self.build, self.roles = Path(data_dir), build, list(roles)
        self.batch_size, self.num_workers, self.shuffle_buffer = batch_size, num_workers, shuffle_buffer
        self.val_fraction, self.test_fraction, self.seed = val_fraction, test_fraction, seed
        self.skip_corrupt, self.nonfinite = skip_corrupt, nonfinite
        self.feature_groups = None if feature_groups is None else list(feature_groups)
        self._moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.shards: list[dict] = []
        self.dropped_rows = 0
        """Rows with NaN/inf features dropped (``nonfinite="drop"``)."""
        self.skipped_shards: list[str] = []
        """Shards skipped as corrupt (``skip_corrupt=True``)."""
        self._verified: dict[str, tuple] = {}
        self._counted: dict[tuple, tuple[dict[str, int], int]] = {}
        self._spec: dict | None = None

    # -- what the probes read --------------------------------------------------------------

    @property
    def input_spec(self) -> dict[str, dict]:
        """Per role: ``hidden_size``, ``layer_ids``, ``pooling``, ``feature_groups``, ``token_stats``,
        ``reads``, ``delimiters``, ``labels``.

        From the manifest when the data is built, else from the build config (model folders'
        ``config.json`` and tokenizer; no weights are loaded).
        """
        if self._spec is None:
            manifest = S.read_manifest(self.data_dir) if self.data_dir.is_dir() else None
            if manifest is not None and manifest.get("complete"):
                sig = manifest["build"]
            elif self.build is not None:
                sig = signature(self.build)
            else:
                raise FileNotFoundError(self._missing_message())
            held = list(sig.get("feature_groups", ["hidden"]))  # builds before format 2 stored pooled states only
            stats = list(sig.get("token_stats", []))
            groups = held if self.feature_groups is None else self.feature_groups
            require_features(groups, stats, held, stats, where=f"data.feature_groups={groups}",
                             provider=f"the data in {self.data_dir}")
            self._spec = {r: {"hidden_size": int(sig["reads"][r]["hidden_size"]), "layer_ids": list(sig["layer_ids"]),
                              "pooling": sig["pooling"], "feature_groups": list(groups),
                              "token_stats": stats if "token_stats" in groups else [],
                              "reads": dict(sig["reads"][r]), "delimiters": list(sig["delimiters"]),
                              "labels": dict(sig["labels"])} for r in self.roles}
        return self._spec

    def feature_moments(self, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-column mean and standard deviation of ``role``'s probe inputs over the training split (finite rows).

        Probes standardise their inputs with them (``SemanticProbe.set_standardization``). Summed in
        float64 by the scan ``setup`` makes of every shard anyway; cached.
        """
        if role not in self._moments:
            if not self.shards:
                self.setup()
            sums = [shard["train_sums"][role] for shard in self.shards]  # gathered by setup's one scan
            n = sum(c for _, _, c in sums)
            if not n:
                raise ValueError(f"no finite {role} training rows in {self.data_dir} to standardise probe inputs with")
            mean = sum(s for s, _, _ in sums) / n
            std = (sum(sq for _, sq, _ in sums) / n - mean * mean).clamp(min=0).sqrt()
            self._moments[role] = (mean.float(), std.float())
        return self._moments[role]

    def _missing_message(self) -> str:
        state = "does not exist" if not self.data_dir.exists() else "holds no finished build (no complete manifest.json)"
        return (f"data_dir {self.data_dir} {state} and build=None; build it with `python -m datamodules.build "
                f"--data_dir {self.data_dir}` or give a build config")

    # -- Lightning hooks -------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Build what is missing (on one process per node, as Lightning calls it)."""
        if self.build is None:
            if not (self.data_dir / S.MANIFEST).is_file():
                raise FileNotFoundError(self._missing_message())
            print(f"reusing {len(S.read_manifest(self.data_dir)['shards'])} shards in {self.data_dir}")
            return
        build(self.build, self.data_dir)
        self._spec = None

    def setup(self, stage: str | None = None) -> None:
        """Check the manifest and every shard (checksum, width, finite features) and count rows per split."""
        manifest = S.read_manifest(self.data_dir) if self.data_dir.is_dir() else None
        if manifest is None or not manifest.get("complete"):
            raise FileNotFoundError(self._missing_message())
        if self.build is not None:
            diff = signature_mismatches(manifest["build"], signature(self.build))
            if diff:
                raise ValueError(f"{self.data_dir} was built for another config than this datamodule's build asks: "
                                 + "; ".join(diff) + ". Use another data_dir or delete this one to rebuild.")
        self._spec = None
        spec = self.input_spec
        self.shards, self.skipped_shards, self.dropped_rows = [], [], 0
        for entry in manifest["shards"]:
            path = self.data_dir / entry["file"]
            try:
                self._verify(path, entry["sha256"])
            except S.CorruptShardError as e:
                if not self.skip_corrupt:
                    raise
                warnings.warn(f"skipping corrupt shard: {e}")
                self.skipped_shards.append(str(path))
                continue
            key = (str(path), self._verified[str(path)], tuple(self.roles), tuple(spec[self.roles[0]]["feature_groups"]))
            if key not in self._counted:  # setup runs once per stage; scan each shard once
                self._counted[key] = self._count(path, spec)
            rows, bad, sums = self._counted[key]
            self.dropped_rows += bad
            self.shards.append({"path": str(path), "rows": rows, "train_sums": sums})
        if not self.shards:
            raise ValueError(f"no usable shard in {self.data_dir} (skipped as corrupt: {self.skipped_shards})")

    def _verify(self, path: Path, sha: str) -> None:
        stat = path.stat() if path.is_file() else None
        key = (stat.st_size, stat.st_mtime_ns, sha) if stat else None
        if key is None or self._verified.get(str(path)) != key:
            S.verify_file(path, sha)
            self._verified[str(path)] = key

    def _count(self, path: Path, spec: dict) -> tuple[dict[str, int], int, dict[str, tuple]]:
        """One scan of a shard: rows of each split, rows with NaN/inf features (after the width check), and
        per role the float64 sum, sum of squares and count of the finite training rows' inputs (for
        :meth:`feature_moments`)."""
        shapes = S.shard_shapes(path)
        rows, dropped, sums = {s: 0 for s in SPLITS}, 0, {}
        for r in self.roles:
            groups = tuple(spec[r]["feature_groups"])
            if "hidden" in groups:
                want = len(spec[r]["layer_ids"]) * spec[r]["hidden_size"]
                have = shapes[f"{r}.features"][1]
                if have != want:
                    raise ValueError(f"shard {path}: {r}.features are {have} wide, expected {want} "
                                     f"(= {len(spec[r]['layer_ids'])} layers x hidden_size {spec[r]['hidden_size']})")
            if "token_stats" in groups and shapes.get(f"{r}.token_stats", [0, -1])[1] != len(spec[r]["token_stats"]):
                raise ValueError(f"shard {path}: {r}.token_stats has shape {shapes.get(f'{r}.token_stats')}, "
                                 f"expected {len(spec[r]['token_stats'])} columns ({spec[r]['token_stats']})")
            t = read_rows(path, [r], groups, ("problem_id",))
            finite = torch.isfinite(t[f"{r}.input"]).all(1)
            if not bool(finite.all()):
                bad = int((~finite).sum())
                if self.nonfinite == "error":
                    raise ValueError(f"shard {path} has {bad} {r} rows with NaN/inf features; "
                                     "rebuild it or pass nonfinite='drop' to drop them")
                dropped += bad
            codes = split_of(t[f"{r}.problem_id"][finite], self.seed, self.val_fraction, self.test_fraction)
            for i, s in enumerate(SPLITS):
                rows[s] += int((codes == i).sum())
            train = t[f"{r}.input"][finite][codes == SPLITS.index("train")].double()
            sums[r] = (train.sum(0), (train * train).sum(0), len(train))
        return rows, dropped, sums

    def _loader(self, split: str) -> DataLoader:
        if not self.shards:
            self.setup()
        groups = tuple(self.input_spec[self.roles[0]]["feature_groups"])
        stream = ShardStream(self.shards, self.roles, split, self.batch_size, split == "train", self.shuffle_buffer,
                             self.seed, (self.val_fraction, self.test_fraction), self.nonfinite, groups)
        stream._num_workers = self.num_workers
        return _EpochLoader(stream, batch_size=None, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")
