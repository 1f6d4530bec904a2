"""`python -m probes.fit`: build labels if missing, train the probes, test the best, export them.

With no arguments it runs the embedded default (``configs/arithmetic.yaml``) offline on a CPU.
Every option can be overridden (``--trainer.max_epochs 3``, ``--data.batch_size 256``) and
``--help`` lists them with their docs. On success it prints the exported probe paths and a metric
table. Probes are exported inside the run's own folder (``<trainer.log_dir>/export/<role>``);
replacing the shipped ones is explicit: ``--export_dir checkpoints/arithmetic/probes``.

Bad input (an unknown key, a value a class refuses, data that cannot be built) ends the command with
one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional

from jsonargparse import set_parsing_settings
from lightning.pytorch import Callback
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from datamodules.datamodule import SemanticProbeDataModule
from generation.paths import portable_paths
from probes.export import export_probe
from probes.module import SemanticProbeModule

# Field docstrings of ProbeConfig / BuildConfig become their --help text (as in litgpt).
set_parsing_settings(docstring_parse_attribute_docstrings=True)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "arithmetic.yaml"
PROG = "python -m probes.fit"
DESCRIPTION = (
    "Build SemanticSpec label data if it is missing, train the target and draft probes, test the best "
    "checkpoint on held-out problems and export it (model.safetensors + config.json per role)."
)


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
        fail(message)


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
        parser.link_arguments("data.roles", "model.roles")
        parser.link_arguments("data.input_spec", "model.input_spec", apply_on="instantiate")

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        # main() always hands over the arguments (sys.argv's, after the default --config), so Lightning's
        # warning about `args` and sys.argv both being given would open every run; parse them directly.
        self.config = parser.parse_args(args)

    def before_instantiate_classes(self) -> None:
        epochs = self.config.get("trainer.max_epochs")
        if epochs is not None and epochs < 1:  # Lightning reads -1 as "no limit" and shows "Epoch 1/-2"
            fail(f"--trainer.max_epochs {epochs}: expected a number of epochs >= 1 (early stopping may end the run "
                 "sooner; --trainer.max_time bounds it by time)")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, OSError) as e:  # the classes check their arguments when built (STYLE.md)
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
    args = list(sys.argv[1:] if args is None else args)
    if not any(a == "--config" or a.startswith("--config=") for a in args):
        # The embedded default unless a config is given. (Not `default_config_files`: jsonargparse then
        # rejects an optimizer class_path in the YAML.)
        args = ["--config", str(DEFAULT_CONFIG)] + args
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
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    setup_done = _SetupDone()
    trainer.callbacks.append(setup_done)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=cli.config.get("ckpt_path"))
    except (ValueError, OSError) as e:
        if setup_done.done:  # raised while training: not an input error, keep the traceback
            raise
        fail(str(e))  # the data build, the data checks or the optimizer refused the input
    if trainer.interrupted:
        return {"export": {}, "test": {}, "best_ckpt": getattr(trainer.checkpoint_callback, "best_model_path", None)}
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
