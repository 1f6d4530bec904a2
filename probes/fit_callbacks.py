"""The callback `python -m probes.fit` adds: a run without a validation split monitors the training loss."""

from __future__ import annotations

import sys

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

FALLBACK_MONITOR = "train/loss_epoch"
"""What EarlyStopping and ModelCheckpoint watch when there is no validation split: the training loss per epoch."""


class NoValidationFallback(Callback):
    """Without validation rows (``data.val_fraction 0``, or too few problems), monitors watch the training loss.

    EarlyStopping and ModelCheckpoint watch a ``val/`` metric that such a run never logs (Lightning
    then stops with "Early stopping conditioned on metric ... which is not available"). This
    switches them to :data:`FALLBACK_MONITOR` and says so once, on stderr. Runs after the data's
    ``setup`` (Lightning calls the datamodule's hook before the callbacks').
    """

    def __init__(self) -> None:
        self.switched: list[str] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        data = trainer.datamodule
        shards = getattr(data, "shards", None)
        if stage != "fit" or shards is None or sum(s["rows"]["val"] for s in shards):
            return
        for cb in trainer.callbacks:
            if isinstance(cb, (EarlyStopping, ModelCheckpoint)) and (cb.monitor or "").startswith("val/"):
                old, cb.monitor = cb.monitor, FALLBACK_MONITOR
                if isinstance(cb, ModelCheckpoint) and cb.filename and old in cb.filename:
                    cb.filename = "epoch{epoch}-train_loss{" + FALLBACK_MONITOR + ":.4f}"
                self.switched.append(f"{type(cb).__name__} ({old})")
        trainer.limit_val_batches = 0  # nothing to validate: no empty validation loop, no warning about it
        if self.switched and trainer.is_global_zero:
            print(f"no validation rows (data.val_fraction={data.val_fraction}): {', '.join(self.switched)} "
                  f"monitor {FALLBACK_MONITOR} instead", file=sys.stderr)
