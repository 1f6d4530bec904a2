"""The fit job's LightningCLI: its parser, the links between data and module, and the fit that reports refusals.

:mod:`probes.fit` imports this module only after :func:`probes.fit_args.first_pass` found nothing wrong with the
arguments, since importing it loads torch and Lightning.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import types
import typing
import warnings
from pathlib import Path
from typing import Any, NoReturn, Optional

from jsonargparse import set_parsing_settings
from lightning.pytorch import Callback
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from datamodules.datamodule import SemanticProbeDataModule
from generation.cli import did_you_mean, parser_options
from generation.threads import OPTION_HELP as THREADS_HELP, apply_threads, launched_processes
from probes.fit_args import DESCRIPTION, KNOWN_OPTIONS, PROG, fail, library_versions
from probes.fit_callbacks import NoValidationFallback, ProbeSummary
from probes.module import SemanticProbeModule
from probes.resume import KeepHistory, interrupted_line, refuse_differences, resume_args, run_dir_of

# Field docstrings of ProbeConfig / BuildConfig become their --help text (as in litgpt).
set_parsing_settings(docstring_parse_attribute_docstrings=True)


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
        parser.add_argument("--export", type=bool, default=True,
                            help="Export the best probes (false skips the export).")
        parser.add_argument("--test", type=bool, default=True,
                            help="Test the best checkpoint on the held-out split before exporting.")
        parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                            help="Resume training from this Lightning checkpoint (e.g. last.ckpt).")
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
            self.config["seed_everything"] = seed_everything(None if seed is True else seed, workers=True,
                                                             verbose=False)

    def before_instantiate_classes(self) -> None:
        try:  # one thread count per process, set before any model work
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


def make_cli(args: list[str], default_config: Path) -> ProbeCLI:
    """The parsed and instantiated CLI of ``args`` (a resume reads the run's own config first, see
    :mod:`probes.resume`; without ``--config``, ``default_config``)."""
    args, resume_base = resume_args(args)
    if "--config" not in args:
        # The embedded default unless a config is given. (Not `default_config_files`: jsonargparse then
        # rejects an optimizer class_path in the YAML.)
        args = ["--config", str(default_config)] + args
    quiet_lightning()
    ProbeCLI.resume_base = resume_base
    try:
        return ProbeCLI(SemanticProbeModule, SemanticProbeDataModule, args=args, save_config_kwargs={"overwrite": True},
                        **CLI_KWARGS)
    finally:
        ProbeCLI.resume_base = None


CHECKPOINT_ERRORS = ("Error(s) in loading state_dict",)
"""How torch refuses a ``--ckpt_path`` whose weights do not fit the model the config builds: an input error."""
CLI_KWARGS = {"run": False, "auto_configure_optimizers": False, "parser_class": ProbeArgumentParser,
              "parser_kwargs": {"prog": PROG, "description": DESCRIPTION, "allow_abbrev": False}}
"""How the fit's LightningCLI is built: by :func:`make_cli`, and by :func:`_fit_parser` for the options it knows
(``allow_abbrev`` off: no silent prefix matches)."""


class _SetupDone(Callback):
    """Marks the start of training: errors raised before it are about the input (data, config, optimizer)."""

    done = False

    def on_fit_start(self, trainer, pl_module) -> None:
        self.done = True


def fit(trainer, module, data, ckpt_path: Optional[str], args: list[str]) -> None:
    """``trainer.fit``; bad input before training ends in one line, Ctrl-C in what was kept and how to resume."""
    setup_done = _SetupDone()
    trainer.callbacks.append(setup_done)
    new_run_dir = _new_run_dir(trainer)
    run = run_dir_of(ckpt_path) if ckpt_path else None
    if run is not None:
        trainer.callbacks.append(KeepHistory(run, ckpt_path))
        # a resumed run saves into its own checkpoints/ by design (probes.resume): not worth a warning
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    handler = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    except (ValueError, OSError, RuntimeError) as e:
        from generation.engines.base import EngineError  # a server of the data build failed or refused

        refused = isinstance(e, EngineError) or str(e).startswith(CHECKPOINT_ERRORS)
        if setup_done.done or (isinstance(e, RuntimeError) and not refused):
            raise  # raised while training, or a fault of ours: not an input error, keep the traceback
        _drop_empty_run_dir(new_run_dir)
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


def _new_run_dir(trainer) -> Path | None:
    """The run folder this fit will create (its logger's next version), or None when it exists already (a resume)."""
    log_dir = trainer.log_dir if trainer.is_global_zero else None
    return Path(log_dir) if log_dir and not Path(log_dir).exists() else None


def _drop_empty_run_dir(run_dir: Path | None) -> None:
    """Remove the folder a refused fit created if it holds nothing but its ``config.yaml``."""
    if run_dir is not None and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {"config.yaml"}:
        (run_dir / "config.yaml").unlink(missing_ok=True)
        run_dir.rmdir()


def _fit_parser():
    """The fit's LightningCLI parser, built as the CLI builds it and never run."""
    class Built(Exception):
        pass

    class Capture(ProbeCLI):
        def parse_arguments(self, parser, args) -> NoReturn:
            raise Built(parser)

    try:
        Capture(SemanticProbeModule, SemanticProbeDataModule, args=[], **CLI_KWARGS)
    except Built as built:
        return built.args[0]
    raise RuntimeError("the fit parser was never built")  # pragma: no cover (parse_arguments always runs)


def known_options() -> list[str]:
    """Every option name of the fit parser, with the build config's keys under ``--data.build`` (the parser
    reads those only when it builds the data's ``BuildConfig``): what :data:`probes.fit_args.KNOWN_OPTIONS` records."""
    from datamodules.labels.build import build_parser

    build = {"--data." + o[2:] for o in parser_options(build_parser()) if o.startswith("--build.")}
    return sorted(set(parser_options(_fit_parser())) | build)


def scalar_kinds() -> dict[str, str]:
    """``{option: kind}`` for the fit parser's options whose type is made of int, float, bool and None alone
    (``"int|null"``, ``"float"``...): the values :func:`probes.fit_args.bad_value` checks before torch loads."""
    kinds = {option: kind for action in _fit_parser()._actions
             if (kind := scalar_kind(getattr(action, "_typehint", None) or action.type))
             for option in action.option_strings if option.startswith("--")}
    return dict(sorted(kinds.items()))


def scalar_kind(hint: Any) -> str | None:
    """``hint`` as ``"int|float|null"``-style text when it is int, float, bool, None or a union of them, else None."""
    names = {int: "int", float: "float", bool: "bool", type(None): "null"}
    parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if not parts or not all(p in names for p in parts):
        return None
    return "|".join(names[p] for p in parts)


def write_known_options(path: Path = KNOWN_OPTIONS) -> Path:
    """Write :func:`known_options` and :func:`scalar_kinds` with the library versions they were read with to
    ``path``."""
    record: dict[str, Any] = {"versions": library_versions(), "options": known_options(), "kinds": scalar_kinds()}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


_LIGHTNING_NOISE = ("litlogger", "Skipping setting a default `ModelSummary`")


def quiet_lightning() -> None:
    """Silence what a normal run need not show: Lightning's litlogger tip, its warning about a ``__len__``
    of iterable datasets (the stream deals shards to workers itself, so its length holds), and torch's
    deprecation of ``LeafSpec``, which Lightning's own code still builds (nothing a user can
    change)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages())
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(word in str(record.getMessage()) for word in _LIGHTNING_NOISE)
