"""`python -m probes.fit`: build labels if missing, train the probes, test the best, export them.

With no arguments it runs the embedded default (``configs/arithmetic.yaml``) offline on a CPU.
Every option can be overridden (``--trainer.max_epochs 3``, ``--data.batch_size 256``) and
``--help`` shows the common ones, ``--help_all`` (or ``--help full``) every one with its docs. On success it prints the exported probe paths and a metric
table. Probes are exported inside the run's own folder (``<trainer.log_dir>/export/<role>``);
replacing the shipped ones is explicit: ``--export_dir checkpoints/arithmetic/probes``.

Bad input (an unknown key, a value a class refuses, data that cannot be built) ends the command with
one line on stderr and exit status 2, never a traceback. ``--ckpt_path <run>/checkpoints/last.ckpt``
resumes an interrupted run with its own config, in its own folder (:mod:`probes.resume`); Ctrl-C
prints that command.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn, Optional

from jsonargparse import set_parsing_settings
from lightning.pytorch import Callback
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from datamodules.labels.build import SERVER_ERRORS
from datamodules.labels.cli import check_yaml_files, did_you_mean, normalise_args, parser_options
from datamodules.datamodule import SemanticProbeDataModule
from generation.paths import portable_paths
from generation.threads import DEFAULT_THREADS, OPTION_HELP as THREADS_HELP, apply_threads, launched_processes
from probes.export import export_probe
from probes.fit_callbacks import NoValidationFallback, ProbeSummary
from probes.module import SemanticProbeModule
from probes.resume import KeepHistory, interrupted_line, refuse_differences, resume_args, run_dir_of

# Field docstrings of ProbeConfig / BuildConfig become their --help text (as in litgpt).
set_parsing_settings(docstring_parse_attribute_docstrings=True)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "arithmetic.yaml"
PROG = "python -m probes.fit"
DESCRIPTION = (
    "Build SemanticSpec label data if it is missing, train the target and draft probes, test the best "
    "checkpoint on held-out problems and export it (model.safetensors + config.json per role)."
)
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
  --threads N                 torch threads per process (default: OMP_NUM_THREADS, else {DEFAULT_THREADS} per host)
  --export_dir DIR            where the best probes are exported (default: <run folder>/export)
  --ckpt_path FILE            resume an interrupted run from its last.ckpt (with the run's own config)
  --print_config              print the full config and exit
  -h, --help                  this screen
  --help_all                  every option (trainer, model, data, build), with its docs
"""


def fail(message: str) -> NoReturn:
    """Report bad input as one line on stderr and exit 2 (issue 12: no traceback, no page of usage)."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    # jsonargparse explains a type error over several lines; keep what names the key, the types and the value
    noise = ("Subtypes:", "Errors:", "Given value type:")
    text = " ".join(line for line in lines if not line.startswith(noise))
    # a class that refused its arguments in an Optional field: keep its own message, not the Union's wrapping
    refused = re.search(r"(invalid \w+: .*?)(?: - Expected a <class 'NoneType'>.*)?$", text)
    if refused and "Union subtypes" in text:
        text = refused.group(1)
    print(f"{PROG}: error: {text} (see `{PROG} --help`)", file=sys.stderr)
    raise SystemExit(2)


class ProbeArgumentParser(LightningArgumentParser):
    """Parse errors as one line (see :func:`fail`) instead of the whole usage and a tip."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        from jsonargparse._common import debug_mode_active

        if not self.exit_on_error or debug_mode_active():  # jsonargparse asks for an exception here
            super().error(message, ex)
        fail(did_you_mean(message, parser_options(self)))


class ProbeCLI(LightningCLI):
    """LightningCLI that links what only the data knows into the module and adds ``--export_dir``."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--export_dir",
            type=Optional[str],
            default=None,
            help="Where the best probes are exported, one folder per role (model.safetensors + config.json). "
            "Default: <trainer.log_dir>/export, inside this run's folder. `--export_dir checkpoints/arithmetic/probes` "
            "replaces the shipped probes.",
        )
        parser.add_argument("--export", type=bool, default=True, help="Export the best probes (false skips the export).")
        parser.add_argument("--test", type=bool, default=True, help="Test the best checkpoint on the held-out split before exporting.")
        parser.add_argument("--ckpt_path", type=Optional[str], default=None, help="Resume training from this Lightning checkpoint (e.g. last.ckpt).")
        parser.add_argument("--threads", type=Optional[int], default=None, help=THREADS_HELP)
        parser.link_arguments("data.roles", "model.roles")
        parser.link_arguments("data.input_spec", "model.input_spec", apply_on="instantiate")

    resume_base: Optional[list[str]] = None
    """Set by main() when resuming: the arguments that give the run's own config (see :mod:`probes.resume`)."""

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        # main() always hands over the arguments (sys.argv's, after the default --config), so Lightning's
        # warning about `args` and sys.argv both being given would open every run; parse them directly.
        self.config = parser.parse_args(args)
        if self.resume_base is not None:  # a resumed run is the interrupted run: refuse other values
            run = parser.parse_args(self.resume_base)
            refuse_differences(fail, PROG, self.config.as_dict(), run.as_dict(), self.config.get("ckpt_path"))

    def _set_seed(self) -> None:
        # Lightning prints "Seed set to N" here, before the classes check their arguments: a refused value
        # would then print two lines. The seed stays in the run's config.yaml.
        from lightning.fabric.utilities.seed import seed_everything

        seed = self.config.get("seed_everything")
        if seed is not False:
            self.config["seed_everything"] = seed_everything(None if seed is True else seed, workers=True, verbose=False)

    def before_instantiate_classes(self) -> None:
        try:  # issue 36: one thread count per process, set before any model work
            apply_threads(self.config.get("threads"), launched=launched_processes(self.config.get("trainer.devices")))
        except ValueError as e:
            fail(str(e))
        epochs = self.config.get("trainer.max_epochs")
        if epochs is not None and epochs < 1 and epochs != -1:
            fail(f"--trainer.max_epochs {epochs}: expected a number of epochs >= 1, or -1 for no limit (early "
                 "stopping or --trainer.max_time ends the run)")

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]):
        callbacks = list(callbacks) + [NoValidationFallback()]
        if config.get("enable_model_summary") is not False:
            callbacks.append(ProbeSummary())  # Lightning's own, less its "FLOPs 0" column and total
        return super()._instantiate_trainer(config, callbacks)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, OSError) as e:  # the classes check their arguments when built (docs/contributing.md)
            fail(str(e))


class _SetupDone(Callback):
    """Marks the start of training: errors raised before it are about the input (data, config, optimizer)."""

    done = False

    def on_fit_start(self, trainer, pl_module) -> None:
        self.done = True


def export_probes(module: SemanticProbeModule, export_dir: str | os.PathLike, test_metrics: dict[str, float]) -> dict[str, Path]:
    """Export each role's probe of ``module`` with its test metrics into ``export_dir/<role>``.

    Paths in the exported ``config.json`` (the model's ``name_or_path``, the judge's) are made
    portable first: relative to the repository when inside it, else the folder's name. They are
    informative only (loading compares the other fingerprint fields), and a shipped export must not
    carry the exporting machine's folders.
    """
    paths = {}
    for role, probe in module.probes.items():
        prefix = f"test/{role}/"
        probe.config.test_metrics = {k[len(prefix) :]: float(v) for k, v in test_metrics.items() if k.startswith(prefix)}
        probe.config.reads, probe.config.labels = portable_paths(probe.config.reads), portable_paths(probe.config.labels)
        paths[role] = export_probe(probe.cpu().eval(), Path(export_dir) / role)
    return paths


def default_export_dir(trainer) -> Path:
    """``<trainer.log_dir>/export``: the run's own folder, so a default run never writes over tracked files."""
    return Path(trainer.log_dir or trainer.default_root_dir) / "export"


def format_table(rows: dict[str, dict[str, float]], columns: list[str]) -> str:
    """A small markdown table: one row per key of ``rows``."""
    lines = ["| probe | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, values in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[c]:.4f}" if c in values else "-" for c in columns) + " |")
    return "\n".join(lines)


def main(args: ArgsType = None) -> dict[str, Any]:
    """Run the fit job; returns ``{"export": {role: path}, "test": metrics, "best_ckpt": path}``."""
    args = normalise_args(list(sys.argv[1:] if args is None else args))
    args = _help_args(args)
    try:
        check_yaml_files(args)
    except ValueError as e:
        fail(str(e))
    given = list(args)  # for the resume command an interrupted run prints
    args, resume_base = resume_args(args)
    if "--config" not in args:
        # The embedded default unless a config is given. (Not `default_config_files`: jsonargparse then
        # rejects an optimizer class_path in the YAML.)
        args = ["--config", str(DEFAULT_CONFIG)] + args
    _quiet_lightning()
    ProbeCLI.resume_base = resume_base
    try:
        cli = ProbeCLI(
            SemanticProbeModule,
            SemanticProbeDataModule,
            run=False,
            auto_configure_optimizers=False,
            args=args,
            save_config_kwargs={"overwrite": True},
            parser_class=ProbeArgumentParser,
            parser_kwargs={"prog": PROG, "description": DESCRIPTION, "allow_abbrev": False},  # no silent prefix matches
        )
    finally:
        ProbeCLI.resume_base = None
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    ckpt_path = cli.config.get("ckpt_path")
    _fit(trainer, module, data, ckpt_path, given)
    best = getattr(trainer.checkpoint_callback, "best_model_path", "") or None
    live = _spec_summary(trainer)  # before test() replaces the callback metrics
    test_metrics: dict[str, float] = {}
    if cli.config.get("test", True):
        results = trainer.test(module, datamodule=data, ckpt_path="best" if best else None, verbose=False)
        test_metrics = {k: float(v) for r in results for k, v in r.items()}
    paths: dict[str, Path] = {}
    if cli.config.get("export", True) and trainer.is_global_zero:
        export_dir = cli.config.get("export_dir") or default_export_dir(trainer)
        paths = export_probes(module, export_dir, test_metrics)
    if trainer.is_global_zero:
        summary = metric_rows(test_metrics, module.roles)
        summary.update(live)
        print("\nbest checkpoint:", best or "(none)")
        for role, p in paths.items():
            print(f"exported {role} probe: {p}")
        print(format_table(summary, ["mse", "mae", "r2", "pearson", "auroc", "ece", "speedup", "accuracy", "accuracy_delta",
                                     "step_acceptance"]))
    return {"export": paths, "test": test_metrics, "best_ckpt": best}


def _fit(trainer, module, data, ckpt_path: Optional[str], args: list[str]) -> None:
    """``trainer.fit``; bad input before training ends in one line, Ctrl-C in what was kept and how to resume."""
    setup_done = _SetupDone()
    trainer.callbacks.append(setup_done)
    run = run_dir_of(ckpt_path) if ckpt_path else None
    if run is not None:
        trainer.callbacks.append(KeepHistory(run, ckpt_path))
    handler = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    except (ValueError, OSError, RuntimeError) as e:
        if setup_done.done or (isinstance(e, RuntimeError) and not str(e).startswith(SERVER_ERRORS)):
            raise  # raised while training, or a fault of ours: not an input error, keep the traceback
        fail(str(e))  # the data build (its servers), the data checks or the optimizer refused the input
    except SystemExit:
        if not trainer.interrupted:
            raise
        # Lightning caught KeyboardInterrupt, shut down and called sys.exit(1): say what was kept
        if handler is not None:
            signal.signal(signal.SIGINT, handler)  # Lightning left SIGINT ignored
        if trainer.is_global_zero:
            print(interrupted_line(PROG, trainer, args), file=sys.stderr)
        raise SystemExit(130) from None


def _help_args(args: list[str]) -> list[str]:
    """``--help`` / ``-h``: the short screen of common options (and exit); ``--help_all`` / ``--help full``: every one."""
    if "--help_all" in args or any(a in ("--help", "-h") and args[i + 1 : i + 2] == ["full"] for i, a in enumerate(args)):
        return ["--help"]
    if "--help" in args or "-h" in args:
        print(SHORT_HELP, end="")
        raise SystemExit(0)
    return args


_LIGHTNING_NOISE = ("litlogger", "Skipping setting a default `ModelSummary`")


def _quiet_lightning() -> None:
    """Silence what a normal run need not show: Lightning's litlogger tip and its warning about a ``__len__``
    of iterable datasets (the stream deals shards to workers itself, so its length holds)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages())
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(word in str(record.getMessage()) for word in _LIGHTNING_NOISE)


def metric_rows(test_metrics: dict[str, float], roles: list[str]) -> dict[str, dict[str, float]]:
    """Rows of the closing table: each probe on all its test rows, and the target probe on the rows each model wrote.

    ``test/target/auroc`` goes to row ``target``; ``test/target/draft_written/auroc`` to row
    ``target (draft-written)``, where the decoder's decisions happen.
    """
    rows: dict[str, dict[str, float]] = {}
    for role in roles:
        for sub in ("", "draft_written/", "target_written/"):
            prefix = f"test/{role}/{sub}"
            values = {k[len(prefix) :]: v for k, v in test_metrics.items() if k.startswith(prefix) and "/" not in k[len(prefix) :]}
            if values:
                rows[f"{role} ({sub[:-1].replace('_', '-')})" if sub else role] = values
    return rows


def _spec_summary(trainer) -> dict[str, dict[str, float]]:
    """The last live speculative-decoding figures, when a SpeculativeValidation callback ran."""
    found = {k.split("/", 1)[1]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("spec/")}
    return {"decoding (live)": found} if found else {}


if __name__ == "__main__":
    main()
