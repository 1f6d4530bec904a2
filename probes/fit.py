"""`python -m probes.fit`: build labels if missing, train the probes, test the best, export them.

With no arguments it runs the embedded default (``configs/arithmetic.yaml``) offline on a CPU.
Every option can be overridden (``--trainer.max_epochs 3``, ``--data.batch_size 256``) and
``--help`` lists them with their docs. On success it prints the exported probe paths and a metric
table.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import ArgsType, LightningCLI

from datamodules.datamodule import SemanticProbeDataModule
from probes.export import export_probe
from probes.module import SemanticProbeModule

# Field docstrings of ProbeConfig / BuildConfig become their --help text (as in litgpt).
set_parsing_settings(docstring_parse_attribute_docstrings=True)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "arithmetic.yaml"


class ProbeCLI(LightningCLI):
    """LightningCLI that links what only the data knows into the module and adds ``--export_dir``."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--export_dir",
            type=Optional[str],
            default="checkpoints/arithmetic/probes",
            help="Where the best probes are exported, one folder per role (model.safetensors + config.json). "
            "None skips the export.",
        )
        parser.add_argument("--test", type=bool, default=True, help="Test the best checkpoint on the held-out split before exporting.")
        parser.add_argument("--ckpt_path", type=Optional[str], default=None, help="Resume training from this Lightning checkpoint (e.g. last.ckpt).")
        parser.link_arguments("data.roles", "model.roles")
        parser.link_arguments("data.input_spec", "model.input_spec", apply_on="instantiate")


def export_probes(module: SemanticProbeModule, export_dir: str | os.PathLike, test_metrics: dict[str, float]) -> dict[str, Path]:
    """Export each role's probe of ``module`` with its test metrics into ``export_dir/<role>``."""
    paths = {}
    for role, probe in module.probes.items():
        prefix = f"test/{role}/"
        probe.config.test_metrics = {k[len(prefix) :]: float(v) for k, v in test_metrics.items() if k.startswith(prefix)}
        paths[role] = export_probe(probe.cpu().eval(), Path(export_dir) / role)
    return paths


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
    )
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    trainer.fit(module, datamodule=data, ckpt_path=cli.config.get("ckpt_path"))
    if trainer.interrupted:
        return {"export": {}, "test": {}, "best_ckpt": getattr(trainer.checkpoint_callback, "best_model_path", None)}
    best = getattr(trainer.checkpoint_callback, "best_model_path", "") or None
    live = _spec_summary(trainer)  # before test() replaces the callback metrics
    test_metrics: dict[str, float] = {}
    if cli.config.get("test", True):
        results = trainer.test(module, datamodule=data, ckpt_path="best" if best else None, verbose=False)
        test_metrics = {k: float(v) for r in results for k, v in r.items()}
    paths: dict[str, Path] = {}
    export_dir = cli.config.get("export_dir")
    if export_dir and trainer.is_global_zero:
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
