"""The fit job's LightningCLI: its parser, the links between data and module, and the fit that reports refusals.

:mod:`probes.fit` imports this module only after :func:`probes.fit_args.first_pass` found nothing wrong with the
arguments, since importing it loads torch and Lightning.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import re
import shlex
import signal
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, NoReturn, Optional

from jsonargparse import set_parsing_settings
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from datamodules.datamodule import SemanticProbeDataModule
from generation.cli import OneLineErrors, parser_options
from generation.paths import atomic_path, folder_problem
from generation.threads import OPTION_HELP as THREADS_HELP, apply_threads, launched_processes
from probes.fit_args import DESCRIPTION, PROG, check_names, fail, options_cache
from probes.fit_callbacks import FALLBACK_MONITOR, NoValidationFallback
from probes.module import SemanticProbeModule

# Field docstrings of ProbeConfig / BuildConfig become their --help text (as in litgpt).
set_parsing_settings(docstring_parse_attribute_docstrings=True)


class ProbeArgumentParser(OneLineErrors, LightningArgumentParser):
    """Parse errors as one line (see :func:`generation.cli.fail`) instead of the whole usage and a tip."""

    def __init__(self, *args, prog: str | None = None, **kwargs):
        # jsonargparse makes the parser of a nested help (--data.build.help) with no prog: it was "usage: fit.py"
        super().__init__(*args, prog=prog or PROG, **kwargs)


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

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        # main() always hands over the arguments (sys.argv's, after the default --config), so Lightning's
        # warning about `args` and sys.argv both being given would open every run; parse them directly.
        check_names(list(args or ()), remember_options(parser))  # what the cache checked, when it was there
        parser.given_args = list(args or ())  # its errors name the config file of a key no option set
        self.config = parser.parse_args(args)
        _logger_follows_root(self.config, list(args or ()))

    def _set_seed(self) -> None:
        # Lightning prints "Seed set to N" here, before the classes check their arguments: a refused value
        # would then print two lines. The seed stays in the run's config.yaml.
        from lightning.fabric.utilities.seed import seed_everything

        seed = self.config.get("seed_everything")
        if seed is True:  # "a random seed", as --help says (Lightning's seed_everything(None) picks 0)
            seed = random.SystemRandom().randrange(2**32)
        if seed is not False:
            try:
                self.config["seed_everything"] = seed_everything(seed, workers=True, verbose=False)
            except ValueError as e:  # out of numpy's range
                fail(f"--seed_everything {seed}: {e}")

    def before_instantiate_classes(self) -> None:
        if self.config.get("ckpt_path"):
            check_checkpoint(self.config.ckpt_path, self.config.get("trainer.default_root_dir"))
            check_resumed_options(self.config.ckpt_path, self.parser.dump(self.config, skip_check=True))
        try:  # one thread count per process, set before any model work
            apply_threads(self.config.get("threads"), launched=launched_processes(self.config.get("trainer.devices")))
        except ValueError as e:
            fail(str(e))
        epochs = self.config.get("trainer.max_epochs")
        if epochs is not None and epochs < 1 and epochs != -1:
            fail(f"--trainer.max_epochs {epochs}: expected a number of epochs >= 1, or -1 for no limit (early "
                 "stopping or --trainer.max_time ends the run)")
        if self.config.get("ckpt_path") == "":  # Lightning's "found no path for the best weights"
            fail("--ckpt_path '': expected a last.ckpt to resume from (leave it out to start afresh)")
        folders = (("--export_dir", self.config.get("export_dir")),
                   ("--trainer.default_root_dir", self.config.get("trainer.default_root_dir")))
        for problem in trainer_problems(self.config.get("trainer")) + [roles_problem(self.config)] + [
                folder_problem(value, option) for option, value in folders if value is not None]:
            if problem:
                fail(problem)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]):
        check_optimizer(self.model)  # before the Trainer's own lines (GPU available: ...) on the terminal
        return super()._instantiate_trainer(config, list(callbacks) + [NoValidationFallback()])

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, OSError) as e:  # the classes check their arguments when built (docs/contributing.md)
            fail(str(e))
        except (MisconfigurationException, TypeError) as e:  # the Trainer's own refusal: devices, accelerator...
            if isinstance(e, TypeError) and "devices" not in str(e):
                raise
            fail(f"--trainer: {e}")


def trainer_problems(trainer) -> list[str]:
    """The Trainer's counts that Lightning takes and then fails on (a ZeroDivisionError mid-fit), trains wrongly with
    (``accumulate_grad_batches -1``) or takes outside its documented range, as ``--trainer.<name> <value>: ...``."""
    trainer = trainer or {}
    out = []
    least = {"accumulate_grad_batches": 1, "check_val_every_n_epoch": 1, "log_every_n_steps": 1, "min_epochs": 0,
             "num_sanity_val_steps": -1}  # Lightning's documented ranges (-1: every validation batch), unchecked there
    for name, low in least.items():
        value = trainer.get(name)
        if value is not None and not (isinstance(value, int) and value >= low):
            out.append(f"--trainer.{name} {value}: expected an integer >= {low}")
    interval = trainer.get("val_check_interval")  # also a time ("00:00:00:02", a timedelta, a dict): Lightning's
    if isinstance(interval, (int, float)) and not isinstance(interval, bool) and not interval > 0:
        out.append(f"--trainer.val_check_interval {interval}: expected a share of an epoch > 0 or a number of "
                   "batches >= 1")
    elif interval is not None and not isinstance(interval, (int, float)) and configured(trainer, "EarlyStopping"):
        out.append(f"--trainer.val_check_interval {interval}: a time between validations breaks Lightning's "
                   "EarlyStopping (it reads trainer.val_check_interval, which a time leaves unset: an "
                   "AttributeError); give a share of an epoch or a number of batches, or drop EarlyStopping")
    if trainer.get("limit_val_batches") in (0, 0.0):
        out.append("--trainer.limit_val_batches 0: the monitors watch validation metrics; to train without "
                   "validation give --data.val_fraction 0 (they then watch the train loss)")
    return out


def configured(trainer, name: str) -> bool:
    """Whether the trainer options list a callback of class ``name`` (a config's ``class_path``, or an instance)."""
    return any(str(getattr(c, "class_path", c)).endswith(name) for c in (trainer or {}).get("callbacks") or [])


def roles_problem(config) -> str | None:
    """Live validation (``SpeculativeValidation``) decodes with both probes: a run that trains one is refused here,
    before the data is prepared, rather than by the callback's setup after it."""
    roles = config.get("data.roles") or []
    if not roles or not set(roles) <= {"target", "draft"}:
        return None  # no roles, or not roles: the data module names what is wrong with the value
    if not configured(config.get("trainer"), "SpeculativeValidation") or {"target", "draft"} <= set(roles):
        return None
    return (f"--data.roles {list(roles)}: SpeculativeValidation (live validation, in the config's trainer.callbacks) "
            "decodes with both probes; train both (--data.roles [target, draft]), or train one with a config whose "
            "trainer.callbacks leave SpeculativeValidation out")


def make_cli(args: list[str], default_config: Path) -> ProbeCLI:
    """The parsed and instantiated CLI of ``args`` (without ``--config``, ``default_config`` first; not for
    ``--help``, whose screen shows the parser's defaults whatever the config, so it prints where no default config is,
    as in a wheel)."""
    if "--config" not in args and "--help" not in args:
        # The embedded default unless a config is given. (Not `default_config_files`: jsonargparse then
        # rejects an optimizer class_path in the YAML.)
        args = ["--config", str(default_config)] + args
    quiet_lightning()
    return ProbeCLI(SemanticProbeModule, SemanticProbeDataModule, args=args, save_config_kwargs={"overwrite": True},
                    **CLI_KWARGS)


def remember_options(parser) -> set[str]:
    """``parser``'s option names, with the build config's under ``--data.build`` (the parser reads those only when it
    builds the data's ``BuildConfig``), kept where :func:`probes.fit_args.first_pass` looks for them."""
    path = options_cache()
    try:
        return set(json.loads(path.read_text()))
    except (OSError, ValueError):
        pass
    from datamodules.labels.build import build_parser

    build = {"--data." + o[2:] for o in parser_options(build_parser()) if o.startswith("--build.")}
    known = set(parser_options(parser)) | build
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob(path.name.rsplit("-", 1)[0] + "-*.json"):  # this checkout's other versions
            old.unlink(missing_ok=True)
        with atomic_path(path) as tmp:  # a temporary of this process: several of one run may write it at once
            tmp.write_text(json.dumps(sorted(known)))
    except OSError:
        pass  # an unwritable cache: the real parser's names check every run here
    return known


def _logger_follows_root(config, args: list[str]) -> None:
    """``--trainer.default_root_dir DIR`` given alone moves the whole run there: the logger's ``save_dir`` (where the
    run folder, its plots and the default export go; the configs set it to the same root) follows it, unless the
    command line sets the logger's ``save_dir`` or another logger (its name or version alone leave it following)."""
    own = [a.split("=", 1)[0] for a in args if a.startswith("--trainer.logger")]
    if "--trainer.default_root_dir" not in args or any(
            a in ("--trainer.logger", "--trainer.logger.class_path") or a.endswith("save_dir") for a in own):
        return
    logger = config.get("trainer.logger")
    if logger is not None and not isinstance(logger, (bool, list)) and "save_dir" in (logger.get("init_args") or {}):
        logger.init_args.save_dir = config.get("trainer.default_root_dir")


def check_checkpoint(path: str, root: str | None = None) -> None:
    """Refuse, through :func:`fail`, a ``--ckpt_path`` that is not a Lightning checkpoint, before the data is
    prepared (Lightning reads it after). A Lightning checkpoint is a ``torch.save`` zip archive whose pickled dict
    (``<name>/data.pkl``) has a ``pytorch-lightning_version`` key, looked for here without unpickling.

    Lightning's own words for a checkpoint (``last``, ``best``, ``hpc``) are refused too, naming the newest
    ``last.ckpt`` under ``root`` (``--trainer.default_root_dir``): Lightning looks for them in the run it is starting,
    and a resumed fit starts in a new version folder, so ``last`` would find nothing and train from scratch."""
    expected = "give the last.ckpt of an interrupted run (<run folder>/checkpoints/last.ckpt)"
    if path in ("last", "best", "hpc") and not Path(path).exists():
        runs = sorted(Path(root or ".").rglob("checkpoints/last.ckpt"), key=lambda f: f.stat().st_mtime)
        newest = f"the newest under {root or '.'} is {runs[-1]}" if runs else f"there is none under {root or '.'}"
        fail(f"--ckpt_path {path}: Lightning looks for '{path}' in the run it starts, a new version folder; "
             f"{expected}: {newest}")
    try:
        with zipfile.ZipFile(path) as z:
            pickled = b"".join(z.read(n) for n in z.namelist() if n.endswith("data.pkl"))
            damaged = z.testzip()  # every member's CRC: a flipped byte in the weights trains on silently
    except OSError as e:
        fail(f"--ckpt_path {path}: {e.strerror or e}; {expected}")
    except zipfile.BadZipFile:
        fail(f"--ckpt_path {path} is not a Lightning checkpoint (not a torch.save archive); {expected}")
    if b"pytorch-lightning_version" not in pickled:
        fail(f"--ckpt_path {path} is a torch.save archive but not a Lightning checkpoint; {expected}")
    if damaged is not None:
        fail(f"--ckpt_path {path} is damaged: {damaged} fails its checksum; {expected} (an intact copy), or start "
             "the run again without --ckpt_path")


RESUMED = ("model", "data", "seed_everything")
"""The options a resumed run keeps from its run: the checkpoint's weights, optimizer state and data position were
made with them (the trainer's, such as ``max_epochs`` or the devices, may change)."""


def check_resumed_options(path: str, config_yaml: str) -> None:
    """Refuse, through :func:`fail`, resuming with other :data:`RESUMED` options than the run's own (``config.yaml``
    beside its ``checkpoints/``; without one, the model and data options the checkpoint records), naming them: a
    changed loss, batch size or dropout trained otherwise than the run without a word, and a changed optimizer was
    recorded and not used (Lightning restores the optimizer's state from the checkpoint, learning rate included)."""
    import yaml

    run_config = Path(path).resolve().parent.parent / "config.yaml"
    try:
        old = yaml.safe_load(run_config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        old = None
    new = yaml.safe_load(config_yaml) or {}
    if not isinstance(old, dict):  # a checkpoint copied out of its run folder
        return _check_recorded_options(path, new)
    was, now = (_flat({k: c.get(k) for k in RESUMED}) for c in (old, new))  # a null argument is its default
    differ = [k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    optimizer = [k for k in differ if k.startswith("model.optimizer.")]
    if "model.optimizer.class_path" in optimizer:
        optimizer = ["model.optimizer.class_path"]
    named = ", ".join(f"{k.removeprefix('model.optimizer.').removeprefix('init_args.')}: {was.get(k)!r} -> "
                      f"{now.get(k)!r}" for k in optimizer)
    if optimizer and old.get("model", {}).get("optimizer") is not None:
        fail(f"--ckpt_path {path} resumes its run's optimizer state (learning rate included), but model.optimizer "
             f"differs from that run's ({run_config}): {named}; resume with the run's own optimizer (--config "
             f"{run_config}), or train a new run without --ckpt_path")
    _refuse_changed(path, differ, was, now, f"that run's ({run_config})", f"resume with the run's own (--config "
                    f"{run_config}; trainer options such as --trainer.max_epochs may change)")


def _check_recorded_options(path: str, new: dict) -> None:
    """:func:`check_resumed_options` for a checkpoint without its run's ``config.yaml``: the model's and the data's
    options as the checkpoint's hyperparameters record them (this CLI's checkpoints: their config sections; not the
    optimizer, which the module does not record, nor the seed); nothing to compare in one made otherwise."""
    import torch

    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    recorded = {}
    for section, key in (("model", "hyper_parameters"), ("data", "datamodule_hyper_parameters")):
        if isinstance(hp := checkpoint.get(key), dict) and "_instantiator" in hp:
            recorded[section] = {k: v for k, v in hp.items() if not k.startswith("_")}
    was, now = _flat(recorded), _flat({k: new.get(k) for k in recorded})
    # a key the config does not hold is a link's target (model.roles, model.input_spec), set from the data
    differ = [k for k in sorted(was) if k in now and was[k] != now[k]]
    _refuse_changed(path, differ, was, now, "those the checkpoint records (its run's config.yaml is not beside it)",
                    "resume with the run's own options")


def _refuse_changed(path: str, differ: list[str], was: dict, now: dict, whose: str, fix: str) -> None:
    """Refuse, through :func:`fail`, a resume whose options ``differ`` from ``whose`` (``was`` -> ``now``), but the
    optimizer's (refused on their own) and the build's: the data is built before a checkpoint exists (its servers may
    have moved since), and the data module refuses finished data that differs from the build config itself."""
    if differ := [k for k in differ if not k.startswith(("model.optimizer.", "data.build."))]:
        fail(f"--ckpt_path {path} continues a run, but options it trained with differ from {whose}: "
             + ", ".join(f"{k}: {was.get(k)!r} -> {now.get(k)!r}" for k in differ) + f"; {fix}, or train a new run "
             "without --ckpt_path")


def _flat(tree: dict, prefix: str = "") -> dict:
    """``tree``'s leaves by dotted key (a list is one leaf)."""
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


CHECKPOINT_ERRORS = ("Error(s) in loading state_dict",)
"""How torch refuses a ``--ckpt_path`` whose weights do not fit the model the config builds: an input error."""
CLI_KWARGS = {"run": False, "auto_configure_optimizers": False, "parser_class": ProbeArgumentParser,
              "parser_kwargs": {"prog": PROG, "description": DESCRIPTION, "allow_abbrev": False}}
"""How :func:`make_cli` builds the fit's LightningCLI (``allow_abbrev`` off: no silent prefix matches)."""


class _SetupDone(Callback):
    """Marks the start of the fit (``done``: the data is prepared) and of training (``training``: the first batch).
    Errors raised before the first batch are about the input: the data, the config, the optimizer, and the checks
    Lightning makes of its options once the data is there (a ``val_check_interval`` longer than an epoch, a
    ``GradientAccumulationScheduler`` beside ``accumulate_grad_batches``)."""

    done = training = False

    def on_fit_start(self, trainer, pl_module) -> None:
        self.done = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.training = True


def check_optimizer(module) -> None:
    """Refuse, through :func:`fail`, what the optimizer and the scheduler refuse (a learning rate below 0, a start
    factor above 1), built on one parameter before the data is prepared for minutes."""
    import torch

    try:
        optimizer = module.optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError) as e:
        fail(f"--model.optimizer: {e}")
    try:
        if module.scheduler_factory is not None:
            module.scheduler_factory(optimizer)
    except (ValueError, TypeError) as e:
        fail(f"--model.lr_scheduler: {e}")


def fit(trainer, module, data, ckpt_path: Optional[str]) -> None:
    """``trainer.fit``; bad input before training ends in one line, Ctrl-C in what was kept and how to resume."""
    setup_done = _SetupDone()
    trainer.callbacks.append(setup_done)
    if trainer.fast_dev_run:  # "no checkpoints", Lightning says; its ModelCheckpoint still wrote last.ckpt at the end
        for callback in trainer.checkpoint_callbacks:
            callback.save_last = False
    new_run_dir = _new_run_dir(trainer)
    if ckpt_path:
        _refuse_a_finished_resume(trainer, ckpt_path)
        keep_checkpoints_together(trainer, ckpt_path)
    handler = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    except (ValueError, OSError, RuntimeError, ImportError, MisconfigurationException) as e:
        from generation.engines.base import EngineError  # a server of the data build failed or refused

        refused = isinstance(e, EngineError) or str(e).startswith(CHECKPOINT_ERRORS)
        if isinstance(e, RuntimeError) and str(e).startswith("Early stopping conditioned on metric"):
            monitor = str(e).split(" which is not available", 1)[0].removeprefix("Early stopping conditioned on ")
            _drop_empty_run_dir(new_run_dir)  # nothing was kept: the next run is not version_N+1 beside an empty one
            fail(f"EarlyStopping's {monitor} had no value: the run ended before a validation logged it (a "
                 "--trainer.max_steps or limit_train_batches shorter than an epoch, or a metric logged only every "
                 "few epochs); validate within the run (--trainer.val_check_interval) or monitor a metric every "
                 "validation logs")
        if setup_done.training or (isinstance(e, RuntimeError) and not refused):
            raise  # raised while training, or a fault of ours: not an input error, keep the traceback
        _drop_empty_run_dir(new_run_dir)
        # the data build (its servers), the data checks, the optimizer or Lightning (a checkpoint past
        # --trainer.max_epochs) refused the input
        fail(str(e))
    except SystemExit:
        _interrupted(trainer, handler, setup_done.done)


def run_test(trainer, module, data, ckpt_path: str | None) -> list[dict]:
    """``trainer.test`` of the checkpoint ``ckpt_path``; Ctrl-C ends in what was kept and how to resume, as in
    :func:`fit`."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        return trainer.test(module, datamodule=data, ckpt_path=ckpt_path, verbose=False)
    except SystemExit:
        _interrupted(trainer, handler)


def _interrupted(trainer, handler, training: bool = True) -> NoReturn:
    """Re-raise a ``SystemExit`` that is no Ctrl-C; else Lightning caught KeyboardInterrupt, shut down and called
    ``sys.exit(1)``: restore SIGINT's ``handler``, say what was kept and exit 130."""
    if not trainer.interrupted:
        raise
    if handler is not None:
        signal.signal(signal.SIGINT, handler)  # Lightning left SIGINT ignored
    if trainer.is_global_zero:
        print(interrupted_line(trainer, training), file=sys.stderr)
    raise SystemExit(130) from None


def keep_checkpoints_together(trainer, ckpt_path: str) -> None:
    """A resumed run saves its checkpoints where the run it resumes saved them (each ``ModelCheckpoint`` given no
    ``dirpath``), so that Lightning restores what they tracked: it keeps a callback's best score only when its folder
    is unchanged, and the resumed run logs into a new version folder. Otherwise the resumed run's first epoch counted
    as its best, and a worse checkpoint than the whole run's best was tested and exported."""
    import torch

    states = torch.load(ckpt_path, map_location="cpu", weights_only=False).get("callbacks") or {}
    for callback in trainer.checkpoint_callbacks:
        fallback = copy.copy(callback)  # the key it saved under if a run without validation rows switched it
        fallback.monitor = FALLBACK_MONITOR
        saved = states.get(callback.state_key) or states.get(fallback.state_key) or {}
        recorded = saved.get("dirpath")
        if callback.dirpath is None and recorded and Path(recorded).is_dir():
            callback.dirpath = recorded
            warnings.filterwarnings("ignore", message=rf"Checkpoint directory {re.escape(recorded)} exists and is not")


def latest_checkpoint(trainer) -> str:
    """The checkpoint of the latest epoch an interrupted run kept: a ``ModelCheckpoint``'s ``last.ckpt``
    (``save_last``), or the one file a ``ModelCheckpoint`` without a monitor keeps (the configs' ``filename: last``);
    "" for none."""
    paths = [c.last_model_path or ("" if c.monitor else c.best_model_path) for c in trainer.checkpoint_callbacks]
    return next((p for p in paths if p and Path(p).is_file()), "")


def interrupted_line(trainer, training: bool = True) -> str:
    """What an interrupted fit kept (``last.ckpt``) and the command that resumes it from the run's own
    ``config.yaml`` (LightningCLI saved it in the run's folder), as one line; ``training``: whether training had
    started (before it, the data was being prepared: the label build keeps its whole shards)."""
    last = latest_checkpoint(trainer)
    if not last and not training:
        return (f"{PROG}: interrupted while preparing the data; the label build keeps the shards it finished. Rerun "
                "the command to go on from them.")
    if not last and not trainer.checkpoint_callbacks:
        return (f"{PROG}: interrupted in epoch {trainer.current_epoch + 1}; this run saves no checkpoints "
                "(--trainer.enable_checkpointing false), so nothing is kept to resume from.")
    if not last:
        return (f"{PROG}: interrupted in epoch {trainer.current_epoch + 1} before a checkpoint was saved; nothing "
                "kept to resume from. Rerun the command to start again.")
    import torch

    epoch = int(torch.load(last, map_location="cpu", weights_only=False).get("epoch", -1)) + 1
    config = _run_folder(trainer) / "config.yaml"
    return (f"{PROG}: interrupted; kept {last} (after epoch {epoch}). Resume with: {PROG} --config "
            f"{shlex.quote(str(config))} --ckpt_path {shlex.quote(last)}")


def _refuse_a_finished_resume(trainer, ckpt_path: str) -> None:
    """Refuse, through :func:`fail`, resuming a checkpoint that has trained ``--trainer.max_epochs`` epochs already:
    Lightning refuses one past it but takes one at it, trains nothing, and the run tested and exported again."""
    import torch

    limit = trainer.max_epochs
    if limit in (None, -1):  # no limit: nothing to read
        return
    progress = torch.load(ckpt_path, map_location="cpu", weights_only=False).get("loops", {}).get("fit_loop", {})
    trained = progress.get("epoch_progress", {}).get("current", {}).get("processed")
    if isinstance(trained, int) and trained >= limit:
        fail(f"--ckpt_path {ckpt_path}: its run trained {trained} epochs, and --trainer.max_epochs {limit} allows no "
             "more, so nothing would be trained; give a larger --trainer.max_epochs to train on")


def _run_folder(trainer) -> Path:
    """The run's folder as this rank's logger knows it: ``trainer.log_dir`` without its broadcast, which needs every
    rank (after an interrupt under DDP the others are gone, and rank 0 alone asking broke the line)."""
    logger = trainer.loggers[0] if trainer.loggers else None
    folder = (getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)) if logger is not None else None
    return Path(folder or trainer.default_root_dir)


def _new_run_dir(trainer) -> Path | None:
    """The run folder this fit will create (its logger's next version), or None when it exists already (a resume)."""
    log_dir = trainer.log_dir if trainer.is_global_zero else None
    return Path(log_dir) if log_dir and not Path(log_dir).exists() else None


_RUN_DIR_AT_START = {"config.yaml", "hparams.yaml"}
"""What a run folder holds before the first batch: LightningCLI's config, the logger's hyperparameters."""


def _drop_empty_run_dir(run_dir: Path | None) -> None:
    """Remove the folder a refused fit created if it holds nothing but what a run writes before training
    (:data:`_RUN_DIR_AT_START`), and the logger's folder above it (``fit/``) when that is left empty."""
    if run_dir is not None and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= _RUN_DIR_AT_START:
        for name in _RUN_DIR_AT_START:
            (run_dir / name).unlink(missing_ok=True)
        run_dir.rmdir()
        if not any(run_dir.parent.iterdir()):
            run_dir.parent.rmdir()


_LIGHTNING_NOISE = ("litlogger", "Skipping setting a default `ModelSummary`")


def quiet_lightning() -> None:
    """Silence what a normal run need not show: Lightning's litlogger tip, its warning about a ``__len__``
    of iterable datasets (the stream's is exact with at most one worker, and with several it has none), and torch's
    deprecation of ``LeafSpec``, which Lightning's own code still builds (nothing a user can
    change)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_drop_noise)  # once: addFilter skips a filter it holds
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)


def _drop_noise(record: logging.LogRecord) -> bool:
    return not any(word in str(record.getMessage()) for word in _LIGHTNING_NOISE)
