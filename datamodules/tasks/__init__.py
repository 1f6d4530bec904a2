"""Tasks: the Task interface, boxed-answer math, multiple choice, and the registry of self-contained worlds."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

MOVED_CLASSES = {
    "datamodules.tasks.ArithmeticTask": "arithmetic_world.task.ArithmeticTask",
    "datamodules.tasks.BoxedMathTask": "datamodules.tasks.math.BoxedMathTask",
    "datamodules.tasks.MultipleChoiceTask": "datamodules.tasks.choice.MultipleChoiceTask",
}
"""Task classes recorded by builds before the tasks moved into subpackages, and where they live now."""


def __getattr__(name: str) -> Any:
    """A task class under the path it had before the tasks moved (``datamodules.tasks.ArithmeticTask``), with a
    warning naming today's, so configs that name the old path keep working."""
    new = MOVED_CLASSES.get(f"{__name__}.{name}")
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} moved to {new}; name the new path in your config (class_path: {new})",
                  FutureWarning, stacklevel=2)
    module, _, cls = new.rpartition(".")
    globals()[name] = moved = getattr(importlib.import_module(module), cls)  # one warning per process
    return moved
