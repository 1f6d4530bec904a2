"""Bookkeeping of a data folder that several builds may share: ranks, locks, progress, damage.

Two builds into one folder share the work: each shard is built under an OS file lock (filelock),
shards another build holds are skipped and waited for, and the lock of a killed build is released
by the OS with its process, so another build takes the shard over. A finished build's shards are
checked against the manifest's checksums, so exactly the missing or altered ones are rebuilt. Builds of two configs
never share a folder: ``build.json`` records the config that writes it, claimed under the folder's lock, and a build
keeps each shard it writes only while the folder is still its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from filelock import FileLock, Timeout

from datamodules.labels import shards as S
from datamodules.labels.config import signature_mismatches
from generation.fingerprints import sha256_file
from generation.paths import file_mode

def dist_info(env: bool = True) -> tuple[int, int]:
    """``(rank, world_size)`` from torch.distributed when initialised, else from RANK / WORLD_SIZE (``env=False``:
    ``(0, 1)``, a process outside a process group)."""
    import torch.distributed as dist

    if in_process_group():
        return dist.get_rank(), dist.get_world_size()
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))) if env else (0, 1)


def in_process_group() -> bool:
    """Whether this process is in an initialised torch.distributed process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier(synced: bool = True) -> None:
    """Wait for every rank of the process group (nothing without one, or when not ``synced``: a process building
    alone)."""
    if synced and in_process_group():
        import torch.distributed as dist

        dist.barrier()


def check_recorded(data_dir: Path, sig: dict) -> tuple[dict | None, bool, list[str]]:
    """Refuse a folder holding shards of another config; returns ``(manifest or None, build.json matches, stale)``.

    A folder without a single shard is not pinned by what it records (a build refused or killed before its first
    shard): ``stale`` names how its records differ from ``sig``, and :func:`forget_records` removes them once every
    other input is checked. Nothing is written here.
    """
    existing = S.read_manifest(data_dir) if data_dir.is_dir() else None
    started = _started(data_dir)
    recorded = [existing.get("build") if existing else None, started]
    diff = next((d for d in (signature_mismatches(r, sig) for r in recorded if r is not None) if d), [])
    if not diff:
        return existing, started is not None, []
    _refuse_shards(data_dir, diff)
    return None, False, diff


def forget_records(data_dir: Path, stale: list[str], log) -> None:
    """Remove the manifest and target traces of another config from a folder that holds no shard yet (``stale``: how
    they differ, from :func:`check_recorded`); build.json is rewritten by :func:`claim`."""
    log(f"{data_dir} holds no shard yet; its records of another config are replaced ({'; '.join(stale)})")
    for name in (S.MANIFEST, "target-traces.jsonl"):
        (data_dir / name).unlink(missing_ok=True)


def claim(data_dir: Path, sig: dict, record: dict) -> None:
    """Record in ``build.json`` that this build writes ``data_dir`` (``record``: its signature ``sig`` and config),
    under the folder's lock, unless shards of another config appeared there since :func:`check_recorded` looked (a
    build of another config started beside this one): refused then, as :func:`check_recorded` refuses them."""
    with FileLock(data_dir / ".build.lock", mode=file_mode()):
        if diff := _other_config(data_dir, sig):
            _refuse_shards(data_dir, diff)
        S.atomic_write_json(data_dir / "build.json", record)


def keep_if_claimed(data_dir: Path, sig: dict, k: int) -> None:
    """After shard ``k`` was written: keep it if ``build.json`` still records this build's config, else remove it
    and refuse to go on (a build of another config claimed the folder after this one started; mixing their shards
    would make one dataset of two configs)."""
    with FileLock(data_dir / ".build.lock", mode=file_mode()):
        if not (diff := _other_config(data_dir, sig)):
            return
        for name in (S.shard_name(k), S.steps_name(k)):
            (data_dir / name).unlink(missing_ok=True)
    raise ValueError(f"a build of another config took {data_dir} over while this one ran ({'; '.join(diff)}); this "
                     "build stopped and removed the shard it had just written. Give each config its own data_dir")


def remove_locks(data_dir: Path, n_shards: int) -> None:
    """Remove the lock files of a finished build: the folder's and those of shards on disk (a killed build's stay
    behind until then)."""
    (data_dir / ".build.lock").unlink(missing_ok=True)
    for k in range(n_shards):
        if (data_dir / S.shard_name(k)).is_file():
            _lock_path(data_dir, k).unlink(missing_ok=True)


def _other_config(data_dir: Path, sig: dict) -> list[str]:
    """How the config ``build.json`` records differs from ``sig`` ([] when the same, or when none is recorded)."""
    started = _started(data_dir)
    return signature_mismatches(started, sig) if started is not None else []


def _started(data_dir: Path) -> dict | None:
    """The build signature ``build.json`` records (the build that started writing ``data_dir``), or None."""
    path = data_dir / "build.json"
    return S.upgrade_build_record(json.loads(path.read_text())["build"]) if path.is_file() else None


def _refuse_shards(data_dir: Path, diff: list[str]) -> None:
    """Refuse ``data_dir`` if it holds shards, built for another config (``diff``: how it differs)."""
    if shards := sorted(data_dir.glob("shard-*.safetensors")):
        raise ValueError(f"{data_dir} holds {len(shards)} shards built for another config: " + "; ".join(diff)
                         + ". Use another data_dir or delete this one to rebuild.")


def data_dir_problem(data_dir: str | os.PathLike) -> str | None:
    """Why ``data_dir`` cannot be a data folder (empty: the working folder; or a file), or None."""
    if not str(data_dir):
        return "data_dir '': expected a folder for the shards + manifest.json (not the working folder)"
    if Path(data_dir).is_file():
        return (f"data_dir {data_dir} is a file, not a folder; give the folder of shards + manifest.json (built "
                "there when missing)")
    return None


def make_data_dir(data_dir: Path, todo: str = "the build") -> None:
    """Create ``data_dir`` for writing ``todo``; refuse, naming the way out, when it cannot be written."""
    if data_dir_problem(data_dir):
        raise ValueError(data_dir_problem(data_dir))
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. a folder under /proc, or a file in the way: "No such file" would not say which
        raise ValueError(f"cannot create data_dir {data_dir} ({e.strerror or e}); give a folder on a writable disk "
                         "(--data_dir, or --data.data_dir for python -m probes.fit)") from None
    if not os.access(data_dir, os.W_OK | os.X_OK):
        raise ValueError(f"data_dir {data_dir} is not writable, and {todo} must be written there; give a folder on a "
                         "writable disk (--data_dir, or --data.data_dir for python -m probes.fit), or train on the "
                         "finished data it holds without building with --data.build null")


def sha_or_none(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def damaged_shards(data_dir: Path, manifest: dict) -> list[int]:
    """Indices of the shards of a finished build that are missing or differ from their checksums."""
    def on_disk(k, e):
        return (sha_or_none(data_dir / e["file"]), sha_or_none(data_dir / S.steps_name(k)))
    return [k for k, e in enumerate(manifest["shards"]) if on_disk(k, e) != (e["sha256"], e.get("steps_sha256"))]


# ---------------------------------------------------------------------------------------------
# Shard locks: two builds into one folder share the work instead of both computing every shard.

LOCK_POLL_S = 2.0
"""Seconds between looks at shards another build holds."""


def _lock_path(data_dir: Path, k: int) -> Path:
    return data_dir / f".{S.shard_name(k)}.lock"


def _try_lock(data_dir: Path, k: int) -> FileLock | None:
    """Shard ``k``'s lock, taken without waiting, or None while another build (or thread) holds it."""
    lock = FileLock(_lock_path(data_dir, k), mode=file_mode())
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return lock


def build_locked(data_dir: Path, pending: list[int], needs, build_one, done_one, max_shards: int | None) -> list[int]:
    """Build every shard of ``pending`` that ``needs`` building, each under its lock.

    A shard's lock is an OS lock (flock on Unix) on ``.shard-00000.safetensors.lock``, released when its
    holder exits or is killed. Shards another build holds are skipped and looked at again until they are
    on disk, or until their holder is gone and this build takes them over. The lock files of the shards
    done are removed on the way out (no build locks a shard that is on disk); a shard whose build failed
    keeps its released lock file, which the next build takes.

    Args:
        data_dir: the folder of shards and their lock files.
        pending: the shards to see to, in order.
        needs: ``needs(k)``: whether shard ``k`` must be built (asked again under its lock).
        build_one: ``build_one(k)`` writes shard ``k``.
        done_one: ``done_one(k)`` is called once shard ``k`` is on disk, whoever built it.
        max_shards: return after building this many shards (None: no limit).

    Returns:
        The shards this process built.
    """
    built: list[int] = []
    todo = list(pending)
    try:
        while todo:
            progressed = False
            for k in list(todo):
                if max_shards is not None and len(built) >= max_shards:
                    return built
                if needs(k):
                    lock = _try_lock(data_dir, k)
                    if lock is None:
                        continue  # another build is writing it
                    try:
                        if needs(k):  # checked again under the lock: another build may have just finished it
                            build_one(k)
                            built.append(k)
                    finally:
                        lock.release()
                todo.remove(k)
                done_one(k)
                progressed = True
            if todo and not progressed:
                time.sleep(LOCK_POLL_S)
        return built
    finally:
        for k in pending:
            if k not in todo:
                _lock_path(data_dir, k).unlink(missing_ok=True)


PROGRESS_EVERY_S = 30.0
"""When stderr is not a terminal (CI, nohup, a log file), a progress line after a shard once this many seconds
passed since the last line..."""
PROGRESS_EVERY_SHARDS = 0.1
"""... or every time this share of the shards is done."""


class Progress:
    """Progress lines for logs: tqdm draws a bar on a terminal and nothing elsewhere."""

    def __init__(self, total: int, rank: int, log):
        self.total, self.rank, self.log = total, rank, log
        self.enabled = total > 0 and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
        self.done = self.logged_done = 0
        self.t0 = self.logged_at = time.perf_counter()

    def update(self) -> None:
        self.done += 1
        now = time.perf_counter()
        step = max(1, int(self.total * PROGRESS_EVERY_SHARDS))
        if self.enabled and (self.done == self.total or now - self.logged_at >= PROGRESS_EVERY_S
                             or self.done - self.logged_done >= step):
            self.log(f"build (rank {self.rank}): {self.done}/{self.total} shards, {now - self.t0:.0f} s elapsed")
            self.logged_at, self.logged_done = now, self.done


def _still_missing(missing, timeout_s: float) -> list:
    """Poll ``missing()`` (what is not there yet) until it is empty or ``timeout_s`` passed; what is still missing."""
    t0 = time.time()
    while (left := missing()) and time.time() - t0 <= timeout_s:
        time.sleep(LOCK_POLL_S)
    return left


def wait_for_file(path: Path, timeout_s: float = 12 * 3600) -> None:
    """A rank other than 0 without a process group: wait until rank 0 has written ``path`` (the target's traces)."""
    if _still_missing(lambda: [] if path.is_file() else [path], timeout_s):
        raise TimeoutError(f"waited {timeout_s:.0f} s for rank 0 to write {path}; start rank 0 too, or rerun")


def wait_for_shards(data_dir: Path, n_shards: int, needs, timeout_s: float = 12 * 3600) -> None:
    """Rank 0 without a process group: wait until the other ranks' shards are all on disk (and as recorded: no shard
    ``needs`` building)."""
    if missing := _still_missing(lambda: [S.shard_name(k) for k in range(n_shards) if needs(k)], timeout_s):
        raise TimeoutError(f"rank 0 waited {timeout_s:.0f} s for {len(missing)} shards of the other "
                           f"ranks in {data_dir} "
                           f"(first: {missing[0]}); rerun the build to finish them")
