"""`SemanticProbeDataModule`: streams label shards to the probes' training, flat in memory.

``prepare_data`` builds what is missing (:func:`datamodules.labels.build.build`); ``setup`` checks the
manifest against the build config and every shard against its checksum, and splits by problem
(a hash of the problem id, so no problem lands in two splits and nothing needs a global index).
The dataloaders stream shards through :class:`~datamodules.stream.ShardStream` (a bounded
shuffle buffer; one shard in memory at a time). A batch is ``{role: {"features", "label", "writer"}}``
(see :mod:`datamodules.stream`).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from datamodules.labels import shards as S
from datamodules.labels.build import build
from datamodules.labels.clustering import ClusteringConfig
from datamodules.labels.config import (ROLES, BuildConfig, EndpointConfig, JudgeConfig, OpenAIConfig, ReadingConfig,
                                       SamplingConfig, VLLMConfig, signature, signature_mismatches)
from datamodules.labels.coordination import data_dir_problem
from datamodules.stream import SPLITS, EpochLoader, ShardStream, read_rows, split_of
from generation.cli import sigterm_interrupts
from generation.specs import FeatureSpec, SamplingSpec, StepSpec, check_groups, is_int, is_real, require_features

# The arguments travel in checkpoints (``save_hyperparameters``); a ``BuildConfig`` built in Python is pickled, and
# torch's weights_only unpickler (``load_from_checkpoint``) needs each of its classes allowed. A task object is the
# user's class: its checkpoint loads with ``weights_only=False`` (torch's refusal names it).
torch.serialization.add_safe_globals([BuildConfig, JudgeConfig, ClusteringConfig, SamplingConfig, OpenAIConfig,
                                      EndpointConfig, VLLMConfig, ReadingConfig, StepSpec])


class SemanticProbeDataModule(pl.LightningDataModule):
    """Label shards for the target and draft probes, built on demand and streamed.

    Args:
        data_dir: folder of ``manifest.json`` and ``shard-*.safetensors``.
        build: how to build missing data (see :class:`~datamodules.labels.build.BuildConfig`); None
            never builds and only reads what ``data_dir`` holds.
        roles: which probes' data to stream: ``target`` (label q) and/or ``draft`` (label p).
        batch_size: rows per batch, all roles together.
        num_workers: dataloader worker processes (shards are dealt among them, so the batches, and the metrics, differ
            from those of another count; each count repeats its own run).
        shuffle_buffer: rows held to shuffle the training stream (memory: about ``shuffle_buffer * 2 * L * D`` bytes
            when the probes read the hidden states alone, kept in float16; ``shuffle_buffer * 4 * (L * D + S)`` with
            the token statistics, S of them, when every row is float32).
        val_fraction: share of problems in the validation split.
        test_fraction: share of problems in the test split.
        seed: seed of the split hash and of shuffling.
        skip_corrupt: skip (with a warning) shards whose checksum differs instead of failing.
        nonfinite: ``error`` on NaN/inf features, or ``drop`` those rows (counted in ``dropped_rows``).
        feature_groups: feature groups the probes read, from those the data holds (``hidden``: pooled
            hidden states; ``token_stats``: the reading model's statistics of the step's tokens; ``topk_stats``:
            statistics exact from its top-k log-probs). None = every group the data holds
            (``[hidden, token_stats, topk_stats]`` for builds of this version).
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
        errors = _argument_errors(data_dir, build, roles, batch_size, num_workers, shuffle_buffer, val_fraction,
                                  test_fraction, seed, skip_corrupt, nonfinite, feature_groups)
        if errors:
            raise ValueError("invalid SemanticProbeDataModule arguments: " + "; ".join(errors))
        # kept in checkpoints, so load_from_checkpoint rebuilds this data; not logged (the module's hparams are, and
        # the fit CLI's config.yaml records these): a Python fit whose module trains fewer roles than this streams
        # would otherwise fail Lightning's merge of the two
        self.save_hyperparameters(logger=False)
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
        self._said: set[str] = set()

    # -- what the probes read --------------------------------------------------------------

    @property
    def input_spec(self) -> dict[str, dict]:
        """Per role: ``hidden_size``, ``features`` (what the probe reads: a :class:`~generation.specs.FeatureSpec` of
        the groups ``data.feature_groups`` picks from those held), ``reads``, ``step`` (a
        :class:`~generation.specs.StepSpec`),
        ``sampling`` (a :class:`~generation.specs.SamplingSpec`, None when the data did not record it), ``labels``.

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
            stats, topk = list(sig.get("token_stats", [])), list(sig.get("topk_stats", []))  # topk: format 3
            groups = held if self.feature_groups is None else self.feature_groups
            require_features(groups, stats, held, stats, where=f"data.feature_groups={groups}",
                             provider=f"the data in {self.data_dir}", wanted_topk=topk, provided_topk=topk)
            step, sampling, labels = _recorded_specs(sig)
            features = FeatureSpec(groups, sig["layer_ids"], sig["pooling"], stats, sig.get("top_k", 20), topk,
                                   sig.get("source", "transformers"),  # builds before format 3 read in-process
                                   sig.get("hidden_norm", "final_norm"))
            self._spec = {r: {"hidden_size": int(sig["reads"][r]["hidden_size"]), "features": features,
                              "reads": dict(sig["reads"][r]), "step": step, "sampling": sampling, "labels": labels}
                          for r in self.roles}
        return self._spec

    def feature_moments(self, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-column mean and standard deviation of ``role``'s probe inputs over the training split (finite rows).

        Probes standardise their inputs with them (``SemanticProbe.set_standardization``). Summed in
        float64 by the scan ``setup`` makes of every shard anyway; cached.
        """
        if role not in self.roles:
            raise ValueError(f"feature_moments({role!r}): expected one of this data module's roles {self.roles}")
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
        if self.build is not None:  # setup() before prepare_data(), which a Trainer calls first
            return (f"data_dir {self.data_dir} holds no finished build yet: call prepare_data() first (it builds the "
                    "labels with this build config; a Trainer calls it before setup)")
        if (self.data_dir / "build.json").is_file():  # started with options of its own: the default would be refused
            return (f"data_dir {self.data_dir} holds an unfinished build (no complete manifest.json) and build=None; "
                    "finish it by running the build that started it again (its options are the `config` in "
                    f"{self.data_dir / 'build.json'}), or give that build config")
        state = ("does not exist" if not self.data_dir.exists()
                 else "holds no finished build (no complete manifest.json)")
        return (f"data_dir {self.data_dir} {state} and build=None; build it with `python -m datamodules.labels.build "
                f"--data_dir {self.data_dir}` or give a build config")

    # -- Lightning hooks -------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Build what is missing (on one process per node, as Lightning calls it)."""
        if self.build is None:
            if not (self.data_dir / S.MANIFEST).is_file():
                raise FileNotFoundError(self._missing_message())
            self._say(f"reusing {len(S.read_manifest(self.data_dir)['shards'])} shards in {self.data_dir}")
            return
        with sigterm_interrupts():  # a scheduler's stop ends the build as Ctrl-C does (Lightning's handler comes later)
            build(self.build, self.data_dir, log=self._say, alone=True)  # the others wait in Lightning's barrier
        self._spec = None

    def _say(self, line: str) -> None:
        """Print ``line`` unless this datamodule said it before (Lightning prepares the data for fit and test)."""
        if line not in self._said:
            self._said.add(line)
            print(line)

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
        self._spec, self._moments = None, {}  # the data may have changed since (a shard rebuilt, or skipped)
        spec = self.input_spec
        self.shards, self.skipped_shards, self.dropped_rows = [], [], 0
        for entry in manifest["shards"]:
            path = self.data_dir / entry["file"]
            try:
                self._verify(path, entry["sha256"])
            except S.CorruptShardError as e:
                if not self.skip_corrupt:
                    raise
                warnings.warn(f"skipping corrupt shard: {str(e).replace(S.SKIP_ADVICE, '')}", stacklevel=2)
                self.skipped_shards.append(str(path))
                continue
            key = (str(path), self._verified[str(path)], tuple(self.roles),
                   spec[self.roles[0]]["features"].groups)
            if key not in self._counted:  # setup runs once per stage; scan each shard once
                self._counted[key] = self._count(path, spec)
                if (trim := _malloc_trim()) is not None:  # else the peak grows with every shard scanned
                    trim(0)
            rows, bad, sums = self._counted[key]
            self.dropped_rows += bad
            self.shards.append({"path": str(path), "rows": rows, "train_sums": sums})
        if not self.shards:
            raise ValueError(f"no usable shard in {self.data_dir} (skipped as corrupt: {self.skipped_shards})")
        for split, share in (("val", self.val_fraction), ("test", self.test_fraction)):
            if share > 0 and not sum(s["rows"][split] for s in self.shards):  # Lightning's own error comes later
                warnings.warn(f"data.{split}_fraction={share} put none of the problems in {self.data_dir} into the "
                              f"{split} split (problems are assigned by a hash of their id), so there are no {split} "
                              f"metrics to monitor; build more problems, raise it, or set it to 0",
                              stacklevel=2)

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
            f = spec[r]["features"]
            groups = f.groups
            if "hidden" in groups:
                want = len(f.layer_ids) * spec[r]["hidden_size"]
                have = shapes[f"{r}.features"][1]
                if have != want:
                    raise ValueError(f"shard {path}: {r}.features are {have} wide, expected {want} "
                                     f"(= {len(f.layer_ids)} layers x hidden_size {spec[r]['hidden_size']})")
            for g in ("token_stats", "topk_stats"):
                names = list(getattr(f, g))
                if g in groups and shapes.get(f"{r}.{g}", [0, -1])[1] != len(names):
                    raise ValueError(f"shard {path}: {r}.{g} has shape {shapes.get(f'{r}.{g}')}, "
                                     f"expected {len(names)} columns ({names})")
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
        groups = self.input_spec[self.roles[0]]["features"].groups
        shuffle = split == "train" and not getattr(self.trainer, "overfit_batches", 0)  # overfitting: the same batches
        stream = ShardStream(self.shards, self.roles, split, self.batch_size, shuffle, self.shuffle_buffer,
                             self.seed, (self.val_fraction, self.test_fraction), self.nonfinite, groups,
                             self.num_workers)
        return EpochLoader(stream, batch_size=None, num_workers=self.num_workers, epoch_of=self._trainer_epoch)

    def _trainer_epoch(self) -> int | None:
        """The epoch the trainer runs (None outside one), as Lightning counts it for a sampler's ``set_epoch`` (a
        resumed run's epochs then read as an uninterrupted run's do)."""
        return None if self.trainer is None else self.trainer.fit_loop.epoch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        """The test split, in file order: what ``trainer.predict`` scores (held-out problems)."""
        return self._loader("test")


def _recorded_specs(sig: dict) -> tuple[StepSpec, SamplingSpec | None, dict]:
    """The step and sampling specs a manifest's build record holds, and the label provenance without them."""
    step = StepSpec(tuple(sig["delimiters"]), sig.get("max_step_tokens") or sig["labels"].get("max_step_tokens")
                    or StepSpec.max_step_tokens)
    recorded = sig.get("sampling") or {}
    sampling = SamplingSpec(recorded["temperature"], recorded["top_p"]) if "temperature" in recorded else None
    labels = {k: v for k, v in sig["labels"].items() if k != "max_step_tokens"}
    if "n_samples" in recorded:
        labels["n_samples"] = recorded["n_samples"]
    return step, sampling, labels


def _argument_errors(data_dir, build, roles, batch_size, num_workers, shuffle_buffer, val_fraction, test_fraction,
                     seed, skip_corrupt, nonfinite, feature_groups) -> list[str]:
    """What is wrong with :class:`SemanticProbeDataModule`'s arguments, one line each naming the value."""
    errors = []
    if not roles or any(r not in ROLES for r in roles) or len(set(roles)) != len(roles):
        errors.append(f"roles={roles}: expected a non-empty subset of {list(ROLES)} without repeats")
    for name, value, low in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0),
                             ("shuffle_buffer", shuffle_buffer, 0)):
        if not is_int(value) or value < low:  # only what is wrong
            errors.append(f"{name}={value!r}: expected an integer >= {low}")
    if not (is_real(val_fraction) and is_real(test_fraction)) or not (
            0 <= val_fraction and 0 <= test_fraction and val_fraction + test_fraction < 1):
        errors.append(f"val_fraction={val_fraction!r}, test_fraction={test_fraction!r}: need numbers >= 0 each "
                      f"and a sum below 1")
    if not is_int(seed) or not 0 <= seed < 2**32:  # as Lightning's seed range
        errors.append(f"seed={seed!r}: expected an integer in [0, 2**32)")
    if not isinstance(skip_corrupt, bool):
        errors.append(f"skip_corrupt={skip_corrupt!r}: expected true or false")
    if build is not None and not isinstance(build, BuildConfig):
        errors.append(f"build={build!r}: expected a BuildConfig (or None: never build)")
    if not isinstance(data_dir, (str, os.PathLike)):
        errors.append(f"data_dir={data_dir!r}: expected a folder path")
    elif data_dir_problem(data_dir):  # refused here, before the Trainer prints its device lines
        errors.append(data_dir_problem(data_dir))
    if nonfinite not in ("error", "drop"):
        errors.append(f"nonfinite={nonfinite!r}: expected 'error' or 'drop'")
    if feature_groups is not None:
        errors += check_groups(feature_groups, None)
    return errors


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``), or None (no glibc). It hands a
    shard scan's freed buffers back to the OS; glibc keeps them, fragmented, and the peak RSS grows with every shard
    scanned (``benchmarks/labels.py`` measures the peak; docs/benchmarks.md, Labels)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
