"""Build labelled training data: prefixes → sampled steps → pooled states → meaning groups → shards.

    python -m datamodules.labels.build --data_dir data/arithmetic               # the embedded world
    python -m datamodules.labels.build --config build.yaml                      # keys: data_dir, build.*
    python -m datamodules.labels.build --fit_config configs/arithmetic.yaml     # a fit YAML's data: section
    python -m datamodules.labels.build --build.sampling.n_samples 4             # judge, clustering, sampling, steps
    torchrun --nproc_per_node 4 -m datamodules.labels.build --config build.yaml # ranks share the shards

The work is cut into shards of ``shard_size`` prefixes. A shard's random streams are seeded by
``(sampling.seed, shard index)``, so a shard comes out the same whichever rank builds it and whether
the build was interrupted before: a rerun skips the whole shards on disk and builds the rest. Rank 0
merges everything into ``manifest.json`` (docs/design.md "Formats"). The config and the signature the
manifest records live in :mod:`datamodules.labels.config`, one shard's work in
:mod:`datamodules.labels.shard`, locks and progress in :mod:`datamodules.labels.coordination`, the writer of
shards and manifest in :mod:`datamodules.labels.shards`. One shard's work (torch, transformers) is imported
when the first shard is planned, so the command line refuses bad input before torch loads.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from datamodules.labels import shards as S
from generation.fingerprints import sha256_file
from datamodules.labels.config import (
    ROLES,
    BuildConfig,
    config_record,
    signature,
)
from generation.cli import check_yaml_files, fail, normalise_args, one_line_parser, sigterm_interrupts
from generation.specs import layer_problems
from datamodules.labels.prefixes import make_prefixes, prefix_ids, target_traces
from generation.threads import OPTION_HELP as THREADS_HELP, apply_threads, set_wait_policy
from datamodules.labels.coordination import (
    Progress,
    barrier,
    build_locked,
    check_recorded,
    forget_records,
    claim,
    damaged_shards,
    data_dir_problem,
    dist_info,
    in_process_group,
    keep_if_claimed,
    make_data_dir,
    remove_locks,
    sha_or_none,
    wait_for_file,
    wait_for_shards,
)


def build(config: BuildConfig, data_dir: str | os.PathLike, *, max_shards: int | None = None, log=print,
          alone: bool = False) -> dict:
    """Build (or finish building) the dataset of ``config`` in ``data_dir``.

    Resumable: whole shards already on disk are kept; a shard is written under a temporary name
    and renamed, so a killed build never leaves half a shard. A finished build is checked against
    its manifest: shards that are missing or whose checksum differs are rebuilt, exactly those.
    Under torch.distributed (or with RANK / WORLD_SIZE set) each rank builds shards ``rank, rank +
    world_size, ...`` and rank 0 writes the manifest after a barrier. Each shard is built under a
    lock file (``.shard-00000.safetensors.lock``), so a second build into the same folder skips the
    shards another one is building and waits for them before writing the manifest.

    Args:
        config: what to build.
        data_dir: output folder.
        max_shards: stop after building this many new shards without writing the manifest
            (tests use it to simulate a kill).
        log: where the summary (and, when stderr is not a terminal, progress lines) go.
        alone: this process builds every shard and waits for no other, whatever process group it is in (Lightning's
            ``prepare_data`` runs on one process per node while the others wait in Lightning's own barrier).

    Returns:
        The manifest (``complete=False`` and no checksums when stopped by ``max_shards``).

    Raises:
        ValueError: ``data_dir`` holds shards built for another config (naming the differing fields),
            cannot be created, or the task is empty or malformed (naming file and line), ... Every
            input is checked before anything is written.
        RuntimeError: an ``http`` judge stayed unreachable after its retries (finished shards stay).
    """
    data_dir = Path(data_dir)
    rank, world = (0, 1) if alone else dist_info()
    synced = not alone and in_process_group()  # ranks that build together and meet at barriers
    sig = signature(config)
    # Check every input before writing anything: a refused build leaves no build.json behind.
    records = config.resolved_task().problems(config.n_problems, config.task_seed)
    _check_models(config, sig)
    existing, pinned, stale = check_recorded(data_dir, sig)
    finished = bool(existing and existing.get("complete"))
    damaged = damaged_shards(data_dir, existing) if finished else []
    if finished and not damaged:  # read as it is: a finished build needs no write access
        log(f"reusing {len(existing['shards'])} shards in {data_dir}")
        return existing
    # what is built is checked (a reused build was, when it was built): its problems, then what the models read
    if config.n_problems > len(records):
        log(f"the task file holds {len(records)} problems: building all of them (n_problems={config.n_problems})")
    _check_problems(config, records)
    from datamodules.labels.shard import load_tokenizers

    tokenizers = load_tokenizers(config)
    _check_prompts(config, records, tokenizers)
    expected = _recorded_checksums(data_dir, existing, damaged, log) if finished else {}
    # an unreachable or refusing server fails before anything is written
    servers = _server_samplers(config, rank, tokenizers)
    make_data_dir(data_dir, f"{len(damaged)} missing or altered shards" if finished else "the whole build")
    if rank == 0 and not pinned:
        if stale:
            forget_records(data_dir, stale, log)
        claim(data_dir, sig, {"build": sig, "config": config_record(config)})

    timer: dict[str, float] = {}
    t0 = time.perf_counter()
    plan = _plan(config, records, data_dir, rank, timer, tokenizers, servers, synced)
    run = _ShardRun(config, sig, data_dir, plan, timer, expected, (rank, world), synced)
    run.build_mine(max_shards, log)
    stopped = max_shards is not None and any(run.needs(k) for k in range(run.n_shards))
    stats = run.stats(t0)
    if stopped:
        return {"complete": False,
                "shards_on_disk": sum((data_dir / S.shard_name(k)).is_file() for k in range(run.n_shards)),
                "n_shards": run.n_shards, "stats": stats}
    return _merge(run, sig, existing, len(records), stats, log)


def _recorded_checksums(data_dir: Path, existing: dict, damaged: list[int], log) -> dict[int, tuple[str, str]]:
    """Say which shards of a finished build are rebuilt; return, per such shard, the checksums it recorded."""
    log(f"{data_dir}: {len(damaged)} of {len(existing['shards'])} shards are missing or differ from manifest.json "
        f"({', '.join(S.shard_name(k) for k in damaged)}); rebuilding exactly those")
    return {k: (e["sha256"], e.get("steps_sha256")) for k, e in enumerate(existing["shards"]) if k in damaged}


class _ShardRun:
    """This process's share of a build's shards: which still need building, building them, and the totals."""

    def __init__(self, config: BuildConfig, sig: dict, data_dir: Path, plan: dict, timer: dict[str, float],
                 expected: dict[int, tuple[str, str]], rank_world: tuple[int, int], synced: bool) -> None:
        self.config, self.sig, self.data_dir, self.plan, self.timer = config, sig, data_dir, plan, timer
        self.synced = synced  # in a process group whose ranks build together (barriers)
        self.expected = expected  # shard -> checksums a finished build recorded (rebuild what differs)
        self.rank, self.world = rank_world
        self.n_shards = len(plan["shards"])
        self.totals: dict[str, Any] = {"prefixes": 0, "samples": 0, "groups": 0, "judge_calls": 0, "cache_hits": 0}
        self.models = None  # loaded only when a shard is left to build
        self.models_loaded: dict[str, bool] = {}  # role -> weights loaded in this process ({}: nothing loaded)
        self.hits0 = 0  # the judge cache's hits when the models were loaded
        self.on_disk: set[int] = set()
        self.built: list[int] = []
        self.started = time.time()  # a shard written since was rebuilt by this build (any of its ranks)

    def needs(self, k: int) -> bool:
        """Shard ``k`` is not on disk, is no whole safetensors file (cut or damaged in an unfinished build, which has
        no checksums yet), or differs from what the finished build recorded and was not rebuilt since this build
        started (a rebuilt shard may differ in its bytes: another thread count or library version)."""
        path = self.data_dir / S.shard_name(k)
        if not path.is_file() or not S.readable(path):
            return True
        if k in self.expected:
            rebuilt = path.stat().st_mtime >= self.started
            if not rebuilt and (sha256_file(path), sha_or_none(self.data_dir / S.steps_name(k))) != self.expected[k]:
                return True
            del self.expected[k]  # as recorded, or rebuilt (by us or another rank): stop hashing it
        return False

    def build_mine(self, max_shards: int | None, log) -> None:
        """Build this rank's shards that need it, each under its lock, with a bar and progress lines."""
        self.on_disk = {k for k in range(self.n_shards) if not self.needs(k)}
        cut = [S.shard_name(k) for k in range(self.n_shards) if (self.data_dir / S.shard_name(k)).is_file()
               and k not in self.on_disk and k not in self.expected]
        if cut and self.rank == 0:
            log(f"{self.data_dir}: {', '.join(cut)} cannot be read as safetensors (cut or damaged); rebuilding them")
        mine = [k for k in range(self.n_shards) if k % self.world == self.rank and k not in self.on_disk]
        self.bar = tqdm(total=len(mine), desc=f"build shards (rank {self.rank})", unit="shard", disable=None)
        self.progress = Progress(len(mine), self.rank, log)
        self.built = build_locked(self.data_dir, mine, self.needs, self._build_one, self._done_one, max_shards)
        self.bar.close()
        if self.models is not None and self.models.judge is not None:
            self.totals["cache_hits"] = self.models.judge.cache_hits - self.hits0

    def _build_one(self, k: int) -> None:
        from datamodules.labels.shard import build_shard

        if self.models is None:
            self._load_models()
        tensors, recs, counts = build_shard(k, self.plan["shards"][k], self.models, self.config, self.timer)
        S.write_shard_files(self.data_dir, k, tensors, recs)
        self.expected.pop(k, None)  # rebuilt: it need not have the old bytes
        keep_if_claimed(self.data_dir, self.sig, k)
        for key, v in counts.items():
            self.totals[key] += v
        self.bar.set_postfix(prefixes=self.totals["prefixes"], groups=self.totals["groups"],
                             judge_calls=self.totals["judge_calls"],
                             **{f"{s}_s": round(v, 1) for s, v in self.timer.items() if s in ("sampling", "reading",
                                                                                              "judge")})

    def _load_models(self) -> None:
        from datamodules.labels.shard import load_models

        t = time.perf_counter()
        self.models = load_models(self.config, self.data_dir / "judge-cache", self.rank, self.plan["samplers"])
        self.timer["loading"] = time.perf_counter() - t
        m = self.models  # which weights this process holds (an engine-read build holds no target or draft)
        self.models_loaded = {"target": m.target is not None, "draft": m.draft is not None,
                              "judge": getattr(m.judge, "model", None) is not None}
        self.hits0 = self.models.judge.cache_hits if self.models.judge is not None else 0

    def _done_one(self, k: int) -> None:
        self.bar.update(1)
        self.progress.update()

    @property
    def samplers(self) -> dict:
        """The samplers the loaded models used (``{}`` when this process built nothing)."""
        return self.models.samplers if self.models is not None else {}

    def stats(self, t0: float) -> dict:
        """What this run did, for the manifest: totals (with the samplers' own stats), seconds, shard counts."""
        if self.samplers:
            self.totals["sampler"] = {r: smp.stats() for r, smp in self.samplers.items()}
        return {"this_run": self.totals, "models_loaded": self.models_loaded,
                "seconds_per_stage": {k: round(v, 3) for k, v in self.timer.items()},
                "seconds": round(time.perf_counter() - t0, 3), "rank": self.rank, "world_size": self.world,
                "built_shards": len(self.built), "reused_shards": len(self.on_disk)}


def _merge(run: _ShardRun, sig: dict, existing: dict | None, n_problems: int, stats: dict, log) -> dict:
    """Rank 0 writes the manifest once every shard is on disk and returns it; other ranks return what it
    wrote, or (launched without a process group) a note that rank 0 merges."""
    synced = run.synced
    barrier(synced)
    if run.rank != 0:
        if not synced:  # ranks launched without a process group: rank 0 merges once it sees every shard
            return {"complete": False, "rank": run.rank, "n_shards": run.n_shards, "stats": stats}
        barrier(synced)
        return S.read_manifest(run.data_dir)
    if not synced:
        wait_for_shards(run.data_dir, run.n_shards, run.needs)
    sampler = _sampler_record(run, existing)
    manifest = S.write_manifest(run.data_dir, sig, run.n_shards, config=config_record(run.config),
                                n_problems=n_problems,
                                n_prefixes=run.plan["n_prefixes"], sampler=sampler,
                                reader=_reader_record(run, existing),
                                stats=stats)
    remove_locks(run.data_dir, run.n_shards)
    barrier(synced)
    _summary(manifest, log)
    return manifest


def _sampler_record(run: _ShardRun, existing: dict | None) -> dict:
    """The manifest's ``sampler``: this run's samplers' provenance, else what the last build recorded, else the
    backend."""
    if run.samplers:
        return {r: smp.provenance() for r, smp in run.samplers.items()}
    return (existing or {}).get("sampler") or {r: {"backend": run.config.sampling.backend} for r in ROLES}

def _reader_record(run: _ShardRun, existing: dict | None) -> dict:
    """The manifest's ``reader``: who read the steps (``backend``; for ``engine`` the engine, each role's server
    version, URL and model) and which of the target and draft this run loaded in-process (``loaded``)."""
    r = run.config.reading
    if run.models is None:  # nothing built here: what the last build recorded
        return (existing or {}).get("reader") or {"backend": r.backend}
    loaded = [role for role in ROLES if getattr(run.models, role) is not None]
    if r.backend != "engine":
        import transformers

        return {"backend": r.backend, "engine": "transformers", "version": transformers.__version__, "loaded": loaded}
    readers = run.models.readers
    return {"backend": r.backend, "engine": r.engine, "version": {k: e.version for k, e in readers.items()},
            "urls": {k: e.url for k, e in readers.items()},
            "models": {k: getattr(e, "model", None) for k, e in readers.items()},
            "loaded": loaded}


def _check_problems(config: BuildConfig, records: list[dict]) -> None:
    """Refuse a problem given twice (its prefixes would land in more than one split), and for reference prefixes a
    problem without a trace, or traces none of which holds a step delimiter (each problem would give its prompt alone);
    naming the file and lines."""
    task = config.resolved_task()
    where = functools.partial(_where, task, records)
    first: dict[str, int] = {}
    twice: list[tuple[int, int]] = []  # (the first copy, a repeat)
    for k, r in enumerate(records):
        if r["problem"] in first:
            twice.append((first[r["problem"]], k))
        else:
            first[r["problem"]] = k
    if twice:
        raise ValueError(f"{where([twice[0][1]])} repeats the problem of {where([twice[0][0]])} ({len(twice)} repeats):"
                         " the datamodule splits by problem, so a repeat can train on what another copy tests; remove "
                         "the repeats")
    if config.prefix_source != "reference":
        return
    bad = [k for k, r in enumerate(records) if not isinstance(r.get("trace"), str) or not r["trace"].strip()]
    if bad:
        raise ValueError(f"{where(bad)} has no 'trace'; prefix_source='reference' cuts prefixes from each problem's "
                         "trace (a non-empty string): add the traces, or let the target write them with "
                         "--build.prefix_source target")
    from generation.steps import split_steps

    delims = config.steps.delimiters
    if records and all(len(split_steps(r["trace"], delims)) < 2 for r in records):
        crlf = " (their line breaks are \\r\\n)" if any("\r\n" in r["trace"] for r in records) else ""
        raise ValueError(f"{where(list(range(len(records))))}: no trace holds a step delimiter of "
                         f"build.steps.delimiters={list(delims)!r}{crlf}, so each problem would give its prompt "
                         "alone: write the steps apart as the delimiters say, or give the traces' own delimiters")


def _check_models(config: BuildConfig, sig: dict) -> None:
    """Refuse a device this process cannot use, and ``layer_ids`` a model lacks (``sig``: the build's
    :func:`~datamodules.labels.config.signature`, which read each model's ``config.json``), before any weights load."""
    from generation.loading import device_problem

    if problem := device_problem(config.resolved_device()[0]):
        raise ValueError(f"build.device={config.device!r}: {problem}")
    for role in ("target", "draft"):
        problems = layer_problems(list(config.layer_ids), sig["reads"][role]["num_layers"])
        if problems:
            raise ValueError(f"build.{problems[0]} (the {role} model, {config.model_path(role)})")


def _check_prompts(config: BuildConfig, records: list[dict], tokenizers: tuple) -> None:
    """Refuse the problems a model cannot read: whose prompt (and, for reference prefixes, trace up to its last step)
    holds text its tokenizer has no token for (it reads ``<unk>``), or leaves fewer than ``max_step_tokens`` positions
    of its context for a step; naming the first, the model and the counts."""
    from transformers import AutoConfig

    from generation.cache import context_length
    from generation.steps import split_steps

    task, room = config.resolved_task(), config.steps.max_step_tokens
    reference = config.prefix_source == "reference"
    what = "prompt and reference trace" if reference else "prompt"
    texts = ["".join(split_steps(r["trace"], config.steps.delimiters)[:-1]) if reference else "" for r in records]
    for role, tok in zip(("target", "draft"), (tokenizers[0], tokenizers[1] or tokenizers[0])):
        ids = [prefix_ids(task, tok, r["problem"], text) for r, text in zip(records, texts)]
        unknown = [k for k, row in enumerate(ids) if tok.unk_token_id is not None and tok.unk_token_id in row]
        if unknown:
            raise ValueError(f"{_where(task, records, unknown[:1])}: its {what} hold text the {role} model's "
                             f"tokenizer ({config.model_path(role)}) has no token for (it reads {tok.unk_token!r}; "
                             f"{len(unknown)} of {len(records)} problems do): rewrite them in the models' vocabulary, "
                             "or use models that can read them")
        context = context_length(AutoConfig.from_pretrained(config.model_path(role), local_files_only=True))
        over = [k for k, row in enumerate(ids) if context is not None and len(row) + room > context]
        if over:
            raise ValueError(f"{_where(task, records, over[:1])}: its {what} take {len(ids[over[0]])} tokens of the "
                             f"{role} model's {context}-position context ({config.model_path(role)}), leaving fewer "
                             f"than max_step_tokens={room} for a step ({len(over)} of {len(records)} problems do): "
                             "drop or shorten them, or use models with a longer context")


def _where(task, records: list[dict], ks: list[int]) -> str:
    """Where records ``ks`` come from, as a message names them: ``file:line`` (and how many more), else the
    problem's number (from 1) and the task's class."""
    lines = [records[k].get("line", k + 1) for k in ks]
    out = f"{task.path}:{lines[0]}" if task.path else f"problem {lines[0]} of {task.spec()['class_path']}"
    return out + (f" (and {len(ks) - 1} more {'lines' if task.path else 'problems'}: {lines[1:6]})"
                  if len(ks) > 1 else "")


def _server_samplers(config: BuildConfig, rank: int, tokenizers: tuple) -> dict:
    """The ``openai`` backend's samplers, made now: each asks its server for its models, so a server that is
    unreachable or refuses the key stops the build before it writes anything. Other backends: ``{}``."""
    if config.sampling.backend != "openai":
        return {}
    from datamodules.labels.shard import make_sampler, refuse_swapped

    tok, dtok = tokenizers
    samplers = {r: make_sampler(config, r, None, t, rank) for r, t in (("target", tok), ("draft", dtok or tok))}
    refuse_swapped(config, {r: (s.urls[0], s.model) for r, s in samplers.items()})
    return samplers


def _plan(config: BuildConfig, records: list[dict], data_dir: Path, rank: int, timer: dict, tokenizers: tuple,
          samplers: dict | None = None, synced: bool = True) -> dict:
    """All prefixes, cut into shards. Target-written traces are generated once and kept on disk."""
    t = time.perf_counter()
    tok, dtok = tokenizers
    samplers = dict(samplers or {})
    if config.prefix_source == "target":
        records = _target_traces(config, records, tok, data_dir, rank, samplers, synced)
    prefixes = make_prefixes(records, tok, config.steps.delimiters, config.prefix_source, draft_tokenizer=dtok,
                             task=config.resolved_task())
    timer["prefixes"] = timer.get("prefixes", 0.0) + time.perf_counter() - t
    k = config.shard_size
    return {"shards": [prefixes[i : i + k] for i in range(0, len(prefixes), k)], "n_prefixes": len(prefixes),
            "samplers": samplers}


def _target_traces(config: BuildConfig, records: list[dict], tok, data_dir: Path, rank: int,
                   samplers: dict, synced: bool = True) -> list[dict]:
    """The target's own traces, written once (by the build's backend) and kept on disk; a server or vLLM
    sampler made for them goes into ``samplers`` for the build to reuse."""
    path = data_dir / "target-traces.jsonl"
    if rank == 0 and not path.is_file():
        from datamodules.labels.shard import load_model, make_sampler, shard_seed

        s = config.sampling
        # the package samples with its own copy of the target; a server or vLLM needs none here
        model = load_model(config, "target") if s.backend == "hf" and "target" not in samplers else None
        sampler = samplers.get("target") or make_sampler(config, "target", model, tok, rank)
        if s.backend != "hf":
            samplers["target"] = sampler
        out = target_traces(sampler, records,
                            max_new_tokens=16 * config.steps.max_step_tokens, seed=shard_seed(s.seed, -1, "traces"),
                            task=config.resolved_task())
        S.atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in out).encode())
    barrier(synced)
    if not synced:  # ranks launched without a process group (RANK, WORLD_SIZE): no barrier waits for rank 0
        wait_for_file(path)
    return [json.loads(line) for line in path.read_text().splitlines()]


def _summary(manifest: dict, log) -> None:
    st = manifest["stats"]
    t = st["this_run"]
    built, reused = st["built_shards"], st["reused_shards"]
    others = len(manifest["shards"]) - built - reused
    log(f"built {built} shards, reused {reused}" + (f", {others} built by other processes" if others else "")
        + f" in {st['seconds']:.1f} s: {t['prefixes']} prefixes, {t['samples']} samples, "
        f"{t['groups']} groups, {t['judge_calls']} judge calls, {t['cache_hits']} cache hits; rows "
        + ", ".join(f"{r}={v['rows']}" for r, v in manifest["roles"].items()))
    log("seconds per stage: " + ", ".join(f"{k} {v:.1f}" for k, v in st["seconds_per_stage"].items()))


def main(args: list[str] | None = None) -> dict:
    """CLI: ``python -m datamodules.labels.build [--config build.yaml] [--data_dir DIR] [--build.KEY VALUE ...]``."""
    set_wait_policy()  # before torch loads: idle threads sleep rather than spin
    parser = build_parser()
    given = normalise_args(list(sys.argv[1:] if args is None else args))
    try:
        check_yaml_files(given, ("--config", "-c", "--fit_config"))
        _refuse_fit_yaml_as_config(given)
        parser.given_args = given  # its errors name the config file of a key no option set
        cfg = parser.parse_args(_with_fit_config(given))
        config = parser.instantiate(cfg).build  # the config checks its values before torch loads
        if data_dir_problem(cfg.data_dir):
            fail(PROG, data_dir_problem(cfg.data_dir))
        if cfg.max_shards is not None and cfg.max_shards < 1:
            fail(PROG, f"--max_shards {cfg.max_shards}: expected a number of new shards >= 1 (leave it out for all)")
        apply_threads(cfg.threads)  # before any model work
    except (ValueError, OSError) as e:
        fail(PROG, str(e))
    _, world = dist_info()
    import torch.distributed as dist

    if world > 1 and not dist.is_initialized() and "MASTER_ADDR" in os.environ:
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(hours=12))
    try:
        with sigterm_interrupts():
            done = build(config, cfg.data_dir, max_shards=cfg.max_shards)
        if "shards_on_disk" in done:  # stopped at --max_shards, without a manifest
            print(f"stopped at --max_shards {cfg.max_shards}: {done['shards_on_disk']} of {done['n_shards']} shards "
                  f"on disk, no manifest yet; rerun without --max_shards (or with it again) to go on", flush=True)
        return done
    except (ValueError, OSError, ImportError) as e:  # refused input: config values, task file, data_dir, models,
        fail(PROG, str(e))  # servers; a backend whose package is not installed (vLLM)
    except RuntimeError as e:
        from generation.engines.base import EngineError  # (here: torch is imported by now)

        if not isinstance(e, EngineError):  # a sampling server, an http judge or a reading engine failed or refused
            raise
        fail(PROG, f"{e} ({_kept(cfg.data_dir)}; rerun the same command to resume)")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; {_kept(cfg.data_dir)}. Resume with: {PROG} {shlex.join(given)}".rstrip(),
              file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _kept(data_dir: str) -> str:
    n = len(list(Path(data_dir).glob("shard-*.safetensors"))) if Path(data_dir).is_dir() else 0
    return f"{n} whole shard{'s' if n != 1 else ''} kept in {data_dir}"


def build_parser():
    """The build command's parser (``python -m datamodules.labels.build``); the fit reads its option names."""
    from jsonargparse import ActionConfigFile, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # field docstrings become --help text
    parser = one_line_parser(PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="YAML with data_dir and build.* keys")
    parser.add_argument("--fit_config", type=str | None, default=None,
                        help="Take data_dir and build from the data: section of a `python -m probes.fit` YAML "
                             "(later options override it).")
    parser.add_argument("--data_dir", type=str, default="data/arithmetic",
                        help="Output folder of shards and manifest.json.")
    parser.add_argument("--max_shards", type=int | None, default=None,
                        help="Stop after this many new shards (no manifest).")
    parser.add_argument("--threads", type=int | None, default=None, help=THREADS_HELP)
    parser.add_class_arguments(BuildConfig, "build")
    return parser


def _refuse_fit_yaml_as_config(args: list[str]) -> None:
    """A ``python -m probes.fit`` YAML given to ``--config`` is refused pointing to ``--fit_config`` (ValueError);
    jsonargparse named its first trainer key as not accepted."""
    for i, a in enumerate(args[:-1]):
        if a in ("--config", "-c") and Path(args[i + 1]).is_file():
            loaded = yaml.safe_load(Path(args[i + 1]).read_text())  # a mapping: check_yaml_files said so first
            if "data" in loaded and ({"trainer", "model"} & set(loaded)):
                raise ValueError(f"{a} {args[i + 1]}: a `python -m probes.fit` config (trainer, model and data "
                                 f"sections); give it as --fit_config {args[i + 1]} to build from its data: section")


def _with_fit_config(args: list[str]) -> list[str]:
    """``args`` with each ``--fit_config PATH`` replaced, where it stands, by the data: section of that fit YAML as a
    ``--config`` (what comes after it wins, as after any ``--config``)."""
    if "--fit_config" not in args:
        return args
    i = args.index("--fit_config")
    if i + 1 >= len(args) or not Path(args[i + 1]).is_file():
        raise ValueError(f"--fit_config {' '.join(args[i + 1 : i + 2])}: expected the path of a `python -m "
                         f"probes.fit` YAML")
    data = (yaml.safe_load(Path(args[i + 1]).read_text()) or {}).get("data") or {}
    if not isinstance(data, dict) or not isinstance(data.get("build") or {}, dict):
        raise ValueError(f"--fit_config {args[i + 1]}: its data: section (and data.build) must be mappings of "
                         "options, as `python -m probes.fit` reads them")
    if "build" in data and data["build"] is None:  # the fit trains on labels built on their own: none to build here
        raise ValueError(f"--fit_config {args[i + 1]}: its data.build is null (the fit builds nothing and reads "
                         "finished labels); give the build's options yourself, or a fit config with a data.build "
                         "section")
    section = {"data_dir": data.get("data_dir", "data/arithmetic"), "build": data.get("build") or {}}
    return args[:i] + ["--config", yaml.safe_dump(section)] + _with_fit_config(args[i + 2 :])


PROG = "python -m datamodules.labels.build"


if __name__ == "__main__":
    main(sys.argv[1:])
