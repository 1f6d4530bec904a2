"""`python -m probes.fit`: build labels if missing, train the probes, test the best, export them.

With no arguments it runs the embedded default (``configs/arithmetic.yaml``) offline on a CPU.
Every option can be overridden (``--trainer.max_epochs 3``, ``--data.batch_size 256``) and
``--help`` shows the common ones, ``--help_all`` (or ``--help full``) every one with its docs. On success it prints the
exported probe paths and a metric table. Probes are exported inside the run's own folder
(``<trainer.log_dir>/export/<role>``); replacing the shipped ones is explicit: ``--export_dir
checkpoints/arithmetic/probes``.

Bad input (an unknown key, a value a class refuses, data that cannot be built) ends the command with
one line on stderr and exit status 2, never a traceback. ``--config <run>/config.yaml --ckpt_path
<run>/checkpoints/last.ckpt`` resumes an interrupted run with its own config (the one LightningCLI saved in its
folder), in a new run folder; Ctrl-C prints that command. Option names are looked at before torch loads
(:mod:`probes.fit_args`), so a mistyped option is refused in under a second; the LightningCLI itself is
:mod:`probes.fit_cli`.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from generation.cli import normalise_args
from generation.paths import DEFAULT_CONFIG
from generation.threads import set_wait_policy
from probes.fit_args import DESCRIPTION, PROG, first_pass

if TYPE_CHECKING:  # torch and Lightning load after the first pass over the arguments (probes.fit_args)
    from probes.module import SemanticProbeModule

SHORT_HELP = f"""usage: {PROG} [options]

{DESCRIPTION}

Common options (every option, with its docs: {PROG} --help_all, or --help full):
  -c, --config FILE           YAML config (default: configs/arithmetic.yaml, the embedded default)
  --data.data_dir DIR         label data: shards + manifest.json, built there when missing
  --data.build null           train on the finished data in data_dir as it is, never build
  --data.feature_groups LIST  what the probes read, from [hidden, token_stats, topk_stats] (e.g. [topk_stats])
  --data.val_fraction X       share of problems held out for validation (0: monitors watch the train loss)
  --trainer.max_epochs N      epochs to train (-1: no limit; early stopping ends the run)
  --trainer.devices N         devices (processes) to train on
  --threads N                 torch threads per process (default: OMP_NUM_THREADS, else the cores)
  --export_dir DIR            where the best probes are exported (default: <run folder>/export)
  --ckpt_path FILE            resume from a last.ckpt (with --config <run>/config.yaml: the run's own options)
  --print_config              print the full config and exit
  -h, --help                  this screen
  --help_all                  every option (trainer, model, data, build), with its docs
"""


def export_probes(module: SemanticProbeModule, export_dir: str | os.PathLike,
                  test_metrics: dict[str, float], training: dict[str, Any] | None = None) -> dict[str, Path]:
    """Export each role's probe of ``module`` with its test metrics and how it was trained (``training``,
    :func:`training_record`) into ``export_dir/<role>`` (the paths it records made portable,
    :func:`~probes.model.portable_config`)."""
    from probes.model import export_probe

    paths = {}
    for role, probe in module.probes.items():
        prefix = f"test/{role}/"
        probe.config.test_metrics = {k[len(prefix) :]: float(v) for k, v in test_metrics.items()
                                     if k.startswith(prefix) and math.isfinite(v)}  # undefined (NaN): left out
        probe.config.training = dict(training or {})
        # float32, as load_probe says an export is, whatever --trainer.precision trained it in (bf16-true, 64-true)
        paths[role] = export_probe(copy.deepcopy(probe).cpu().float().eval(), Path(export_dir) / role)
    return paths


def training_record(trainer, module: SemanticProbeModule, best: str | None = None) -> dict[str, Any]:
    """How ``trainer`` trained ``module``'s probes: the loss, the optimizer's class and learning rate, the
    scheduler's class (if any), the epochs run, the epoch whose weights are exported (``best_epoch``: that of the
    ``best`` checkpoint, where one was kept, counted from 1 as the epochs are) and the precision (the exported
    ``config.json``'s ``training``, shown on the card)."""
    out: dict[str, Any] = {"loss": module.loss_name}
    if trainer.optimizers:
        optimizer = trainer.optimizers[0]
        out["optimizer"] = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        if isinstance(lr := optimizer.defaults.get("lr"), (int, float)):
            out["lr"] = float(lr)
    if trainer.lr_scheduler_configs:
        scheduler = type(trainer.lr_scheduler_configs[0].scheduler)
        out["lr_scheduler"] = f"{scheduler.__module__}.{scheduler.__qualname__}"
    out["epochs"] = int(trainer.current_epoch)
    if best:
        import torch

        out["best_epoch"] = int(torch.load(best, map_location="cpu", weights_only=False)["epoch"]) + 1
    return {**out, "precision": str(trainer.precision)}


def default_export_dir(trainer) -> Path:
    """``<trainer.log_dir>/export``: the run's own folder, so a default run never writes over tracked files."""
    return Path(trainer.log_dir or trainer.default_root_dir) / "export"


def main(args: list[str] | None = None) -> dict[str, Any]:
    """Run the fit job; returns ``{"export": {role: path}, "test": metrics, "best_ckpt": path}``."""
    set_wait_policy()  # before torch loads: idle threads sleep rather than spin
    args = normalise_args(list(sys.argv[1:] if args is None else args))
    args = _help_args(args)
    first_pass(args)  # no torch yet: a bad option costs a second, not the imports below
    from probes.card import markdown_table
    from probes.fit_cli import fit, make_cli, run_test

    cli = make_cli(args, DEFAULT_CONFIG)
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    fit(trainer, module, data, cli.config.get("ckpt_path"))
    best = getattr(trainer.checkpoint_callback, "best_model_path", "") or None
    live = _spec_summary(trainer)  # before test() replaces the callback metrics
    test_metrics: dict[str, float] = {}
    if cli.config.get("test", True) and getattr(data, "test_fraction", 1) > 0:  # 0: no test split to run on
        # the path, not "best": with the configs' second ModelCheckpoint (the latest epoch) Lightning warns that it
        # picks the first one's best
        results = run_test(trainer, module, data, best)
        test_metrics = {k: float(v) for r in results for k, v in r.items()}
    elif best:  # the test loads the best weights; without one, they are loaded here, so the best ones are exported
        import torch

        module.load_state_dict(torch.load(best, map_location="cpu", weights_only=False)["state_dict"])
    paths: dict[str, Path] = {}
    diverged = _diverged(module, trainer)
    unexported = (diverged or _not_exported(trainer)) if cli.config.get("export", True) else None
    export_dir = cli.config.get("export_dir") or default_export_dir(trainer)  # every rank: a broadcast under DDP
    if cli.config.get("export", True) and trainer.is_global_zero and unexported is None:
        paths = export_probes(module, export_dir, test_metrics, training_record(trainer, module, best))
    if trainer.is_global_zero:
        summary = metric_rows(test_metrics, module.roles) | live
        print("\nbest checkpoint:", best or "(none)")
        if unexported is not None:
            print(f"not exported: {unexported}")
        elif diverged:  # --export false: the run still failed, and says why
            print(f"failed: {diverged}")
        for role, p in paths.items():
            print(f"exported {role} probe: {p}")
        if summary:
            columns = ["mse", "mae", "r2", "pearson", "auroc", "ece", "speedup", "accuracy", "accuracy_delta",
                       "step_acceptance"]
            print(markdown_table(["probe", *columns], [[name, *(f"{v[c]:.4f}" if c in v else "-" for c in columns)]
                                                      for name, v in summary.items()]))
        else:
            print("no test metrics: " + ("--trainer.barebones turns off logging" if trainer.barebones else
                                         "the run had no test split (data.test_fraction=0) or --test false"))
        if untested := [r for r in module.roles if test_metrics and not any(k.startswith(f"test/{r}/")
                                                                              for k in test_metrics)]:
            print(f"not tested: the {' and '.join(untested)} probe, which had no rows in the test batches run (the "
                  "test stream gives the rows in the shards' order: a --trainer.limit_test_batches may stop first)")
    if diverged:
        raise SystemExit(1)  # a failed run, whatever it printed: no caller should take it for a trained probe
    return {"export": paths, "test": test_metrics, "best_ckpt": best}


def _diverged(module: SemanticProbeModule, trainer) -> str | None:
    """Why the trained weights are no probe (NaN or infinite values, which the loader refuses), or None."""
    from probes.model import nonfinite_probes

    if not (bad := nonfinite_probes(module.probes)):
        return None
    why = "; in 16-true Adam's updates overflow float16: use 16-mixed" if str(trainer.precision) == "16-true" else ""
    return (f"the weights hold NaN or infinite values ({bad}): the training diverged (--trainer.precision "
            f"{trainer.precision}{why}), and a decoder would refuse them")


def _not_exported(trainer) -> str | None:
    """Why the fit's probes are not worth exporting (over an export a decoder may read), or None: a debugging run,
    or a fit that trained no batch."""
    if trainer.fast_dev_run:
        return "--trainer.fast_dev_run is a debugging run (a batch or a few, no checkpoints)"
    if trainer.global_step == 0:
        return ("the fit trained no batch (--trainer.limit_train_batches, max_steps or max_time 0?): the probes are "
                "as initialised; --export false says so without this line")
    return None


def _help_args(args: list[str]) -> list[str]:
    """``--help`` / ``-h``: the short screen of common options (and exit); ``--help_all`` / ``--help full``: every
    option with the parser's own defaults, the other arguments (a ``--config`` too) kept and ``--help`` last, so no
    default config is read (it prints from a wheel too)."""
    full = [i + 1 for i, a in enumerate(args) if a in ("--help", "-h") and args[i + 1 : i + 2] == ["full"]]
    if "--help_all" in args or full:
        return [a for i, a in enumerate(args) if a not in ("--help_all", "--help", "-h") and i not in full] + ["--help"]
    if "--help" in args or "-h" in args:
        print(SHORT_HELP, end="")
        raise SystemExit(0)
    return args


def metric_rows(test_metrics: dict[str, float], roles: list[str]) -> dict[str, dict[str, float]]:
    """Rows of the closing table: each probe on all its test rows, and the target probe on the rows each model wrote.

    ``test/target/auroc`` goes to row ``target``; ``test/target/draft_written/auroc`` to row
    ``target (draft-written)``, where the decoder's decisions happen.
    """
    rows: dict[str, dict[str, float]] = {}
    for role in roles:
        for sub in ("", "draft_written/", "target_written/"):
            prefix = f"test/{role}/{sub}"
            values = {k[len(prefix) :]: v for k, v in test_metrics.items() if k.startswith(prefix)
                      and "/" not in k[len(prefix) :]}
            if values:
                rows[f"{role} ({sub[:-1].replace('_', '-')})" if sub else role] = values
    return rows


def _spec_summary(trainer) -> dict[str, dict[str, float]]:
    """The last live speculative-decoding figures, when a SpeculativeValidation callback ran."""
    found = {k.split("/", 1)[1]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("spec/")}
    return {"decoding (live)": found} if found else {}


if __name__ == "__main__":
    main()
