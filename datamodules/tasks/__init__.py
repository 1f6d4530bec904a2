"""Tasks: the Task interface, boxed-answer math, multiple choice, and the registry of self-contained worlds."""

from __future__ import annotations

from typing import Any

from datamodules.tasks import choice, math  # noqa: F401,E402  (their tasks are the --task choices --help lists)

MOVED_CLASSES = {
    "datamodules.tasks.ArithmeticTask": "arithmetic_world.task.ArithmeticTask",
    "datamodules.tasks.BoxedMathTask": "datamodules.tasks.math.BoxedMathTask",
    "datamodules.tasks.MultipleChoiceTask": "datamodules.tasks.choice.MultipleChoiceTask",
}
"""Task classes recorded by builds before the tasks moved into subpackages, and where they live now."""


def __getattr__(name: str) -> Any:
    """No task class lives here under the path it had before the tasks moved: the error names today's path (a
    recorded build's old path is upgraded where its manifest is read,
    :func:`datamodules.labels.shards.upgrade_build_record`). Nothing is returned or warned about, so a library
    that looks names up here (jsonargparse shortening an import path) finds nothing and keeps today's path."""
    new = MOVED_CLASSES.get(f"{__name__}.{name}")
    hint = f"; {__name__}.{name} moved to {new}: name that in your config (class_path: {new})" if new else ""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}{hint}")
