"""The embedded arithmetic world as a registered :class:`~datamodules.tasks.worlds.RegisteredWorld`.

``pyproject.toml`` registers :data:`WORLD` under the ``semanticspec.worlds`` entry points, so generic code
finds the world's task, models and judge template without importing this package.
"""

from __future__ import annotations

import functools

from arithmetic_world import models, task
from arithmetic_world.tokenizer import JUDGE_TEMPLATE
from datamodules.tasks.worlds import RegisteredWorld

WORLD = RegisteredWorld(
    name="arithmetic",
    task=task.ArithmeticTask,
    validation_task=lambda: task.ArithmeticTask(min_ops=4, max_ops=4),
    model_root=functools.partial(models.world_root, must_exist=True),
    load_model=models.load_model,
    load_tokenizer=models.load_tokenizer,
    judge_template=JUDGE_TEMPLATE,
    meaning=task.meaning,
)
