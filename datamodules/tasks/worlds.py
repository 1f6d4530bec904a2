"""Self-contained worlds: a task that ships its own models and judge, and registers itself.

Generic code (the build config, the live callback, the oracle judge) never imports a world. A world
registers a :class:`RegisteredWorld` under the ``semanticspec.worlds`` entry-point group of its package's
metadata (``pyproject.toml``; this package registers the embedded arithmetic world there), and
:func:`default_world` loads the one named by ``$SEMANTICSPEC_DEFAULT_WORLD`` (default ``arithmetic``)
whenever a config leaves the task, the models or the judge template unset.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from datamodules.tasks.base import Task

GROUP = "semanticspec.worlds"
"""Entry-point group worlds register under."""
DEFAULT_WORLD_ENV = "SEMANTICSPEC_DEFAULT_WORLD"
"""Environment variable naming the default world (default ``arithmetic``)."""


@dataclass(frozen=True)
class RegisteredWorld:
    """A task with its own models: what generic code needs when a config names no task or model.

    Attributes:
        name: the entry-point name.
        task: builds the world's task (keyword arguments as the task class takes them).
        validation_task: the task live validation decodes by default.
        model_root: folder holding one sub-folder per role (``target``, ``draft``, ``judge``).
        load_model: ``load_model(role, root, device=...)`` loads one model offline, in eval mode.
        load_tokenizer: ``load_tokenizer(root)`` loads the tokenizer the world's models share.
        judge_template: the prompt of an ``llm`` judge given no template.
        meaning: step text -> its meaning, or None when malformed (the oracle judge's).
    """

    name: str
    task: Callable[..., Task]
    validation_task: Callable[[], Task]
    model_root: Callable[[], Path]
    load_model: Callable[..., Any]
    load_tokenizer: Callable[..., Any]
    judge_template: str
    meaning: Callable[[str], Any]


@functools.cache
def registered_world(name: str) -> RegisteredWorld:
    """The world registered as ``name``.

    Raises:
        LookupError: nothing is registered under ``name`` (naming the registered ones).
    """
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    if name not in found:
        raise LookupError(f"no world {name!r} is registered under the entry-point group {GROUP!r} (registered: "
                          f"{sorted(found) or 'none'}); install the package that ships it (pip install -e .)")
    world = found[name].load()
    if not isinstance(world, RegisteredWorld):
        raise TypeError(f"entry point {found[name].value} is a {type(world).__name__}, expected a RegisteredWorld")
    return world


def default_world() -> RegisteredWorld:
    """The world used when a config leaves the task or the models unset (``$SEMANTICSPEC_DEFAULT_WORLD``)."""
    return registered_world(os.environ.get(DEFAULT_WORLD_ENV) or "arithmetic")  # set but empty: the default
