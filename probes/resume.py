"""Resuming a fit: ``--ckpt_path <run>/checkpoints/last.ckpt`` continues that run, with its config, in its folder.

LightningCLI saves each run's full config as ``<run>/config.yaml``. Resuming parses that file first
and the command's own options on top; an option that differs from the run's config is refused,
naming the fields (a resumed run is the interrupted run, continued). The logger is pinned to the
run's version folder, so checkpoints, ``metrics.csv`` and the export stay in one place.
"""

from __future__ import annotations

import csv
import shlex
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import Callback

from generation.cli import option_value

IGNORED = ("config", "ckpt_path", "trainer.logger.init_args.version", "test", "export", "export_dir", "threads")
"""Fields a resumed run may differ in: how it was started (its thread count too) and what follows training, not
what it trains."""


def run_dir_of(ckpt_path: str | Path) -> Path | None:
    """The run folder of a checkpoint in ``<run>/checkpoints/`` whose ``config.yaml`` is there, else None."""
    p = Path(ckpt_path)
    if p.parent.name == "checkpoints" and (p.parent.parent / "config.yaml").is_file():
        return p.parent.parent
    return None


def resume_args(args: list[str]) -> tuple[list[str], list[str] | None]:
    """``args`` to parse for a resume, and the arguments that give the run's own config alone (None: no resume).

    The run's ``config.yaml`` goes first, the command's options on top, the logger's version last
    (the run's folder, when its logger has versions).
    """
    ckpt = option_value(args, "--ckpt_path")
    run = run_dir_of(ckpt) if ckpt else None
    if run is None:
        return args, None
    saved = yaml.safe_load((run / "config.yaml").read_text()) or {}
    logger = (saved.get("trainer") or {}).get("logger")
    pin = ["--trainer.logger.init_args.version", run.name] if isinstance(logger, dict) and "version" in (
        logger.get("init_args") or {}) else []
    base = ["--config", str(run / "config.yaml")]
    return base + args + pin, base + ["--ckpt_path", ckpt] + pin


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix[:-1]}[{i}].").items()}
    return {prefix[:-1]: value}


def config_differences(given: dict, run: dict) -> list[str]:
    """``field: run's value -> given value`` for each field that differs (the fields of :data:`IGNORED` aside)."""
    a, b = _flat(given), _flat(run)
    keys = sorted(k for k in set(a) | set(b) if not any(k == i or k.startswith(i + ".") for i in IGNORED)
                  and not k.endswith("__path__"))
    return [f"{k}: run {b.get(k)!r}, given {a.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def resume_command(prog: str, last: str, args: list[str]) -> str:
    """The command that resumes from ``last``: ``--ckpt_path`` alone when its run folder holds the config."""
    if run_dir_of(last) is not None:
        return f"{prog} --ckpt_path {shlex.quote(str(last))}"
    rest = [a for i, a in enumerate(args) if "--ckpt_path" not in (a, args[i - 1] if i else None)]  # and its value
    return f"{prog} {shlex.join(rest + ['--ckpt_path', str(last)])}".replace("  ", " ")


def interrupted_line(prog: str, trainer, args: list[str]) -> str:
    """What an interrupted fit kept (``last.ckpt``) and the command that resumes it, as one line."""
    last = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
    if not last or not Path(last).is_file():
        return (f"{prog}: interrupted in epoch {trainer.current_epoch + 1} before a checkpoint was saved; nothing "
                "kept to resume from. Rerun the command to start again.")
    import torch

    epoch = int(torch.load(last, map_location="cpu", weights_only=False).get("epoch", -1)) + 1
    return (f"{prog}: interrupted; kept {last} (after epoch {epoch}). Resume with: "
            + resume_command(prog, last, args))


class KeepHistory(Callback):
    """Keeps a resumed run's ``metrics.csv`` rows up to the checkpoint's epoch (the CSV logger would drop them)."""

    def __init__(self, run_dir: Path, ckpt_path: str):
        self.rows: list[dict] = []
        path = run_dir / "metrics.csv"
        if path.is_file():
            import torch

            done = int(torch.load(ckpt_path, map_location="cpu", weights_only=False).get("epoch", -1))
            with path.open(newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if r.get("epoch") in (None, "")
                             or int(float(r["epoch"])) <= done]

    def setup(self, trainer, pl_module, stage: str) -> None:
        experiment = getattr(trainer.logger, "experiment", None)
        if self.rows and hasattr(experiment, "metrics") and hasattr(experiment, "metrics_keys"):
            experiment.metrics[:0] = [{k: v for k, v in r.items() if v != ""} for r in self.rows]
            self.rows = []


def refuse_differences(fail, prog: str, given: dict, run: dict, ckpt: str) -> None:
    """Refuse (through ``fail``) options that differ from the resumed run's config, naming the fields."""
    diff = config_differences(given, run)
    if diff:
        fail(f"--ckpt_path {ckpt} resumes the run in {run_dir_of(ckpt)}, whose config.yaml differs from the options "
             f"given: {'; '.join(diff[:8])}{' ...' if len(diff) > 8 else ''}. Resume with `{prog} --ckpt_path {ckpt}` "
             "alone (the run's own config), or start a new run without --ckpt_path")
