"""Safetensors shards and ``manifest.json``: the one writer of datasets, atomic writes, checksums, verification.

Every dataset is written here: the label build writes shard by shard (:func:`write_shard_files`,
under its locks, resumable) and then :func:`write_manifest`; synthetic datasets (tests,
benchmarks) call :func:`write_dataset`, which does both. Every file is written under a temporary
name in the same folder and renamed into place, so a killed build leaves only whole files
(docs/design.md "Formats"). Nothing here unpickles.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from datamodules.tasks import MOVED_CLASSES
from generation.fingerprints import sha256_file
from generation.paths import atomic_path

if TYPE_CHECKING:  # torch loads with the first shard read or written, not with the build's command line
    import torch

MANIFEST = "manifest.json"
FORMAT_VERSION = 3
"""Layout version of the shards and the manifest (2: a ``token_stats`` feature group beside the pooled ``features``;
3: a ``topk_stats`` group, with ``top_k``, ``source`` and ``hidden_norm`` in the manifest's build record)."""
ROLES = ("target", "draft")
"""Whose probe a shard's rows train: ``<role>.features``, ``<role>.label``, ... per role."""


class CorruptShardError(ValueError):
    """A shard whose bytes differ from what the manifest recorded."""


def shard_name(index: int) -> str:
    """``shard-00000.safetensors`` for index 0."""
    return f"shard-{index:05d}.safetensors"


def steps_name(index: int) -> str:
    """Side file with the step texts of a shard (audits): ``steps-00000.jsonl``."""
    return f"steps-{index:05d}.jsonl"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary sibling and a rename (:func:`~generation.paths.atomic_path`)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically."""
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def write_shard(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                metadata: dict[str, str] | None = None) -> Path:
    """Save ``tensors`` as safetensors at ``path``, atomically (safetensors' 0600 becomes the umask's mode)."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    return Path(path)


SKIP_ADVICE = " Or train without it: --data.skip_corrupt true"
"""The end of :func:`rebuild_advice`: left out where the shard is being skipped already."""


def rebuild_advice(data_dir: str | os.PathLike) -> str:
    """What to do about a missing or altered shard: the build checks every shard against the manifest."""
    return (
        f"run the build again to rebuild it: `python -m datamodules.labels.build --data_dir {data_dir}` with "
        f"the options it was "
        "built with (the manifest's `config`), or `python -m probes.fit` with the same data section, "
        "whose prepare_data "
        "runs that build unless data.build is null; the build checks every shard against manifest.json and rebuilds "
        "exactly the missing or altered ones." + SKIP_ADVICE
    )


def verify_file(path: str | os.PathLike, expected_sha256: str) -> None:
    """Raise :class:`CorruptShardError` naming ``path``, both checksums and how to rebuild it when they differ."""
    path = Path(path)
    if not path.is_file():
        raise CorruptShardError(
            f"shard {path} is missing (manifest expects sha256 {expected_sha256}); {rebuild_advice(path.parent)}"
        )
    actual = sha256_file(path)
    if actual != expected_sha256:
        raise CorruptShardError(
            f"shard {path} is truncated or altered: expected sha256 {expected_sha256}, actual {actual} "
            f"({path.stat().st_size} bytes); {rebuild_advice(path.parent)}"
        )


def read_shard(path: str | os.PathLike, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Load the tensors of a shard (all, or only ``keys``)."""
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in (keys if keys is not None else f.keys())}


def readable(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a whole safetensors file: its header reads and covers the file (a cut copy's does not)."""
    from safetensors import SafetensorError

    try:
        with safe_open(str(path), framework="pt"):
            return True
    except (SafetensorError, OSError):
        return False


def shard_shapes(path: str | os.PathLike) -> dict[str, list[int]]:
    """Shapes of a shard's tensors, read from its header without loading data."""
    with safe_open(str(path), framework="pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118  (safe_open is not a dict)


def _rows(shapes: dict[str, list[int]], role: str) -> int:
    """A role's rows in a shard: its features' (hidden), else its labels' (a build without hidden has no features)."""
    return shapes[f"{role}.features" if f"{role}.features" in shapes else f"{role}.label"][0]


def read_manifest(data_dir: str | os.PathLike) -> dict | None:
    """The manifest of ``data_dir``, or None when there is none yet."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg}); delete it and rebuild") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards", []), list):
        raise ValueError(f"{path} is not a label build's manifest (a JSON object with a list of shards); delete it "
                         "and rebuild")
    if manifest.get("complete") and "shards" not in manifest:
        raise ValueError(f"{path} records a finished build but no shards; delete it and rebuild")
    version = manifest.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {version!r}; this semanticspec-probes reads up to "
                         f"{FORMAT_VERSION}: upgrade semanticspec-probes, or rebuild the labels with this one")
    if isinstance(manifest.get("build"), dict):
        manifest["build"] = upgrade_build_record(manifest["build"])
    _check_entry_paths(path, manifest)
    return manifest


def read_step_records(data_dir: str | os.PathLike) -> list[dict]:
    """The step-text records of a finished dataset, one per prefix, in shard order (what
    :func:`write_shard_files` wrote: ``problem_id``, ``prefix_id``, ``prefix`` and its ``samples``, each with
    ``text``, ``writer``, ``group``, ``q`` and ``p``).

    Raises:
        ValueError: ``data_dir`` holds no finished dataset, or a shard of it has no step texts.
    """
    manifest = read_manifest(data_dir)
    if manifest is None or not manifest.get("complete"):
        raise ValueError(f"{data_dir} holds no finished dataset (no complete {MANIFEST}); build it first")
    records = []
    for entry in manifest["shards"]:
        if "steps_file" not in entry:
            raise ValueError(f"{data_dir}: shard {entry['file']} has no step texts (built without them)")
        text = (Path(data_dir) / entry["steps_file"]).read_text()
        records += [json.loads(line) for line in text.splitlines() if line.strip()]
    return records


def _check_entry_paths(path: Path, manifest: dict) -> None:
    """Refuse shard entries whose files are not plain names inside the manifest's folder (``../x``, ``/x``), and, in a
    finished build, entries without the checksum each shard is checked against."""
    for k, entry in enumerate(manifest.get("shards") or []):
        if manifest.get("complete") and not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)):
            raise ValueError(f"{path}: shards[{k}] has no sha256, which a finished build records for each shard; "
                             "delete it and rebuild")
        for key in ("file", "steps_file"):
            name = entry.get(key) if isinstance(entry, dict) else None
            if name is None and key == "steps_file":
                continue
            if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
                raise ValueError(f"{path}: shards[{k}].{key}={name!r} is not a file name inside {path.parent}; "
                                 "a manifest names its shards by their names in its own folder. Rebuild it with "
                                 f"`python -m datamodules.labels.build --data_dir {path.parent}`")


SAMPLING_KEYS = ("n_samples", "temperature", "top_p")
"""The sampling spec a build record holds under ``sampling``."""


def upgrade_build_record(build: dict[str, Any]) -> dict[str, Any]:
    """A manifest's ``build`` record in today's layout, so data built before keeps matching its config.

    Records written before the sampling spec had its own entry kept ``n_samples``, ``temperature``
    and ``top_p`` in ``labels``; they move to ``sampling`` (the shards are unchanged). Records written
    before the sampling backends sampled with transformers: their ``sampler`` is ``hf``. Task classes
    recorded under the import path they had before the tasks moved (:data:`MOVED_CLASSES`) get today's. Records
    written before ``clustering.verify_members`` was recorded get its default, ``True``.
    """
    labels = build.get("labels")
    if "sampling" not in build and isinstance(labels, dict) and any(k in labels for k in SAMPLING_KEYS):
        build = {**build, "sampling": {k: labels[k] for k in SAMPLING_KEYS if k in labels},
                 "labels": {k: v for k, v in labels.items() if k not in SAMPLING_KEYS}}
    if "sampling" in build and "sampler" not in build:
        build = {**build, "sampler": "hf"}  # every build before the sampling backends sampled with transformers
    params = (build.get("labels") or {}).get("clustering_params")
    if isinstance(params, dict) and "verify_members" not in params:  # recorded since; the default before
        build = {**build, "labels": {**build["labels"], "clustering_params": {**params, "verify_members": True}}}
    task = (build.get("problems") or {}).get("task")
    if isinstance(task, dict) and task.get("class_path") in MOVED_CLASSES:
        task = {**task, "class_path": MOVED_CLASSES[task["class_path"]]}
        build = {**build, "problems": {**build["problems"], "task": task}}
    return build




# ---------------------------------------------------------------------------------------------
# The one writer of datasets.


def write_shard_files(data_dir: str | os.PathLike, index: int, tensors: dict[str, torch.Tensor],
                      steps: list[dict] | None = None) -> Path:
    """Write shard ``index`` of a dataset (and its step texts, one JSON line per prefix), atomically.

    The shard's one metadata key holds the format version and the index: safetensors writes a
    map's keys in no fixed order, and shards must be byte-stable (a resumed build equals a whole one).
    """
    data_dir = Path(data_dir)
    if steps is not None:
        atomic_write_bytes(data_dir / steps_name(index), "".join(json.dumps(r) + "\n" for r in steps).encode())
    meta = {"semanticspec": json.dumps({"format_version": FORMAT_VERSION, "shard": index}, sort_keys=True)}
    return write_shard(data_dir / shard_name(index), tensors, meta)


def write_manifest(data_dir: str | os.PathLike, build: dict[str, Any], n_shards: int, **fields: Any) -> dict:
    """Checksum shards ``0 .. n_shards - 1`` of ``data_dir`` and write its ``manifest.json``, marked complete.

    Args:
        data_dir: the dataset's folder.
        build: the one record of what the data is (models read, layers, pooling, feature groups,
            steps, sampling, label provenance; ``datamodules.labels.config.signature``); rebuilds and the
            datamodule compare it. Its ``reads`` name the roles the shards hold.
        n_shards: shards on disk.
        **fields: further top-level entries (the build's ``config``, ``n_problems``, ``stats``, ...).

    Returns:
        The manifest written.
    """
    data_dir = Path(data_dir)
    roles = [r for r in ROLES if r in build.get("reads", {})]
    rows, width, shards = {r: 0 for r in roles}, {}, []
    for k in range(n_shards):
        path = data_dir / shard_name(k)
        shapes = shard_shapes(path)
        count = {r: _rows(shapes, r) for r in roles}
        for r in roles:
            rows[r] += count[r]
            if f"{r}.features" in shapes:
                width[r] = shapes[f"{r}.features"][1]
        entry = {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size, "count": count}
        if (data_dir / steps_name(k)).is_file():
            entry.update(steps_file=steps_name(k), steps_sha256=sha256_file(data_dir / steps_name(k)))
        shards.append(entry)
    default_width = {r: len(build.get("layer_ids", [-1])) * build["reads"][r]["hidden_size"] for r in roles}
    manifest = {"format_version": FORMAT_VERSION, "complete": True, "build": build, **fields,
                "roles": {r: {"width": width.get(r, default_width[r]), "rows": rows[r]} for r in roles},
                "shards": shards}
    atomic_write_json(data_dir / MANIFEST, manifest)
    return manifest


def write_dataset(data_dir: str | os.PathLike, shards: Iterable[dict[str, torch.Tensor]], build: dict[str, Any],
                  **fields: Any) -> dict:
    """Write a whole dataset: every shard of ``shards`` in order, then the manifest (see :func:`write_manifest`)."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    n = 0
    for n, tensors in enumerate(shards, 1):
        write_shard_files(data_dir, n - 1, tensors)
    return write_manifest(data_dir, build, n, **fields)
